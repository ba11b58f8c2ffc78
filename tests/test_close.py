"""Closing, as one matrix: every role of every API, over shared memory and over TCP, closed twice,
from two threads (two tasks, for the async roles, whose ``aclose`` belongs to one event loop) at
once, while another thread or task waits in ``get``/``put``, and inside ``with``/``async with``.

Every close returns, every later close does nothing, a waiting call raises ``ClosedResourceError``
within seconds (never an ``OSError``, never a hang), and a closed role refuses every use with
``ClosedResourceError``. Real rings, real TCP servers (one writer per module serves the reader
cases of both transports), real threads.

And the remote reader's I/O thread failing after the welcome: the stream ends with a
``TransportError`` that says so, and a waiting ``get`` wakes up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import psutil
import pytest
from _peers import LOOPBACK, ON_ASYNCIO, tcp_writer, until
from _tcp_workers import ASYNCIO, TRIO, UVLOOP

import aiobroadcast as ab
from aiobroadcast import blocking
from aiobroadcast._tcp import client as tcp_client
from aiobroadcast._tcp import pump as tcp_pump
from aiobroadcast._tcp.receiving import ClientProtocol
from aiobroadcast.vllm import Handle as QueueHandle
from aiobroadcast.vllm import MessageQueue

#: A liveness bound for "at once" (it takes milliseconds): a loaded 2-core machine.
PROMPT_S = 5.0
#: How long a waiting call is given to park before the close (if it has not, it still must raise
#: ClosedResourceError: the test is only weaker, never wrong).
PARK_S = 0.3
Transport = Literal["shm", "tcp"]
TRANSPORTS: list[Transport] = ["shm", "tcp"]
SCENARIOS = ["twice", "threads", "waiting", "with"]


@pytest.fixture(scope="module")
def channel() -> Iterator[ab.Handle]:
    """One writer with a TCP server for every reader case of this module (nothing is published:
    readers attach, wait, and close)."""
    with blocking.open_writer(capacity=8, slot_bytes=256, tcp=LOOPBACK) as writer:
        yield writer.handle


@pytest.fixture(autouse=True)
def _no_leftover_segments(channel: ab.Handle) -> Iterator[None]:
    """conftest's check, less the shared writer's files: its TCP server rewrites its report
    (through a temporary file) whenever it likes."""
    shared = os.path.basename(channel.path)

    def ours() -> set[str]:
        return {n for n in os.listdir("/dev/shm") if n.startswith("aiobroadcast-") and not n.startswith(shared)}

    before = ours()
    yield
    left = ours() - before
    assert not left, f"left behind in /dev/shm: {sorted(left)}"


class Call(threading.Thread):
    """``fn()`` in a thread; ``outcome()`` is what it returned or raised."""

    def __init__(self, fn: Callable[[], Any], start: threading.Barrier | None = None) -> None:
        super().__init__(daemon=True)
        self._fn = fn
        self._barrier = start
        self.out: tuple[bool, Any] | None = None
        self.start()

    def run(self) -> None:
        if self._barrier is not None:
            self._barrier.wait()
        try:
            self.out = (True, self._fn())
        except BaseException as exc:
            self.out = (False, exc)

    def outcome(self) -> tuple[bool, Any]:
        self.join(PROMPT_S)
        assert not self.is_alive(), f"{self._fn} did not return within {PROMPT_S} s"
        assert self.out is not None
        return self.out


def fill(put_nowait: Callable[[bytes], None]) -> None:
    """Publish until a stalled reader holds the writer back."""
    with pytest.raises(ab.WouldBlock):
        for _ in range(1000):
            put_nowait(b"x")


# --- the blocking roles and vLLM's MessageQueue ---------------------------------------------------
@dataclass
class Role:
    close: Callable[[], None]
    #: a call that waits (a get with nothing published, a put into a ring a reader holds full)
    wait: Callable[[], Any]
    #: a use that a closed role refuses
    use: Callable[[], Any]
    #: the role as a context manager, if it is one
    managed: contextlib.AbstractContextManager[Any] | None
    #: whether the close is over (a writer: its segment is gone), asked as a close returns
    done: Callable[[], bool] = lambda: True


def gone(handle: ab.Handle) -> Callable[[], bool]:
    return lambda: not os.path.exists(handle.path)


def blocking_writer(transport: Transport, channel: ab.Handle, stack: contextlib.ExitStack) -> Role:
    w = blocking.open_writer(capacity=4, slot_bytes=256, tcp=LOOPBACK if transport == "tcp" else None)
    stack.callback(w.close)
    stall = stack.enter_context(blocking.open_reader(w.handle, transport="shm"))  # never reads

    def wait() -> None:
        fill(w.put_nowait)
        w.put(b"held back")

    assert stall.name
    return Role(w.close, wait, lambda: w.put_nowait(b"x"), w, gone(w.handle))


def blocking_reader(transport: Transport, channel: ab.Handle, stack: contextlib.ExitStack) -> Role:
    r = blocking.open_reader(channel, transport=transport)
    stack.callback(r.close)
    return Role(r.close, r.get, r.get_nowait, r)


def queue_writer(transport: Transport, channel: ab.Handle, stack: contextlib.ExitStack) -> Role:
    if transport == "shm":
        mq = MessageQueue(1, 1, max_chunk_bytes=256, max_chunks=2)
    else:  # a TCP server, a remote reader, and the local reader that holds the writer back
        mq = MessageQueue(2, 1, local_reader_ranks=[0], max_chunk_bytes=256, max_chunks=2, connect_ip="127.0.0.1")
    stack.callback(mq.close)
    readers = [MessageQueue.create_from_handle(mq.export_handle(), rank) for rank in range(mq.handle.n_reader)]
    for reader in readers:
        stack.callback(reader.close)

    def wait() -> None:
        mq.enqueue(1)
        mq.enqueue(2)
        for reader in readers[1:]:  # the remote reader takes what it was sent (the server drains)
            assert [reader.dequeue(timeout=PROMPT_S), reader.dequeue(timeout=PROMPT_S)] == [1, 2]
        mq.enqueue(3)  # rank 0 has read nothing: the ring of 2 is full

    return Role(mq.close, wait, lambda: mq.enqueue("x", timeout=0), None, gone(ab.Handle.parse(mq.handle.channel)))


def queue_reader(transport: Transport, channel: ab.Handle, stack: contextlib.ExitStack) -> Role:
    h = QueueHandle(local_reader_ranks=[0], channel=channel.to_json(), n_reader=2, n_local_reader=1)
    mq = MessageQueue.create_from_handle(h, 0 if transport == "shm" else 1)
    stack.callback(mq.close)

    def close() -> None:
        mq.close()
        mq.shutdown()  # after a close, as vLLM's shutdown flow may do

    return Role(close, mq.dequeue, lambda: mq.dequeue(timeout=0), None)


BLOCKING_ROLES = {
    "blocking-writer": blocking_writer,
    "blocking-reader": blocking_reader,
    "queue-writer": queue_writer,
    "queue-reader": queue_reader,
}


@pytest.mark.parametrize(
    ("role", "transport", "scenario"),
    [
        pytest.param(role, transport, scenario, id=f"{role}-{transport}-{scenario}")
        for role in BLOCKING_ROLES
        for transport in TRANSPORTS
        for scenario in SCENARIOS
        if not (role.startswith("queue") and scenario == "with")  # vLLM's MessageQueue is no context manager
    ],
)
def test_blocking_roles_close_once_for_good(role: str, transport: Transport, scenario: str, channel: ab.Handle) -> None:
    with contextlib.ExitStack() as stack:
        r = BLOCKING_ROLES[role](transport, channel, stack)
        if scenario == "twice":
            r.close()
            r.close()
        elif scenario == "threads":  # neither returns before the close is over

            def close() -> bool:
                r.close()
                return r.done()

            barrier = threading.Barrier(2)
            closers = [Call(close, barrier) for _ in range(2)]
            assert [c.outcome() for c in closers] == [(True, True)] * 2
        elif scenario == "waiting":
            waiters = [Call(r.wait) for _ in range(2 if role == "blocking-reader" else 1)]
            time.sleep(PARK_S)
            assert all(w.is_alive() for w in waiters), [w.out for w in waiters]
            closer = Call(r.close)
            assert closer.outcome() == (True, None)
            for w in waiters:
                ok, got = w.outcome()
                assert not ok and type(got) is ab.ClosedResourceError, got
        else:
            assert r.managed is not None
            with r.managed:
                r.close()
        with pytest.raises(ab.ClosedResourceError):
            r.use()
        r.close()


# --- the async roles --------------------------------------------------------------------------------
@dataclass
class AsyncRole:
    aclose: Callable[[], Any]
    wait: Callable[[], Any]
    use: Callable[[], Any]
    managed: contextlib.AbstractAsyncContextManager[Any]
    done: Callable[[], bool] = lambda: True


async def async_writer(transport: Transport, channel: ab.Handle, stack: contextlib.AsyncExitStack) -> AsyncRole:
    w = await ab.open_writer(capacity=4, slot_bytes=256, tcp=LOOPBACK if transport == "tcp" else None)
    stack.push_async_callback(w.aclose)
    stall = stack.enter_context(blocking.open_reader(w.handle, transport="shm"))  # never reads

    async def wait() -> None:
        fill(w.put_nowait)
        await w.put(b"held back")

    assert stall.name
    return AsyncRole(w.aclose, wait, lambda: w.put_nowait(b"x"), w, gone(w.handle))


async def async_reader(transport: Transport, channel: ab.Handle, stack: contextlib.AsyncExitStack) -> AsyncRole:
    r = await ab.open_reader(channel, transport=transport)
    stack.push_async_callback(r.aclose)
    return AsyncRole(r.aclose, r.get, r.get_nowait, r)


ASYNC_ROLES = {"writer": async_writer, "reader": async_reader}


def async_cases() -> Iterator[Any]:
    """Every case on every backend, but a writer with a TCP server (a process of its own, the
    slow one to start) on one backend per scenario, in turn: its close is the same code on each."""
    backends = [pytest.param(b, id=name) for b, name in ((ASYNCIO, "asyncio"), (UVLOOP, "uvloop"), (TRIO, "trio"))]
    for role in ASYNC_ROLES:
        for transport in TRANSPORTS:
            for i, scenario in enumerate(SCENARIOS):
                turn = [backends[i % 3]] if role == "writer" and transport == "tcp" else backends
                for b in turn:
                    yield pytest.param(
                        b.values[0], role, transport, scenario, id=f"{b.id}-{role}-{transport}-{scenario}"
                    )


@pytest.mark.anyio
@pytest.mark.parametrize(("anyio_backend", "role", "transport", "scenario"), list(async_cases()))
async def test_async_roles_close_once_for_good(
    role: str, transport: Transport, scenario: str, channel: ab.Handle
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        r = await ASYNC_ROLES[role](transport, channel, stack)
        if scenario == "twice":
            await r.aclose()
            await r.aclose()
        elif scenario == "threads":  # aclose belongs to the role's event loop: two tasks at once
            done: list[bool] = []

            async def close() -> None:
                await r.aclose()
                done.append(r.done())  # neither returns before the close is over

            with anyio.fail_after(PROMPT_S):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(close)
                    tg.start_soon(close)
            assert done == [True, True]
        elif scenario == "waiting":
            outcomes: list[BaseException | None] = []

            async def waiter() -> None:
                try:
                    await r.wait()
                except BaseException as exc:
                    outcomes.append(exc)
                    if not isinstance(exc, ab.BroadcastError):
                        raise
                else:
                    outcomes.append(None)

            with anyio.fail_after(PROMPT_S + PARK_S):
                async with anyio.create_task_group() as tg:
                    for _ in range(2 if role == "reader" else 1):
                        tg.start_soon(waiter)
                    await anyio.sleep(PARK_S)
                    assert not outcomes
                    await r.aclose()
            assert outcomes and all(type(exc) is ab.ClosedResourceError for exc in outcomes), outcomes
        else:
            async with r.managed:
                await r.aclose()
        with pytest.raises(ab.ClosedResourceError):
            r.use()
        await r.aclose()


# --- relays -------------------------------------------------------------------------------------------
@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_relay_cancelled_while_it_waits_upstream_ends_its_channel(
    transport: Transport, channel: ab.Handle
) -> None:
    """A relay has no close of its own: cancelling it is its close. Its upstream reader, asleep
    with nothing published, detaches; its own readers get ``EndOfStream``."""
    ready: list[ab.Handle] = []
    started = anyio.Event()

    def on_ready(handle: ab.Handle) -> None:
        ready.append(handle)
        started.set()

    with anyio.fail_after(PROMPT_S + PARK_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: ab.relay(channel, transport=transport, on_ready=on_ready))
            await started.wait()
            async with await ab.open_reader(ready[0]) as down:
                await anyio.sleep(PARK_S)
                tg.cancel_scope.cancel()
                with anyio.fail_after(PROMPT_S), pytest.raises(ab.EndOfStream):
                    await down.get()


# --- the remote reader's I/O thread -------------------------------------------------------------------
class PumpFault(Exception):
    """Raised in a remote reader's I/O thread, at the test's command."""


@pytest.fixture
def pump_fault(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set it: a remote reader's I/O thread raises ``PumpFault`` at its next turn (the test then
    pokes the thread so that the turn comes at once), or as it takes the next frame from the
    server (set before ``open_reader``: the WELCOME)."""
    armed = threading.Event()

    def failing(method: Callable[..., Any]) -> Callable[..., Any]:
        def fail_when_armed(self: ClientProtocol, *args: Any, **kw: Any) -> Any:
            if armed.is_set():
                raise PumpFault("injected")
            return method(self, *args, **kw)

        return fail_when_armed

    monkeypatch.setattr(ClientProtocol, "tick", failing(ClientProtocol.tick))
    monkeypatch.setattr(ClientProtocol, "receive", failing(ClientProtocol.receive))
    return armed


