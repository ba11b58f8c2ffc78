"""The writer role."""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Generator, Sequence
from time import perf_counter_ns
from types import TracebackType
from typing import TYPE_CHECKING, Generic, NoReturn, TypeVar, final

import anyio
import anyio.lowlevel
import anyio.to_thread

from . import _fork, _ring
from ._codec import Buffer, JsonCodec, PickleEncoder, SchemaCodec
from ._exceptions import BroadcastError, ClosedResourceError, MessageTooLarge, WouldBlock
from ._handle import Handle
from ._ring import (
    BUSY,
    F_FIRST,
    F_GAP,
    F_LAST,
    F_OOB,
    R_GENERATION,
    R_NAME_LEN,
    R_PID,
    R_RECEIVED,
    SLOT_REST,
    W_CLOSED,
    W_CODEC,
    W_HEAD,
    W_NEXT_MSG,
    W_WAIT_TARGET,
    Segment,
    fence,
)
from ._stats import ReaderInfo, WriterStatistics
from ._wake import Inbox, Outbox, poll, poll_blocking

if TYPE_CHECKING:
    from ._tcp_supervisor import ServerProcess

T_contra = TypeVar("T_contra", contravariant=True)

log = logging.getLogger("aiobroadcast")

#: How often a blocked writer re-checks that the readers it waits for are alive (seconds).
LIVENESS_S = 0.5
#: A task that never has to wait yields to the event loop once every this many calls.
YIELD_EVERY = 64
#: A side that must wait (a reader for a message, a blocked writer for room) first polls the ring
#: for up to ``POLL_NS``, but only if its previous sleep was shorter than ``DENSE_NS`` (a dense
#: stream): then what it waits for usually comes within microseconds, and neither side pays a
#: wake-up. A side that waited longer (a paced or idle stream) sleeps at once and uses no CPU.
POLL_NS = 50_000
DENSE_NS = 200_000

_private = object()


