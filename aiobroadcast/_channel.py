"""The writing side of a channel: everything ``Writer`` (async), ``BlockingWriter`` and a relay
share. The role classes are facades over one ``WriterChannel``.

It owns the ring's ``Publisher``, the writer's wake-up inbox (readers wake a writer that waits
for room), the order in which the writer's tasks take turns, and the TCP server supervisor.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from time import perf_counter_ns
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import anyio.to_thread

from . import _fork, _tuning
from ._codec import Buffer, JsonCodec, PickleEncoder, SchemaCodec
from ._exceptions import BroadcastError, InvalidArgument, MessageTooLarge
from ._files import unlink_quietly
from ._handle import Handle
from ._shm.arena import ArenaWriter
from ._shm.layout import CODECS, W_CODEC, W_WAIT_TARGET, holds_writer, wait_target
from ._shm.publisher import Chunks, Encoded, Publisher
from ._shm.segment import Segment
from ._shm.wake import Inbox
from ._stats import WriterStatistics
from ._steps import CHECKPOINT, Steps, poll_steps, run, run_blocking

if TYPE_CHECKING:
    from ._tcp.supervisor import ServerProcess


class WriterChannel:
    """One open channel, from its writer's side."""

    def __init__(
        self,
        seg: Segment,
        handle: Handle,
        encoder: PickleEncoder | SchemaCodec | JsonCodec,
        max_message_bytes: int | None,
        arena_bytes: int = 0,
    ) -> None:
        self.seg = seg
        self.handle = handle
        self._encode = self._arena_source = encoder.encode
        self._max_message_bytes = max_message_bytes
        self.pub = pub = Publisher(seg, handle.policy == "block")
        #: The tensor arena (docs/design.md, "The arena"), if ``open_writer(arena_bytes=...)``.
        self.arena: ArenaWriter | None = None
        if arena_bytes:
            self.arena = ArenaWriter(seg, arena_bytes, lambda: pub.head)
            self.arena.probe = lambda: pub.records.reap(1 << 63, pub.head, self._restarting)
            self._encode = self._encode_arena
        #: Encode a message a put is about to publish: the encoder's own method when there is no
        #: size limit to check (one call less per message).
        self.encode: Callable[[object], tuple[Sequence[Buffer], int, bool]] = (
            self._encode if max_message_bytes is None else self._encode_checked
        )
        self.payload_bytes = seg.layout.payload_bytes
        self.inbox = Inbox(seg.sock_path("w"))
        # Two locks. `turns` orders the tasks of the writer's event loop (a put waiting for room
        # keeps its turn). `pub.mutex` is held, never across an await, by whoever is writing into
        # the ring right now, from any thread; a put_nowait that cannot take it at once raises
        # WouldBlock. Encoding runs outside both: it may run user code (a __reduce__ that
        # publishes, a logging handler that broadcasts), which must find the writer usable.
        self.turns = Turns()
        self.thread = threading.get_ident()
        self.waiting_tasks = 0
        self.slept_ns = _tuning.DENSE_NS  # no polling before the first sleep
        self.server: ServerProcess | None = None
        #: Set once the first ``aclose`` is over (made by it): a second one waits for it.
        self.closed_event: anyio.Event | None = None
        #: ``spare(pid)``: keep the place of reader ``pid`` although its lock is free (a fan-in
        #: sender keeps the place it reserved for its collector until the collector takes it).
        self.spare: Callable[[int], bool] | None = None
        # The readers' sockets too: a reader that died unnoticed (never reaped) leaves its own.
        # Inherited by fork children (atexit hooks and finalizers are), so they carry our pid.
        self.owner = os.getpid()
        extra = (self.arena.path,) if self.arena is not None else ()
        self._finalizer = weakref.finalize(
            self, _cleanup_files, self.owner, seg.path, self.inbox.path, *extra, *pub.records.sock_paths
        )
        atexit.register(self._finalizer)
        _fork.track(self)

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
    async def _wait_room(self, entries: int) -> None:
        if not self.pub.room(entries):
            await run(self.room_steps(entries), self._sleep)

    async def _sleep(self, limit_s: float) -> bool:
        try:
            return await self.inbox.wait(limit_s)
        except anyio.ClosedResourceError:
            return False  # closed meanwhile: check_open raises

    def wait_room_blocking(self, entries: int, sleep: Callable[[float], bool]) -> None:
        """``_wait_room`` for a thread without an event loop (the blocking writer).
        ``sleep(limit)`` blocks on the inbox for up to ``limit`` seconds and says whether a
        wake-up came; it may raise instead (a deadline passed, the writer is closing)."""
        if not self.pub.room(entries):
            run_blocking(self.room_steps(entries), sleep)

    def room_steps(self, entries: int) -> Steps[None]:
        """The wait for room, written once for both drivers (``_steps``): polls a while if the
        ring was full only briefly of late, then sleeps on the inbox. Returns once the slowest
        live reader made room."""
        pub = self.pub
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
                woken = yield _tuning.ROOM_CHECK_S
                self.slept_ns = perf_counter_ns() - start
                pub.check_open()
                if not woken:
                    pub.records.reap(target, pub.head, self._restarting)
        finally:
            if not pub.closed:  # after a close the mapping is gone
                w[W_WAIT_TARGET] = 0

    def _restarting(self, pid: int) -> bool:
        if self.spare is not None and self.spare(pid):
            return True
        return self.server is not None and self.server.restarting_from(pid)

    # --- for relays ----------------------------------------------------------------------------
    async def put_gap(self, missed: int) -> None:
        """Publish a marker that makes every reader raise ``ReaderLagged(missed)``."""
        self.pub.check_open()
        async with self.turns:
            await run(self.publish_steps((b"",), 0, False, 1, gap=missed), self._sleep)
        self.pub.lost_upstream += missed - 1  # the marker took their numbers; it is one message sent

    def set_codec(self, codec: str, schema_path: str | None) -> None:
        """The channel carries another channel's bodies as they are: say how to decode them."""
        self.handle = self.handle.model_copy(update={"codec": codec, "schema_path": schema_path})
        self.pub.seg.words[W_CODEC] = CODECS.index(codec)

    # --- the TCP server --------------------------------------------------------------------------
    def serve_tcp(self, server: ServerProcess, handle: Handle) -> None:
        self.server = server
        self.handle = handle
        # A writer dropped without closing (or left open at exit): its server drains, then stops.
        weakref.finalize(self, server.abandon)

    async def _stop_server(self, server: ServerProcess | None) -> None:
        """Stop ``server`` (handed over by ``closing``) in a thread of its own that the loop
        waits for. A cancellation that gets through the shield (asyncio's own: ``task.cancel()``,
        ``asyncio.timeout``, ``wait_for``, a failing ``TaskGroup`` sibling; no anyio shield stops
        them) ends the wait, never the stop: the stop is finished here, blocking for a bounded
        time, before the cancellation goes on (``ServerProcess.finish``)."""
        if server is None:
            return
        # Not anyio's worker: a worker that had not started the stop when the wait was cancelled
        # would never run it.
        stopper = threading.Thread(target=server.stop, name="aiobroadcast-tcp-stop", daemon=True)
        stopper.start()
        try:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(stopper.join)
        except BaseException:
            server.finish(stopper)
            raise

    # --- state ---------------------------------------------------------------------------------
    def statistics(self, tasks_waiting: int) -> WriterStatistics:
        pub = self.pub
        pub.check_open()
        server = self.server
        readers = pub.records.infos(pub.head, server.pids if server is not None else ())
        target = pub.seg.words[W_WAIT_TARGET]
        state, remote, remote_dropped, rejected = server.report() if server is not None else ("none", (), 0, 0)
        arena = self.arena
        if arena is not None:
            arena.reclaim()
            pinned = arena.pinned_bytes()
            readers = tuple(r._replace(pinned_bytes=pinned.get(r.place, 0)) for r in readers)
        return WriterStatistics(
            sent=pub.sent,
            head=pub.head,
            capacity=pub.layout.capacity,
            readers=readers + remote,
            waiting_for=tuple(r for r in readers if holds_writer(pub.head - r.lag, target)),
            tasks_waiting=tasks_waiting,
            dropped_readers=pub.records.dropped + remote_dropped,
            tcp_server=state,
            tcp_server_restarts=server.restarts if server is not None else 0,
            rejected_frames=rejected,
            tcp_server_health=server.health() if server is not None else "",
            arena_bytes=arena.data_bytes if arena is not None else 0,
            arena_used_bytes=arena.used_bytes() if arena is not None else 0,
            arena_placed=arena.placed if arena is not None else 0,
            arena_fallbacks=arena.fallbacks if arena is not None else 0,
        )

    def check_thread(self) -> None:
        """``put`` and ``aclose`` wait in the event loop of the thread that opened the writer; its
        task lock and wake-up socket cannot be shared with another thread's loop."""
        if threading.get_ident() != self.thread:
            raise BroadcastError(
                "this writer's put() and aclose() belong to the thread whose event loop opened it; "
                "from another thread use put_nowait(), or anyio.from_thread.run(writer.put, obj)"
            )

    @contextlib.contextmanager
    def closing(self, abandon: bool = False) -> Iterator[ServerProcess | None]:
        """A close, written once for both front ends: mark the ring closed (readers drain what
        was published, then ``EndOfStream``; ``abandon``: as if this process had died, then
        ``WriterGone``), and hand over the TCP server, if any, for the front end to stop (remote
        readers drain what it holds, within its drain timeout), waiting its own way: the thread
        blocks, a task waits for a thread. The files, sockets and mapping are released on every
        way out, a cancellation included: the writer is marked closed already, so a second close
        would do nothing, and what was cut short would stay in /dev/shm until the process exits."""
        if abandon:
            self.pub.abandon()
            _fork.untrack(self)
        else:
            self.mark_closed()
        server, self.server = self.server, None
        try:
            yield server
        finally:
            self.release()

    def close_blocking(self) -> None:
        """Close, from a thread (or a channel without a server yet): waits for the server here."""
        with self.closing() as server:
            if server is not None:
                server.stop()

    def mark_closed(self) -> None:
        """The first step of a close: readers drain what was published, then ``EndOfStream``."""
        self.pub.mark_closed()
        _fork.untrack(self)

    async def aclose(self) -> None:
        """Close from the writer's event loop (``closing``). A second ``aclose`` (another task's)
        returns once the first one is over."""
        if self.closed_event is not None:
            await self.closed_event.wait()
            return
        if self.pub.closed:
            return
        closed = self.closed_event = anyio.Event()
        try:
            with self.closing() as server:
                await self._stop_server(server)
        finally:
            closed.set()

    async def abandon(self) -> None:
        """Stop as if this process had died: readers drain, then get ``WriterGone``; the server
        sees the writer gone and tells remote readers."""
        if self.pub.closed:
            return
        with self.closing(abandon=True) as server:
            await self._stop_server(server)

    def release(self) -> None:
        """The last step of a close: unlink the files, close the sockets, unmap the ring."""
        self.inbox.close()
        self.pub.outbox.close()
        self._finalizer()
        atexit.unregister(self._finalizer)
        if self.arena is not None:
            self.arena.close()
        self.seg.close()

    def leave_segment(self) -> None:
        """Do not remove the segment on close, at exit or when dropped: its one reader removes it
        once it has drained it (a fan-in sender's ring, which its collector may attach after
        the sender closed). The writer's wake-up socket is still removed."""
        self._finalizer.detach()
        atexit.unregister(self._finalizer)
        self._finalizer = weakref.finalize(self, _cleanup_files, self.owner, self.inbox.path)
        atexit.register(self._finalizer)

    def _forget_in_child(self) -> None:
        """In a fork child: the channel is the parent's. Refuse every use from now on and close
        this process's copy of the TCP server's pipes (the server stops when the parent closes
        its stdin: a copy left open here would keep it serving). Nothing is removed, stored or
        woken: the parent goes on with its channel (docs/design.md, "Fork")."""
        self.pub.closed = True
        if self.arena is not None:
            self.arena.forget_in_child()
        self.pub.refusal = _fork.refusal("writer", self.owner)
        self.closed_event = None  # a close under way in the parent is not this process's to wait for
        server, self.server = self.server, None
        if server is not None:
            server.forget_in_child()


class Turns:
    """The writer's tasks take turns, first come first served. Like ``anyio.Lock``, but an
    exception of any kind thrown into a waiting task (not only a cancellation) gives its turn
    back: a turn is never left held by a task that is gone."""

    __slots__ = ("_held", "_waiters")

    def __init__(self) -> None:
        self._held = False
        self._waiters: collections.deque[anyio.Event] = collections.deque()

    def locked(self) -> bool:
        return self._held

    async def __aenter__(self) -> None:
        if not self._held:
            self._held = True
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
            self._held = False


def _cleanup_files(owner: int, *paths: str) -> None:
    if os.getpid() != owner:
        return  # a fork child exiting: the files are its parent's
    for path in paths:
        unlink_quietly(path)