def pump_of(source: object) -> tcp_pump.Pump:
    assert isinstance(source, tcp_client.TcpSource)
    return source._pump


@pytest.mark.anyio
async def test_a_failed_io_thread_ends_the_stream_with_a_transport_error(
    channel: ab.Handle, pump_fault: threading.Event
) -> None:
    async with await ab.open_reader(channel, transport="tcp") as reader:
        failed = False

        async def wait() -> None:
            nonlocal failed
            with pytest.raises(ab.TransportError, match=r"I/O thread failed.*PumpFault"):
                await reader.get()
            failed = True

        with anyio.fail_after(PROMPT_S + PARK_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait)
                await anyio.sleep(PARK_S)  # the get is asleep
                pump_fault.set()
                pump_of(reader._src).poke()
        assert failed
        with pytest.raises(ab.TransportError, match="I/O thread failed"):  # for good
            reader.get_nowait()


def test_a_failed_io_thread_wakes_a_blocking_get(channel: ab.Handle, pump_fault: threading.Event) -> None:
    with blocking.open_reader(channel, transport="tcp") as reader:
        getter = Call(reader.get)
        time.sleep(PARK_S)
        pump_fault.set()
        pump_of(reader._src).poke()
        ok, got = getter.outcome()
        assert not ok and isinstance(got, ab.TransportError), got
        assert "PumpFault" in str(got)
    # Before the WELCOME (its first turn fails): open_reader says why, without waiting for its timeout.
    with pytest.raises(ab.TransportError, match=r"I/O thread failed.*PumpFault"):
        blocking.open_reader(channel, transport="tcp", connect_timeout=PROMPT_S)


