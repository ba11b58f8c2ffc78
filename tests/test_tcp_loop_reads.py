"""A remote reader's event loop reads the data connection itself while a task sleeps on it in a
paced stream, and hands it back to the reader's I/O thread for a dense one (docs/tcp.md, "The
reader's loop reads while it sleeps"). Two threads then share one ZeroMQ socket and the
protocol behind it: these tests attack the hand-over.

Real writer, real server process, real remote reader over loopback. The heartbeat is long
(``SLOW_HB``) where a lost wake-up is looked for: a message that nobody polls for would come
only with the I/O thread's next timer, seconds late. Bounds on time are liveness bounds, never
latency.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections import Counter
from typing import Any

import anyio
import pytest

import aiobroadcast as ab
import aiobroadcast.blocking as abb
from aiobroadcast._base import tuning as _tuning
from aiobroadcast._tcp import inbox

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def no_safety_net(monkeypatch: pytest.MonkeyPatch) -> None:
    """A remote reader's sleep ends on its own after ``_tuning.REMOTE_SLEEP_S`` (a safety net):
    made long here, so that a lost wake-up shows as a message seconds late, not hidden by it."""
    monkeypatch.setattr(_tuning, "REMOTE_SLEEP_S", 60.0)


#: heartbeat_s of the writers: a lost wake-up costs a message up to this long
SLOW_HB = 5.0
#: what "at once" means for one message here, on a loaded 2-core machine (a lost wake-up: SLOW_HB)
PROMPT_S = 2.0
#: pauses between messages of a paced stream: each longer than _tuning.DENSE_NS, so the reader's
#: loop polls the data connection during the next sleep
PACED_S = (0.0005, 0.001, 0.002, 0.004)


@pytest.fixture
def who_takes(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the batches queued by the event loop's turns and by the I/O thread."""
    counts: Counter[str] = Counter()
    push = inbox.Inbox.push_batch

    def counted(self: inbox.Inbox, batch: Any, wake_at: int) -> None:
        io = threading.current_thread().name == "aiobroadcast-tcp-reader"
        counts["io thread" if io else "event loop"] += 1
        push(self, batch, wake_at)

    monkeypatch.setattr(inbox.Inbox, "push_batch", counted)
    return counts


