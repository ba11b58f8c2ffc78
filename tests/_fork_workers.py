"""Child-process entry points for tests/test_fork.py: processes that fork while they hold a role.

The test starts each of them with the spawn start method (a clean interpreter: the fork is the
worker's doing, not pytest's). The worker then forks, or starts a helper with the start method
under test, as an application does: multiprocessing workers started from a running event loop, a
pre-fork server's workers that end with ``sys.exit``, a child handed the parent's objects.

A worker forks either from inside its event loop with a child that never returns to it (a
multiprocessing child runs its target and ``os._exit``s), or between two ``anyio.run`` calls, so
that the child may run an event loop of its own (trio refuses to start one in a child forked
inside ``trio.run``).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
import time
import traceback
import warnings
from collections.abc import Awaitable, Callable
from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext
from typing import Any

import anyio
from _workers import Backend, Conn, _child, _expect

import aiobroadcast as ab

_CONTEXTS: dict[str, ForkContext | ForkServerContext | SpawnContext] = {
    "fork": multiprocessing.get_context("fork"),
    "forkserver": multiprocessing.get_context("forkserver"),
    "spawn": multiprocessing.get_context("spawn"),
}

#: How long a helper lives unless the test kills it first (far longer than any test waits).
HELPER_LIFE_S = 120.0
#: How long a worker waits for its own child's report.
REPORT_S = 30.0


def sleeper(seconds: float) -> None:
    """A helper that lives on, busy elsewhere, until the test kills it."""
    time.sleep(seconds)


def _start_helper(method: str) -> int:
    """Start a sleeping helper with ``method`` from wherever the caller is (an event loop too)."""
    helper = _CONTEXTS[method].Process(target=sleeper, args=(HELPER_LIFE_S,), daemon=True)
    helper.start()
    pid = helper.pid
    assert pid is not None
    return pid


def _sync_child(conn: Conn, main: Callable[..., None], *args: Any) -> None:
    """Run ``main(conn, *args)`` outside any event loop; report a failure over ``conn``. Only an
    ``Exception`` is a failure: a forked copy of this process may leave through ``SystemExit``."""
    try:
        main(conn, *args)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        raise
    finally:
        conn.close()


def _run(backend: Backend, fn: Callable[[], Awaitable[Any]]) -> Any:
    """One ``anyio.run`` on ``backend``: the roles outlive it, as in a program that forks between runs."""

    async def main() -> Any:
        return await fn()

    return anyio.run(main, backend=backend[0], backend_options=backend[1])


def _recv(conn: Conn, tag: str) -> Any:
    """The next report of this worker's own child, which must carry ``tag``."""
    if not conn.poll(REPORT_S):
        raise AssertionError(f"no {tag!r} from the child within {REPORT_S} s")
    got, payload = conn.recv()
    if got == "error":
        raise AssertionError(f"the child failed:\n{payload}")
    assert got == tag, (got, payload)
    return payload


def _files(handle: ab.Handle) -> list[str]:
    return sorted(n for n in os.listdir(handle.directory) if n.startswith(handle.name))


# --- a writer, then a reader, that start a helper and are killed ---------------------------------
def forking_writer_proc(conn: Conn, backend: Backend, method: str, count: int) -> None:
    """Open a writer, start a helper from the running event loop, publish ``count`` ints, hang."""
    _child(conn, backend, _forking_writer, method, count)


async def _forking_writer(conn: Conn, method: str, count: int) -> None:
    writer = await ab.open_writer(capacity=count + 4, slot_bytes=256)
    conn.send(("handle", writer.handle.to_json()))
    _expect(conn, "go")
    conn.send(("helper", _start_helper(method)))
    for i in range(count):
        await writer.put(i)
    conn.send(("sent", count))
    await anyio.sleep_forever()  # until SIGKILL: the writer is never closed


def forking_reader_proc(conn: Conn, backend: Backend, handle: str, method: str) -> None:
    """Attach with zero-copy reads; take a message and keep it (a view of the ring) while starting
    a helper from the running event loop; take one more, then stop reading (alive, not reading)
    until SIGKILL."""
    _child(conn, backend, _forking_reader, handle, method)