@pytest.mark.anyio
@ON_ASYNCIO  # the reader's side of the failure runs on every backend above
async def test_a_relay_whose_upstream_io_fails_stops_like_a_dead_writer(
    channel: ab.Handle, pump_fault: threading.Event
) -> None:
    """Its readers get ``WriterGone``, not an ``EndOfStream`` they would take for a clean end;
    the relay raises the ``TransportError``."""
    ready: list[ab.Handle] = []
    started = anyio.Event()
    raised: list[BaseException] = []

    def on_ready(handle: ab.Handle) -> None:
        ready.append(handle)
        started.set()

    async def relay() -> None:
        try:
            await ab.relay(channel, transport="tcp", on_ready=on_ready)
        except ab.TransportError as exc:
            raised.append(exc)

    with anyio.fail_after(PROMPT_S + PARK_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(relay)
            await started.wait()
            async with await ab.open_reader(ready[0]) as down:
                await anyio.sleep(PARK_S)
                pump_fault.set()  # the relay's I/O thread fails at its next turn (every 0.25 s)
                with pytest.raises(ab.WriterGone):
                    await down.get()
    assert raised and "I/O thread failed" in str(raised[0])


# --- the writer's TCP server watcher --------------------------------------------------------------------
@pytest.mark.anyio
@ON_ASYNCIO
async def test_a_server_watcher_that_fails_says_so_and_lets_go_of_the_ring(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The thread that restarts a dead TCP server cannot even spawn one (no such executable, for
    real): the writer says ``tcp_server == "failed"`` and logs it, and drops the dead server's ring
    place, so a "block" writer is not held by a server that never comes back."""
    caplog.set_level(logging.WARNING, logger="aiobroadcast")
    async with tcp_writer() as writer:
        assert writer._ch.serving.server is not None
        (pid,) = writer._ch.serving.server.pids  # (the module's writer has a server of its own)
        server = psutil.Process(pid)
        monkeypatch.setattr(sys, "executable", "/nonexistent/python")
        server.kill()
        await until(lambda: writer.statistics().tcp_server == "failed", PROMPT_S)
        assert any(r.levelno >= logging.ERROR and "TCP server" in r.getMessage() for r in caplog.records)
        with anyio.fail_after(PROMPT_S):
            for i in range(2 * writer.handle.capacity):
                await writer.put(i)
