"""A writer's channel, its publishing part: encoding a message, waiting (in turn) for room in
the ring, publishing. The logic that waits is step generators (``_steps``) that the async put
(``run``, in its turn) and the blocking put (``run_blocking``, under its lock) both drive."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Sequence
from time import perf_counter_ns
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel

from .._base import tuning as _tuning
from .._base.codec import Buffer, JsonCodec, PickleEncoder, SchemaCodec
from .._base.errors import BroadcastError, InvalidArgument, MessageTooLarge
from .._base.steps import CHECKPOINT, Sleep, Steps, poll_steps, run
from .._shm.layout import W_WAIT_TARGET, wait_target
from .._shm.publisher import Chunks, Encoded, Publisher
from .._shm.wake import Inbox

if TYPE_CHECKING:
    from .._shm.arena import ArenaWriter


class Publishing:
    """What a put does, once the object is in hand: ``WriterChannel.publishing``, which the
    roles bind once (their put path reads its attributes directly)."""

    def __init__(
        self,
        pub: Publisher,
        inbox: Inbox,
        encoder: PickleEncoder | SchemaCodec | JsonCodec,
        max_message_bytes: int | None,
        arena: ArenaWriter | None,
        restarting: Callable[[int], bool],
    ) -> None:
        self.pub = pub
        self.inbox = inbox
        self.arena = arena
        #: ``restarting(pid)``: keep the place of reader ``pid`` (``Serving.restarting``).
        self._restarting = restarting
        self._arena_source = self._encode = encoder.encode
        self._max_message_bytes = max_message_bytes
        if arena is not None:
            self._encode = self._encode_arena
        #: Encode a message a put is about to publish: the encoder's own method when there is no
        #: size limit to check (one call less per message).
        self.encode = self._encode if max_message_bytes is None else self._encode_checked
        self.payload_bytes = pub.layout.payload_bytes
        # Two locks. `turns` orders the tasks of the writer's event loop (a put waiting for room
        # keeps its turn). `pub.mutex` is held, never across an await, by whoever is writing into
        # the ring right now, from any thread; a put_nowait that cannot take it at once raises
        # WouldBlock. Encoding runs outside both: it may run user code (a __reduce__ that
        # publishes, a logging handler that broadcasts), which must find the writer usable.
        self.turns = Turns()
        self.thread = threading.get_ident()
        self.waiting_tasks = 0
        #: How long the last wait for room slept: a writer that slept only briefly polls first.
        self.slept_ns = _tuning.DENSE_NS  # no polling before the first sleep
        #: The slots the last wait for room waited for (one, for a streamed message), kept for the
        #: error of a wait cut short by a deadline (``Serving.put_timeout``).
        self.wanted = 1

    def check_thread(self) -> None:
        """``put`` and ``aclose`` wait in the event loop of the thread that opened the writer; its
        task lock and wake-up socket cannot be shared with another thread's loop."""
        if threading.get_ident() != self.thread:
            raise BroadcastError(
                "this writer's put() and aclose() belong to the thread whose event loop opened it; "
                "from another thread use put_nowait(), or anyio.from_thread.run(writer.put, obj)"
            )

    # --- encoding and publishing -------------------------------------------------------------
    def _encode_arena(self, obj: object) -> tuple[Sequence[Buffer], int, bool]:
        parts, total, oob = self._arena_source(obj)
        if oob:
            assert self.arena is not None
            parts, total = self.arena.place(parts, total)
        return parts, total, oob

    def _encode_checked(self, obj: object) -> tuple[Sequence[Buffer], int, bool]:
        # The whole message is measured, before any of it goes to the arena: the limit does not
        # depend on whether the arena has room (a message that falls back to the ring is the same
        # message), and a refused message takes no record.
        parts, total, oob = self._arena_source(obj)
        if self._max_message_bytes is not None and total > self._max_message_bytes:
            raise MessageTooLarge(total, self._max_message_bytes)
        if oob and self.arena is not None:
            parts, total = self.arena.place(parts, total)
        return parts, total, oob

    def encoded(self, obj: object) -> Encoded:
        """What every put does first, before it tries the ring: the object as it is now, encoded
        (``encode``: checked against the size limit, its tensors placed in the arena), with the
        ring slots it takes. (``Writer.put`` has these two lines inline: its hot path.)"""
        parts, total, oob = self.encode(obj)
        return parts, total, oob, 1 if total <= self.payload_bytes else self.pub.layout.entries_for(total)

    def entries_for(self, total: int) -> int:
        return 1 if total <= self.payload_bytes else self.pub.layout.entries_for(total)

    async def put_encoded(self, parts: Sequence[Buffer], total: int, oob: bool, entries: int) -> None:
        """Publish, waiting (in turn) for room; no await once the message is out."""
        if not self.turns.locked() and self.pub.try_publish(parts, total, oob, entries):
            return
        await self.put_in_turn(parts, total, oob, entries)

    async def put_in_turn(
        self, parts: Sequence[Buffer], total: int, oob: bool, entries: int, yield_first: bool = False
    ) -> None:
        """Publish after the tasks ahead of this one, waiting for room. ``yield_first``: let the
        loop's other tasks run once, holding the turn, before anything is published (a
        cancellation there publishes nothing)."""
        self.waiting_tasks += 1
        try:
            async with self.turns:
                if yield_first:
                    await anyio.lowlevel.checkpoint()
                pub = self.pub
                pub.check_open()
                # Room now (the usual case after yield_first): publish without a generator.
                if (entries <= pub.layout.capacity or not pub.block) and pub.try_publish(parts, total, oob, entries):
                    return
                await run(self.publish_steps(parts, total, oob, entries), self._sleep)
        finally:
            self.waiting_tasks -= 1

    async def put_batch(self, batch: Sequence[Encoded], entries: int, yield_first: bool = False) -> bool:
        """Publish several messages at once (``entries`` slots in all, at most the ring's
        capacity), waiting (in turn) for room for all of them. True if they went out at once.
        ``yield_first`` as for ``put_in_turn``."""
        pub = self.pub
        if not yield_first and not self.turns.locked() and pub.try_publish_many(batch, entries):
            return True
        self.waiting_tasks += 1
        try:
            async with self.turns:
                if yield_first:
                    await anyio.lowlevel.checkpoint()
                pub.check_open()
                if not pub.try_publish_many(batch, entries):
                    await run(self.batch_steps(batch, entries), self._sleep)
                return False
        finally:
            self.waiting_tasks -= 1

    def encode_batch(self, objs: Iterable[object]) -> tuple[list[Encoded], int]:
        """Encode the messages of a ``put_many``: each with its slot count, and the slots in all.
        Raises ``InvalidArgument`` if they would not fit in the ring together."""
        batch: list[Encoded] = []
        entries = 0
        encode = self.encode
        payload = self.payload_bytes
        for obj in objs:
            parts, total, oob = encode(obj)
            n = 1 if total <= payload else self.pub.layout.entries_for(total)
            batch.append((parts, total, oob, n))
            entries += n
        capacity = self.pub.layout.capacity
        if entries > capacity:
            raise InvalidArgument(
                f"put_many: these {len(batch)} messages take {entries} ring slots together, more than the "
                f"ring's capacity of {capacity}; split the batch, or put() them one at a time"
            )
        return batch, entries

    def publish_steps(self, parts: Sequence[Buffer], total: int, oob: bool, entries: int, gap: int = 0) -> Steps[None]:
        """Wait for room, then publish; or stream a message larger than the ring (policy
        "block") a few slots at a time. Written once for both drivers (``_steps``); the caller
        holds the writer's turn (a task's ``turns``, a thread's lock) and has checked it is open.

        Another thread's ``put_nowait`` may take the room or hold the mutex meanwhile: then the
        steps let it finish (its copy takes microseconds) and wait again. Closing the steps
        midway (a cancellation, a deadline, a close) publishes nothing, or, streaming, ends the
        message so that readers drop it whole."""
        pub = self.pub
        if entries <= pub.layout.capacity or not pub.block:
            yield from self.when_room_steps(entries, lambda: pub.try_publish(parts, total, oob, entries, gap))
            return
        chunks = Chunks(parts)
        msg = pub.msg
        try:
            while not chunks.done:
                if not pub.room(1):
                    yield from self.room_steps(1)
                if not pub.stream_some(chunks, total, oob, msg):
                    yield CHECKPOINT  # another thread is finishing a put_nowait
                    pub.check_open()
        finally:
            pub.end_stream(chunks, msg)

    def batch_steps(self, batch: Sequence[Encoded], entries: int) -> Steps[None]:
        """``put_many``'s wait: room for the whole batch (``entries`` slots), then all of it at
        once. For both drivers; the caller holds the writer's turn, as for ``publish_steps``."""
        pub = self.pub
        return self.when_room_steps(entries, lambda: pub.try_publish_many(batch, entries))

    def when_room_steps(self, entries: int, publish: Callable[[], bool]) -> Steps[None]:
        """Wait for room for ``entries`` slots (policy "block"), then ``publish()``; again while
        it finds the room taken or the mutex held by another thread's ``put_nowait`` (its copy
        takes microseconds: let it finish)."""
        pub = self.pub
        while True:
            if pub.block and not pub.room(entries):
                yield from self.room_steps(entries)
            if publish():
                return
            yield CHECKPOINT
            pub.check_open()

    # --- waiting for room ----------------------------------------------------------------------
    async def _sleep(self, limit_s: float) -> bool:
        try:
            return await self.inbox.wait(limit_s)
        except anyio.ClosedResourceError:
            return False  # closed meanwhile: check_open raises

    def room_steps(self, entries: int) -> Steps[None]:
        """The wait for room, written once for both drivers (``_steps``): polls a while if the
        ring was full only briefly of late, then sleeps on the inbox. Returns once the slowest
        live reader made room."""
        pub = self.pub
        self.wanted = entries
        if self.slept_ns < _tuning.DENSE_NS:

            def room() -> bool:
                pub.check_open()
                return pub.room(entries)

            if (yield from poll_steps(room, _tuning.POLL_NS)):
                self.slept_ns = 0
                return
        w = pub.seg.words
        cap = pub.layout.capacity
        # Hysteresis: a full ring makes the writer wait for a quarter of it to be free, not for
        # one slot, so a writer faster than its slowest reader sleeps and is woken once per
        # capacity/4 entries instead of once per entry (each wake-up costs the reader a system
        # call and the writer a trip through its event loop).
        target = wait_target(pub.head, entries + min(cap - entries, cap // 4), cap)
        try:
            while True:
                # Announce, then re-check: a reader that reaches the target after our rescan
                # sees it stored (the rescan fences) and wakes us.
                w[W_WAIT_TARGET] = target
                pub.records.rescan(pub.head)
                if pub.records.min_cursor >= target:
                    return
                start = perf_counter_ns()
                woken = yield Sleep(_tuning.ROOM_CHECK_S)
                self.slept_ns = perf_counter_ns() - start
                pub.check_open()
                if not woken:
                    pub.records.reap(target, pub.head, self._restarting)
        finally:
            if not pub.closed:  # after a close the mapping is gone
                w[W_WAIT_TARGET] = 0

    # --- for relays ----------------------------------------------------------------------------
    async def put_gap(self, missed: int) -> None:
        """Publish a marker that makes every reader raise ``ReaderLagged(missed)``."""
        self.pub.check_open()
        async with self.turns:
            await run(self.publish_steps((b"",), 0, False, 1, gap=missed), self._sleep)
        self.pub.lost_upstream += missed - 1  # the marker took their numbers; it is one message sent


class Turns:
    """The writer's tasks take turns, first come first served. Like ``anyio.Lock``, but an
    exception of any kind thrown into a waiting task (not only a cancellation) gives its turn
    back: a turn is never left held by a task that is gone."""

    __slots__ = ("_waiters", "held")

    def __init__(self) -> None:
        #: a task holds the turn (``locked()``; read directly on the put path, which is cheaper)
        self.held = False
        self._waiters: collections.deque[anyio.Event] = collections.deque()

    def locked(self) -> bool:
        return self.held

    async def __aenter__(self) -> None:
        if not self.held:
            self.held = True
            return
        turn = anyio.Event()
        self._waiters.append(turn)
        try:
            await turn.wait()
        except BaseException:
            if turn.is_set():
                self._release()  # it was handed to us as we were interrupted: pass it on
            else:
                self._waiters.remove(turn)
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        self._release()

    def _release(self) -> None:
        if self._waiters:
            self._waiters.popleft().set()  # handed over: still held, by the next task
        else:
            self.held = False