async def _forking_reader(conn: Conn, handle: str, method: str) -> None:
    async with ab.open_reader(handle, name="forker", zero_copy=True) as reader:
        conn.send(("attached", {"pid": os.getpid(), "place": reader.statistics().place}))
        kept = await reader.get()
        conn.send(("helper", {"pid": _start_helper(method), "kept": type(kept).__name__}))
        await reader.get()
        conn.send(("stalled", 2))
        await anyio.sleep_forever()


# --- a child that ends with sys.exit -------------------------------------------------------------
def fork_exit_proc(conn: Conn, backend: Backend) -> None:
    """Open a writer; fork a child that leaves the writer's ``async with`` and ends with
    ``sys.exit``, as a pre-fork server's worker does; then publish 0, 1, 2 and close."""
    _sync_child(conn, _fork_exit, backend)


def _fork_exit(conn: Conn, backend: Backend) -> None:
    writer = _run(backend, lambda: ab.open_writer(capacity=8, slot_bytes=256))
    conn.send(("handle", writer.handle.to_json()))
    pid = os.fork()
    if pid == 0:
        _exiting_worker(writer, backend)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    conn.send(("child-exited", {"code": code, "files": _files(writer.handle)}))
    _expect(conn, "go")
    for i in range(3):
        writer.put_nowait(i)
    _run(backend, writer.aclose)
    conn.send(("closed", _files(writer.handle)))


def _exiting_worker(writer: ab.Writer[Any], backend: Backend) -> None:
    """The forked child. ``sys.exit`` unwinds to the interpreter's exit, which runs the atexit
    hooks and finalizers inherited from the parent. Exit code 0: the inherited writer refused to
    publish with the fork message and its ``aclose`` (on leaving ``async with``) did nothing."""

    async def work() -> int:
        async with writer:
            try:
                await writer.put("from the child")
            except ab.ClosedResourceError as exc:
                return 0 if "a fork child inherits no role" in str(exc) else 4
        return 5

    code = 3
    try:
        code = _run(backend, work)
    finally:
        sys.exit(code)


# --- a child that uses what it inherited --------------------------------------------------------
def inherit_proc(conn: Conn, backend: Backend, tcp: bool) -> None:
    """Open a writer and readers of it (shared memory; over TCP too if ``tcp``); fork a child
    handed all of them; while the child lives on, publish, read and close as if it did not exist.
    Reports what the child saw and what this process saw."""
    _sync_child(conn, _inherit, backend, tcp)


def _inherit(conn: Conn, backend: Backend, tcp: bool) -> None:
    writer = _run(backend, lambda: ab.open_writer(capacity=8, slot_bytes=256, tcp="tcp://127.0.0.1:0" if tcp else None))
    readers = {"shm": _run(backend, lambda: ab.open_reader(writer.handle, name="parent-shm", transport="shm"))}
    if tcp:
        readers["tcp"] = _run(backend, lambda: ab.open_reader(writer.handle, name="parent-tcp", transport="tcp"))
    writer.put_nowait("before")
    server = writer._ch.serving.server  # held here across the fork: the child's copy is not freed with its writer
    ctx = multiprocessing.get_context("fork")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=use_inherited, args=(theirs, backend, writer, readers), daemon=True)
    child.start()
    theirs.close()
    seen = _recv(mine, "inherited")
    # The child lives on while this process goes on as if it did not exist.
    writer.put_nowait("after")

    async def two(reader: ab.Reader[Any]) -> list[Any]:
        with anyio.fail_after(10):
            return [await reader.get(), await reader.get()]

    got = {name: _run(backend, functools.partial(two, r)) for name, r in readers.items()}
    files = _files(writer.handle)
    names = sorted(r.name for r in writer.statistics().readers)
    for r in readers.values():
        _run(backend, r.aclose)
    _run(backend, writer.aclose)
    mine.send("exit")
    child.join(REPORT_S)
    conn.send(
        (
            "done",
            {
                "child": seen,
                "child_exitcode": child.exitcode,
                "got": got,
                "files": files,
                "readers": names,
                "server_exitcode": server.returncode if server is not None else None,
                "files_after": _files(writer.handle),
            },
        )
    )


