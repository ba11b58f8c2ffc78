"""``put_many``: several messages published as one operation, all or none."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from _peers import until
from hypothesis import given, settings
from hypothesis import strategies as st

import aiobroadcast as ab
from aiobroadcast import blocking

pytestmark = pytest.mark.anyio


def drain(reader: ab.Reader[Any]) -> list[Any]:
    out = []
    while True:
        try:
            out.append(reader.get_nowait())
        except ab.WouldBlock:
            return out


async def test_put_many_delivers_each_message_in_order_small_and_multi_slot() -> None:
    batch = [("s", 0), ("big", b"b" * 20_000), ("s", 2), ("big", b"c" * 9_000), ("s", 4)]
    async with ab.open_writer(capacity=16, slot_bytes=4096) as writer:
        async with ab.open_reader(writer.handle) as reader:
            await writer.put_many(batch)
            await writer.put_many([])  # nothing to do
            await writer.put(("after", 5))
            assert drain(reader) == [*batch, ("after", 5)]
            assert writer.statistics().sent == 6 and reader.statistics().received == 6


async def test_put_many_publishes_nothing_if_one_object_cannot_be_encoded() -> None:
    async with ab.open_writer(capacity=16, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle) as reader:
            with pytest.raises(ab.SerializationError):
                await writer.put_many([1, 2, lambda: None, 4])
            with pytest.raises(ab.SerializationError):
                await writer.put_many([lambda: None])
            assert writer.statistics().sent == 0
            await writer.put(5)
            assert drain(reader) == [5]


async def test_a_batch_larger_than_the_ring_is_refused_and_publishes_nothing() -> None:
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle) as reader:
            with pytest.raises(ab.InvalidArgument, match="capacity of 4"):
                await writer.put_many(range(5))
            with pytest.raises(ab.InvalidArgument):
                await writer.put_many([b"x" * 2000])  # one message, 9 slots
            await writer.put_many(range(4))  # exactly the ring
            assert drain(reader) == [0, 1, 2, 3]


async def test_put_many_waits_for_room_for_the_whole_batch(one_slot_per_get: None) -> None:
    """With 2 slots free, a batch of 4 waits (publishing none of it) until the reader makes room
    (the writer waits for a quarter of the ring beyond what it needs: 6 slots), then goes out
    whole and in order."""
    async with ab.open_writer(capacity=8, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle) as reader:
            for i in range(6):
                await writer.put(i)
            done = anyio.Event()

            async def batch() -> None:
                await writer.put_many([6, 7, 8, 9])
                done.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(batch)
                await until(lambda: writer.statistics().tasks_waiting == 1)
                assert writer.statistics().head == 6  # none of the batch yet
                assert [reader.get_nowait() for _ in range(2)] == [0, 1]  # room for the batch...
                await anyio.sleep(0.05)
                assert writer.statistics().head == 6  # ... but not yet for the hysteresis
                assert [reader.get_nowait() for _ in range(2)] == [2, 3]
                with anyio.fail_after(10):
                    await done.wait()
            assert drain(reader) == [4, 5, 6, 7, 8, 9]


async def test_a_cancelled_put_many_publishes_nothing() -> None:
    async with ab.open_writer(capacity=8, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle) as reader:
            for i in range(6):
                await writer.put(i)
            with anyio.move_on_after(0.2) as scope:
                await writer.put_many([6, 7, 8, 9])
            assert scope.cancelled_caught
            assert writer.statistics().sent == 6 and writer.statistics().tasks_waiting == 0
            assert drain(reader) == [0, 1, 2, 3, 4, 5]
            await writer.put_many([10, 11])
            assert drain(reader) == [10, 11]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@settings(max_examples=60, deadline=None, database=None)
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("many"), st.lists(st.integers(0, 3), max_size=6)),
            st.tuples(st.just("put"), st.integers(0, 3)),
            st.tuples(st.just("read"), st.integers(0, 10)),
        ),
        max_size=30,
    ),
    policy=st.sampled_from(["block", "lag"]),
)
async def test_batches_singles_and_reads_interleaved_arrive_exactly(steps: list[Any], policy: str) -> None:
    """Batches (payloads of 0 to 3 slots each), single puts and reads in any order: the reader
    receives every message in order, or (policy "lag") is told exactly how many it missed."""
    sizes = [10, 300, 900, 1_500]  # 1, 2, 5 and 7 slots of 256 bytes
    async with ab.open_writer(capacity=16, slot_bytes=256, policy=policy) as writer:  # type: ignore[call-overload]
        async with ab.open_reader(writer.handle) as reader:
            sent: list[int] = []
            got: list[Any] = []

            def take(limit: int) -> None:
                for _ in range(limit):
                    try:
                        got.append(reader.get_nowait()[0])
                    except ab.WouldBlock:
                        return
                    except ab.ReaderLagged as exc:
                        got.append(("lagged", exc.missed))

            for kind, arg in steps:
                if kind == "read":
                    take(arg)
                    continue
                if kind == "put":
                    arg = [arg]
                msgs = [(len(sent) + k, b"x" * sizes[s]) for k, s in enumerate(arg)]
                before = writer.statistics().sent
                while True:
                    try:
                        # Under "block" a batch waits for room: give it a moment, then read one
                        # message (this test's one task must not wait for itself) and retry.
                        with anyio.fail_after(0.001):
                            await writer.put_many(msgs)
                        break
                    except TimeoutError:
                        assert policy == "block" and writer.statistics().sent == before  # none of it
                        take(1)
                    except ab.InvalidArgument:  # more slots than the ring has: none of it
                        assert writer.statistics().sent == before
                        msgs = []
                        break
                sent.extend(m[0] for m in msgs)
            take(10_000)
            expected = 0
            for item in got:
                if isinstance(item, tuple):
                    assert policy == "lag" and item[1] > 0
                    expected += item[1]
                else:
                    assert item == expected
                    expected += 1
            assert expected == len(sent)


def test_blocking_put_many_all_or_nothing_with_a_timeout() -> None:
    with blocking.open_writer(capacity=8, slot_bytes=256) as writer, blocking.open_reader(writer.handle) as reader:
        for i in range(6):
            writer.put(i)
        with pytest.raises(ab.WaitTimeout):
            writer.put_many([6, 7, 8, 9], timeout=0.1)
        assert writer.statistics().sent == 6
        assert [reader.get(timeout=5) for _ in range(6)] == [0, 1, 2, 3, 4, 5]
        writer.put_many([6, 7, 8, 9], timeout=5)
        writer.put_many([])
        with pytest.raises(ab.SerializationError):
            writer.put_many([10, lambda: None])
        with pytest.raises(ab.InvalidArgument):
            writer.put_many(range(9))
        assert [reader.get(timeout=5) for _ in range(4)] == [6, 7, 8, 9]
        with pytest.raises(ab.WouldBlock):
            reader.get_nowait()
