"""The parent of tests/test_fork_matrix.py: a process that holds every role of one family (a
writer and a reader, a collector and a sender, a caller and a worker, vLLM's two
``MessageQueue`` roles), async or blocking, over shared memory or TCP, and forks a child per
command. Run as ``python tests/_fork_matrix.py FAMILY API TRANSPORT``; it prints one JSON line
when its roles are open, then one per command read from stdin (``ROLE OP``), and closes its
roles on ``exit``.

The child does ``OP`` ("close", "use", "statistics", "gc") with the inherited ``ROLE``, writes
what happened to a pipe, and leaves the way a pre-fork server's worker does: ``sys.exit`` at
the top of this script, so that the interpreter's exit runs the atexit hooks and finalizers it
inherited and collects every inherited role. Its stderr goes to a file the parent reads back:
nothing may be printed there (no traceback, warning or "Exception ignored" line).

Then the parent checks that nothing of its own was touched: the same files in the channel's
directory, the same liveness locks on them (/proc/locks), the same TCP server processes, and a
message still makes the round trip through its roles (the role the child used included).
"""

from __future__ import annotations

import functools
import gc
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, Literal, cast

import anyio
import psutil

import aiobroadcast as ab
from aiobroadcast import blocking

Transport = Literal["shm", "tcp"]
LOOPBACK = "tcp://127.0.0.1:0"
#: A deadline for a round trip (never a measurement).
WITHIN_S = 20.0
#: How long a child may take (a deadline: a child still there then hangs, and is killed).
CHILD_S = 20.0
#: The exit code said for a child that hung.
HUNG = -1000


def run(fn: Callable[[], Awaitable[Any]]) -> Any:
    """One event loop run: the async roles outlive it, as in a program that forks between runs
    (a child cannot start an event loop of its own inside its parent's running one)."""

    async def main() -> Any:
        return await fn()

    return anyio.run(main)


def opened(opening: Any) -> Any:
    """An async factory's role, opened in a run of its own."""

    async def open_it() -> Any:
        return await opening

    return run(open_it)


# --- the families: their roles, what a child does with each, the parent's round trip -----------
class Family:
    """The roles a parent holds. ``uses``: per role, the calls that must raise
    ``ClosedResourceError`` in a child; ``closes``: the calls that must do nothing; ``answers``:
    what must still answer (what a child needs to open a role of its own)."""

    roles: dict[str, Any]
    uses: dict[str, dict[str, Callable[[Any], Any]]]
    closes: dict[str, dict[str, Callable[[Any], Any]]]
    answers: dict[str, dict[str, Callable[[Any], Any]]]
    #: per role, its close (aclose) as a bound method taken before any fork, as
    #: ``atexit.register(writer.close)`` takes it
    bound: dict[str, Callable[[], Any]]
    #: per role, some of its uses as bound methods taken before any fork
    bound_uses: dict[str, dict[str, Callable[[], Any]]]
    directory: str = "/dev/shm"

    def round_trip(self, i: int) -> None:
        raise NotImplementedError


def closes_of(api: str) -> dict[str, Callable[[Any], Any]]:
    """Closing, twice, and leaving a ``with`` block."""
    if api == "async":

        async def leave(role: Any) -> None:
            async with role:
                pass

        return {"aclose": lambda r: r.aclose(), "aclose again": lambda r: r.aclose(), "async with": leave}

    def leave_sync(role: Any) -> None:
        with role:
            pass

    return {"close": lambda r: r.close(), "close again": lambda r: r.close(), "with": leave_sync}