def use_inherited(conn: Conn, backend: Backend, writer: ab.Writer[Any], readers: dict[str, ab.Reader[Any]]) -> None:
    """The forked child: try every use of the inherited roles; report the outcome of each (the
    error's message, or "ok"). Then stay alive until told to exit."""
    _sync_child(conn, _use_inherited, backend, writer, readers)


def _use_inherited(conn: Conn, backend: Backend, writer: ab.Writer[Any], readers: dict[str, ab.Reader[Any]]) -> None:
    seen: dict[str, str] = {}

    def outcome(exc: BaseException | None) -> str:
        return "ok" if exc is None else f"{type(exc).__name__}: {exc}"

    def attempt(what: str, call: Callable[[], object]) -> None:
        try:
            call()
        except Exception as exc:
            seen[what] = outcome(exc)
        else:
            seen[what] = outcome(None)

    async def attempt_async(what: str, call: Callable[[], Awaitable[object]]) -> None:
        try:
            with anyio.fail_after(10):  # a hang is a failure too
                await call()
        except Exception as exc:
            seen[what] = outcome(exc)
        else:
            seen[what] = outcome(None)

    attempt("writer.put_nowait", lambda: writer.put_nowait("from the child"))
    attempt("writer.statistics", writer.statistics)
    for name, r in readers.items():
        attempt(f"{name}.get_nowait", r.get_nowait)
        attempt(f"{name}.statistics", r.statistics)

    async def main() -> None:
        await attempt_async("writer.put", lambda: writer.put("from the child"))
        await attempt_async("writer.put_many", lambda: writer.put_many(["from", "the child"]))
        for name, r in readers.items():
            await attempt_async(f"{name}.get", r.get)
        await attempt_async("writer.aclose", writer.aclose)
        for name, r in readers.items():
            await attempt_async(f"{name}.aclose", r.aclose)

    _run(backend, main)
    # What the garbage collector would do here: no warning about an unclosed role that is not ours.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer.__del__()
        for r in readers.values():
            r.__del__()
    seen["warnings"] = repr([str(w.message) for w in caught])
    conn.send(("inherited", seen))
    _expect(conn, "exit")


# --- a child that opens its own reader ------------------------------------------------------------
def own_reader_parent_proc(conn: Conn, backend: Backend, method: str, count: int) -> None:
    """Open a writer; start a child with ``method`` (from outside the event loop) that opens its
    own reader from the handle; publish ``count`` ints and close. Reports what the child got."""
    _sync_child(conn, _own_reader_parent, backend, method, count)


def _own_reader_parent(conn: Conn, backend: Backend, method: str, count: int) -> None:
    writer = _run(backend, lambda: ab.open_writer(capacity=count, slot_bytes=256))
    ctx = _CONTEXTS[method]
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=own_reader_proc, args=(theirs, backend, writer.handle.to_json(), count), daemon=True)
    child.start()
    theirs.close()
    _recv(mine, "attached")
    for i in range(count):
        writer.put_nowait(i)
    _run(backend, writer.aclose)
    got = _recv(mine, "got")
    child.join(REPORT_S)
    conn.send(("done", {"got": got, "exitcode": child.exitcode}))


def own_reader_proc(conn: Conn, backend: Backend, handle: str, count: int) -> None:
    """Open a reader of ``handle``, receive ``count`` messages and the end of the stream."""
    _child(conn, backend, _own_reader, handle, count)


async def _own_reader(conn: Conn, handle: str, count: int) -> None:
    async with ab.open_reader(handle, name=f"child-{os.getpid()}") as reader:
        conn.send(("attached", os.getpid()))
        got: list[Any] = [await reader.get() for _ in range(count)]
        try:
            got.append(await reader.get())
        except ab.EndOfStream:
            got.append("end")
    conn.send(("got", got))
