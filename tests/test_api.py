"""The public API within one process: handles, errors, schema, statistics."""

from __future__ import annotations

import os
import pickle
import stat
import threading
from pathlib import Path

import anyio
import pydantic
import pytest
from pydantic import BaseModel

import aiobroadcast as ab

pytestmark = pytest.mark.anyio


class Tick(BaseModel):
    symbol: str
    price: float


async def test_handle_is_frozen_picklable_and_round_trips_json(tmp_path: Path) -> None:
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        h = writer.handle
        assert ab.Handle.parse(h.to_json()) == h
        assert pickle.loads(pickle.dumps(h)) == h
        with pytest.raises(pydantic.ValidationError):
            h.capacity = 5
        path = tmp_path / "handle.json"
        h.save(path)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert ab.Handle.load(path) == h
        async with ab.open_reader(h.to_json(), name="from-json") as reader:
            await writer.put("hello")
            assert await reader.get() == "hello"


@pytest.mark.parametrize("text", ["", "{}", "not json", '{"version": 1}'])
def test_unparsable_handle_raises_invalid_handle(text: str) -> None:
    with pytest.raises(ab.InvalidHandle, match="not an aiobroadcast handle"):
        ab.Handle.parse(text)


async def test_unpicklable_object_publishes_nothing() -> None:
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle) as reader:
            with pytest.raises(ab.SerializationError, match="cannot pickle"):
                await writer.put(threading.Lock())
            with pytest.raises(ab.SerializationError):
                writer.put_nowait(lambda: None)
            assert writer.statistics().sent == 0
            with pytest.raises(ab.WouldBlock):
                reader.get_nowait()
            await writer.put(1)
            assert reader.get_nowait() == 1


async def test_schema_validates_and_readers_get_models() -> None:
    async with ab.open_writer(capacity=4, slot_bytes=256, schema=Tick) as writer:
        assert writer.handle.codec == "pydantic-json"
        async with ab.open_reader(writer.handle, schema=Tick) as reader:
            with pytest.raises(ab.SchemaViolation):
                await writer.put({"symbol": "X"})  # type: ignore[arg-type]
            with pytest.raises(ab.SchemaViolation):
                writer.put_nowait(Tick.model_construct(symbol="Y", price="cheap"))
            assert writer.statistics().sent == 0
            await writer.put(Tick(symbol="ACME", price=1.5))
            got = await reader.get()
            assert got == Tick(symbol="ACME", price=1.5)
            assert isinstance(got, Tick)
        # The reader can find the schema from the handle alone.
        async with ab.open_reader(writer.handle) as reader2:
            await writer.put(Tick(symbol="B", price=2))
            assert await reader2.get() == Tick(symbol="B", price=2)


async def test_message_too_large_publishes_nothing() -> None:
    async with ab.open_writer(capacity=4, slot_bytes=256, max_message_bytes=1000) as writer:
        with pytest.raises(ab.MessageTooLarge) as info:
            await writer.put(b"x" * 2000)
        assert info.value.limit == 1000
        assert writer.statistics().sent == 0


async def test_closed_roles_raise_closed_resource_error() -> None:
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        reader = await ab.open_reader(writer.handle)
        await reader.aclose()
        await reader.aclose()  # idempotent
        with pytest.raises(ab.ClosedResourceError):
            reader.get_nowait()
        with pytest.raises(ab.ClosedResourceError):
            await reader.get()
    with pytest.raises(ab.ClosedResourceError):
        await writer.put(1)
    with pytest.raises(ab.ClosedResourceError):
        writer.put_nowait(1)


async def test_writer_close_lets_readers_drain_then_end_of_stream() -> None:
    async with ab.open_writer(capacity=8, slot_bytes=256) as writer:
        reader = await ab.open_reader(writer.handle)
        for i in range(5):
            await writer.put(i)
    try:
        assert [x async for x in reader] == [0, 1, 2, 3, 4]
        with pytest.raises(ab.EndOfStream):
            await reader.get()
        with pytest.raises(ab.EndOfStream):
            reader.get_nowait()
    finally:
        await reader.aclose()


async def test_put_nowait_would_block_when_a_reader_would_be_overrun() -> None:
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle, name="slow") as reader:
            for i in range(4):
                writer.put_nowait(i)
            with pytest.raises(ab.WouldBlock):
                writer.put_nowait(4)
            assert reader.get_nowait() == 0
            writer.put_nowait(4)
            assert [reader.get_nowait() for _ in range(4)] == [1, 2, 3, 4]


async def test_statistics_name_the_reader_the_writer_waits_for(one_slot_per_get: None) -> None:
    async with ab.open_writer(capacity=2, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle, name="fast") as fast, ab.open_reader(writer.handle, name="stuck") as _:
            await writer.put(0)
            await writer.put(1)
            assert fast.get_nowait() == 0
            async with anyio.create_task_group() as tg:
                tg.start_soon(writer.put, 2)
                await anyio.sleep(0.05)
                stats = writer.statistics()
                assert [r.name for r in stats.waiting_for] == ["stuck"]
                assert stats.waiting_for[0].pid == os.getpid()
                assert stats.tasks_waiting == 1
                lags = {r.name: r.lag for r in stats.readers}
                assert lags == {"fast": 1, "stuck": 2}
                tg.cancel_scope.cancel()
            rs = fast.statistics()
            assert (rs.name, rs.received, rs.lag) == ("fast", 1, 1)


async def test_repr_shows_state() -> None:
    async with ab.open_writer(capacity=2, slot_bytes=256) as writer:
        assert "sent=0" in repr(writer)
        async with ab.open_reader(writer.handle, name="r1") as reader:
            assert "'r1'" in repr(reader)
    assert "closed" in repr(writer)


