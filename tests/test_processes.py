"""Process-level tests: real processes (multiprocessing spawn), real shared memory, no mocks.

Each test names the field note (/work/shared/FIELD-NOTES.md) or the vLLM test it answers. The child
processes run the same anyio backend as the test. Where a test must prove that a wake-up was
*sent* (not merely that the periodic liveness re-check papered over a lost one), it raises the
liveness period to a minute, so a lost wake-up turns into a hang and the test fails at its
``fail_after``; that bounds liveness, it does not measure latency.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import psutil
import pytest
from _workers import (
    Backend,
    Bomb,
    ReaderOpts,
    WriterSpec,
    collect_proc,
    digest,
    forget_proc,
    huge_proc,
    numbered_array,
    numpy_proc,
    spawn,
    stress_array,
    stress_proc,
    writer_proc,
)
from anyio.streams.buffered import BufferedByteReceiveStream

import aiobroadcast as ab
from aiobroadcast._base import tuning as _tuning
from aiobroadcast._shm import layout as _layout

pytestmark = pytest.mark.anyio

UVLOOP_ONLY = pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")])
NO_TIMEOUT = 60.0  #: a liveness period no test waits for: a lost wake-up becomes a hang
HUGE_BYTES = 1 << 30  #: the one huge message (test_one_huge_message)


async def until(predicate: Callable[[], bool], within_s: float = 10.0) -> None:
    """Poll ``predicate`` until it holds (a liveness bound, not a latency measurement)."""
    with anyio.fail_after(within_s):
        while True:
            if predicate():
                return
            await anyio.sleep(0.01)


def waiting_on(writer: ab.Writer[Any], place: int) -> bool:
    return any(r.place == place for r in writer.statistics().waiting_for)


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def files_of(handle: ab.Handle) -> list[str]:
    return sorted(n for n in os.listdir(handle.directory) if n.startswith(handle.name))


# --- 1. stress ----------------------------------------------------------------------------------
@UVLOOP_ONLY
@pytest.mark.timeout(120)
async def test_stress_random_numpy_arrays(anyio_backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM test 1, beaten: 10,000 int64 arrays of 1-9,999 elements (many larger than the 40 KiB
    slot), capacity 2, three reader processes, random 0-1 ms naps on every side; each reader
    regenerates every array from the seed and checks contents and order. Liveness re-checks are
    pushed to a minute, so any lost wake-up stalls the run instead of hiding behind them."""
    monkeypatch.setattr(_tuning, "ROOM_CHECK_S", NO_TIMEOUT)
    count, seed = 10_000, 20240611
    async with ab.open_writer(capacity=2, slot_bytes=40 * 1024, max_readers=3) as writer:
        with contextlib.ExitStack() as stack:
            readers = [
                stack.enter_context(spawn(stress_proc, anyio_backend, writer.handle.to_json(), seed, count, NO_TIMEOUT))
                for _ in range(3)
            ]
            for r in readers:
                await r.recv("attached")
            rng = np.random.default_rng(seed)
            naps = random.Random(7)
            with anyio.fail_after(90):
                for i in range(count):
                    await writer.put((i, stress_array(rng)))
                    if naps.random() < 0.1:
                        await anyio.sleep(naps.random() / 1000)
            stats = writer.statistics()
            assert stats.sent == count
            assert stats.head > count  # many arrays took more than one slot
            assert stats.dropped_readers == 0
            await writer.aclose()
            for r in readers:
                result = await r.recv("done", within_s=90)
                assert result == {"received": count, "bad": [], "extra": None}
                assert await r.join() == 0


# --- 2. received buffers are private copies -----------------------------------------------------
async def test_numpy_results_are_writable_and_never_alias_the_ring(anyio_backend: Backend) -> None:
    """vLLM 6-8 / field note 9: in-band arrays (one slot), out-of-band arrays in one slot, and
    out-of-band arrays streamed through a ring smaller than them. The reader scribbles on every
    array it gets and keeps it; later messages reuse the slots many times over; every later message
    must arrive intact and every kept array must still hold what the reader wrote. The writer also
    scribbles on each array right after ``put`` returns: readers must see the value at ``put``."""
    sizes = [10, 3_000, 40_000, 400_000] * 8  # 80 B, 24 KB, 320 KB (OOB), 3.2 MB (OOB, streamed)
    async with ab.open_writer(capacity=4, slot_bytes=512 * 1024) as writer:
        with spawn(numpy_proc, anyio_backend, writer.handle.to_json(), sizes) as reader:
            await reader.recv("attached")
            with anyio.fail_after(60):
                for i, size in enumerate(sizes):
                    arr = numbered_array(i, size)
                    await writer.put((i, arr))
                    arr[:] = 7  # the sender's buffer is its own again once put returns
            await writer.aclose()
            result = await reader.recv("done")
            assert result == {"problems": [], "kept": len(sizes)}
            assert await reader.join() == 0