class Broadcast(Family):
    """A writer and a reader of its channel (over TCP: a reader of the writer's TCP server)."""

    def __init__(self, api: str, transport: Transport) -> None:
        tcp = LOOPBACK if transport == "tcp" else None
        if api == "async":
            self.writer = opened(ab.open_writer(capacity=8, slot_bytes=256, tcp=tcp))
            self.reader = opened(ab.open_reader(self.writer.handle, name="peer", transport=transport))
            self.uses = {
                "writer": {
                    "put_nowait": lambda w: w.put_nowait("x"),
                    "put": lambda w: w.put("x"),
                    "put_many": lambda w: w.put_many(["x", "y"]),
                },
                "reader": {
                    "get_nowait": lambda r: r.get_nowait(),
                    "get": lambda r: r.get(),
                    "async for": lambda r: r.__anext__(),
                },
            }
        else:
            self.writer = blocking.open_writer(capacity=8, slot_bytes=256, tcp=tcp)
            self.reader = blocking.open_reader(self.writer.handle, name="peer", transport=transport)
            self.uses = {
                "writer": {
                    "put_nowait": lambda w: w.put_nowait("x"),
                    "put": lambda w: w.put("x", timeout=1),
                    "put_many": lambda w: w.put_many(["x", "y"], timeout=1),
                },
                "reader": {
                    "get_nowait": lambda r: r.get_nowait(),
                    "get": lambda r: r.get(timeout=1),
                    "for": lambda r: next(iter(r)),
                },
            }
        self.api = api
        self.directory = self.writer.handle.directory
        self.roles = {"writer": self.writer, "reader": self.reader}
        self.closes = {name: closes_of(api) for name in self.roles}
        self.answers = {
            "writer": {"handle": lambda w: ab.Handle.parse(w.handle.to_json())},
            "reader": {"handle": lambda r: ab.Handle.parse(r.handle.to_json()), "name": lambda r: r.name},
        }

    def round_trip(self, i: int) -> None:
        w, r = self.writer, self.reader
        if self.api == "async":

            async def both() -> Any:
                with anyio.fail_after(WITHIN_S):
                    await w.put(i)
                    return await r.get()

            got = run(both)
        else:
            w.put(i, timeout=WITHIN_S)
            got = r.get(timeout=WITHIN_S)
        assert got == i, (got, i)


class FanIn(Family):
    """A collector and a sender (over TCP: a remote sender the collector attached)."""

    def __init__(self, api: str, transport: Transport) -> None:
        tcp = LOOPBACK if transport == "tcp" else None
        if api == "async":
            self.collector = opened(ab.open_collector(capacity=8, slot_bytes=256))
            self.sender = opened(ab.open_sender(self.collector.handle, name="peer", tcp=tcp))
            if tcp is not None:
                run(lambda: self.collector.attach(self.sender.remote_handle, name="peer"))
            self.uses = {
                "collector": {
                    "get_nowait": lambda c: c.get_nowait(),
                    "get": lambda c: c.get(),
                    "get_many": lambda c: c.get_many(),
                    "attach": lambda c: c.attach(self.sender.remote_handle or self.writer_like(), name="other"),
                    "async for": lambda c: c.__anext__(),
                },
                "sender": {
                    "put_nowait": lambda s: s.put_nowait("x"),
                    "put": lambda s: s.put("x"),
                    "put_many": lambda s: s.put_many(["x", "y"]),
                },
            }
        else:
            self.collector = blocking.open_collector(capacity=8, slot_bytes=256)
            self.sender = blocking.open_sender(self.collector.handle, name="peer", tcp=tcp)
            if tcp is not None:
                self.collector.attach(self.sender.remote_handle, name="peer")
            self.uses = {
                "collector": {
                    "get_nowait": lambda c: c.get_nowait(),
                    "get": lambda c: c.get(timeout=1),
                    "get_many": lambda c: c.get_many(timeout=1),
                    "attach": lambda c: c.attach(self.sender.remote_handle or self.writer_like(), name="other"),
                    "for": lambda c: next(iter(c)),
                },
                "sender": {
                    "put_nowait": lambda s: s.put_nowait("x"),
                    "put": lambda s: s.put("x", timeout=1),
                    "put_many": lambda s: s.put_many(["x", "y"], timeout=1),
                },
            }
        self.api = api
        self.directory = self.collector.handle.directory
        self.roles = {"collector": self.collector, "sender": self.sender}
        self.closes = {name: closes_of(api) for name in self.roles}
        self.answers = {
            "collector": {"handle": lambda c: c.handle.to_json()},
            "sender": {"handle": lambda s: s.handle.to_json(), "name": lambda s: s.name},
        }

    def writer_like(self) -> str:
        """A channel's handle for ``attach`` where the sender has none to offer (a local one)."""
        return '{"name": "aiobroadcast-00000000000000000000000000000000"}'

    def round_trip(self, i: int) -> None:
        c, s = self.collector, self.sender
        if self.api == "async":

            async def both() -> Any:
                with anyio.fail_after(WITHIN_S):
                    await s.put(i)
                    return await c.get()

            got = run(both)
        else:
            s.put(i, timeout=WITHIN_S)
            got = c.get(timeout=WITHIN_S)
        assert got == ab.Item("peer", i), (got, i)