@final
class Writer(Generic[T_contra]):
    """The sending end of a channel. Built by ``open_writer``; has no ``get``.

    Every attached reader receives every message in order. Under policy ``"block"`` (default)
    ``put`` waits while the slowest live reader is ``capacity`` entries behind; under ``"lag"``
    it never waits and readers that fall behind get ``ReaderLagged``.
    """

    def __init__(
        self,
        token: object,
        seg: Segment,
        handle: Handle,
        encoder: PickleEncoder | SchemaCodec | JsonCodec,
        max_message_bytes: int | None,
    ) -> None:
        if token is not _private:
            raise TypeError("Writer cannot be built directly; use aiobroadcast.open_writer()")
        self._seg = seg
        self._handle = handle
        self._encode = encoder.encode
        self._max_message_bytes = max_message_bytes
        lay = seg.layout
        self._cap = lay.capacity
        self._slot_bytes = lay.slot_bytes
        self._payload = lay.payload_bytes
        self._data = lay.data_offset
        self._block = handle.policy == "block"
        self._words = seg.words
        self._buf = seg.buf
        self._head = 0
        self._msg = 0
        self._min_cursor = 0
        self._notified = [0] * lay.max_readers
        self._waiting = seg.waiting
        self._nobody_waiting = bytes(8 * lay.max_readers)  # what the waiting words hold when no reader sleeps
        self._reader_socks = [seg.sock_path(f"r{i}") for i in range(lay.max_readers)]
        self._inbox = Inbox(seg.sock_path("w"))
        self._outbox = Outbox()
        # Two locks. `_lock` orders the tasks of the writer's event loop (a put waiting for room
        # keeps its turn). `_mutex` is held, never across an await, by whoever is writing into the
        # ring right now, from any thread; a put_nowait that cannot take it at once raises
        # WouldBlock. Encoding runs outside both: it may run user code (a __reduce__ that
        # publishes, a logging handler that broadcasts), which must find the writer usable.
        self._lock = _Turns()
        self._mutex = threading.Lock()
        self._thread = threading.get_ident()
        self._waiting_tasks = 0
        self._since_yield = 0
        self._slept_ns = DENSE_NS  # no polling before the first sleep
        self._dropped = 0
        self._aborted = 0  # message numbers used by messages cut short (their LAST never published)
        self._lost_upstream = 0  # message numbers that gap markers took beyond one each
        self._closed = False
        self._refusal: str | None = None  # why a fork child may not use it
        self._server: ServerProcess | None = None
        # The readers' sockets too: a reader that died unnoticed (never reaped) leaves its own.
        # Inherited by fork children (atexit hooks and finalizers are), so they carry our pid.
        self._owner = os.getpid()
        self._finalizer = weakref.finalize(
            self, _cleanup_files, self._owner, seg.path, self._inbox.path, *self._reader_socks
        )
        atexit.register(self._finalizer)
        _fork.track(self)

    def _serve_tcp(self, server: ServerProcess, handle: Handle) -> None:
        self._server = server
        self._handle = handle
        # A writer dropped without aclose (or left open at exit): its server drains, then stops.
        weakref.finalize(self, server.abandon)

    async def _stop_server(self) -> None:
        if self._server is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._stop_server_blocking)

    def _stop_server_blocking(self) -> None:
        """Ask the TCP server to stop once remote readers have drained, and wait for it."""
        server = self._server
        if server is None:
            return
        self._server = None
        server.stop()

    # --- public API ----------------------------------------------------------------------
    @property
    def handle(self) -> Handle:
        """What a reader needs to attach: pass it (or its JSON) to ``open_reader``."""
        return self._handle

    def put_nowait(self, obj: T_contra) -> None:
        """Publish ``obj`` now, or raise ``WouldBlock`` if a live reader would be overrun (or
        another ``put`` is in progress). Raises ``SerializationError``,
        ``pydantic.ValidationError`` or ``MessageTooLarge`` for a bad object, publishing
        nothing, and ``ClosedResourceError`` after ``aclose``."""
        self._check_open()
        if self._lock.locked():
            raise WouldBlock
        self._wake_early()
        parts, total, oob = self._encode_checked(obj)
        entries = 1 if total <= self._payload else -(-total // self._payload)
        if not self._mutex.acquire(blocking=False):
            raise WouldBlock  # another thread is writing into the ring right now
        try:
            self._check_open()
            # A task's put may have taken its turn while we encoded: it may be streaming a
            # message larger than the ring, which nothing may interleave with.
            if self._lock.locked() or (self._block and not self._room(entries)):
                raise WouldBlock
            self._publish(parts, total, oob, entries)
        finally:
            self._mutex.release()

    async def put(self, obj: T_contra) -> None:
        """Publish ``obj``, waiting for room while a live reader would be overrun.

        Cancel-safe: a cancelled ``put`` has published nothing (a message larger than the whole
        ring is streamed; if cancelled midway, readers drop the incomplete message). Raises
        like ``put_nowait``; a reader that dies while the writer waits for it is dropped within
        about a second and the ``put`` goes on.
        """
        self._check_open()
        self._check_thread()
        self._wake_early()
        parts, total, oob = self._encode_checked(obj)  # the object as it is now
        await self._put_encoded(parts, total, oob)

    async def _put_encoded(self, parts: Sequence[Buffer], total: int, oob: bool) -> None:
        entries = 1 if total <= self._payload else -(-total // self._payload)
        if not self._lock.locked() and self._try_publish(parts, total, oob, entries):
            # Fast path: room now and nobody queued. Yield to the loop now and then so that
            # a tight loop of puts does not starve other tasks. Shielded: the message is
            # published, so a cancellation here would report a published message as not sent.
            self._since_yield += 1
            if self._since_yield >= YIELD_EVERY:
                self._since_yield = 0
                await anyio.lowlevel.cancel_shielded_checkpoint()
            return
        self._waiting_tasks += 1
        try:
            async with self._lock:
                self._check_open()
                if entries <= self._cap or not self._block:
                    await self._publish_when_room(parts, total, oob, entries)
                else:
                    await self._stream(parts, total, oob, entries)
        finally:
            self._waiting_tasks -= 1

    def _try_publish(self, parts: Sequence[Buffer], total: int, oob: bool, entries: int, gap: int = 0) -> bool:
        """Publish now if no other thread is writing and there is room. No await."""
        if not self._mutex.acquire(blocking=False):
            return False
        try:
            self._check_open()  # closed by another thread, or inherited by a fork child
            if self._block and not self._room(entries):
                return False
            self._publish(parts, total, oob, entries, gap)
            return True
        finally:
            self._mutex.release()

    async def _publish_when_room(
        self, parts: Sequence[Buffer], total: int, oob: bool, entries: int, gap: int = 0
    ) -> None:
        """Wait for room (holding the task lock), then publish. Another thread's put_nowait may
        take the room or hold the mutex meanwhile: then wait again."""
        while True:
            if self._block:
                await self._wait_room(entries)
            if self._try_publish(parts, total, oob, entries, gap):
                return
            await anyio.lowlevel.checkpoint()  # the other thread's copy takes microseconds
            self._check_open()

    # --- for relays: republish bodies as they are, and gaps --------------------------------
    async def _put_raw(self, body: bytes, oob: bool) -> None:
        self._check_open()
        await self._put_encoded((body,), len(body), oob)

    async def _put_gap(self, missed: int) -> None:
        """Publish a marker that makes every reader raise ``ReaderLagged(missed)``."""
        self._check_open()
        async with self._lock:
            await self._publish_when_room((b"",), 0, False, 1, gap=missed)
        self._lost_upstream += missed - 1  # the marker took their numbers; it is one message sent

    def _relay_codec(self, codec: str, schema_path: str | None) -> None:
        """A relay's channel carries the upstream's bodies: say how to decode them."""
        self._handle = self._handle.model_copy(update={"codec": codec, "schema_path": schema_path})
        self._words[W_CODEC] = _ring.CODECS.index(codec)

    async def _abandon(self) -> None:
        """Stop as if this process had died: readers drain, then get ``WriterGone``."""
        if self._closed:
            return
        self._check_thread()
        with self._mutex:  # no other thread is writing into the ring from here on
            self._closed = True
        _ring.unlock(self._seg.fd, _ring.WRITER_LOCK_BYTE)
        _fork.untrack(self)
        self._wake_all_readers()  # sleepers find the lock free on waking
        await self._stop_server()  # it sees the writer gone and tells remote readers
        self._release()

    def statistics(self) -> WriterStatistics:
        self._check_open()
        readers = self._readers()
        target = self._words[W_WAIT_TARGET]
        waiting_for = tuple(r for r in readers if _ring.holds_writer(self._head - r.lag, target))
        server = self._server
        remote, remote_dropped, rejected = server.report() if server is not None else ((), 0, 0)
        return WriterStatistics(
            sent=self._msg - self._aborted - self._lost_upstream,
            head=self._head,
            capacity=self._cap,
            readers=readers + remote,
            waiting_for=waiting_for,
            tasks_waiting=self._waiting_tasks,
            dropped_readers=self._dropped + remote_dropped,
            tcp_server=server.state if server is not None else "none",
            tcp_server_restarts=server.restarts if server is not None else 0,
            rejected_frames=rejected,
        )

    async def aclose(self) -> None:
        """Close the channel: readers receive what was published, then ``EndOfStream``.
        The segment is removed now; readers already attached keep their mapping. In a fork child
        of the writer's process it does nothing: the channel is the parent's."""
        if self._closed:
            return
        self._check_thread()
        self._mark_closed()
        # Remote readers drain what the TCP server holds, within its drain timeout.
        await self._stop_server()
        self._release()

    async def __aenter__(self) -> Writer[T_contra]:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"sent={self._msg}"
        return f"<aiobroadcast.Writer {self._handle.name} {self._handle.policy} {state}>"

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1, source=self)

    def __reduce__(self) -> NoReturn:
        raise BroadcastError(
            "a Writer cannot be pickled or sent to another process: send writer.handle (or its JSON) "
            "and open_reader there"
        )

    def _forget_in_child(self) -> None:
        """In a fork child: this writer is the parent's. Refuse every use from now on and close
        this process's copy of the TCP server's pipes (the server stops when the parent closes
        its stdin: a copy left open here would keep it serving). Nothing is removed, stored or
        woken: the parent goes on with its channel (docs/design.md, "Fork")."""
        self._closed = True
        self._refusal = _fork.refusal("writer", self._owner)
        server = self._server
        self._server = None
        if server is not None:
            server.forget_in_child()

    # --- internals -----------------------------------------------------------------------
    def _mark_closed(self) -> None:
        """The first step of a close: readers drain what was published, then ``EndOfStream``."""
        with self._mutex:  # no other thread is writing into the ring from here on
            self._closed = True
        _fork.untrack(self)
        self._words[W_CLOSED] = 1
        self._wake_all_readers()

    def _release(self) -> None:
        """The last step of a close: unlink the files, close the sockets, unmap the ring."""
        self._inbox.close()
        self._outbox.close()
        self._finalizer()
        atexit.unregister(self._finalizer)
        self._seg.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedResourceError(self._refusal or "this writer is closed")

    def _check_thread(self) -> None:
        """``put`` and ``aclose`` wait in the event loop of the thread that opened the writer; its
        task lock and wake-up socket cannot be shared with another thread's loop."""
        if threading.get_ident() != self._thread:
            raise BroadcastError(
                "this writer's put() and aclose() belong to the thread whose event loop opened it; "
                "from another thread use put_nowait(), or anyio.from_thread.run(writer.put, obj)"
            )

    def _encode_checked(self, obj: object) -> tuple[Sequence[Buffer], int, bool]:
        parts, total, oob = self._encode(obj)
        if self._max_message_bytes is not None and total > self._max_message_bytes:
            raise MessageTooLarge(total, self._max_message_bytes)
        return parts, total, oob

    def _rescan(self) -> None:
        """Recompute the slowest active reader's cursor (docs/design.md, joining)."""
        fence()
        m = self._head
        for active, cursor in zip(self._seg.rec_active.tolist(), self._seg.rec_cursor.tolist(), strict=True):
            if active and cursor < m:
                m = cursor
        self._min_cursor = m

    def _room(self, entries: int) -> bool:
        if _ring.has_room(self._head, self._min_cursor, entries, self._cap):
            return True
        self._rescan()
        return _ring.has_room(self._head, self._min_cursor, entries, self._cap)

    async def _wait_room(self, entries: int) -> None:
        if self._room(entries):
            return
        if self._slept_ns < DENSE_NS and await self._poll_room(entries):
            return
        steps = self._room_steps(entries)
        try:
            limit = next(steps, None)
            while limit is not None:
                try:
                    woken = await self._inbox.wait(limit)
                except anyio.ClosedResourceError:
                    woken = False  # aclose() meanwhile: _check_open raises
                limit = _resume(steps, woken)
        finally:
            steps.close()

    def _wait_room_blocking(self, entries: int, sleep: Callable[[float], bool]) -> None:
        """``_wait_room`` for a thread without an event loop (the blocking writer).
        ``sleep(limit)`` blocks on the inbox for up to ``limit`` seconds and says whether a
        wake-up came; it may raise instead (a deadline passed, the writer is closing)."""
        if self._room(entries):
            return
        if self._slept_ns < DENSE_NS and poll_blocking(lambda: self._room(entries), POLL_NS):
            self._slept_ns = 0
            return
        steps = self._room_steps(entries)
        try:
            limit = next(steps, None)
            while limit is not None:
                limit = _resume(steps, sleep(limit))
        finally:
            steps.close()

    def _room_steps(self, entries: int) -> Generator[float, bool, None]:
        """The wait for room once polling is over, written once for both drivers (async and
        blocking): yields how long to sleep on the inbox, and is sent whether a wake-up came.
        Returns once the slowest live reader made room. The driver must close it."""
        w = self._words
        # Hysteresis: a full ring makes the writer wait for a quarter of it to be free, not for
        # one slot, so a writer faster than its slowest reader sleeps and is woken once per
        # capacity/4 entries instead of once per entry (each wake-up costs the reader a system
        # call and the writer a trip through its event loop).
        slack = min(self._cap - entries, self._cap // 4)
        target = _ring.wait_target(self._head, entries + slack, self._cap)
        try:
            while True:
                w[W_WAIT_TARGET] = target
                self._rescan()  # re-check after announcing (the rescan fences)
                if self._min_cursor >= target:
                    return
                start = perf_counter_ns()
                woken = yield LIVENESS_S
                self._slept_ns = perf_counter_ns() - start
                self._check_open()
                if not woken:
                    self._reap(target)
        finally:
            if not self._closed:  # after aclose the mapping is gone
                w[W_WAIT_TARGET] = 0

    async def _poll_room(self, entries: int) -> bool:
        """Poll for room for up to ``POLL_NS`` (readers on a busy host get the CPU between
        rounds to make it). True if room came; raises if the writer is closed meanwhile."""

        def room() -> bool:
            self._check_open()
            return self._room(entries)

        if await poll(room, POLL_NS):
            self._slept_ns = 0
            return True
        return False

    def _reap(self, target: int) -> None:
        """Drop readers that hold the writer back and whose process is gone."""
        seg = self._seg
        fd = seg.fd
        for i, (active, cursor) in enumerate(zip(seg.rec_active.tolist(), seg.rec_cursor.tolist(), strict=True)):
            if not active or cursor >= target:
                continue
            if self._server is not None and self._server.restarting_from(self._words[seg.layout.record_word(i, R_PID)]):
                continue  # the TCP server died: the one starting now takes its place over
            byte = _ring.reader_lock_byte(i)
            if not _ring.try_lock(fd, byte):
                continue  # alive: it holds its lock
            try:
                name = seg.read_name(i)
                pid = self._words[seg.layout.record_word(i, R_PID)]
                host = seg.read_host(i)
                seg.rec_active[i] = 0
                seg.waiting[i] = 0
                _ring._unlink_quiet(self._reader_socks[i])
                self._outbox.forget(self._reader_socks[i])
            finally:
                _ring.unlock(fd, byte)
            self._dropped += 1
            log.warning(
                "aiobroadcast: reader %r (pid %d on %s, place %d) died at entry %d of %d; dropped it",
                name,
                pid,
                host or "?",
                i,
                cursor,
                self._head,
            )

    def _publish(self, parts: Sequence[Buffer], total: int, oob: bool, entries: int, gap: int = 0) -> None:
        """Write a whole message into ``entries`` free slots and publish it. No await."""
        try:
            self._write_message(parts, total, oob, entries, gap)
        except BaseException:
            # A KeyboardInterrupt (or any exception a signal handler raises) can land between any
            # two bytecodes of the copy. Readers go by the slots' seq words: whatever was
            # committed before the interrupt is seen, so the writer's own counters must follow.
            self._recover()
            raise

    def _recover(self) -> None:
        """Bring ``head`` and the message number up to the entries whose seq word was stored.

        Before the commit of a one-slot message nothing was stored: nothing is published. After
        it (a few bytecodes of bookkeeping), the message is published whole: readers may have it
        already. Fragments of a larger message that were committed stay, without their LAST:
        readers drop them at the next FIRST fragment, as for a cancelled streamed message."""
        w = self._words
        head = self._head
        msg = self._msg
        whole = True
        while w[self._data + (head % self._cap) * self._slot_bytes >> 3] == head:
            at = self._data + (head % self._cap) * self._slot_bytes + 8
            number, _length, flags, _total = SLOT_REST.unpack_from(self._buf, at)
            msg = number + 1
            whole = bool(flags & F_LAST)
            head += 1
        if head == self._head and w[W_HEAD] == head:
            return
        if not whole:
            self._aborted += 1  # its number is used, but no reader delivers it
        self._head = head
        self._msg = max(self._msg, msg)
        w[W_NEXT_MSG] = self._msg
        w[W_HEAD] = head
        self._wake_all_readers()

    def _write_message(self, parts: Sequence[Buffer], total: int, oob: bool, entries: int, gap: int) -> None:
        w = self._words
        buf = self._buf
        msg = self._msg
        seq = self._head
        base_flags = F_OOB if oob else 0
        if entries == 1:
            off = self._data + (seq % self._cap) * self._slot_bytes
            if not self._block:
                w[off >> 3] = BUSY
            if len(parts) == 1:
                buf[off + 32 : off + 32 + total] = parts[0]
            else:  # pickle frames around a large payload, or out-of-band parts: byte buffers
                at = off + 32
                for part in parts:
                    end = at + len(part)
                    buf[at:end] = part
                    at = end
            if gap:
                SLOT_REST.pack_into(buf, off + 8, msg, 0, F_FIRST | F_LAST | F_GAP, gap)
            else:
                SLOT_REST.pack_into(buf, off + 8, msg, total, base_flags | F_FIRST | F_LAST, total)
            w[off >> 3] = seq
            seq += 1
        else:
            seq = self._write_fragments(_Chunks(parts), total, base_flags, seq, entries, first=True)
        # A gap marker takes the numbers of the messages it stands for, so a message's number is
        # the same for every reader, local or remote, relayed or not (docs/design.md).
        self._msg = msg + (gap or 1)
        w[W_NEXT_MSG] = self._msg
        self._head = seq
        w[W_HEAD] = seq
        self._wake_readers()

    def _write_fragments(
        self, chunks: _Chunks, total: int, base_flags: int, seq: int, count: int, *, first: bool
    ) -> int:
        w = self._words
        buf = self._buf
        msg = self._msg
        payload = self._payload
        for k in range(count):
            off = self._data + (seq % self._cap) * self._slot_bytes
            if not self._block:
                w[off >> 3] = BUSY
            n = chunks.copy_into(buf, off + 32, payload)
            flags = base_flags
            if first and k == 0:
                flags |= F_FIRST
            if chunks.done:
                flags |= F_LAST
            SLOT_REST.pack_into(buf, off + 8, msg, n, flags, total)
            w[off >> 3] = seq
            seq += 1
        return seq

    async def _stream(self, parts: Sequence[Buffer], total: int, oob: bool, entries: int) -> None:
        """Publish a message larger than the ring, a few slots at a time."""
        chunks = _Chunks(parts)
        msg = self._msg
        try:
            while not chunks.done:
                await self._wait_room(1)
                if not self._stream_some(chunks, total, oob, msg):
                    await anyio.lowlevel.checkpoint()  # another thread is finishing a put_nowait
                    self._check_open()
        finally:
            self._end_stream(chunks, msg)

    def _stream_some(self, chunks: _Chunks, total: int, oob: bool, msg: int) -> bool:
        """Publish the next fragments of streamed message ``msg`` into the room there is now.
        False if another thread holds the mutex (the caller holds the writer's turn, so no other
        put starts now; one may still be finishing): wait a moment and call again."""
        if not self._mutex.acquire(blocking=False):
            return False
        try:
            self._check_open()
            free = self._cap - (self._head - self._min_cursor)  # that other put may have taken some
            n = min(free, -(-(total - chunks.pos) // self._payload))
            if n <= 0:
                return True
            first = chunks.pos == 0
            self._head = self._write_fragments(chunks, total, F_OOB if oob else 0, self._head, n, first=first)
            if first:
                self._words[W_NEXT_MSG] = msg + 1
            self._words[W_HEAD] = self._head
            self._wake_readers()
            return True
        except BaseException:
            self._recover()
            raise
        finally:
            self._mutex.release()

    def _end_stream(self, chunks: _Chunks, msg: int) -> None:
        """After a streamed message, whole or cut short (cancelled, interrupted, timed out) once
        its FIRST fragment went out: its number is used either way (readers drop a message whose
        LAST never comes, and it does not count as sent)."""
        if chunks.pos and self._msg == msg:
            self._msg = msg + 1
            if not chunks.done:
                self._aborted += 1

    def _wake_all_readers(self) -> None:
        """Wake every attached reader, asleep or not, after a change they must see (closed, gone)."""
        fence()
        lay = self._seg.layout
        for i, active in enumerate(self._seg.rec_active.tolist()):
            if active:
                self._outbox.wake(self._reader_socks[i], self._words[lay.record_word(i, R_GENERATION)])

    def _wake_early(self) -> None:
        """A put begins: wake the readers asleep now, before the message is encoded and published.

        A wake-up takes tens of microseconds to land (the reader's CPU may have to be woken
        first), more than encoding and publishing a small message: sent first, it overlaps them
        instead of following them. A reader that wakes before the message is in the ring waits
        for it polling, briefly (``Reader._wait``). No fence: the wake-up after publishing
        (``_wake_readers``) remains the one that no sleep can miss; it skips the sleeps woken
        here and wakes those that began since."""
        if self._waiting.tobytes() != self._nobody_waiting:
            self._wake_readers()

    def _wake_readers(self) -> None:
        """Wake the readers that announced they sleep (and only once per sleep)."""
        fence()
        waiting = self._waiting
        if waiting.tobytes() == self._nobody_waiting:  # the usual case of a dense stream: cheap
            return
        notified = self._notified
        for i, episode in enumerate(waiting.tolist()):
            if episode and episode != notified[i]:
                notified[i] = episode
                # An episode carries its reader's generation in its high half (see
                # ShmSource._join): the outbox connects again when the place changed hands.
                self._outbox.wake(self._reader_socks[i], episode >> 32)

    def _readers(self) -> tuple[ReaderInfo, ...]:
        seg = self._seg
        lay = seg.layout
        w = self._words
        out = []
        server_pids = self._server.pids if self._server is not None else set()
        for i, (active, cursor) in enumerate(zip(seg.rec_active.tolist(), seg.rec_cursor.tolist(), strict=True)):
            if not active or (not w[lay.record_word(i, R_NAME_LEN)] and not w[lay.record_word(i, R_PID)]):
                continue
            pid = w[lay.record_word(i, R_PID)]
            out.append(
                ReaderInfo(
                    place=i,
                    name=seg.read_name(i),
                    pid=pid,
                    received=w[lay.record_word(i, R_RECEIVED)],
                    lag=max(0, self._head - cursor),
                    sleeping=bool(seg.waiting[i]),
                    transport="tcp-server" if pid in server_pids else "shm",
                    host=seg.read_host(i),
                )
            )
        return tuple(out)


class _Turns:
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


class _Chunks:
    """Walks a list of buffers, copying them into consecutive slots."""

    def __init__(self, parts: Sequence[Buffer]) -> None:
        self._parts = [memoryview(p).cast("B") for p in parts]
        self._i = 0
        self._off = 0
        self.pos = 0
        self.done = not any(p.nbytes for p in self._parts)

    def copy_into(self, buf: memoryview, at: int, room: int) -> int:
        written = 0
        parts = self._parts
        while room and self._i < len(parts):
            part = parts[self._i]
            n = min(room, part.nbytes - self._off)
            buf[at + written : at + written + n] = part[self._off : self._off + n]
            written += n
            room -= n
            self._off += n
            if self._off == part.nbytes:
                self._i += 1
                self._off = 0
        self.pos += written
        self.done = self._i >= len(parts)
        return written


def _resume(steps: Generator[float, bool, None], woken: bool) -> float | None:
    """Send a wake-up result into ``_room_steps``: the next sleep, or None once there is room."""
    try:
        return steps.send(woken)
    except StopIteration:
        return None


def _cleanup_files(owner: int, *paths: str) -> None:
    if os.getpid() != owner:
        return  # a fork child exiting: the files are its parent's
    for path in paths:
        _ring._unlink_quiet(path)
