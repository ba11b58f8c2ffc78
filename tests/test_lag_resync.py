"""The lag resync (docs/design.md, "Catching up after a lag") against every interleaving we choose.

A reader of a policy-"lag" ring races a writer in another process. Here the race is replayed
deterministically: the reader is a real ``ShmSource``, the writer is ``SteppedWriter`` below, which
makes the stores of ``Writer._publish`` in the same order, one store per step (a store of an
aligned 8-byte word is atomic; a payload or header copy is one step, and so is the zeroing of the
header that ``struct.pack_into`` does before it fills the fields in). The reader's loads of ring
words go through ``Interleave``, which lets the writer take a chosen number of steps after each
load: the reader sees exactly the memory a racing writer could have shown it at that point.

Every run checks the reader's promise: each message is received, in order, or counted by the
``ReaderLagged(n)`` raised where it is missing; never counted and received, never skipped silently.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest

import aiobroadcast as ab
from aiobroadcast._shm.atomic import Words
from aiobroadcast._shm.layout import BUSY, F_FIRST, F_LAST, SLOT_REST, W_HEAD, W_NEXT_MSG
from aiobroadcast._shm.segment import Segment
from aiobroadcast._shm.subscriber import ShmSource

pytestmark = pytest.mark.anyio

CAPACITY = 4
SLOT_BYTES = 64  #: 32 bytes of payload per slot


def body(k: int, slots: int) -> bytes:
    """Message ``k``'s body, filling ``slots`` slots (the last one partly)."""
    return (b"%d:" % k).ljust(32 * (slots - 1) + 8, bytes([65 + k % 26]))


