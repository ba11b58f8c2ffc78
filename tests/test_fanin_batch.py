"""A collector's ``get_many`` (docs/fan-in.md, "Batches"): what ``get`` would hand out, in its
order and turns, a ring's batch at a time; bounded; errors and interruptions take nothing."""

from __future__ import annotations

import sys
import threading
from typing import Any

import anyio
import pytest
from _fanin_workers import CtrlCOnce, Undecodable, remote_writer_proc
from _workers import spawn

import aiobroadcast as ab
from aiobroadcast import blocking
from aiobroadcast._base import tuning as _tuning


@pytest.fixture
def anyio_backend() -> Any:
    """asyncio alone, but for the tests marked ``BACKENDS``."""
    return ("asyncio", {"use_uvloop": False})


BACKENDS = pytest.mark.parametrize(
    "anyio_backend",
    [("asyncio", {"use_uvloop": False}), ("asyncio", {"use_uvloop": True}), ("trio", {})],
    ids=["asyncio", "uvloop", "trio"],
)


def _check_batches(batches: list[list[Any]], max_items: int) -> tuple[dict[str, list[Any]], list[Any]]:
    assert batches and all(1 <= len(b) <= max_items for b in batches)
    items: dict[str, list[Any]] = {}
    events: list[Any] = []
    for d in (d for b in batches for d in b):
        if isinstance(d, ab.Item):
            assert not any(e.source == d.source for e in events), "an item after its sender's close"
            items.setdefault(d.source, []).append(d.value)
        else:
            events.append(d)
    return items, events


@BACKENDS
@pytest.mark.anyio
async def test_batches_hold_what_get_hands_out_in_its_order_and_turns() -> None:
    turn = _tuning.AHEAD_MESSAGES
    async with ab.open_collector(capacity=256) as collector, ab.open_sender(collector.handle, name="b") as b:
        async with ab.open_sender(collector.handle, name="a") as a:
            for i in range(100):
                await a.put(("a", i))
                await b.put(("b", i))
        batches: list[list[Any]] = []
        while sum(len(x) for x in batches) < 201:  # 200 items and a's close
            batches.append(await collector.get_many(max_items=1000))
        items, events = _check_batches(batches, turn)  # one ring's batch at most
        assert items == {s: [(s, i) for i in range(100)] for s in "ab"}
        assert events == [ab.SourceClosed("a")]
        # Both had more than a turn ready: a turn each, as gets take them.
        assert [len(x) for x in batches[:2]] == [turn, turn]
        assert {x[0].source for x in batches[:2]} == {"a", "b"}
        assert collector.statistics().received == 200
        with pytest.raises(ab.WouldBlock):
            collector.get_nowait()


@pytest.mark.anyio
async def test_a_batch_ends_with_its_senders_turn() -> None:
    """A turn that began with a short ring batch ends with items of the next one still taken
    ahead: the batch ends there too, and the next sender's turn is the next batch."""
    turn = _tuning.AHEAD_MESSAGES
    async with ab.open_collector(capacity=256) as collector, ab.open_sender(collector.handle, name="a") as a:
        for i in range(5):
            await a.put(("a", i))
        assert len(await collector.get_many()) == 5  # a's turn: 5 of 32
        async with ab.open_sender(collector.handle, name="b") as b:
            for i in range(5, 45):
                await a.put(("a", i))
            for i in range(40):
                await b.put(("b", i))
        batches = [await collector.get_many(max_items=1000)]
        assert batches[0] == [ab.Item("a", ("a", i)) for i in range(5, turn)]  # the rest of its turn
        while sum(len(x) for x in batches) < 81:  # 80 items and b's close
            batches.append(await collector.get_many(max_items=1000))
        for x in batches:
            assert len(x) <= turn and len({d.source for d in x}) == 1
        items, events = _check_batches(batches, turn)
        assert items == {"a": [("a", i) for i in range(5, 45)], "b": [("b", i) for i in range(40)]}
        assert events == [ab.SourceClosed("b")]