class Calls(Family):
    """A caller and its one worker (shared memory only: a pool has no TCP transport)."""

    def __init__(self, api: str, transport: Transport) -> None:
        assert transport == "shm", "a pool of workers has no TCP transport"
        if api == "async":
            self.caller = opened(ab.open_caller(workers=["peer"], capacity=8, slot_bytes=256))
            self.worker = opened(ab.open_worker(self.caller.handle, name="peer"))
            self.uses = {
                "caller": {
                    "call": lambda c: c.call("x", timeout=1),
                    "wait_ready": lambda c: c.wait_ready(timeout=1),
                },
                "worker": {"serve": lambda w: w.serve(lambda x: x), "async for": lambda w: w.__anext__()},
            }
        else:
            self.caller = blocking.open_caller(workers=["peer"], capacity=8, slot_bytes=256)
            self.worker = blocking.open_worker(self.caller.handle, name="peer")
            self.uses = {
                "caller": {
                    "call": lambda c: c.call("x", timeout=1),
                    "wait_ready": lambda c: c.wait_ready(timeout=1),
                },
                "worker": {"serve": lambda w: w.serve(lambda x: x), "for": lambda w: next(iter(w))},
            }
        self.api = api
        self.directory = self.caller.handle.requests.directory
        self.roles = {"caller": self.caller, "worker": self.worker}
        self.closes = {name: closes_of(api) for name in self.roles}
        self.answers = {"caller": {"handle": lambda c: c.handle.to_json()}, "worker": {"name": lambda w: w.name}}

    def round_trip(self, i: int) -> None:
        c, w = self.caller, self.worker
        if self.api == "async":

            async def both() -> Any:
                async def answer_one() -> None:
                    request = await w.__anext__()
                    await request.reply(request.value)

                with anyio.fail_after(WITHIN_S):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(answer_one)
                        return await c.call(i, timeout=WITHIN_S)

            got = run(both)
        else:

            def answer_one() -> None:
                request = next(w)
                request.reply(request.value)

            t = threading.Thread(target=answer_one)
            t.start()
            try:
                got = c.call(i, timeout=WITHIN_S)
            finally:
                t.join(WITHIN_S)
            assert not t.is_alive()
        assert got == {"peer": ab.Reply("peer", i)}, (got, i)


class Vllm(Family):
    """vLLM's ``MessageQueue``: the writer and a reader (over TCP: a remote reader). Blocking
    only: vLLM's queue has no async API."""

    def __init__(self, api: str, transport: Transport) -> None:
        from aiobroadcast.vllm import MessageQueue

        assert api == "blocking", "vLLM's MessageQueue has no async API"
        if transport == "shm":
            self.writer = MessageQueue(1, 1, max_chunk_bytes=256, max_chunks=8)
            self.reader = MessageQueue.create_from_handle(self.writer.export_handle(), 0)
        else:
            self.writer = MessageQueue(1, 0, max_chunk_bytes=256, max_chunks=8, connect_ip="127.0.0.1")
            self.reader = MessageQueue.create_from_handle(self.writer.export_handle(), -1)
        self.writer.wait_until_ready()
        self.directory = ab.Handle.parse(self.writer.export_handle().channel).directory
        self.roles = {"mq-writer": self.writer, "mq-reader": self.reader}
        self.uses = {
            "mq-writer": {
                "enqueue": lambda q: q.enqueue("x", timeout=1),
                "broadcast_object": lambda q: q.broadcast_object("x"),
                "wait_until_ready": lambda q: q.wait_until_ready(),
            },
            "mq-reader": {
                "dequeue": lambda q: q.dequeue(timeout=1),
                "broadcast_object": lambda q: q.broadcast_object(),
                "wait_until_ready": lambda q: q.wait_until_ready(),
            },
        }
        ends = {"close": lambda q: q.close(), "close again": lambda q: q.close(), "shutdown": lambda q: q.shutdown()}
        self.closes = dict.fromkeys(self.roles, ends)
        self.answers = {name: {"export_handle": lambda q: q.export_handle().channel} for name in self.roles}

    def round_trip(self, i: int) -> None:
        self.writer.enqueue(i, timeout=WITHIN_S)
        got = self.reader.dequeue(timeout=WITHIN_S)
        assert got == i, (got, i)


FAMILIES: dict[str, Callable[[str, Transport], Family]] = {
    "broadcast": Broadcast,
    "fanin": FanIn,
    "calls": Calls,
    "vllm": Vllm,
}