def number(raw: bytes) -> int:
    """The number of an intact body made by ``body``."""
    k = int(raw.split(b":")[0])
    assert raw == body(k, -(-len(raw) // 32)), f"message {k} arrived damaged: {raw!r}"
    return k


class SteppedWriter:
    """Publishes like ``Writer._publish`` under policy "lag", one store per step."""

    def __init__(self, seg: Segment) -> None:
        self._seg = seg
        self._steps: Iterator[None] = iter(())
        self.head = 0
        self.msg = 0
        self.queued: list[bytes] = []

    def publish(self, *bodies: bytes) -> None:
        self.queued.extend(bodies)

    def step(self, n: int = 1) -> None:
        """Make the next ``n`` stores (fewer if the queue runs out)."""
        for _ in range(n):
            if not self._store():
                return

    def finish(self) -> None:
        while self._store():
            pass

    def _store(self) -> bool:
        if next(self._steps, StopIteration) is not StopIteration:
            return True
        if not self.queued:
            return False
        self._steps = self._message(self.queued.pop(0))
        return next(self._steps, StopIteration) is not StopIteration

    def _message(self, raw: bytes) -> Iterator[None]:
        w, buf, lay = self._seg.words, self._seg.buf, self._seg.layout
        pay = lay.payload_bytes
        frags = [raw[i : i + pay] for i in range(0, len(raw), pay)] or [b""]
        seq, msg = self.head, self.msg
        for i, frag in enumerate(frags):
            off = lay.slot_offset(seq)
            flags = (F_FIRST if i == 0 else 0) | (F_LAST if i == len(frags) - 1 else 0)
            w[off >> 3] = BUSY
            yield
            buf[off + 32 : off + 32 + len(frag)] = frag
            yield
            buf[off + 8 : off + 32] = bytes(24)  # struct.pack_into zeroes the header first
            yield
            SLOT_REST.pack_into(buf, off + 8, msg, len(frag), flags, len(raw))
            yield
            w[off >> 3] = seq
            yield
            seq += 1
        w[W_NEXT_MSG] = msg + 1
        yield
        w[W_HEAD] = seq
        self.head, self.msg = seq, msg + 1
        yield


class Interleave:
    """The reader's view of the ring's words: after its load number ``k`` (from 0), the writer
    takes ``steps(k)`` steps."""

    def __init__(self, words: Words, writer: SteppedWriter, steps: Callable[[int], int]) -> None:
        self._words = words
        self._writer = writer
        self._steps = steps
        self.loads = 0

    def __getitem__(self, i: int) -> int:
        assert self.loads < 100_000, "the reader spins"
        value = int(self._words[i])
        self._writer.step(self._steps(self.loads))
        self.loads += 1
        return value

    def __setitem__(self, i: int, value: int) -> None:
        self._words[i] = value


def take(src: ShmSource, events: list[tuple[str, int]], until_blocked: bool = True) -> None:
    """Read until ``WouldBlock``, noting ("msg", k) and ("lagged", n)."""
    while True:
        try:
            events.append(("msg", number(src.get_nowait())))
        except ab.ReaderLagged as exc:
            events.append(("lagged", exc.missed))
        except ab.WouldBlock:
            return
        if not until_blocked:
            return


def check(events: list[tuple[str, int]], total: int) -> None:
    """Every message 0 .. total-1 received in order or counted where it is missing."""
    expected = 0
    for kind, n in events:
        if kind == "msg":
            assert n == expected, f"expected message {expected}, got {n}: {events}"
            expected += 1
        else:
            assert n > 0
            expected += n
    assert expected == total, f"accounted for {expected} of {total} messages: {events}"


async def ring(steps: Callable[[int], int]) -> tuple[ab.Writer[Any], ab.Reader[Any], ShmSource, SteppedWriter]:
    writer = await ab.open_writer(policy="lag", capacity=CAPACITY, slot_bytes=SLOT_BYTES)
    reader = await ab.open_reader(writer.handle, transport="shm")
    src = cast(ShmSource, reader._src)
    src.taking.decode = lambda raw, oob: bytes(raw)
    stepped = SteppedWriter(src._seg)
    src._words = src.cursor.words = cast(Any, Interleave(src._seg.words, stepped, steps))
    return writer, reader, src, stepped


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_writer_overtakes_the_resync_scan() -> None:
    """The reader, 8 messages behind, loads head (8), then the writer publishes 4 more before the
    reader looks at slots 4..7. Entries 8..11 are intact: it lost exactly 0..7."""
    schedule = {1: 4 * 7}  # after load 1 (head, in the resync): four whole messages
    writer, reader, src, stepped = await ring(lambda k: schedule.get(k, 0))
    async with writer, reader:
        stepped.publish(*(body(k, 1) for k in range(12)))
        stepped.step(8 * 7)
        events: list[tuple[str, int]] = []
        take(src, events)
        assert events[:2] == [("lagged", 8), ("msg", 8)], events
        check(events, 12)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_torn_header_is_never_taken_for_the_rest_of_a_message() -> None:
    """The writer starts to overwrite entry 0 right after the reader loaded its seq: the reader
    sees a zeroed header (no FIRST, no LAST). Message 0 is lost and must be counted."""
    schedule = {0: 3}  # after load 0 (slot 0's seq): BUSY, payload, zeroed header
    writer, reader, src, stepped = await ring(lambda k: schedule.get(k, 0))
    async with writer, reader:
        stepped.publish(*(body(k, 1) for k in range(5)))
        stepped.step(4 * 7)
        events: list[tuple[str, int]] = []
        take(src, events, until_blocked=False)
        stepped.finish()
        take(src, events)
        assert events == [("lagged", 1), ("msg", 1), ("msg", 2), ("msg", 3), ("msg", 4)], events
        check(events, 5)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_writer_stopped_inside_a_message_longer_than_the_ring() -> None:
    """Message 1 takes 6 slots of 4; the writer stops (dies) while it writes the sixth. The reader
    must count message 1 as lost and then wait, not spin on a head that will not move."""
    writer, reader, src, stepped = await ring(lambda k: 0)
    async with writer, reader:
        stepped.publish(body(0, 1))
        stepped.finish()
        events: list[tuple[str, int]] = []
        take(src, events)
        stepped.publish(body(1, 6))
        stepped.step(5 * 5 + 1)  # five fragments of message 1, and BUSY for the sixth
        take(src, events)
        assert events == [("msg", 0), ("lagged", 1)], events
        assert not src.ready()  # so a get() sleeps, and finds out that the writer is gone


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("seed", range(12))
async def test_the_lag_count_is_exact_in_random_interleavings(seed: int) -> None:
    """Messages of 1, 2, 3 and 6 slots (more than the ring: the writer overwrites their start
    while it writes their end), the writer taking 0 to 40 steps after each load of the reader."""
    rng = random.Random(seed)
    bursts = [0, 0, 0, 0, 1, 1, 2, 3, 5, 8, 13, 40]
    writer, reader, src, stepped = await ring(lambda k: rng.choice(bursts))
    async with writer, reader:
        total = 1500
        stepped.publish(*(body(k, rng.choice([1, 1, 1, 2, 3, 6])) for k in range(total)))
        events: list[tuple[str, int]] = []
        while stepped.queued:
            take(src, events)
            stepped.step(rng.choice(bursts))
        stepped.finish()
        take(src, events)
        check(events, total)
        assert sum(n for kind, n in events if kind == "lagged") == src.statistics(0).lagged
