"""A cancelled close still closes: every role's ``aclose`` (and a relay's own close) under every way
of cancelling it.

asyncio's own ways (``task.cancel()``, twice, ``asyncio.timeout``, ``asyncio.wait_for``, a
``TaskGroup`` whose other task fails) on asyncio and uvloop, which no anyio shield stops; and a
cancel scope on every backend (trio's own under trio). Each lands while the close waits (a writer
with a TCP server waits for it to stop). Whether the close then raises the cancellation or
completes, the role is closed at once: its files are gone from /dev/shm, its TCP server process is
gone, its readers get ``EndOfStream``, and a second ``aclose`` does nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import aiobroadcast as ab
import aiobroadcast.blocking as abb
from aiobroadcast._tcp import supervisor

pytestmark = pytest.mark.anyio

ASYNCIO = [
    pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
]
ASYNCIO_WAYS = ["task.cancel", "cancel twice", "timeout", "wait_for", "TaskGroup"]
TCP = "tcp://127.0.0.1:0"

Call = Callable[[], Coroutine[Any, Any, None]]
#: returns once the call is to be cancelled
Fire = Callable[[], Awaitable[None]]


class Boom(Exception):
    """The failure of a task group's other task, which cancels the call."""


async def one_round() -> None:
    await anyio.lowlevel.checkpoint()


async def cancelled(call: Call, way: str, fire: Fire = one_round) -> bool:
    """Run ``call`` and cancel it by ``way`` once ``fire`` returns (by default after one round of
    the loop: the call is at its first await). True if it completed all the same; the cancellation
    must not be swallowed otherwise."""
    if way in ("task.cancel", "cancel twice"):
        task = asyncio.ensure_future(call())
        await fire()
        task.cancel()
        if way == "cancel twice":
            await asyncio.sleep(0)
            task.cancel()  # while the first cancellation unwinds (a close in a finally, say)
        try:
            await task
        except asyncio.CancelledError:
            assert task.cancelled()
            return False
        return True
    if way == "timeout":
        loop = asyncio.get_running_loop()

        async def arm(cm: asyncio.Timeout) -> None:
            await fire()
            cm.reschedule(loop.time())

        try:
            async with asyncio.timeout(None) as cm:
                armed = asyncio.ensure_future(arm(cm))
                try:
                    await call()
                finally:
                    armed.cancel()
            return True
        except TimeoutError:
            return False
    if way == "wait_for":
        assert fire is one_round  # wait_for takes a delay, not a moment
        try:
            await asyncio.wait_for(call(), 1e-3)
            return True
        except TimeoutError:
            return False
    failing = way == "TaskGroup"
    done: list[bool] = []
    scope = anyio.CancelScope()

    async def run() -> None:
        with scope:
            await call()
            done.append(True)

    async def sibling() -> None:
        await fire()
        if failing:
            raise Boom
        scope.cancel()

    try:
        if failing:
            async with asyncio.TaskGroup() as atg:
                atg.create_task(run())
                atg.create_task(sibling())
        else:
            assert way == "scope.cancel"
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                tg.start_soon(sibling)
    except* Boom:
        pass
    return bool(done)


def servers() -> set[int]:
    """The TCP server processes this process started that are alive (not yet reaped zombies
    excluded: their command line is empty)."""
    me = str(os.getpid())
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError):
            continue
        if ppid == me and b"aiobroadcast._tcp.server" in cmd:
            pids.add(int(entry))
    return pids


def files(handle: ab.Handle) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(handle.name))


async def end_of_stream(reader: ab.Reader[Any]) -> None:
    """The reader receives what is left, then EndOfStream."""
    with anyio.fail_after(10):
        while True:
            try:
                await reader.get()
            except ab.EndOfStream:
                return


def closed_at_once(handle: ab.Handle, before: set[int]) -> None:
    assert files(handle) == []
    assert servers() <= before  # stopped and reaped, not stopping in the background