# --- the child ---------------------------------------------------------------------------------
def outcome(call: Callable[[], Any]) -> str:
    """ "ok", or the exception that escaped: "Type: message"."""
    try:
        got = call()
        if hasattr(got, "__await__"):

            async def wait() -> Any:
                with anyio.fail_after(10):  # a hang is a failure too
                    return await got

            run(wait)
    except BaseException as exc:  # what escaped is the report
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def in_child(family: Family, role: str, op: str) -> dict[str, str]:
    if op == "gc":
        # Drop the child's every reference to the role, and collect it now (the other roles are
        # collected at the interpreter's exit).
        for name in list(vars(family)):
            if getattr(family, name) is family.roles[role]:
                delattr(family, name)
        del family.roles[role], family.uses[role], family.closes[role], family.answers[role], family.bound[role]
        family.bound_uses.pop(role, None)
        gc.collect()
        return {"gc": "ok"}
    calls = {"close": family.closes, "use": family.uses, "answers": family.answers}.get(op)
    if calls is None:
        assert op == "statistics", op
        calls = {role: {"statistics": lambda r: r.statistics()}}
    obj = family.roles[role]
    seen = {what: outcome(functools.partial(call, obj)) for what, call in calls[role].items()}
    if op == "close":
        seen["bound before the fork"] = outcome(family.bound[role])
    for what, call in family.bound_uses.get(role, {}).items():
        if (what == "statistics") == (op == "statistics") and op in ("use", "statistics"):
            seen[f"{what}, bound before the fork"] = outcome(call)
    return seen


# --- what the parent checks it still has --------------------------------------------------------
def files(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("aiobroadcast"))


def locks(directory: str) -> list[str]:
    """The locks held on the files in ``directory`` (by inode and byte range), from /proc/locks:
    liveness locks, which no one but their holder may release."""
    where = {}
    for root, _dirs, names in os.walk(directory):
        for n in names:
            try:
                st = os.stat(os.path.join(root, n))
            except OSError:  # replaced meanwhile (a TCP server's report)
                continue
            # as /proc/locks says where a lock is: major and minor in hex, the inode in decimal
            where[f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"] = os.path.relpath(
                os.path.join(root, n), directory
            )
    held = []
    with open("/proc/locks") as f:
        for line in f:
            cols = line.split()
            if "->" in cols:  # a waiter's line
                continue
            # N: OFDLCK ADVISORY WRITE PID MAJ:MIN:INODE START END
            if cols[5] in where:
                held.append(f"{cols[1]} {cols[3]} {where[cols[5]]} {cols[6]}-{cols[7]}")
    return sorted(held)


def servers() -> list[int]:
    """This process's child processes: its TCP servers."""
    return sorted(p.pid for p in psutil.Process().children())


def reap(pid: int) -> int:
    """The child's exit code; a child still there after ``CHILD_S`` hangs: killed, and said so."""
    deadline = time.monotonic() + CHILD_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return HUNG


def say(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# --- the parent's loop: at the top of the script, so a child's sys.exit ends the interpreter ---
family: Family = FAMILIES[sys.argv[1]](sys.argv[2], cast(Transport, sys.argv[3]))
family.bound = {name: getattr(obj, "aclose", None) or obj.close for name, obj in family.roles.items()}
#: Not for a pool's roles: a caller's statistics() taken so reads only its own in-process counts,
#: and a blocking worker's serve() taken so returns 0 at once (its reader refuses).
family.bound_uses = {
    name: {
        what: functools.partial(getattr(obj, what), *(["x"] if what.startswith("put") else []))
        for what in ("put_nowait", "get_nowait", "dequeue", "statistics")
        if hasattr(obj, what)
    }
    for name, obj in family.roles.items()
    if sys.argv[1] != "calls"
}
family.round_trip(0)
say({"ready": os.getpid(), "roles": sorted(family.roles)})
for n, line in enumerate(sys.stdin, 1):
    if line.strip() == "exit":
        break
    role, op = line.split()
    before = {"files": files(family.directory), "locks": locks(family.directory), "servers": servers()}
    err_path = os.path.join(tempfile.gettempdir(), f"fork-matrix-{os.getpid()}-{n}.err")
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(err, 2)
        os.close(err)
        try:
            seen: dict[str, str] = in_child(family, role, op)
        except BaseException:  # a failure of the harness itself
            seen = {"harness": traceback.format_exc()}
        os.write(w, json.dumps(seen).encode())
        os.close(w)
        sys.exit(0)  # the interpreter's exit: atexit hooks, finalizers, every inherited role collected
    os.close(w)
    code = reap(pid)
    with os.fdopen(r, "rb") as f:
        raw = f.read()
    with open(err_path) as err_file:
        stderr = err_file.read()
    os.unlink(err_path)
    after = {"files": files(family.directory), "locks": locks(family.directory), "servers": servers()}
    try:
        family.round_trip(n)
        trip = "ok"
    except BaseException as exc:  # reported
        trip = f"{type(exc).__name__}: {exc}"
    say(
        {
            "seen": json.loads(raw) if raw else None,
            "exitcode": code,
            "stderr": stderr,
            "before": before,
            "after": after,
            "round_trip": trip,
        }
    )

for obj in reversed(family.roles.values()):  # the peers first: the reader, the sender, the worker
    if sys.argv[2] == "async":
        run(obj.aclose)
    else:
        obj.close()
say({"closed": files(family.directory)})
