"""One behaviour suite, run against every transport: shared memory and TCP (ZeroMQ, loopback).

A remote reader promises what a local one does: the same API, the same order, the same errors.
Every test here is parametrized over ``transport``; for "tcp" the writer also serves
``tcp://127.0.0.1:0`` (CurveZMQ) and the reader is opened with ``transport="tcp"``, so it reads
over a real socket even though the ring is reachable.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from _tcp_workers import ASYNCIO, WriterSpec, account, check_message, spawn, summary, writer_proc
from pydantic import BaseModel

import aiobroadcast as ab

pytestmark = pytest.mark.anyio

LOOPBACK = "tcp://127.0.0.1:0"
HEARTBEAT_S = 0.5


class Tick(BaseModel):
    symbol: str
    price: float


@pytest.fixture(params=["shm", "tcp"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def writer_for(transport: str, **kw: Any) -> Any:
    """``open_writer`` for this transport (the TCP one also serves loopback)."""
    if transport == "tcp":
        kw.setdefault("tcp", LOOPBACK)
        kw.setdefault("heartbeat_s", HEARTBEAT_S)
    return ab.open_writer(**kw)


def reader_for(transport: str, handle: ab.Handle, **kw: Any) -> Any:
    assert transport in ("shm", "tcp")
    kw["transport"] = transport
    return ab.open_reader(handle, **kw)


@asynccontextmanager
async def channel(transport: str, **kw: Any) -> AsyncIterator[ab.Writer[Any]]:
    async with writer_for(transport, **kw) as writer:
        assert (writer.handle.tcp is not None) == (transport == "tcp")
        yield writer


def mixed(i: int) -> object:
    """Message ``i`` of a stream of mixed sizes: small values, and bodies larger than a slot
    (256 bytes) and larger than the whole ring (8 x 256 bytes)."""
    kind = i % 6
    if kind == 0:
        return i
    if kind == 1:
        return f"message {i}"
    if kind == 2:
        return (i, b"s" * 200)
    if kind == 3:
        return (i, bytes([i % 256]) * 1500)  # several slots
    if kind == 4:
        return {"i": i, "blob": bytes([i % 256]) * 5000}  # more than the whole ring
    return [i, None, 1.5]


async def test_ordered_delivery_of_mixed_sizes_to_several_readers(transport: str) -> None:
    n = 120
    async with channel(transport, capacity=8, slot_bytes=256) as writer:
        results: dict[str, list[object]] = {}
        async with (
            reader_for(transport, writer.handle, name="a") as ra,
            reader_for(transport, writer.handle, name="b") as rb,
        ):

            async def collect(reader: ab.Reader[Any]) -> None:
                results[reader.name] = [x async for x in reader]

            async with anyio.create_task_group() as tg:
                tg.start_soon(collect, ra)
                tg.start_soon(collect, rb)
                for i in range(n):
                    await writer.put(mixed(i))
                await writer.aclose()
    expected = [mixed(i) for i in range(n)]
    assert results["a"] == expected
    assert results["b"] == expected


async def test_get_nowait_raises_would_block_when_empty(transport: str) -> None:
    async with channel(transport, capacity=4, slot_bytes=256) as writer:
        async with reader_for(transport, writer.handle) as reader:
            with pytest.raises(ab.WouldBlock):
                reader.get_nowait()
            await writer.put("x")
            with anyio.fail_after(10):
                assert await reader.get() == "x"
            with pytest.raises(ab.WouldBlock):
                reader.get_nowait()


async def test_close_then_drain_then_end_of_stream_and_async_for_ends(transport: str) -> None:
    async with channel(transport, capacity=8, slot_bytes=256) as writer:
        reader = await reader_for(transport, writer.handle)
        try:
            for i in range(5):
                await writer.put(i)
            with anyio.fail_after(10):
                await writer.aclose()
                assert [x async for x in reader] == [0, 1, 2, 3, 4]
                with pytest.raises(ab.EndOfStream):
                    await reader.get()
            with pytest.raises(ab.EndOfStream):
                reader.get_nowait()
            assert reader.statistics().writer_closed
        finally:
            await reader.aclose()


async def test_late_join_starts_with_the_next_message_published(transport: str) -> None:
    async with channel(transport, capacity=8, slot_bytes=256) as writer:
        async with reader_for(transport, writer.handle, name="early") as early:
            for i in range(5):
                writer.put_nowait(i)
            with anyio.fail_after(10):
                assert [await early.get() for _ in range(5)] == [0, 1, 2, 3, 4]
            async with reader_for(transport, writer.handle, name="late") as late:
                with pytest.raises(ab.WouldBlock):
                    late.get_nowait()
                for i in range(5, 10):
                    await writer.put(i)
                with anyio.fail_after(10):
                    assert [await late.get() for _ in range(5)] == [5, 6, 7, 8, 9]
                    assert [await early.get() for _ in range(5)] == [5, 6, 7, 8, 9]


async def test_tasks_sharing_one_reader_get_distinct_messages_none_lost(transport: str) -> None:
    n = 300
    got: list[list[int]] = [[] for _ in range(4)]
    async with channel(transport, capacity=8, slot_bytes=256) as writer:
        async with reader_for(transport, writer.handle) as reader:

            async def take(k: int) -> None:
                while True:
                    try:
                        got[k].append(await reader.get())
                    except ab.EndOfStream:
                        return
                    if random.random() < 0.1:
                        await anyio.lowlevel.checkpoint()

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    for k in range(4):
                        tg.start_soon(take, k)
                    for i in range(n):
                        await writer.put(i)
                    await writer.aclose()
    everything = sorted(x for part in got for x in part)
    assert everything == list(range(n))  # each message exactly once
    for part in got:
        assert part == sorted(part)  # each task sees its share in order


async def test_cancelled_parked_get_loses_nothing(transport: str) -> None:
    async with channel(transport, capacity=4, slot_bytes=256) as writer:
        async with reader_for(transport, writer.handle) as reader:
            with anyio.move_on_after(0.2) as scope:
                await reader.get()
            assert scope.cancelled_caught
            await writer.put("after")
            with anyio.fail_after(10):
                assert await reader.get() == "after"

            # Cancellations racing with arrivals: whatever a cancelled get did not return is
            # still there for the next one.
            n = 60
            taken: list[int] = []

            async def publish() -> None:
                for i in range(n):
                    await writer.put(i)
                    if i % 3 == 0:
                        await anyio.sleep(0.001)

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(publish)
                    while len(taken) < n:
                        with anyio.move_on_after(random.choice([0, 0.0005, 0.002, 0.01])):
                            taken.append(await reader.get())
    assert taken == list(range(n))


async def test_schema_channel_sends_models(transport: str) -> None:
    async with channel(transport, capacity=4, slot_bytes=256, schema=Tick) as writer:
        assert writer.handle.codec == "pydantic-json"
        async with reader_for(transport, writer.handle, trust_pickle=False) as reader:
            with pytest.raises(ab.SchemaViolation):
                await writer.put({"symbol": "X"})
            await writer.put(Tick(symbol="ACME", price=1.5))
            await writer.put({"symbol": "B", "price": 2})
            with anyio.fail_after(10):
                first = await reader.get()
                second = await reader.get()
            assert isinstance(first, Tick)
            assert (first, second) == (Tick(symbol="ACME", price=1.5), Tick(symbol="B", price=2))
            with pytest.raises(ab.WouldBlock):
                reader.get_nowait()  # the invalid one published nothing


async def test_lag_policy_reports_exactly_what_was_missed_then_continues(transport: str) -> None:
    """A reader that does not read while the writer publishes 300 messages: it gets what it had
    already received (over TCP, at most one credit window), then exactly one ``ReaderLagged``
    whose count closes the gap, then the newest messages in order, then what comes next.

    Shared memory keeps ``capacity`` messages; the TCP server keeps 2 * max(tcp_window,
    capacity) and a reader holds at most ``tcp_window``, so the result has the same shape. Over
    TCP the ring is larger: the TCP server is itself a reader of the ring, and on a loaded
    machine a 4-slot ring lets it lag too (then the gap comes in pieces, the sum still exact)."""
    n = 300
    capacity = 4 if transport == "shm" else 64
    kept = capacity if transport == "shm" else 2 * max(4, capacity)
    async with channel(transport, capacity=capacity, slot_bytes=256, policy="lag", tcp_window=4) as writer:
        async with reader_for(transport, writer.handle, name="lagger") as reader:
            for i in range(n):
                writer.put_nowait(i)  # never blocks under "lag"
                await anyio.sleep(0.001)  # (not for the reader: for the TCP server, see below)
            events: list[tuple[Any, ...]] = []
            with anyio.fail_after(10):
                while not events or events[-1] != ("msg", n - 1):
                    try:
                        events.append(("msg", await reader.get()))
                    except ab.ReaderLagged as exc:
                        events.append(("lagged", exc.missed))
            _, lags = account(events, n)
            assert reader.statistics().lagged == sum(lags)
            # One gap: the lag reports are adjacent (over TCP the server may still be catching up
            # with the ring when the reader takes the first report, so the gap can come as two
            # or more consecutive reports; their sum is exact all the same).
            kinds = [e[0] for e in events]
            head = kinds.index("lagged")
            assert kinds[head : head + len(lags)] == ["lagged"] * len(lags), summary(events)
            assert head <= 4, summary(events)  # at most one credit window before the gap
            tail = len(events) - head - len(lags)
            assert 1 <= tail <= kept, summary(events)  # no more than the server (or ring) kept
            if transport == "shm":
                assert events == [("lagged", n - 4)] + [("msg", i) for i in range(n - 4, n)]
            # ... and it goes on in order, with nothing more missed.
            for i in range(n, n + 3):
                await writer.put(i)
            with anyio.fail_after(10):
                assert [await reader.get() for _ in range(3)] == [n, n + 1, n + 2]


async def test_statistics_show_the_reader_by_name(transport: str) -> None:
    async with channel(transport, capacity=4, slot_bytes=256) as writer:
        async with reader_for(transport, writer.handle, name="worker-7") as reader:
            infos = [r for r in writer.statistics().readers if r.name == "worker-7"]
            assert len(infos) == 1
            assert infos[0].transport == transport
            for i in range(3):
                await writer.put(i)
            with anyio.fail_after(10):
                assert [await reader.get() for _ in range(3)] == [0, 1, 2]
            stats = reader.statistics()
            assert (stats.name, stats.received, stats.lagged) == ("worker-7", 3, 0)
        with anyio.fail_after(10):  # a remote reader says BYE; the server lists it until then
            while True:
                if not [r for r in writer.statistics().readers if r.name == "worker-7"]:
                    break
                await anyio.sleep(0.02)


@pytest.mark.parametrize("anyio_backend", [pytest.param(ASYNCIO, id="asyncio")])
async def test_lag_count_is_exact_while_the_reader_races_the_writer(transport: str) -> None:
    """A writer process publishes 100,000 messages as fast as it can into a 4-slot ring under
    policy "lag" while this reader reads: every ReaderLagged(n) must count exactly the messages
    missing where it is raised (design.md: "nothing is lost silently", and nothing is
    reported lost that then arrives)."""
    n = 100_000
    spec = WriterSpec(tcp=LOOPBACK if transport == "tcp" else None, policy="lag", capacity=4, count=n, heartbeat_s=0.5)
    with spawn(writer_proc, ASYNCIO, None, spec) as wproc:
        handle = await wproc.recv("handle")
        async with reader_for(transport, ab.Handle.parse(handle), name="racer") as reader:
            wproc.send("go")
            events: list[tuple[Any, ...]] = []
            with anyio.fail_after(60):
                while not events or events[-1] != ("msg", n - 1):
                    try:
                        events.append(("msg", check_message(await reader.get())))
                    except ab.ReaderLagged as exc:
                        events.append(("lagged", exc.missed))
            await wproc.recv("sent")
        await wproc.recv("closed")
        assert await wproc.join() == 0
    account(events, n)