# --- 3. an exception inside a read --------------------------------------------------------------
async def test_deserialization_error_consumes_the_message_and_never_stalls_the_writer(
    anyio_backend: Backend,
) -> None:
    """Field note 5 (vLLM #45224): a message that cannot be unpickled in the reader's process
    raises DeserializationError there, is consumed (the next get returns the next message), and
    the writer is not held up: capacity 2, policy "block", ten more messages after each bad one,
    one bad message of one slot and one streamed through more slots than the ring has. The reader
    keeps the exceptions (with their tracebacks) until after it has closed."""
    async with ab.open_writer(capacity=2, slot_bytes=1024) as writer:
        with spawn(collect_proc, anyio_backend, writer.handle.to_json(), ReaderOpts()) as reader:
            await reader.recv("attached")
            with anyio.fail_after(30):
                await writer.put(0)
                await writer.put(Bomb())  # message #1
                await writer.put(1)
                await writer.put(Bomb(b"x" * 5000))  # message #3: 6 entries through 2 slots
                for i in range(2, 12):
                    await writer.put(i)
            await writer.aclose()
            result = await reader.recv("events")
            assert result["events"] == [
                ("msg", 0),
                ("deser", 1, "RuntimeError"),
                ("msg", 1),
                ("deser", 3, "RuntimeError"),
                *[("msg", i) for i in range(2, 12)],
                ("end",),
            ]
            assert result["received"] == 14  # a consumed bad message counts as taken
            assert await reader.join() == 0


# --- 4. many tasks, one reader --------------------------------------------------------------------
async def test_many_tasks_share_one_reader(anyio_backend: Backend) -> None:
    """Field note 6 (vLLM #50398, #50548; vLLM test 12): eight tasks of one process share a
    reader while a writer process sends 5,000 ints through 4 slots. Every int is delivered to
    exactly one task, each task sees its ints in increasing order, and every task ends cleanly."""
    count, tasks = 5_000, 8
    spec = WriterSpec(capacity=4, count=count)
    with spawn(writer_proc, anyio_backend, spec) as writer:
        handle = await writer.recv("handle")
        got: list[list[int]] = [[] for _ in range(tasks)]
        async with ab.open_reader(handle, name="shared") as reader:

            async def consume(mine: list[int]) -> None:
                while True:
                    try:
                        mine.append(await reader.get())
                    except ab.EndOfStream:
                        return

            writer.send("go")
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for mine in got:
                        tg.start_soon(consume, mine)
            assert reader.statistics().received == count
        everything = [x for mine in got for x in mine]
        assert sorted(everything) == list(range(count))  # none lost, none duplicated
        for mine in got:
            assert mine == sorted(mine)
        assert await writer.recv("sent") == count
        assert await writer.recv("closed") == {"sent": count, "dropped": 0}
        assert await writer.join() == 0