async def check_aclose_cancelled(way: str) -> None:
    """Every role's aclose, cancelled by ``way``."""
    before = servers()
    with anyio.fail_after(60):
        # A writer with a TCP server, its readers over shared memory and TCP.
        writer = await ab.open_writer(capacity=16, slot_bytes=256, tcp=TCP, heartbeat_s=0.5)
        near = await ab.open_reader(writer.handle, name="near")
        far = await ab.open_reader(writer.handle, name="far", transport="tcp")
        await writer.put(1)
        for r in (near, far):
            assert await r.get() == 1
            await cancelled(r.aclose, way)
            with pytest.raises(ab.ClosedResourceError):
                r.get_nowait()
            await r.aclose()  # nothing left to do
        assert "near" not in [r.name for r in writer.statistics().readers]

        near = await ab.open_reader(writer.handle, name="near")
        far = await ab.open_reader(writer.handle, name="far", transport="tcp")
        await writer.put(2)
        assert await far.get() == 2  # its server serves it
        await cancelled(writer.aclose, way)
        closed_at_once(writer.handle, before)
        await writer.aclose()  # nothing left to do
        closed_at_once(writer.handle, before)
        for r in (near, far):
            await end_of_stream(r)
            await r.aclose()

        # A writer without a TCP server.
        writer = await ab.open_writer(capacity=16, slot_bytes=256)
        near = await ab.open_reader(writer.handle)
        await writer.put(3)
        await cancelled(writer.aclose, way)
        closed_at_once(writer.handle, before)
        await writer.aclose()
        assert await near.get() == 3
        await end_of_stream(near)
        await near.aclose()


async def check_relay_cancelled(way: str) -> None:
    """A relay (with a TCP server of its own) cancelled while it closes: its upstream closed, its
    local readers got EndOfStream (the close began), and the close is waiting for its server."""
    before = servers()
    with anyio.fail_after(60):
        up = abb.open_writer(capacity=16, slot_bytes=256)  # closes without awaiting, from on_ready
        handles: list[ab.Handle] = []
        ready = anyio.Event()
        ended = anyio.Event()

        def on_ready(h: ab.Handle) -> None:
            handles.append(h)
            ready.set()

        async def run_relay() -> None:
            await ab.relay(up.handle, transport="shm", tcp=TCP, on_ready=on_ready)

        async def fire() -> None:
            await ready.wait()
            async with ab.open_reader(handles[0]) as down:
                up.put_nowait(7)
                assert await down.get() == 7
                up.close()  # the relay sees EndOfStream and closes its channel
                await end_of_stream(down)
            ended.set()

        await cancelled(run_relay, way, fire)
        assert ended.is_set()
        closed_at_once(handles[0], before)


@pytest.mark.parametrize("anyio_backend", ASYNCIO)
@pytest.mark.parametrize("way", ASYNCIO_WAYS)
async def test_aclose_cancelled_by_asyncio_still_closes(way: str) -> None:
    await check_aclose_cancelled(way)


async def test_aclose_cancelled_by_a_scope_still_closes() -> None:
    await check_aclose_cancelled("scope.cancel")


@pytest.mark.parametrize("anyio_backend", ASYNCIO)
@pytest.mark.parametrize("way", ["task.cancel", "cancel twice", "timeout", "TaskGroup"])
async def test_a_relay_cancelled_while_it_closes_still_closes(way: str) -> None:
    await check_relay_cancelled(way)


async def test_a_relay_cancelled_by_a_scope_while_it_closes_still_closes() -> None:
    await check_relay_cancelled("scope.cancel")


@pytest.mark.parametrize("anyio_backend", ASYNCIO[:1])
async def test_a_cancelled_close_kills_a_server_that_does_not_stop(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that does not stop by itself (stopped here by SIGSTOP; a remote reader that does not
    drain, in life) is killed ``CANCELLED_STOP_S`` after its close was cancelled, not left behind."""
    monkeypatch.setattr(supervisor, "CANCELLED_STOP_S", 0.2)
    before = servers()
    with anyio.fail_after(30):
        writer = await ab.open_writer(capacity=16, slot_bytes=256, tcp=TCP)
        (pid,) = servers() - before
        os.kill(pid, signal.SIGSTOP)
        assert not await cancelled(writer.aclose, "task.cancel")
        closed_at_once(writer.handle, before)
    assert "close was cancelled" in caplog.text
