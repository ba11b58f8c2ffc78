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