def test_sweep_removes_sockets_and_stats_files_whose_channel_file_is_gone(tmp_path: Path) -> None:
    """A writer killed after its segment was swept, or a reader killed after the writer closed,
    leaves files that no segment names any more: the next sweep removes them once they are old."""
    orphan_sock = tmp_path / f"aiobroadcast-{'a' * 32}-r3.sock"
    orphan_stats = tmp_path / f"aiobroadcast-{'a' * 32}-tcp.json"
    orphan_tmp = tmp_path / f"aiobroadcast-{'a' * 32}-tcp.json.tmp"  # a server killed mid-write
    young = tmp_path / f"aiobroadcast-{'b' * 32}-w.sock"
    owned = tmp_path / f"aiobroadcast-{'c' * 32}-r0.sock"
    unrelated = tmp_path / "other-file.sock"
    (tmp_path / f"aiobroadcast-{'c' * 32}").write_bytes(b"")  # the channel file that owns it
    for f in (orphan_sock, orphan_stats, orphan_tmp, young, owned, unrelated):
        f.write_text("")
    old = os.stat(orphan_sock).st_mtime - 60
    for f in (orphan_sock, orphan_stats, orphan_tmp, owned, unrelated):
        os.utime(f, (old, old))
    ab.sweep_stale(str(tmp_path))
    assert not orphan_sock.exists() and not orphan_stats.exists() and not orphan_tmp.exists()
    assert young.exists() and unrelated.exists()
    # Its channel file exists (and is too new to count as stale), so its socket stays.
    assert owned.exists()


def test_sweep_removes_a_stale_channel_with_every_file_beside_it(tmp_path: Path) -> None:
    """A channel file whose every lock is free (its writer and readers were killed) goes with
    all its files, the TCP server's half-written report included; another channel's stay."""
    stale = tmp_path / f"aiobroadcast-{'d' * 32}"
    beside = [stale.with_name(f"{stale.name}-{suffix}") for suffix in ("w.sock", "r0.sock", "tcp.json", "tcp.json.tmp")]
    other = tmp_path / f"aiobroadcast-{'e' * 32}-tcp.json.tmp"  # its channel file is gone: an orphan
    neighbour = tmp_path / f"aiobroadcast-{'d' * 31}f-tcp.json"  # a young orphan: it stays
    stale.write_bytes(b"")
    for f in (*beside, other, neighbour):
        f.write_text("")
    old = os.stat(stale).st_mtime - 60
    for f in (stale, *beside, other):
        os.utime(f, (old, old))
    assert ab.sweep_stale(str(tmp_path)) == [str(stale)]
    assert sorted(os.listdir(tmp_path)) == [neighbour.name]


async def _sleeps_while_waiting(writer: ab.Writer[object], reader: ab.Reader[object], wait_s: float) -> bool:
    """Park a get for ``wait_s`` seconds, then publish; whether the writer ever saw the reader
    asleep meanwhile. The writer runs in the same event loop as the polling reader, so the put
    also shows that polling leaves the loop to other tasks."""
    seen_asleep = False
    async with anyio.create_task_group() as tg:
        got: list[object] = []

        async def take() -> None:
            got.append(await reader.get())

        tg.start_soon(take)
        with anyio.fail_after(10):
            end = anyio.current_time() + wait_s
            while anyio.current_time() < end:
                seen_asleep |= writer.statistics().readers[0].sleeping
                await anyio.sleep(0.01)
            await writer.put("late")
    assert got == ["late"]
    return seen_asleep


async def test_spin_us_polls_instead_of_sleeping_and_zero_sleeps_at_once() -> None:
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle, spin_us=1_000_000) as spinning:
            assert not await _sleeps_while_waiting(writer, spinning, 0.3)
        async with ab.open_reader(writer.handle, spin_us=0) as sleeping:
            assert await _sleeps_while_waiting(writer, sleeping, 0.3)
        # The default polls only while messages come densely: a reader that waits for long sleeps.
        async with ab.open_reader(writer.handle) as default:
            assert await _sleeps_while_waiting(writer, default, 0.3)
            assert await _sleeps_while_waiting(writer, default, 0.3)


@pytest.mark.parametrize("spin_us", [-1, 1_000_001, float("nan")])
async def test_spin_us_out_of_range_raises_value_error(spin_us: float) -> None:
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        with pytest.raises(ValueError, match="spin_us"):
            async with ab.open_reader(writer.handle, spin_us=spin_us):
                pass


async def test_a_relayed_gap_counts_the_same_for_a_reader_that_reads_it_and_one_that_lags_over_it() -> None:
    """A gap marker (a relay's upstream loss of 10 messages) takes their numbers: a reader that
    reads it is told 10, and one that lags over it counts them in its ReaderLagged."""
    async with ab.open_writer(capacity=4, slot_bytes=256, policy="lag") as writer:
        async with ab.open_reader(writer.handle, name="keeps-up") as keeps_up, ab.open_reader(writer.handle) as lags:
            await writer.put(0)
            assert keeps_up.get_nowait() == 0
            await writer._ch.publishing.put_gap(10)  # messages 1..10 lost upstream
            with pytest.raises(ab.ReaderLagged) as told:
                keeps_up.get_nowait()
            assert told.value.missed == 10
            for k in range(11, 19):
                await writer.put(k)
                assert keeps_up.get_nowait() == k
            with pytest.raises(ab.ReaderLagged) as lagged:
                lags.get_nowait()
            assert lagged.value.missed == 15  # 0, the 10 behind the marker, 11..14
            assert [lags.get_nowait() for _ in range(4)] == [15, 16, 17, 18]
            assert writer.statistics().sent == 10  # the marker is one message sent
