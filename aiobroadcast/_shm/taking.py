"""Taking messages out of the ring for one reader: a one-slot message (the path per message),
the fragments of a larger one reassembled, and the whole messages ready after it taken at once
(``_take_ahead``). Where the cursor goes and how slots are given back: ``cursor.py``, whose
``ReaderCursor`` a ``MessageTaking`` holds."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from .._base import tuning as _tuning
from .._base.errors import DeserializationError, ReaderLagged
from .atomic import fence_acquire
from .cursor import ReaderCursor
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
)

_NOTHING: Any = object()  # what _take_ahead returns when the next entry is not a whole message

Decoder = Callable[[memoryview | bytes | bytearray, bool], Any]


class MessageTaking:
    """Taking one reader's messages out of the ring and decoding them: ``get_nowait``, the
    take-ahead, fragments reassembled. It moves its ``ReaderCursor`` (cursor.py), which it holds;
    its ``ShmSource`` hands its ``get_nowait``, ``ready`` and ``ahead`` to the reader."""

    def __init__(self, cursor: ReaderCursor, decode: Decoder, take_ahead: int | None) -> None:
        self.cursor = cursor
        #: the reader's decoder (``ShmSource.attach_arena`` wraps it)
        self.decode = decode
        # The message being assembled (``ReaderCursor.partial`` holds its bytes).
        self._partial_msg = -1
        self._partial_fill = 0
        self._partial_flags = 0
        # A message taken out of the ring whose decoding was interrupted (Ctrl-C, SystemExit,
        # a cancellation raised inside __setstate__): the next get_nowait decodes it again.
        self._pending: tuple[int, bytearray, int] | None = None
        #: Messages taken out of the ring and decoded ahead of their ``get_nowait``, in order
        #: (``_take_ahead``); ``Reader`` hands them out first. Policy "block" without zero-copy
        #: holds only: under "lag" every body is copied out under the seqlock one at a time, and
        #: a zero-copy message must keep its slot until the next get.
        self.ahead: deque[Any] = deque()
        self._ahead_ok = cursor.block and not cursor.hold_slot
        self._ahead_max = take_ahead
        #: A message ``_take_ahead`` found undecodable after others (entry, message number, the
        #: error): still in the ring, reported by the get after those others.
        self._failed: tuple[int, int, Exception] | None = None

    def get_nowait(self) -> Any:
        """Take the next message or raise (see ``Reader.get_nowait``)."""
        ahead = self.ahead
        if ahead:
            return ahead.popleft()
        cur = self.cursor
        if cur.held:
            cur.release()
        if self._pending is not None:
            return self._deliver_assembled(*self._pending)
        if self._ahead_ok and cur.partial is None:
            obj = self._take_ahead(cur)
            if obj is not _NOTHING:
                return obj
        w = cur.words
        buf = cur.buf
        while True:
            c = cur.entry
            off = cur.slot_offset(c)
            seq = w[off >> 3]
            if seq != c:
                cur.not_ready(c, seq)  # raises, or returns after resynchronising
                continue
            msg, flen, flags, total = SLOT_REST.unpack_from(buf, off + SLOT_REST_OFFSET)
            at = off + SLOT_HEADER_BYTES  # the payload
            if flags & F_WHOLE == F_WHOLE and cur.partial is None:
                if flags & F_GAP:  # a relay lost messages upstream
                    if not cur.block:  # the header may be torn: re-check after reading it
                        fence_acquire()
                        if w[off >> 3] != c:
                            continue
                    cur.moved(c, c + 1, 0)
                    cur.next_msg = msg + total  # the lost messages have their numbers
                    cur.lagged_total += total
                    raise ReaderLagged(total)
                if cur.block:
                    body: memoryview | bytes = buf[at : at + flen]
                else:
                    body = bytes(buf[at : at + flen])
                    fence_acquire()  # the copy's loads before the re-check (docs/design.md, step 6)
                    if w[off >> 3] != c:  # overwritten while we copied
                        continue
                # The one-slot message, written out: what ``_deliver`` and ``cur.take`` do.
                try:
                    obj = self.decode(body, flags & F_OOB != 0)
                except Exception as exc:
                    cur.next_msg = msg + 1
                    cur.take(c)  # consumed: the next get returns the next message
                    raise DeserializationError(msg, exc) from exc
                # Any other BaseException propagates before the take: the entry stays in the ring.
                cur.next_msg = msg + 1
                if cur.hold_slot:
                    cur.hold(c)
                    return obj
                cur.moved(c, c + 1, 1)
                return obj
            # A fragment of a larger message. Under policy "lag" the header may be torn (the
            # writer zeroes it before filling it in): check that the entry is still ours before
            # acting on it, and again after copying its payload.
            if not cur.block:
                fence_acquire()
                if w[off >> 3] != c:
                    continue
            if flags & F_FIRST:
                cur.partial = bytearray(total)
                self._partial_msg = msg
                self._partial_fill = 0
                self._partial_flags = flags
                cur.next_msg = msg
            elif cur.partial is None or msg != self._partial_msg:
                cur.moved(c, c + 1, 0)  # the rest of a message we joined or lagged in the middle of
                continue
            partial = cur.partial
            assert partial is not None
            fill = self._partial_fill
            partial[fill : fill + flen] = buf[at : at + flen]
            if not cur.block:
                fence_acquire()
                if w[off >> 3] != c:
                    continue
            self._partial_fill = fill + flen
            cur.moved(c, c + 1, 0)
            if flags & F_LAST:
                cur.partial = None
                return self._deliver_assembled(msg, partial, self._partial_flags & F_OOB)

    def ready(self) -> bool:
        """Whether ``get_nowait`` would do anything but raise ``WouldBlock``."""
        cur = self.cursor
        w = cur.words
        c = cur.entry
        seq = w[cur.slot_offset(c) >> 3]
        return (
            seq == c
            or bool(self.ahead)
            or (seq != EMPTY and seq != BUSY and seq > c)
            or self._pending is not None
            or bool(w[W_CLOSED])
            or cur.writer_gone
        )

    def _take_ahead(self, cur: ReaderCursor) -> Any:
        """Take the next message and the whole one-slot messages ready after it, up to
        ``take_ahead`` (default ``AHEAD_MESSAGES``) and about ``AHEAD_BYTES``: the first is returned,
        the others queued in ``ahead``, decoded. ``_NOTHING`` if the next entry is not a whole message ready now
        (``get_nowait``'s general path then decides).

        Nothing is taken until every one of them is decoded: a ``BaseException`` from decoding
        (Ctrl-C, SystemExit, a cancellation raised in ``__setstate__``) leaves them all in the
        ring for the next get. An undecodable message is consumed and raises
        ``DeserializationError`` when it comes first; after others, it stays in the ring and the
        get after them reports it (``_failed``), so it is decoded once."""
        w = cur.words
        buf = cur.buf
        c0 = c = cur.entry
        failed = self._failed
        if failed is not None:
            self._failed = None
            _entry, msg, exc = failed
            cur.next_msg = msg + 1
            cur.moved(c, c + 1, 1)
            raise DeserializationError(msg, exc) from exc
        slot_offset = cur.slot_offset
        off = slot_offset(c)
        if w[off >> 3] != c:
            return _NOTHING
        msg, flen, flags, _total = SLOT_REST.unpack_from(buf, off + SLOT_REST_OFFSET)
        if flags & (F_WHOLE | F_GAP) != F_WHOLE:
            return _NOTHING  # a fragment, or a relay's gap marker
        decode = self.decode
        try:
            at = off + SLOT_HEADER_BYTES
            first = decode(buf[at : at + flen], flags & F_OOB != 0)
        except Exception as exc:
            cur.next_msg = msg + 1
            cur.moved(c, c + 1, 1)  # consumed: the next get returns the next message
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
        # The cursor is stored before the queue is filled, with no call between the two: a
        # Ctrl-C's KeyboardInterrupt is raised only at a call or a backward jump, so it finds
        # both done or neither (queued but not taken, they would be delivered twice).
        cur.next_msg = msg + 1
        cur.entry = c
        w[cur.cur_word] = c
        if more:
            self.ahead.extend(more)
        cur.moved(c0, c, c - c0)
        return first

    def _deliver(self, msg: int, body: memoryview | bytes | bytearray, oob: int) -> Any:
        """Decode message ``msg``. ``Exception`` becomes ``DeserializationError`` (the message
        counts as taken); any other ``BaseException`` propagates with nothing taken."""
        try:
            obj = self.decode(body, bool(oob))
        except Exception as exc:
            self.cursor.next_msg = msg + 1
            raise DeserializationError(msg, exc) from exc
        self.cursor.next_msg = msg + 1
        return obj

    def _deliver_assembled(self, msg: int, body: bytearray, oob: int) -> Any:
        """Deliver a message assembled from fragments (already released from the ring). Kept as
        ``_pending`` until it is delivered or found undecodable."""
        self._pending = (msg, body, oob)
        try:
            obj = self._deliver(msg, body, oob)
        except DeserializationError:
            self._pending = None
            self.cursor.count_delivery()
            raise
        self._pending = None
        self.cursor.count_delivery()
        return obj