@pytest.mark.parametrize(
    "anyio_backend",
    [pytest.param("asyncio", id="asyncio"), pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")],
)
async def test_paced_and_dense_turns_hand_the_connection_over_without_a_lost_wake_up(
    anyio_backend: Any, who_takes: Counter[str]
) -> None:
    """Runs of paced messages (the loop takes them) alternate with bursts of 64 KiB messages
    (the I/O thread takes them, opening the next while the loop hands out the last), with a get
    parked before each put or the put first: every message arrives promptly and in order, and
    each side took some."""
    rng = random.Random(2705)
    body = b"x" * 65536
    async with ab.open_writer(tcp="tcp://127.0.0.1:0", heartbeat_s=SLOW_HB, capacity=64, slot_bytes=256) as w:
        async with ab.open_reader(w.handle, transport="tcp", name="handover") as r:
            n = 0
            for _ in range(6):
                for _ in range(40):  # paced
                    await anyio.sleep(rng.choice(PACED_S))
                    with anyio.fail_after(PROMPT_S):  # a lost wake-up: it comes with a heartbeat
                        async with anyio.create_task_group() as tg:
                            if rng.random() < 0.5:
                                tg.start_soon(w.put, (n, b""))
                                assert await r.get() == (n, b"")
                            else:  # the get parks first

                                async def put(i: int) -> None:
                                    await anyio.sleep(rng.choice(PACED_S))
                                    await w.put((i, b""))

                                tg.start_soon(put, n)
                                assert await r.get() == (n, b"")
                    n += 1
                burst = rng.randrange(50, 300)

                async def read(first: int, count: int) -> None:
                    for i in range(first, first + count):
                        assert await r.get() == (i, body)

                with anyio.fail_after(60):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(read, n, burst)
                        for i in range(n, n + burst):
                            await w.put((i, body))
                n += burst
    assert who_takes["event loop"] > 0, who_takes
    assert who_takes["io thread"] > 0, who_takes


@pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")])
async def test_a_paced_stream_is_taken_by_the_event_loop(anyio_backend: Any, who_takes: Counter[str]) -> None:
    """The point of the design: in a paced stream the sleeping loop takes the messages itself,
    without the I/O thread's hop (most of them; the I/O thread may win a race now and then)."""
    async with ab.open_writer(tcp="tcp://127.0.0.1:0", heartbeat_s=SLOW_HB) as w:
        async with ab.open_reader(w.handle, transport="tcp", name="paced") as r:
            with anyio.fail_after(60):
                for i in range(200):
                    await anyio.sleep(0.002)
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(w.put, i)
                        assert await r.get() == i
    assert who_takes["event loop"] >= 100, who_takes


def _write_from_a_thread(handle: list[str], ready: threading.Event, go: threading.Event, n: int) -> None:
    with abb.open_writer(tcp="tcp://127.0.0.1:0", heartbeat_s=0.1) as w:
        handle.append(w.handle.to_json())
        ready.set()
        go.wait(30)
        for i in range(n):
            w.put(i)
            time.sleep(0.002)
        time.sleep(1.0)  # heartbeats go on while the reader's loop is still blocked


@pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")])
async def test_a_blocked_event_loop_loses_nothing_and_stays_connected(anyio_backend: Any) -> None:
    """A get sleeps with its loop polling the data connection, then another task blocks the
    loop (for 12 heartbeats, twice the writer's silence limit for a reader) while the writer
    goes on: the I/O thread keeps the connection alive at its timers and takes what comes, and
    after the block every message is there, in order."""
    handle: list[str] = []
    ready, go = threading.Event(), threading.Event()
    n = 300
    writer = threading.Thread(target=_write_from_a_thread, args=(handle, ready, go, n))
    writer.start()
    try:
        assert ready.wait(30)
        async with ab.open_reader(handle[0], transport="tcp", name="blocked") as r:
            got: list[int] = []
            paced = anyio.Event()  # a few came paced: the parked get's loop polls the connection

            async def read() -> None:
                while len(got) < n:
                    got.append(await r.get())
                    if len(got) == 5:
                        paced.set()

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(read)
                    go.set()
                    await paced.wait()
                    time.sleep(1.2)  # noqa: ASYNC251 (blocks this loop on purpose, parked get included)
                    blocked_at = len(got)
            assert blocked_at < n  # the block fell while messages came
            assert got == list(range(n))
            assert r.statistics().lagged == 0
    finally:
        go.set()
        writer.join(30)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _park(r: ab.Reader[Any], raised: list[BaseException]) -> None:
    try:
        await r.get()
    except ab.ClosedResourceError as exc:
        raised.append(exc)


@pytest.mark.parametrize(
    "anyio_backend",
    [pytest.param("asyncio", id="asyncio"), pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")],
)
async def test_closing_a_reader_whose_loop_polls_the_connection(anyio_backend: Any) -> None:
    """A get parked with its loop polling the data connection, and the reader closed by another
    task: the get raises ClosedResourceError, and the descriptor the loop polled is closed once
    the loop has let go of it (none left open after 10 rounds)."""
    async with ab.open_writer(tcp="tcp://127.0.0.1:0", heartbeat_s=SLOW_HB) as w:
        fds = 0
        for round_ in range(10):
            r = await ab.open_reader(w.handle, transport="tcp", name=f"closed-{round_}")
            for i in range(3):  # paced: the next sleep polls the connection
                await w.put(i)
                assert await r.get() == i
                await anyio.sleep(0.002)
            raised: list[BaseException] = []

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_park, r, raised)
                    await anyio.sleep(0.01)
                    await r.aclose()
            assert len(raised) == 1
            if round_ == 0:
                fds = _open_fds()  # (after what the first reader leaves for good: threads' pools)
        assert _open_fds() <= fds


@pytest.mark.parametrize("anyio_backend", [pytest.param("asyncio", id="asyncio")])
async def test_a_sleep_whose_add_reader_fails_hands_the_connection_back(
    anyio_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop cannot register the data descriptor (``add_reader`` raises): that get raises
    it, the sleep's end still hands the connection back to the I/O thread (``loop_reads``
    cleared), and the next gets take every message, promptly."""
    async with ab.open_writer(tcp="tcp://127.0.0.1:0", heartbeat_s=SLOW_HB) as w:
        async with ab.open_reader(w.handle, transport="tcp", name="refused") as r:
            loop = asyncio.get_running_loop()
            add_reader = loop.add_reader
            failed: list[int] = []

            def refuse_once(fd: int, *args: Any) -> None:
                if not failed:
                    failed.append(fd)
                    raise OSError("add_reader refused")
                add_reader(fd, *args)

            monkeypatch.setattr(loop, "add_reader", refuse_once)
            pump = r._src._pump  # type: ignore[attr-defined]
            refused = False
            with anyio.fail_after(PROMPT_S):
                while not refused:
                    # A sleep polls the connection itself, unless the I/O thread is in a turn at
                    # that moment (``sleeps_in_loop``: then the loop polls nothing); nothing is
                    # published, so a sleep that did not poll is cut short and tried again.
                    with anyio.move_on_after(0.05):
                        try:
                            await r.get()
                        except OSError as exc:
                            assert "add_reader refused" in str(exc)
                            refused = True
            assert failed and not pump.loop_reads
            for i in range(20):
                await anyio.sleep(0.002)
                with anyio.fail_after(PROMPT_S):  # a lost wake-up: it comes with a heartbeat
                    await w.put(i)
                    assert await r.get() == i
