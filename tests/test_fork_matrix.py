"""A fork child inherits no role (README, "Processes that fork"; docs/design.md, "Fork"), for every
role, both APIs and both transports: closing an inherited role does nothing, using it (and its
``statistics()``) raises ``ClosedResourceError``, what only answers (its handle, its name)
still answers, and neither that, nor dropping it, nor the child's exit prints anything or
touches the parent's channel.

One parent process per family of roles (``tests/_fork_matrix.py``), kept for all the family's
cases: it holds the roles and forks a real child per case. The child does the operation and
reports through a pipe what escaped; it ends with ``sys.exit``, whose interpreter exit runs the
atexit hooks and finalizers it inherited and collects every inherited role, with its stderr
kept for the test. The parent then compares its files, its liveness locks and its TCP servers
with what it had before the fork, and sends a message through its roles.

Combinations that do not exist: a pool of workers (caller, worker) has no TCP transport;
vLLM's ``MessageQueue`` has no async API. Over TCP, the "reader" is a remote reader of a writer
with a TCP endpoint, the "writer" that writer, the "sender" a remote sender (``open_sender(...,
tcp=...)``) and the "collector" the collector that attached it; vLLM's reader over TCP is a
rank that is not local (``create_from_handle(handle, -1)``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

_PARENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fork_matrix.py")

#: family -> its roles
ROLES = {
    "broadcast": ["writer", "reader"],
    "fanin": ["collector", "sender"],
    "calls": ["caller", "worker"],
    "vllm": ["mq-writer", "mq-reader"],
}
#: (family, api, transport) that exist
SETUPS = [
    (family, api, transport)
    for family in ROLES
    for api in ("async", "blocking")
    for transport in ("shm", "tcp")
    # a pool of workers has no TCP transport; vLLM's MessageQueue has no async API
    if not (family == "calls" and transport == "tcp") and not (family == "vllm" and api == "async")
]
OPS = ["close", "use", "statistics", "gc", "answers"]
#: Roles without a statistics() (a sender's ring is read by its collector; a worker's two
#: channels by its caller)
NO_STATISTICS = {"sender", "worker"}
CASES = [
    pytest.param(setup, role, op, id=f"{role}-{setup[1]}-{setup[2]}-{op}")
    for setup in SETUPS
    for role in ROLES[setup[0]]
    for op in OPS
    if not (op == "statistics" and role in NO_STATISTICS)
]
#: How long a parent may take to open its roles, or to answer a case (deadlines, not measurements).
WITHIN_S = 60.0


class Parent:
    """One running ``_fork_matrix.py``."""

    def __init__(self, setup: tuple[str, str, str]) -> None:
        self.setup = setup
        self.proc = subprocess.Popen(
            [sys.executable, _PARENT, *setup],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        ready = self.read()
        self.pid = ready["ready"]

    def read(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            _out, err = self.proc.communicate(timeout=WITHIN_S)
            raise AssertionError(f"the parent {self.setup} ended: {err}")
        return json.loads(line)

    def ask(self, role: str, op: str) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{role} {op}\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
                closed = self.read()
                assert closed["closed"] == [], closed
            finally:
                _out, err = self.proc.communicate(timeout=WITHIN_S)
        else:
            _out, err = self.proc.communicate(timeout=WITHIN_S)
        assert self.proc.returncode == 0, err
        assert err == "", err


def _ours() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("aiobroadcast-")}


@pytest.fixture(autouse=True)
def _no_leftover_segments() -> None:
    """conftest's check after each test, replaced: a parent's channels outlive the test that
    started it. ``parents`` checks the whole module instead."""


@pytest.fixture(scope="module")
def parents() -> Iterator[dict[tuple[str, str, str], Parent]]:
    """The parents, one per setup, started when a case first needs it; the cases of one setup run
    one after the other (pytest keeps the parametrized order), and a parent is closed (checking
    that it closes cleanly) once the next setup starts. /dev/shm is left as it was found."""
    before = _ours()
    running: dict[tuple[str, str, str], Parent] = {}
    try:
        yield running
    finally:
        for p in running.values():
            p.close()
    left = _ours() - before
    assert not left, f"left behind in /dev/shm: {sorted(left)}"


def parent_of(parents: dict[tuple[str, str, str], Parent], setup: tuple[str, str, str]) -> Parent:
    if setup not in parents:
        for other in list(parents):
            parents.pop(other).close()
        parents[setup] = Parent(setup)
    return parents[setup]


@pytest.mark.parametrize(("setup", "role", "op"), CASES)
def test_an_inherited_role_does_nothing_on_close_and_refuses_every_use(
    parents: dict[tuple[str, str, str], Parent], setup: tuple[str, str, str], role: str, op: str
) -> None:
    parent = parent_of(parents, setup)
    got = parent.ask(role, op)
    seen = got["seen"]
    assert seen is not None and "harness" not in seen, got
    # Nothing but ClosedResourceError escapes: closing does nothing, every use and statistics()
    # refuse with the message that names the owner and says what to do instead; a handle or a
    # name still answers.
    refusal = re.compile(
        rf"ClosedResourceError: this {re.escape(role.removeprefix('mq-'))} belongs to process {parent.pid}; "
        r"a fork child inherits no role: \S.*"
    )
    for what, outcome in seen.items():
        if op in ("use", "statistics"):
            assert refusal.fullmatch(outcome), (what, outcome)
        else:
            assert outcome == "ok", (what, outcome)
    # Nothing printed by the child, at its exit and its collection of what it inherited included.
    assert got["stderr"] == "", got["stderr"]
    assert got["exitcode"] == 0, got
    # Nothing of the parent's touched: its files, its liveness locks, its TCP servers; and its
    # roles still carry a message.
    assert got["after"]["files"] == got["before"]["files"]
    assert got["after"]["locks"] == got["before"]["locks"]
    assert got["after"]["servers"] == got["before"]["servers"]
    assert got["before"]["locks"], "the parent holds liveness locks: the check sees them"
    if setup[2] == "tcp":
        assert got["before"]["servers"], "the parent serves TCP: the check sees its server"
    assert got["round_trip"] == "ok", got["round_trip"]


def test_an_inherited_role_takes_no_lock_a_parent_thread_held_at_the_fork() -> None:
    """A process forks while its threads wait inside its roles: one in a blocking reader's
    ``get`` (holding the reader's sleeping place), one in a blocking writer's ``put`` on a full
    ring (holding the writer's lock). The child has no such threads, but its copies of their
    locks are held: closing either role, using it, and its ``statistics()``, return at once in
    the child (an alarm ends a child that hangs). The parent's threads go on: the reader gets what
    the parent publishes next, the writer's put completes once the reader drains the ring."""
    proc = subprocess.run(
        [sys.executable, "-c", THREADS_AT_THE_FORK], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    child, parent = (json.loads(line) for line in proc.stdout.splitlines())
    assert child["exitcode"] == 0 and child["stderr"] == "", child
    for what in ("reader.close", "writer.close", "full.close"):
        assert child["seen"][what] == "ok", (what, child["seen"])
    for what in ("reader.get_nowait", "reader.statistics", "writer.put_nowait", "full.put_nowait", "full.statistics"):
        assert child["seen"][what].startswith("ClosedResourceError: this "), (what, child["seen"])
    assert parent == {"got": ["after the fork"], "put": "done", "drained": 9}


#: Run in a fresh interpreter: two threads parked in blocking roles while the main thread forks.
THREADS_AT_THE_FORK = r"""
import json, os, signal, sys, threading, time
from aiobroadcast import blocking

writer = blocking.open_writer(capacity=8, slot_bytes=256)
reader = blocking.open_reader(writer.handle, name="asleep")
full = blocking.open_writer(capacity=8, slot_bytes=256)  # a ring its reader lets fill up
slow = blocking.open_reader(full.handle, name="slow")
for i in range(8):
    full.put(i)
got, put = [], []
getter = threading.Thread(target=lambda: got.append(reader.get(timeout=60)))
putter = threading.Thread(target=lambda: (full.put(8, timeout=60), put.append("done")))
getter.start()
putter.start()
while not (reader.statistics().tasks_waiting and full.statistics().waiting_for):
    time.sleep(0.01)  # both threads are parked inside their roles, holding their locks

err = "/tmp/threads-at-the-fork-%d.err" % os.getpid()
sys.stdout.flush()
pid = os.fork()
if pid == 0:
    fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    signal.alarm(20)  # a child that hangs on a lock dies of it
    seen = {}
    for what, call in [
        ("reader.close", reader.close), ("reader.get_nowait", reader.get_nowait),
        ("reader.statistics", reader.statistics), ("writer.close", writer.close),
        ("writer.put_nowait", lambda: writer.put_nowait("x")), ("full.put_nowait", lambda: full.put_nowait("x")),
        ("full.statistics", full.statistics), ("full.close", full.close),
    ]:
        try:
            call()
            seen[what] = "ok"
        except BaseException as exc:
            seen[what] = f"{type(exc).__name__}: {exc}"
    with open(err + ".json", "w") as f:
        json.dump(seen, f)
    sys.exit(0)
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
with open(err) as f:
    stderr = f.read()
try:
    with open(err + ".json") as f:
        seen = json.load(f)
except OSError:
    seen = {}
for path in (err, err + ".json"):
    if os.path.exists(path):
        os.unlink(path)
print(json.dumps({"exitcode": code, "stderr": stderr, "seen": seen}), flush=True)
writer.put("after the fork")
getter.join(30)
drained = [slow.get(timeout=30) for _ in range(9)]
putter.join(30)
print(json.dumps({"got": got, "put": put[0] if put else "not done", "drained": len(drained)}), flush=True)
for role in (slow, full, reader, writer):
    role.close()
"""
