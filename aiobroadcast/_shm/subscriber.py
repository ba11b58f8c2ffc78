"""A reader's shared-memory side: joining the ring, taking entries, sleeping."""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from .. import _tuning
from .._exceptions import (
    DeserializationError,
    EndOfStream,
    ReaderLagged,
    WouldBlock,
    WriterGone,
)
from .._handle import Handle
from .._stats import ReaderStatistics
from . import segment as _segment
from .arena import ArenaReader
from .atomic import fence_acquire
from .layout import (
    BUSY,
    EMPTY,
    F_FIRST,
    F_GAP,
    F_LAST,
    F_OOB,
    F_WHOLE,
    SLOT_HEADER_BYTES,
    SLOT_REST,
    SLOT_REST_OFFSET,
    W_CLOSED,
    W_HEAD,
    W_WAIT_TARGET,
    W_WRITER_PID,
    crossed,
    fence,
)
from .place import ReaderPlace
from .segment import Segment
from .wake import Inbox, Outbox

_NOTHING: Any = object()  # what _take_ahead returns when the next entry is not a whole message

Decoder = Callable[[memoryview | bytes | bytearray, bool], Any]


class ShmSource:
    """Takes entries from the ring for one reader place. Used by one ``Reader``; only one task
    at a time calls ``sleep``."""

    def __init__(
        self,
        seg: Segment,
        handle: Handle,
        name: str,
        decode: Decoder,
        *,
        hold: bool = False,
        take_over: int | None = None,
        inbox: bool = True,
        reserved: bool = False,
        take_ahead: int | None = None,
    ) -> None:
        """``take_over``: the pid of a dead reader whose place to take, cursor and all, if the
        writer has not dropped it yet (policy "block" only; see ``_take_over``). ``inbox=False``:
        no wake-up socket of its own (a fan-in collector's ring: the collector sleeps with
        ``announce_sleep``/``retract_sleep`` on its one inbox instead of ``sleep``); ``reserved``:
        ``take_over`` names the place a fan-in sender reserved for its collector (see
        ``ReaderPlace.join``). ``take_ahead``: at most how many messages ``_take_ahead`` takes
        at once (``None``: ``_tuning.AHEAD_MESSAGES``, read at each take)."""
        self._seg = seg
        self._handle = handle
        self._name = name
        self._decode = decode
        lay = seg.layout
        self._cap = lay.capacity
        self._slot_offset = lay.slot_offset  # the layout's function: called per message
        self._block = handle.policy == "block"
        # Zero-copy reads: a delivered message may be a view of its slot, so the slot is released
        # only at the next get_nowait (or close). Under policy "lag" the body is copied out of the
        # ring anyway (the seqlock read), so there is nothing to hold.
        self._hold_slot = hold and self._block
        self._held = False
        self._words = seg.words
        self._buf = seg.buf
        self._cursor = 0
        self._next_msg = 0
        self._received = 0
        self._lagged_total = 0
        self._partial: bytearray | None = None
        self._partial_msg = -1
        self._partial_fill = 0
        self._partial_flags = 0
        # A message taken out of the ring whose decoding was interrupted (Ctrl-C, SystemExit,
        # a cancellation raised inside __setstate__): the next get_nowait decodes it again.
        self._pending: tuple[int, bytearray, int] | None = None
        self._writer_gone = False
        self._closed = True
        #: Messages taken out of the ring and decoded ahead of their ``get_nowait``, in order
        #: (``_take_ahead``); ``Reader`` hands them out first. Policy "block" without zero-copy
        #: holds only: under "lag" every body is copied out under the seqlock one at a time, and
        #: a zero-copy message must keep its slot until the next get.
        self.ahead: deque[Any] = deque()
        self._ahead_ok = self._block and not self._hold_slot
        self._ahead_max = take_ahead
        #: A message ``_take_ahead`` found undecodable after others (entry, message number, the
        #: error): still in the ring, reported by the get after those others.
        self._failed: tuple[int, int, Exception] | None = None
        self.arena: ArenaReader | None = None
        self._outbox = Outbox()
        self._place = place = ReaderPlace(seg, handle.name, name, self._block, self._outbox)
        try:
            self._cursor, self._next_msg = place.join(take_over, inbox, reserved)
        except BaseException:
            self._outbox.close()  # else its socket leaks (ResourceWarning) on TooManyReaders etc.
            raise
        # The place's words and sockets, as attributes: the paths per message read them.
        self._inbox: Inbox | None = place.inbox
        self._cur_word = place.cur_word
        self._recv_word = place.recv_word
        self._wait_word = place.wait_word
        self._episode = place.episode
        self._writer_sock = place.writer_sock
        self._closed = False

    def attach_arena(self, path: str, views: bool) -> None:
        """Decode the channel's arena bodies (docs/design.md, "The arena"): as views that pin their
        record for as long as they live (``views``), else as copies."""
        self.arena = ArenaReader(path, self._place.index)
        self._decode = self.arena.decoder(self._decode, views)

    # --- what Reader calls -------------------------------------------------------------
    def get_nowait(self) -> Any:
        """Take the next message or raise (see ``Reader.get_nowait``)."""
        ahead = self.ahead
        if ahead:
            return ahead.popleft()
        if self._held:
            self._release()
        if self._pending is not None:
            return self._deliver_assembled(*self._pending)
        if self._ahead_ok and self._partial is None:
            obj = self._take_ahead()
            if obj is not _NOTHING:
                return obj
        w = self._words
        buf = self._buf
        while True:
            c = self._cursor
            off = self._slot_offset(c)
            seq = w[off >> 3]
            if seq != c:
                self._not_ready(c, seq)  # raises, or returns after resynchronising
                continue
            msg, flen, flags, total = SLOT_REST.unpack_from(buf, off + SLOT_REST_OFFSET)
            at = off + SLOT_HEADER_BYTES  # the payload
            if flags & F_WHOLE == F_WHOLE and self._partial is None:
                if flags & F_GAP:  # a relay lost messages upstream
                    if not self._block:  # the header may be torn: re-check after reading it
                        fence_acquire()
                        if w[off >> 3] != c:
                            continue
                    self._moved(c, c + 1, 0)
                    self._next_msg = msg + total  # the lost messages have their numbers
                    self._lagged_total += total
                    raise ReaderLagged(total)
                if self._block:
                    body: memoryview | bytes = buf[at : at + flen]
                else:
                    body = bytes(buf[at : at + flen])
                    fence_acquire()  # the copy's loads before the re-check (docs/design.md, step 6)
                    if w[off >> 3] != c:  # overwritten while we copied
                        continue
                # The one-slot message, written out: what ``_deliver`` and ``_take`` do.
                try:
                    obj = self._decode(body, flags & F_OOB != 0)
                except Exception as exc:
                    self._next_msg = msg + 1
                    self._take(c)  # consumed: the next get returns the next message
                    raise DeserializationError(msg, exc) from exc
                # Any other BaseException propagates before the take: the entry stays in the ring.
                self._next_msg = msg + 1
                if self._hold_slot:
                    self._hold(c)
                    return obj
                self._moved(c, c + 1, 1)
                return obj
            # A fragment of a larger message. Under policy "lag" the header may be torn (the
            # writer zeroes it before filling it in): check that the entry is still ours before
            # acting on it, and again after copying its payload.
            if not self._block:
                fence_acquire()
                if w[off >> 3] != c:
                    continue
            if flags & F_FIRST:
                self._partial = bytearray(total)
                self._partial_msg = msg
                self._partial_fill = 0
                self._partial_flags = flags
                self._next_msg = msg
            elif self._partial is None or msg != self._partial_msg:
                self._moved(c, c + 1, 0)  # the rest of a message we joined or lagged in the middle of
                continue
            partial = self._partial
            assert partial is not None
            fill = self._partial_fill
            partial[fill : fill + flen] = buf[at : at + flen]
            if not self._block:
                fence_acquire()
                if w[off >> 3] != c:
                    continue
            self._partial_fill = fill + flen
            self._moved(c, c + 1, 0)
            if flags & F_LAST:
                self._partial = None
                return self._deliver_assembled(msg, partial, self._partial_flags & F_OOB)

    def _take_ahead(self) -> Any:
        """Take the next message and the whole one-slot messages ready after it, up to
        ``take_ahead`` (default ``AHEAD_MESSAGES``) and about ``AHEAD_BYTES``: the first is returned,
        the others queued in ``ahead``, decoded. ``_NOTHING`` if the next entry is not a whole message ready now
        (``get_nowait``'s general path then decides).

        Nothing is taken until every one of them is decoded: a ``BaseException`` from decoding
        (Ctrl-C, SystemExit, a cancellation raised in ``__setstate__``) leaves them all in the
        ring for the next get. An undecodable message is consumed and raises
        ``DeserializationError`` when it comes first; after others, it stays in the ring and the
        get after them reports it (``_failed``), so it is decoded once."""
        w = self._words
        buf = self._buf
        c0 = c = self._cursor
        failed = self._failed
        if failed is not None:
            self._failed = None
            _entry, msg, exc = failed
            self._next_msg = msg + 1
            self._moved(c, c + 1, 1)
            raise DeserializationError(msg, exc) from exc
        slot_offset = self._slot_offset
        off = slot_offset(c)
        if w[off >> 3] != c:
            return _NOTHING
        msg, flen, flags, _total = SLOT_REST.unpack_from(buf, off + SLOT_REST_OFFSET)
        if flags & (F_WHOLE | F_GAP) != F_WHOLE:
            return _NOTHING  # a fragment, or a relay's gap marker
        decode = self._decode
        try:
            at = off + SLOT_HEADER_BYTES
            first = decode(buf[at : at + flen], flags & F_OOB != 0)
        except Exception as exc:
            self._next_msg = msg + 1
            self._moved(c, c + 1, 1)  # consumed: the next get returns the next message
            raise DeserializationError(msg, exc) from exc
        c += 1
        more = []
        limit = c0 + (self._ahead_max or _tuning.AHEAD_MESSAGES)
        budget = _tuning.AHEAD_BYTES - flen
        while c < limit and budget > 0:
            off = slot_offset(c)
            if w[off >> 3] != c:
                break
            number, flen, flags, _total = SLOT_REST.unpack_from(buf, off + SLOT_REST_OFFSET)
            if flags & (F_WHOLE | F_GAP) != F_WHOLE:
                break
            try:
                at = off + SLOT_HEADER_BYTES
                more.append(decode(buf[at : at + flen], flags & F_OOB != 0))
            except Exception as exc:
                self._failed = (c, number, exc)
                break
            msg = number
            budget -= flen
            c += 1
        # Taken: entries c0 .. c-1, with one store of the cursor and one look at the writer.
        self._next_msg = msg + 1
        if more:
            self.ahead.extend(more)
        self._moved(c0, c, c - c0)
        return first

    def statistics(self, tasks_waiting: int) -> ReaderStatistics:
        w = self._words
        waiting = len(self.ahead)  # taken out of the ring, not handed out yet
        return ReaderStatistics(
            name=self._name,
            place=self._place.index,
            received=self._received - waiting,
            lagged=self._lagged_total,
            lag=max(0, w[W_HEAD] - self._cursor) + waiting,
            tasks_waiting=tasks_waiting,
            writer_pid=w[W_WRITER_PID],
            writer_closed=bool(w[W_CLOSED]),
        )

    def describe(self) -> str:
        return f"{self._handle.name} place={self._place.index} received={self._received - len(self.ahead)}"

    def close(self) -> None:
        """Leave the ring: the writer stops waiting for this place at once."""
        if self._closed:
            return
        self._closed = True
        if self.arena is not None:
            self.arena.close()  # its pins first: the place is still this reader's
        self._place.leave()
        self._outbox.close()
        self._seg.close()

    # --- internals -----------------------------------------------------------------------
    def _deliver(self, msg: int, body: memoryview | bytes | bytearray, oob: int) -> Any:
        """Decode message ``msg``. ``Exception`` becomes ``DeserializationError`` (the message
        counts as taken); any other ``BaseException`` propagates with nothing taken."""
        try:
            obj = self._decode(body, bool(oob))
        except Exception as exc:
            self._next_msg = msg + 1
            raise DeserializationError(msg, exc) from exc
        self._next_msg = msg + 1
        return obj

    def _take(self, c: int) -> None:
        """Entry ``c`` (a whole message) is delivered: release its slot, or hold it (zero-copy)."""
        if self._hold_slot:
            self._hold(c)
        else:
            self._moved(c, c + 1, 1)

    def _deliver_assembled(self, msg: int, body: bytearray, oob: int) -> Any:
        """Deliver a message assembled from fragments (already released from the ring). Kept as
        ``_pending`` until it is delivered or found undecodable."""
        self._pending = (msg, body, oob)
        try:
            obj = self._deliver(msg, body, oob)
        except DeserializationError:
            self._pending = None
            self._count_delivery()
            raise
        self._pending = None
        self._count_delivery()
        return obj

    def _count_delivery(self) -> None:
        self._received += 1
        self._words[self._recv_word] = self._received

    def _moved(self, old: int, new: int, delivered: int) -> None:
        """Release entries ``old .. new-1``, of which ``delivered`` messages were handed out: store
        the cursor (and the count), fence, and wake the writer if this move reached the room it
        waits for (``crossed``). The one place a reader gives slots back (docs/design.md,
        "Memory ordering", steps 3 and 5)."""
        w = self._words
        self._cursor = new
        w[self._cur_word] = new
        if delivered:
            self._received = received = self._received + delivered
            w[self._recv_word] = received
        if self._block:
            fence()
            target = w[W_WAIT_TARGET]
            if target and crossed(old, new, target):
                self._outbox.wake(self._writer_sock)

    def _hold(self, c: int) -> None:
        """Take entry ``c`` but keep its slot: the shared cursor stays at ``c``, so the writer does
        not reuse the slot while the message handed out has views of it (zero-copy reads)."""
        self._cursor = c + 1
        self._held = True
        self._received += 1
        self._words[self._recv_word] = self._received

    def _release(self) -> None:
        """Give back the slot ``_hold`` kept, as ``_moved`` would have."""
        self._held = False
        self._cursor -= 1
        self._moved(self._cursor, self._cursor + 1, 0)

    def _not_ready(self, c: int, seq: int) -> None:
        """Entry ``c`` is not in its slot: raise what that means, or resynchronise and return."""
        w = self._words
        if (seq != EMPTY and seq != BUSY and seq > c) or (not self._block and w[W_HEAD] - c >= self._cap):
            self._resync_after_lag(c)
            return
        if w[W_CLOSED] or self._writer_gone:
            # The writer stored every entry before `closed`; look once more now that we saw it.
            if w[self._slot_offset(c) >> 3] == c:
                return
            self._partial = None
            if w[W_CLOSED]:
                raise EndOfStream
            raise WriterGone(w[W_WRITER_PID])
        raise WouldBlock

    def _resync_after_lag(self, c: int) -> None:
        """Policy "lag": the writer overwrote entries we had not read. Skip to the oldest
        entry still held and report exactly how many messages were lost (docs/design.md,
        "Catching up after a lag").

        The count comes only from the header of an intact entry, read under the seqlock. ``head``
        only says where to start looking: it may be stale by the time the slots are read, and
        ``next_msg`` (which the writer stores just before ``head``) cannot be paired with it, so
        neither bounds the search nor gives the count.
        """
        w = self._words
        e, first_kept = oldest_intact(w, self._buf, self._slot_offset, max(c, w[W_HEAD] - self._cap))
        if e == c:
            # The head we loaded was a full ring ahead, but entry c is intact (the writer had not
            # started to overwrite it). Nothing was lost: read it.
            return
        missed = first_kept - self._next_msg
        self._partial = None
        self._cursor = e
        w[self._cur_word] = e
        if missed <= 0:
            # Only fragments of a message already given up (counted, or begun before we joined).
            return
        self._next_msg = first_kept
        self._lagged_total += missed
        raise ReaderLagged(missed)

    def ready(self) -> bool:
        """Whether ``get_nowait`` would do anything but raise ``WouldBlock``."""
        w = self._words
        c = self._cursor
        seq = w[self._slot_offset(c) >> 3]
        return (
            seq == c
            or bool(self.ahead)
            or (seq != EMPTY and seq != BUSY and seq > c)
            or self._pending is not None
            or bool(w[W_CLOSED])
            or self._writer_gone
        )

    def sleep(self, limit_s: float) -> Awaitable[bool]:
        """A task's wait for a wake-up on this reader's inbox, for up to ``limit_s`` (the wait of
        ``_reader.sleep_steps``, which announces the sleep and re-checks the ring first). True if
        one came (the writer wakes sleepers as a put begins: the message may be a few
        microseconds from the ring). Raises ``anyio.ClosedResourceError`` once closed."""
        assert self._inbox is not None
        return self._inbox.wait(limit_s)

    def begin_sleep(self) -> bool:
        """Announce that this reader sleeps. True if it need not: the ring changed meanwhile
        (then the sleep is already over)."""
        self._episode += 1
        self._words[self._wait_word] = self._episode
        fence()
        if self.ready():
            self._words[self._wait_word] = 0
            return True
        return False

    def announce_sleep(self) -> None:
        """Store a new sleep number in this place's waiting word, without the fence and the
        re-check of ``begin_sleep``: a collector announces on all its rings, fences once, then
        re-checks them all (docs/fan-in.md)."""
        self._episode += 1
        self._words[self._wait_word] = self._episode

    def retract_sleep(self) -> None:
        """The sleep announced by ``announce_sleep`` is over."""
        if not self._closed:
            self._words[self._wait_word] = 0

    def check_writer(self) -> bool:
        """Whether the writer is gone with nothing left to read: then the next ``get_nowait``
        raises ``WriterGone`` (after what was published). One system call: call it rarely."""
        if not self._closed and not self.ready() and not _segment.is_locked(self._seg.fd, _segment.WRITER_LOCK_BYTE):
            self._writer_gone = True
        return self._writer_gone

    def end_sleep(self, woken: bool) -> None:
        """End a sleep begun with ``begin_sleep``. ``woken``: a datagram arrived. If the ring has
        nothing new (a timeout, the writer's pidfd, or a wake-up with nothing to read, as from a
        writer that stops without closing), the writer's lock is checked."""
        if self._closed:
            return
        self._words[self._wait_word] = 0
        if not self.ready() and not _segment.is_locked(self._seg.fd, _segment.WRITER_LOCK_BYTE):
            self._writer_gone = True

    @property
    def sleep_limit_s(self) -> float:
        """How long one sleep lasts at most before the writer's liveness is checked."""
        assert self._inbox is not None
        return _tuning.LIVENESS_S if self._inbox.watch is None else _tuning.WATCHED_LIVENESS_S

    def interrupt(self) -> None:
        """Wake this reader's sleeper (from another thread): it looks at the ring again."""
        if self._inbox is not None:
            self._outbox.wake(self._inbox.path)

    @property
    def next_msg(self) -> int:
        """The number of the next message this reader expects: one more than the message just
        delivered, or the first kept after a ``ReaderLagged``."""
        return self._next_msg

    @property
    def inbox_fd(self) -> int:
        """The file descriptor a sleeper polls (for callers outside an event loop)."""
        assert self._inbox is not None
        return self._inbox.fileno()

    def drain_inbox(self) -> bool:
        assert self._inbox is not None
        return self._inbox.drain()


def oldest_intact(w: Any, buf: memoryview, slot_offset: Callable[[int], int], e: int) -> tuple[int, int]:
    """The first entry from ``e`` on that is intact in its slot, read under the seqlock, and the
    number of the first message whose start it holds (policy "lag", after a reader was lapped).

    ``e`` must have been published before the caller loaded it (true of ``head - capacity``,
    below the head it loaded). Entries before ``head - capacity`` are overwritten (or being
    overwritten) for sure, so that is where the caller starts."""
    while True:
        # Entry e was published before this load (true of the first e; and we pass e only after
        # seeing its slot reused, which the writer does after publishing e+1). So its slot holds
        # e, or a later entry, or BUSY for one.
        off = slot_offset(e)
        if w[off >> 3] == e:
            msg, _flen, flags, _total = SLOT_REST.unpack_from(buf, off + SLOT_REST_OFFSET)
            fence_acquire()
            if w[off >> 3] == e:  # the header was read whole: the entry was not being rewritten
                return e, msg if flags & F_FIRST else msg + 1
        else:
            e += 1