# --- 5. cancellation ------------------------------------------------------------------------------
async def test_cancelled_get_takes_nothing(anyio_backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """tokio's "recv is cancel-safe": a parked get cancelled by a timeout takes nothing, and a
    reader whose gets are cancelled at random moments while a writer process publishes still
    receives every message exactly once, in order."""
    monkeypatch.setattr(_tuning, "LIVENESS_S", NO_TIMEOUT)
    monkeypatch.setattr(_tuning, "WATCHED_LIVENESS_S", NO_TIMEOUT)
    count = 300
    with spawn(writer_proc, anyio_backend, WriterSpec(capacity=4, count=count, sleep_prob=0.3)) as writer:
        handle = await writer.recv("handle")
        async with ab.open_reader(handle, name="impatient") as reader:
            with anyio.move_on_after(0.2) as scope:
                await reader.get()
            assert scope.cancelled_caught  # nothing had been published: it was parked
            assert reader.statistics().tasks_waiting == 0
            writer.send("go")
            rnd = random.Random(3)
            got: list[int] = []
            cancelled = 0
            with anyio.fail_after(60):
                while True:
                    with anyio.move_on_after(rnd.random() / 500) as scope:
                        try:
                            got.append(await reader.get())
                        except ab.EndOfStream:
                            break
                    cancelled += scope.cancelled_caught
            assert got == list(range(count))
            assert cancelled > 0  # the scenario did cancel parked gets
        assert await writer.recv("sent") == count
        assert await writer.recv("closed") == {"sent": count, "dropped": 0}


async def test_ready_messages_are_never_lost_to_an_expired_deadline(anyio_backend: Backend) -> None:
    """Each get under an already expired deadline (move_on_after(0)) either returns a ready message
    or takes nothing: 200 published messages, gets under such deadlines until all are in, every
    message returned once, in order (a get used to lose its message when its periodic yield to
    the loop was cancelled). The yield is a checkpoint before the take, so now and then such a get
    is cancelled, having taken nothing; most return at once."""
    count = 200
    with spawn(writer_proc, anyio_backend, WriterSpec(capacity=256, count=count)) as writer:
        handle = await writer.recv("handle")
        async with ab.open_reader(handle, name="in-a-hurry") as reader:
            writer.send("go")
            assert await writer.recv("sent") == count
            got: list[object] = []
            cancelled = 0
            while len(got) < count and cancelled <= count:
                with anyio.move_on_after(0) as scope:
                    got.append(await reader.get())
                cancelled += scope.cancelled_caught
            assert got == list(range(count))
            assert cancelled <= count // 32  # at most the periodic yields (one in YIELD_EVERY)
        assert await writer.recv("closed") == {"sent": count, "dropped": 0}


async def test_cancelled_put_publishes_nothing(anyio_backend: Backend) -> None:
    """A put parked on a full ring and cancelled publishes nothing; a put of a message larger than
    the ring cancelled after its first fragments went out is dropped by readers. The reader sees
    exactly the messages put before and after, nothing partial, nothing extra."""
    async with ab.open_writer(capacity=2, slot_bytes=256) as writer:
        opts = ReaderOpts(gate=True)
        with spawn(collect_proc, anyio_backend, writer.handle.to_json(), opts) as reader:
            await reader.recv("attached")
            await writer.put("before")
            with anyio.move_on_after(0.3) as scope:
                await writer.put(b"streamed" * 500)  # 4000 bytes: 18 entries through 2 slots
            assert scope.cancelled_caught
            assert writer.statistics().head == 2  # its first fragment did go out
            with anyio.move_on_after(0.3) as scope:
                await writer.put("cancelled while waiting")
            assert scope.cancelled_caught
            assert writer.statistics().head == 2
            assert writer.statistics().tasks_waiting == 0
            reader.send("go")
            with anyio.fail_after(30):
                await writer.put("after-1")
                await writer.put(b"after-2" * 500)
                await writer.put("after-3")
            assert writer.statistics().sent == 4
            await writer.aclose()
            result = await reader.recv("events")
            assert result["events"] == [
                ("msg", "before"),
                ("msg", "after-1"),
                ("msg", b"after-2" * 500),
                ("msg", "after-3"),
                ("end",),
            ]


async def test_a_put_is_either_published_or_cancelled(anyio_backend: Backend) -> None:
    """A put that returns has published; a cancelled put has not, never both. With deadlines that
    have already expired (the fast path still publishes; its yield now and then, before the
    publish, is where such a put is cancelled) on a roomy ring,
    and random short deadlines on a full one, the reader process receives exactly the puts that
    returned, in order."""
    rnd = random.Random(11)
    # (capacity, count, reader's delay per message, deadline): the second ring is full nearly
    # all the time (the reader takes 3 ms a message, deadlines are at most 0.2 ms), so some
    # puts are cancelled however loaded the machine is.
    scenarios: list[tuple[int, int, float, Callable[[], float]]] = [
        (512, 300, 0.0005, lambda: 0.0),
        (4, 300, 0.003, lambda: rnd.random() / 5000),
    ]
    for capacity, count, delay, deadline in scenarios:
        async with ab.open_writer(capacity=capacity, slot_bytes=256) as writer:
            opts = ReaderOpts(delay_s=delay)
            with spawn(collect_proc, anyio_backend, writer.handle.to_json(), opts) as reader:
                await reader.recv("attached")
                returned = []
                with anyio.fail_after(60):
                    for i in range(count):
                        with anyio.move_on_after(deadline()):
                            await writer.put(i)
                            returned.append(i)
                await writer.aclose()
                result = await reader.recv("events")
                assert result["events"] == [*[("msg", i) for i in returned], ("end",)]
                if capacity > count:
                    # Room for all: no put had to wait, so only the periodic yield (a checkpoint
                    # before the publish) can be cancelled under an expired deadline.
                    assert count - len(returned) <= count // 32
                else:
                    assert 0 < len(returned) < count  # some waited and were cancelled


# --- 6. a reader killed mid-stream ------------------------------------------------------------------
async def test_sigkilled_reader_is_dropped_and_the_writer_goes_on(
    anyio_backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    """Field notes 7 and 11 (vLLM #45644, #25566): a reader process is SIGKILLed while the writer
    waits for it, and is left a zombie (its parent, this process, does not reap it). The writer
    finds it dead by its lock, drops it (logging which reader it was) and completes its put within
    the liveness bound; the other reader receives everything in order."""
    count = 30
    async with ab.open_writer(capacity=2, slot_bytes=256) as writer:
        handle = writer.handle.to_json()
        with (
            spawn(collect_proc, anyio_backend, handle, ReaderOpts(name="steady")) as steady,
            spawn(collect_proc, anyio_backend, handle, ReaderOpts(name="doomed", stop_after=3)) as doomed,
        ):
            await steady.recv("attached")
            doomed_place = (await doomed.recv("attached"))["place"]
            put_done = anyio.Event()
            progress: list[int] = []

            async def produce() -> None:
                for i in range(count):
                    await writer.put(i)
                    progress.append(i)
                put_done.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                assert await doomed.recv("stalled") == 3
                await until(lambda: waiting_on(writer, doomed_place))
                stuck_at = len(progress)
                doomed.sigkill()
                with anyio.fail_after(10):  # liveness bound: dropped within a few liveness periods
                    await put_done.wait()
            assert stuck_at < count
            assert psutil.Process(doomed.pid).status() == psutil.STATUS_ZOMBIE
            stats = writer.statistics()
            assert stats.dropped_readers == 1
            assert [r.name for r in stats.readers] == ["steady"]
            host = _layout.unpack_host(_layout.pack_host(_layout.host_name()))  # the ring keeps 16 bytes
            assert f"reader 'doomed' (pid {doomed.pid} on {host}, place {doomed_place}) died" in caplog.text
            assert not any(n.endswith(f"-r{doomed_place}.sock") for n in files_of(writer.handle))
            await writer.aclose()
            result = await steady.recv("events")
            assert result["events"] == [*[("msg", i) for i in range(count)], ("end",)]


async def test_dead_reader_leaves_no_files_when_the_writer_never_waited_for_it(anyio_backend: Backend) -> None:
    """Field note 10 (leaked files): a reader killed while the writer never had to wait for it is
    never reaped; closing the writer still removes every file of the channel, the dead reader's
    socket included."""
    async with ab.open_writer(capacity=8, slot_bytes=256) as writer:
        handle = writer.handle
        with spawn(collect_proc, anyio_backend, handle.to_json(), ReaderOpts(stop_after=1)) as doomed:
            place = (await doomed.recv("attached"))["place"]
            await writer.put("one")
            assert await doomed.recv("stalled") == 1
            doomed.sigkill()
            assert await doomed.join() == -9
            assert f"{handle.name}-r{place}.sock" in files_of(handle)
    assert files_of(handle) == []


# --- 7. the writer dies ---------------------------------------------------------------------------
async def test_sigkilled_writer_reader_drains_then_writer_gone_then_swept(anyio_backend: Backend) -> None:
    """A writer process is SIGKILLed after publishing N messages nobody has read yet. The reader
    receives all N, then WriterGone (with the writer's pid); new readers are refused; the dead
    writer's files stay while the reader is attached (its lock is live) and are swept by the next
    ``open_writer`` once it has closed."""
    n = 20
    spec = WriterSpec(capacity=32, slot_bytes=256, count=n, then="hang")
    with spawn(writer_proc, anyio_backend, spec) as writer_proc_:
        handle = ab.Handle.parse(await writer_proc_.recv("handle"))
        async with ab.open_reader(handle, name="survivor") as reader:
            writer_proc_.send("go")
            assert await writer_proc_.recv("sent") == n
            writer_proc_.sigkill()
            assert await writer_proc_.join() == -9
            with anyio.fail_after(10):
                got = [await reader.get() for _ in range(n)]
                with pytest.raises(ab.WriterGone) as exc_info:
                    await reader.get()
            assert got == list(range(n))
            assert exc_info.value.pid == writer_proc_.pid
            with pytest.raises(ab.WriterGone):  # and it stays gone
                reader.get_nowait()
            with pytest.raises(ab.InvalidHandle, match="closed or exited"):
                await ab.open_reader(handle, name="too-late")
            # Old enough to be swept, but our reader still holds its lock: not stale yet.
            age = time.time() - os.stat(handle.path).st_mtime
            await anyio.sleep(max(0.0, _tuning.STALE_MIN_AGE_S + 0.2 - age))
            assert handle.path not in ab.sweep_stale(handle.directory)
            assert handle.name in files_of(handle)
        async with ab.open_writer(capacity=2, slot_bytes=256):
            assert files_of(handle) == []


async def test_a_sleeping_reader_is_woken_by_its_writers_exit(
    anyio_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader parked in get() learns that its writer's process died from the writer's pidfd,
    not from a periodic check: with every periodic check pushed to a minute, a SIGKILL of the
    writer still ends the get with WriterGone (a missed exit would hang until fail_after)."""
    monkeypatch.setattr(_tuning, "LIVENESS_S", NO_TIMEOUT)
    monkeypatch.setattr(_tuning, "WATCHED_LIVENESS_S", NO_TIMEOUT)
    spec = WriterSpec(capacity=4, count=0, then="hang")
    with spawn(writer_proc, anyio_backend, spec) as writer_proc_:
        handle = ab.Handle.parse(await writer_proc_.recv("handle"))
        async with ab.open_reader(handle, name="parked") as reader:
            writer_proc_.send("go")
            assert await writer_proc_.recv("sent") == 0
            outcome: list[BaseException] = []

            async def park() -> None:
                try:
                    await reader.get()
                except ab.WriterGone as exc:
                    outcome.append(exc)

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(park)
                    await until(lambda: reader.statistics().tasks_waiting == 1)
                    await anyio.sleep(0.1)  # let it settle into its sleep
                    writer_proc_.sigkill()
            assert await writer_proc_.join() == -9
            assert len(outcome) == 1 and isinstance(outcome[0], ab.WriterGone)
    # The dead writer's files go with the next sweep once they are old enough.
    age = time.time() - os.stat(handle.path).st_mtime
    await anyio.sleep(max(0.0, _tuning.STALE_MIN_AGE_S + 0.2 - age))
    assert handle.path in ab.sweep_stale(handle.directory)
    assert files_of(handle) == []


async def test_a_writer_that_stops_without_closing_wakes_its_readers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A relay abandons its channel when its upstream dies: its process lives on (so no pidfd
    fires), and its readers, on this host or in another pid namespace, must still get
    WriterGone. Periodic checks are pushed to a minute: the wake-up must come."""
    monkeypatch.setattr(_tuning, "LIVENESS_S", NO_TIMEOUT)
    monkeypatch.setattr(_tuning, "WATCHED_LIVENESS_S", NO_TIMEOUT)
    writer = await ab.open_writer(capacity=4, slot_bytes=256)
    try:
        same_ns = await ab.open_reader(writer.handle, name="same-namespace")
        # As a reader in another pid namespace sees it: the pid in the segment is not its writer's.
        seg_words = writer._ch.seg.words
        own_ns = seg_words[_layout.W_WRITER_PIDNS]
        seg_words[_layout.W_WRITER_PIDNS] = own_ns + 1
        other_ns = await ab.open_reader(writer.handle, name="other-namespace")
        seg_words[_layout.W_WRITER_PIDNS] = own_ns
        assert same_ns._src._inbox.watch is not None  # type: ignore[attr-defined]
        assert other_ns._src._inbox.watch is None  # type: ignore[attr-defined]
        await writer.put("last")
        gone: list[str] = []

        async def drain(reader: ab.Reader[str]) -> None:
            assert await reader.get() == "last"
            with pytest.raises(ab.WriterGone):
                await reader.get()
            gone.append(reader.name)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(drain, same_ns)
                tg.start_soon(drain, other_ns)
                await until(lambda: all(r.statistics().tasks_waiting == 1 for r in (same_ns, other_ns)))
                await anyio.sleep(0.1)
                await writer._ch.abandon()
        assert sorted(gone) == ["other-namespace", "same-namespace"]
        await same_ns.aclose()
        await other_ns.aclose()
    finally:
        await writer.aclose()


# --- 8. late join ---------------------------------------------------------------------------------
async def test_late_reader_starts_with_the_next_message(anyio_backend: Backend) -> None:
    """tokio's subscribe() joins at "now": a reader attached after ten messages were published (and
    while the ring still holds some of them) receives exactly the messages published after it
    attached, in order."""
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        for i in range(10):
            await writer.put(i)
        with spawn(collect_proc, anyio_backend, writer.handle.to_json(), ReaderOpts()) as reader:
            await reader.recv("attached")
            for i in range(10, 20):
                await writer.put(i)
            await writer.aclose()
            result = await reader.recv("events")
            assert result["events"] == [*[("msg", i) for i in range(10, 20)], ("end",)]


async def test_reader_joining_in_the_middle_of_a_streamed_message_skips_it(
    anyio_backend: Backend,
) -> None:
    """A reader that attaches while a message larger than the ring is being streamed never sees a
    piece of it: its first message is the next whole one."""
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        big = bytes(range(256)) * 20  # 5 KB: 23 entries through 4 slots
        handle = writer.handle.to_json()
        with (
            spawn(collect_proc, anyio_backend, handle, ReaderOpts(name="early", gate=True)) as early,
            contextlib.ExitStack() as stack,
        ):
            await early.recv("attached")
            async with anyio.create_task_group() as tg:
                tg.start_soon(writer.put, big)
                await until(lambda: writer.statistics().head == 4)  # streaming, waiting for `early`
                late = stack.enter_context(spawn(collect_proc, anyio_backend, handle, ReaderOpts(name="late")))
                await late.recv("attached")
                assert writer.statistics().head == 4  # still in the middle of `big`
                early.send("go")
            with anyio.fail_after(10):
                await writer.put("next")
                await writer.aclose()
            assert (await early.recv("events"))["events"] == [("msg", big), ("msg", "next"), ("end",)]
            assert (await late.recv("events"))["events"] == [("msg", "next"), ("end",)]


# --- 9. close and drain ---------------------------------------------------------------------------
async def test_close_then_drain_then_async_for_ends(anyio_backend: Backend) -> None:
    """anyio's EndOfStream: the writer puts N that nobody has read yet and closes; its file is gone
    at once; the reader process still receives all N, then its ``async for`` ends."""
    n = 40
    async with ab.open_writer(capacity=64, slot_bytes=256) as writer:
        opts = ReaderOpts(use_async_for=True, gate=True)
        with spawn(collect_proc, anyio_backend, writer.handle.to_json(), opts) as reader:
            await reader.recv("attached")
            for i in range(n):
                writer.put_nowait(i)
            assert writer.statistics().readers[0].lag == n
            await writer.aclose()
            assert files_of(writer.handle) == []
            reader.send("go")
            result = await reader.recv("events")
            assert result["events"] == [*[("msg", i) for i in range(n)], ("end-of-iteration",)]


async def test_parked_reader_is_woken_by_close(anyio_backend: Backend) -> None:
    """vLLM tests 2-3, shutdown while idle: a reader process parked in get() is woken by the
    writer's close and ends with EndOfStream. Its liveness period is a minute, so only the close's
    wake-up can end it in time."""
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        opts = ReaderOpts(liveness_s=NO_TIMEOUT)
        with spawn(collect_proc, anyio_backend, writer.handle.to_json(), opts) as reader:
            await reader.recv("attached")
            await until(lambda: writer.statistics().readers[0].sleeping)
            await writer.aclose()
            result = await reader.recv("events", within_s=10)
            assert result["events"] == [("end",)]


async def test_a_lost_wake_up_still_delivers(anyio_backend: Backend) -> None:
    """vLLM tests 9-10 / field note 3: the datagram that should wake a parked reader process is
    lost (its socket file is gone, so the send fails); the reader still gets the message, from
    its own periodic re-check, within the liveness bound."""
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        with spawn(collect_proc, anyio_backend, writer.handle.to_json(), ReaderOpts(stop_after=1)) as reader:
            place = (await reader.recv("attached"))["place"]
            await until(lambda: writer.statistics().readers[0].sleeping)
            os.unlink(os.path.join(writer.handle.directory, f"{writer.handle.name}-r{place}.sock"))
            await writer.put("delivered anyway")
            assert await reader.recv("stalled", within_s=10) == 1
            reader.send("exit")
            result = await reader.join()
            assert result == 0


# --- 10. idle CPU ---------------------------------------------------------------------------------
@pytest.mark.timeout(60)
async def test_parked_reader_and_blocked_writer_use_no_cpu(anyio_backend: Backend) -> None:
    """Field note 2 (vLLM #19036, #52814, #51950): a reader process parked in get() and a writer
    process blocked on a full ring each use (almost) no CPU time over 3 seconds. This measures
    CPU seconds of the processes, not wall-clock time."""
    window, limit = 3.0, 0.05
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        spec = WriterSpec(capacity=2, count=5, report_block=True)
        with (
            spawn(collect_proc, anyio_backend, writer.handle.to_json(), ReaderOpts(name="idle")) as idle,
            spawn(writer_proc, anyio_backend, spec) as blocked,
        ):
            await idle.recv("attached")
            async with ab.open_reader(await blocked.recv("handle"), name="not-reading") as lazy:
                blocked.send("go")
                assert await blocked.recv("blocking") == 2
                await until(lambda: writer.statistics().readers[0].sleeping)
                await anyio.sleep(0.3)  # let both settle into their waits
                before = cpu_seconds(idle.pid), cpu_seconds(blocked.pid)
                await anyio.sleep(window)
                after = cpu_seconds(idle.pid), cpu_seconds(blocked.pid)
                assert writer.statistics().readers[0].sleeping  # still parked
                assert not blocked.conn.poll()  # still blocked
                used_idle, used_blocked = after[0] - before[0], after[1] - before[1]
                assert used_idle < limit, f"parked reader used {used_idle:.3f} CPU-s in {window} s"
                assert used_blocked < limit, f"blocked writer used {used_blocked:.3f} CPU-s in {window} s"
                got = [x async for x in lazy]
            assert got == list(range(5))
            assert await blocked.recv("sent") == 5
            await blocked.recv("closed")
            await writer.put("bye")
            await writer.aclose()
            assert (await idle.recv("events"))["events"] == [("msg", "bye"), ("end",)]


# --- 11. messages larger than the ring ------------------------------------------------------------
async def test_messages_much_larger_than_the_ring(anyio_backend: Backend) -> None:
    """5 MiB messages through a ring of 4 x 64 KiB, to two slow reader processes: delivered whole,
    in order, no deadlock."""
    payloads = [random.Random(i).randbytes(5 << 20) for i in range(4)] + [b"small"]
    async with ab.open_writer(capacity=4, slot_bytes=64 * 1024) as writer:
        handle = writer.handle.to_json()
        with (
            spawn(collect_proc, anyio_backend, handle, ReaderOpts(name="a", digest=True, delay_s=0.02)) as a,
            spawn(collect_proc, anyio_backend, handle, ReaderOpts(name="b", digest=True, delay_s=0.05)) as b,
        ):
            await a.recv("attached")
            await b.recv("attached")
            with anyio.fail_after(60):
                for p in payloads:
                    await writer.put(p)
            await writer.aclose()
            for reader in (a, b):
                result = await reader.recv("events")
                assert result["events"] == [*[("msg", digest(p)) for p in payloads], ("end",)]


@UVLOOP_ONLY
@pytest.mark.timeout(120)
async def test_one_huge_message(anyio_backend: Backend) -> None:
    """A 1 GiB numpy array through a 4 MiB ring (4 x 1 MiB slots): delivered intact and writable."""
    n = HUGE_BYTES // 8
    arr = np.arange(n, dtype=np.uint64)
    async with ab.open_writer(capacity=4, slot_bytes=1 << 20) as writer:
        with spawn(huge_proc, anyio_backend, writer.handle.to_json(), n) as reader:
            await reader.recv("attached")
            with anyio.fail_after(90):
                await writer.put(arr)
            del arr
            await writer.aclose()
            assert await reader.recv("done", within_s=90) == {"ok": True, "end": True}


# --- 12. policy "lag" -----------------------------------------------------------------------------
async def test_lagging_reader_gets_the_exact_count_then_the_oldest_kept(anyio_backend: Backend) -> None:
    """tokio's Lagged(n): capacity 4, a reader process attached but not reading, ten one-slot
    messages: the reader gets ReaderLagged(6) (messages 0-5 were overwritten), then 6, 7, 8, 9."""
    async with ab.open_writer(capacity=4, slot_bytes=256, policy="lag") as writer:
        with spawn(collect_proc, anyio_backend, writer.handle.to_json(), ReaderOpts(gate=True)) as reader:
            await reader.recv("attached")
            for i in range(10):
                writer.put_nowait(i)  # never blocks under "lag"
            reader.send("go")
            await writer.aclose()
            result = await reader.recv("events")
            assert result["events"] == [("lagged", 6), ("msg", 6), ("msg", 7), ("msg", 8), ("msg", 9), ("end",)]
            assert (result["received"], result["lagged"]) == (4, 6)


async def test_lagging_reader_with_multi_slot_messages(anyio_backend: Backend) -> None:
    """Messages of 3 entries each through 4 slots: after 4 messages the ring holds the last
    fragment of message 2 and all of message 3, so the reader lost 3 messages and gets message 3."""
    async with ab.open_writer(capacity=4, slot_bytes=256, policy="lag") as writer:
        with spawn(collect_proc, anyio_backend, writer.handle.to_json(), ReaderOpts(gate=True)) as reader:
            await reader.recv("attached")
            bodies = [bytes([i]) * 600 for i in range(4)]
            for body in bodies:
                await writer.put(body)
            assert writer.statistics().head == 12
            reader.send("go")
            await writer.aclose()
            result = await reader.recv("events")
            assert result["events"] == [("lagged", 3), ("msg", bodies[3]), ("end",)]


# --- 13. a reader's aclose releases its place at once ---------------------------------------------
async def test_reader_aclose_releases_a_blocked_writer_at_once(
    anyio_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer waits for a reader process that is not reading; the reader closes (and its process
    stays alive). The writer proceeds on the wake-up the close sends: its liveness period is a
    minute, so nothing else could release it within the bound."""
    monkeypatch.setattr(_tuning, "ROOM_CHECK_S", NO_TIMEOUT)
    async with ab.open_writer(capacity=2, slot_bytes=256) as writer:
        with spawn(collect_proc, anyio_backend, writer.handle.to_json(), ReaderOpts(stop_after=0)) as reader:
            place = (await reader.recv("attached"))["place"]
            await reader.recv("stalled")
            await writer.put(0)
            await writer.put(1)
            done = anyio.Event()

            async def third() -> None:
                await writer.put(2)
                done.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(third)
                await until(lambda: waiting_on(writer, place))
                reader.send("close")
                await reader.recv("closed")
                assert reader.proc.is_alive()
                with anyio.fail_after(10):
                    await done.wait()
            stats = writer.statistics()
            assert stats.readers == ()
            assert stats.dropped_readers == 0  # released, not found dead
            reader.send("exit")
            assert await reader.join() == 0


# --- 14. /dev/shm too small -----------------------------------------------------------------------
async def test_ring_larger_than_dev_shm_is_refused_up_front(anyio_backend: Backend) -> None:
    """Field note 10 (vLLM #48879): a ring larger than the free space of /dev/shm raises
    InsufficientSharedMemory at creation (never a SIGBUS later) and leaves no file."""
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    with pytest.raises(ab.InsufficientSharedMemory) as exc_info:
        await ab.open_writer(capacity=2, slot_bytes=free // 2 + (64 << 20))
    assert exc_info.value.needed > exc_info.value.available
    assert "/dev/shm" in str(exc_info.value)


@pytest.fixture
def small_tmpfs() -> Iterator[str]:
    """A 1 MiB tmpfs mounted for the test (needs root: CI and this machine run as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (os.geteuid() != 0)")
    directory = tempfile.mkdtemp(prefix="aiobroadcast-test-tmpfs-")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", directory], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        os.rmdir(directory)
        pytest.fail(f"root could not mount a tmpfs (container without CAP_SYS_ADMIN?): {proc.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", directory], check=True)
        os.rmdir(directory)


async def test_ring_larger_than_a_small_tmpfs_is_refused(anyio_backend: Backend, small_tmpfs: str) -> None:
    """Docker's 64 MB /dev/shm, in miniature: on a 1 MiB tmpfs a 2 MiB ring raises
    InsufficientSharedMemory and leaves nothing behind; a ring that fits works there."""
    with pytest.raises(ab.InsufficientSharedMemory) as exc_info:
        await ab.open_writer(capacity=2, slot_bytes=1 << 20, directory=small_tmpfs)
    assert exc_info.value.available <= 1 << 20
    assert os.listdir(small_tmpfs) == []
    async with ab.open_writer(capacity=4, slot_bytes=4096, directory=small_tmpfs) as writer:
        assert writer.handle.directory == small_tmpfs
        with spawn(collect_proc, anyio_backend, writer.handle.to_json(), ReaderOpts()) as reader:
            await reader.recv("attached")
            await writer.put("fits")
            await writer.aclose()
            assert (await reader.recv("events"))["events"] == [("msg", "fits"), ("end",)]
    assert os.listdir(small_tmpfs) == []


# --- 15. many writers at once ---------------------------------------------------------------------
def test_many_writers_created_concurrently() -> None:
    """vLLM test 15 / field note 12: 20 writers created at the same moment from 20 threads (on all
    three event loops) get 20 distinct segments, and each works."""
    count = 20
    backends: list[Backend] = [("asyncio", {}), ("asyncio", {"use_uvloop": True}), ("trio", {})]
    barrier = threading.Barrier(count)
    names: list[str] = []
    errors: list[BaseException] = []

    async def one(k: int) -> None:
        barrier.wait()
        async with ab.open_writer(capacity=2, slot_bytes=256) as writer:
            names.append(writer.handle.name)
            async with ab.open_reader(writer.handle) as reader:
                barrier.wait()  # every writer exists before any is used
                await writer.put(k)
                assert await reader.get() == k

    def run(k: int) -> None:
        try:
            b = backends[k % 3]
            anyio.run(one, k, backend=b[0], backend_options=b[1])
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(names) == count
    assert len(set(names)) == count


# --- 16. bad handles ------------------------------------------------------------------------------
async def test_bad_handles(anyio_backend: Backend) -> None:
    """open_reader says what is wrong with a handle: gone, another layout, not a handle, full."""
    async with ab.open_writer(capacity=4, slot_bytes=128, max_readers=2) as writer:
        h = writer.handle
        with pytest.raises(ab.InvalidHandle, match="layout"):
            await ab.open_reader(h.model_copy(update={"capacity": 5}))
        with pytest.raises(ab.InvalidHandle, match="capacity 4 != 8"):  # same size, other split
            await ab.open_reader(h.model_copy(update={"capacity": 8, "slot_bytes": 64}))
        with pytest.raises(ab.InvalidHandle, match="not an aiobroadcast handle"):
            await ab.open_reader('{"name": "aiobroadcast-0123", "capacity": 4}')
        with pytest.raises(ab.InvalidHandle, match="not an aiobroadcast handle"):
            await ab.open_reader("this is not JSON")
        with spawn(collect_proc, anyio_backend, h.to_json(), ReaderOpts(stop_after=0)) as other:
            await other.recv("attached")
            async with ab.open_reader(h, name="second"):
                with pytest.raises(ab.TooManyReaders) as exc_info:
                    await ab.open_reader(h, name="third")
                assert exc_info.value.max_readers == 2
            other.send("exit")
            assert await other.join() == 0
            async with ab.open_reader(h, name="third"):  # the place it left is free again
                pass
    with pytest.raises(ab.InvalidHandle, match="gone"):
        await ab.open_reader(h)


# --- 17. no warnings at exit, no resource_tracker -------------------------------------------------
SUBPROCESS_READER = """
import sys
import anyio
import aiobroadcast as ab

async def main() -> None:
    async with ab.open_reader(sys.argv[1], name="sub") as reader:
        print("attached", flush=True)
        print("got", await reader.get(), flush=True)
    print("resource_tracker", "multiprocessing.resource_tracker" in sys.modules, flush=True)

anyio.run(main)
"""


async def test_reader_process_exits_silently_and_leaves_the_segment(anyio_backend: Backend) -> None:
    """Field note 10 (CPython gh-82300): a reader in ``python -W error`` attaches, reads, closes and
    exits with nothing on stderr, without ever loading multiprocessing's resource_tracker; the
    segment stays until the writer closes."""
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        command = [sys.executable, "-W", "error", "-c", SUBPROCESS_READER, writer.handle.to_json()]
        async with await anyio.open_process(command) as proc:
            assert proc.stdout is not None and proc.stderr is not None
            lines = BufferedByteReceiveStream(proc.stdout)
            with anyio.fail_after(30):
                assert await lines.receive_until(b"\n", 100) == b"attached"
                await writer.put("hello")
                assert await lines.receive_until(b"\n", 100) == b"got hello"
                assert await lines.receive_until(b"\n", 100) == b"resource_tracker False"
                assert await proc.wait() == 0
            stderr = b"".join([chunk async for chunk in proc.stderr])
        assert stderr == b""
        assert writer.handle.name in files_of(writer.handle)
        assert writer.statistics().readers == ()
    assert files_of(writer.handle) == []


# --- 18. a reader that is never closed --------------------------------------------------------------
async def test_unclosed_reader_warns(anyio_backend: Backend) -> None:
    """anyio's ResourceWarning for unclosed ends."""
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        reader = await ab.open_reader(writer.handle, name="forgotten")
        with pytest.warns(ResourceWarning, match="unclosed") as record:
            del reader
            gc.collect()
            assert [str(w.message).startswith("unclosed <aiobroadcast.Reader 'forgotten'") for w in record] == [True]
            record.clear()  # the record holds the reader (the warning's source); let it and its sockets go
            gc.collect()


async def test_unclosed_reader_releases_its_place_when_its_process_exits(anyio_backend: Backend) -> None:
    """A reader process that drops its reader without closing it gets a ResourceWarning, and when
    it exits the writer waiting for it finds its place free and goes on."""
    async with ab.open_writer(capacity=2, slot_bytes=256) as writer:
        with spawn(forget_proc, anyio_backend, writer.handle.to_json()) as child:
            place = (await child.recv("attached"))["place"]
            child.send("forget")
            caught = await child.recv("forgot")
            assert any(
                cat == "ResourceWarning" and msg.startswith("unclosed <aiobroadcast.Reader 'forgetful'")
                for cat, msg in caught
            ), caught
            await writer.put(0)
            await writer.put(1)
            done = anyio.Event()

            async def third() -> None:
                await writer.put(2)
                done.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(third)
                await until(lambda: waiting_on(writer, place))
                child.send("exit")
                assert await child.join() == 0
                with anyio.fail_after(10):
                    await done.wait()
            assert writer.statistics().dropped_readers == 1
            assert writer.statistics().readers == ()


# --- bugs found while writing these tests -----------------------------------------------------------
async def test_new_reader_in_a_reused_place_is_woken(anyio_backend: Backend) -> None:
    """Field note 3 (lost wake-ups): reader A parks once and is woken, then leaves; reader B takes
    the same place and parks. The writer must wake B too (it used to skip B's first wake-up, since
    B's sleep counter restarted at A's last value, and B waited for its liveness re-check)."""
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        handle = writer.handle.to_json()
        places = []
        for name in ("A", "B"):
            opts = ReaderOpts(name=name, liveness_s=NO_TIMEOUT, stop_after=1)
            with spawn(collect_proc, anyio_backend, handle, opts) as reader:
                places.append((await reader.recv("attached"))["place"])
                await until(lambda: any(r.sleeping for r in writer.statistics().readers))
                await writer.put(name)
                assert await reader.recv("stalled", within_s=10) == 1
                reader.send("close")
                await reader.recv("closed")
                reader.send("exit")
                assert await reader.join() == 0
        assert places == [places[0], places[0]]


async def test_reader_aclose_wakes_its_parked_gets(anyio_backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reader.aclose while tasks are parked in get(): each raises ClosedResourceError at once (they
    used to wake only at the next liveness check, with OSError(EBADF) from the closed socket)."""
    monkeypatch.setattr(_tuning, "LIVENESS_S", NO_TIMEOUT)
    monkeypatch.setattr(_tuning, "WATCHED_LIVENESS_S", NO_TIMEOUT)
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        reader = await ab.open_reader(writer.handle)
        outcomes: list[str] = []

        async def parked() -> None:
            try:
                await reader.get()
                outcomes.append("message")
            except ab.ClosedResourceError:
                outcomes.append("closed")

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(parked)
                await until(lambda: reader.statistics().tasks_waiting == 3)
                await reader.aclose()
        assert outcomes == ["closed"] * 3
        assert writer.statistics().readers == ()


async def test_writer_aclose_fails_its_parked_puts_cleanly(
    anyio_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writer.aclose while puts wait for room (vLLM tests 2-3, shutdown while busy): the parked
    puts raise ClosedResourceError at once (they used to wake at the next liveness check and fail
    with ValueError on the released mapping), and the reader process receives what was
    published, then EndOfStream."""
    monkeypatch.setattr(_tuning, "ROOM_CHECK_S", NO_TIMEOUT)
    async with ab.open_writer(capacity=2, slot_bytes=256) as writer:
        with spawn(collect_proc, anyio_backend, writer.handle.to_json(), ReaderOpts(gate=True)) as reader:
            await reader.recv("attached")
            await writer.put(0)
            await writer.put(1)
            outcomes: list[str] = []

            async def parked(i: int) -> None:
                try:
                    await writer.put(i)
                    outcomes.append("published")
                except ab.ClosedResourceError:
                    outcomes.append("closed")

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(parked, 2)
                    tg.start_soon(parked, 3)
                    await until(lambda: writer.statistics().tasks_waiting == 2)
                    await writer.aclose()
            assert outcomes == ["closed", "closed"]
            reader.send("go")
            assert (await reader.recv("events"))["events"] == [("msg", 0), ("msg", 1), ("end",)]