@pytest.mark.anyio
async def test_a_batch_holds_at_most_max_items_and_one_rings_batch_of_bytes() -> None:
    big = b"B" * (_tuning.AHEAD_BYTES // 3 + 1)  # three cross AHEAD_BYTES: a ring's batch is three
    async with (
        ab.open_collector(capacity=32, slot_bytes=len(big) + 1024) as collector,
        ab.open_sender(collector.handle, name="s") as sender,
    ):
        for _ in range(8):
            await sender.put(big)
        for i in range(10):
            await sender.put(i)
        batches: list[list[Any]] = []
        while sum(len(x) for x in batches) < 18:
            batches.append([d.value for d in await collector.get_many(max_items=4) if isinstance(d, ab.Item)])
        # A ring's batch of large items is three (bytes), below max_items; the third ring batch
        # has the last two and small ones after them, handed out four at most at a time.
        assert batches == [[big] * 3, [big] * 3, [big, big, 0, 1], [2, 3, 4, 5], [6, 7, 8, 9]]


@pytest.mark.anyio
async def test_a_remote_senders_items_come_one_per_batch_in_order() -> None:
    """A remote sender's items are decoded one per take (nothing is taken ahead): a batch of
    one each, in order, then its close."""
    async with ab.open_collector(expect=["far"]) as collector:
        with spawn(remote_writer_proc, 20, "close") as far:
            await collector.attach(await far.recv("handle"), name="far")
            batches: list[list[Any]] = []
            with anyio.fail_after(15):
                while True:
                    try:
                        batches.append(await collector.get_many())
                    except ab.EndOfStream:
                        break
                assert await far.recv("closed") == 20  # its files removed before it is reaped
    items, events = _check_batches(batches, 1)
    assert items == {"far": list(range(20))}
    assert events == [ab.SourceClosed("far")]


@pytest.mark.anyio
async def test_an_undecodable_item_after_others_is_raised_by_the_next_call_after_them() -> None:
    async with ab.open_collector() as collector, ab.open_sender(collector.handle, name="s") as sender:
        for obj in (1, 2, Undecodable(), 3):
            await sender.put(obj)
        assert await collector.get_many() == [ab.Item("s", 1), ab.Item("s", 2)]
        with pytest.raises(ab.DeserializationError) as caught:  # consumed; says whose it was
            await collector.get_many()
        assert caught.value.source == "s"
        assert await collector.get_many() == [ab.Item("s", 3)]
        assert collector.statistics().received == 3


@pytest.mark.anyio
async def test_a_ctrl_c_while_a_batch_is_decoded_takes_nothing() -> None:
    CtrlCOnce.fired = False
    async with ab.open_collector() as collector, ab.open_sender(collector.handle, name="s") as sender:
        for obj in (0, 1, CtrlCOnce(), 3):
            await sender.put(obj)
        with pytest.raises(KeyboardInterrupt):
            await collector.get_many()
        assert CtrlCOnce.fired
        assert collector.statistics().received == 0
        assert await collector.get_many() == [ab.Item("s", v) for v in (0, 1, "decoded", 3)]
        assert collector.statistics().received == 4


@BACKENDS
@pytest.mark.anyio
async def test_a_cancelled_get_many_has_taken_nothing() -> None:
    async with ab.open_collector() as collector, ab.open_sender(collector.handle, name="s") as sender:
        with anyio.move_on_after(0.05) as scope:
            await collector.get_many()
        assert scope.cancelled_caught
        for i in range(3):
            await sender.put(i)
        assert await collector.get_many() == [ab.Item("s", i) for i in range(3)]


@pytest.mark.anyio
async def test_max_items_must_be_a_positive_integer() -> None:
    async with ab.open_collector() as collector:
        for bad in (0, -1, 1.5, True, "2"):
            with pytest.raises(ab.InvalidArgument, match="max_items"):
                await collector.get_many(max_items=bad)  # type: ignore[arg-type]
    with blocking.open_collector() as bc:
        with pytest.raises(ab.InvalidArgument, match="max_items"):
            bc.get_many(max_items=0)


def test_blocking_threads_each_take_distinct_batches_until_the_end() -> None:
    total = 5000
    with blocking.open_collector(expect=["s"], capacity=128) as collector:

        def send() -> None:
            with blocking.open_sender(collector.handle, name="s") as sender:
                for i in range(total):
                    sender.put(i)

        batches: list[list[Any]] = []
        lock = threading.Lock()

        def take() -> None:
            while True:
                try:
                    batch = collector.get_many(max_items=64, timeout=30)
                except ab.EndOfStream:
                    return
                with lock:
                    batches.append(batch)

        threads = [threading.Thread(target=send), *(threading.Thread(target=take) for _ in range(3))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # (Batches are listed in the order the threads got back to the list, not taken.)
        assert all(1 <= len(b) <= 64 for b in batches)
        taken = [d for b in batches for d in b]
        assert sorted(d.value for d in taken if isinstance(d, ab.Item)) == list(range(total))  # each once
        assert [d for d in taken if not isinstance(d, ab.Item)] == [ab.SourceClosed("s")]
        for b in batches:  # a batch is a run of consecutive deliveries
            values = [d.value for d in b if isinstance(d, ab.Item)]
            if values:
                assert values == list(range(values[0], values[0] + len(values)))
        with pytest.raises(ab.EndOfStream):
            collector.get_many(timeout=0.01)


def test_a_blocking_get_many_with_nothing_to_take_times_out_having_taken_nothing() -> None:
    with blocking.open_collector() as collector, blocking.open_sender(collector.handle, name="s") as sender:
        with pytest.raises(ab.WaitTimeout):
            collector.get_many(timeout=0.05)
        sender.put(1)
        assert collector.get_many(timeout=5) == [ab.Item("s", 1)]


@pytest.mark.parametrize("many", [False, True], ids=["get", "get_many"])
@pytest.mark.anyio
async def test_a_thread_taking_with_get_nowait_beside_the_loop_takes_each_item_once(many: bool) -> None:
    """Another thread calls ``get_nowait`` (as the collector's error for a foreign thread's
    ``get`` suggests) while the loop's task takes with ``get`` or ``get_many``; the interpreter
    switches threads as often as it can. The thread may take the last item of a batch between
    two takes of ``get_many``: the batch then ends, with no placeholder in it."""
    total = 20_000
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        async with ab.open_collector(capacity=256) as collector, ab.open_sender(collector.handle, name="s") as sender:
            side: list[Any] = []
            errors: list[BaseException] = []
            stop = threading.Event()

            def take_beside() -> None:
                while not stop.is_set():
                    try:
                        side.append(collector.get_nowait())
                    except ab.WouldBlock:
                        pass
                    except BaseException as exc:
                        errors.append(exc)
                        return

            async def produce() -> None:
                for i in range(total):
                    await sender.put(i)

            mine: list[Any] = []
            thread = threading.Thread(target=take_beside)
            thread.start()
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(produce)
                    while len(mine) + len(side) < total and not errors:
                        with anyio.move_on_after(0.05):  # the thread may have taken the rest
                            if many:
                                mine.extend(await collector.get_many())
                            else:
                                mine.append(await collector.get())
            finally:
                stop.set()
                thread.join()
            assert not errors
            got = mine + side
            assert all(type(d) is ab.Item for d in got)
            assert sorted(d.value for d in got) == list(range(total))
            assert collector.statistics().received == total
    finally:
        sys.setswitchinterval(switch)


class TakesWhileDecoded:
    """Unpickling it calls the blocking collector's ``get_many`` (a ``__setstate__`` that reads)."""

    collector: Any = None
    seen: list[str] = []  # noqa: RUF012

    def __reduce__(self) -> Any:
        return (_take_inside, ())


def _take_inside() -> str:
    try:
        TakesWhileDecoded.collector.get_many(timeout=0.01)
        TakesWhileDecoded.seen.append("took")
    except ab.WouldBlock as exc:
        TakesWhileDecoded.seen.append("WouldBlock" if "get_many() called from inside" in str(exc) else repr(exc))
    return "decoded"


def test_a_get_many_from_inside_decoding_raises_would_block_and_takes_nothing_twice() -> None:
    with blocking.open_collector() as collector, blocking.open_sender(collector.handle, name="s") as sender:
        TakesWhileDecoded.collector, TakesWhileDecoded.seen = collector, []
        sender.put(TakesWhileDecoded())
        sender.put("next")
        assert collector.get_many(timeout=5) == [ab.Item("s", "decoded"), ab.Item("s", "next")]
        assert TakesWhileDecoded.seen == ["WouldBlock"]
