"""Taking messages out of the ring for one reader: a one-slot message (the path per message),
the fragments of a larger one reassembled, and the whole messages ready after it taken at once
(``_take_ahead``). Where the cursor goes and how slots are given back: ``cursor.py``."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from .._base import tuning as _tuning
from .._base.errors import DeserializationError, ReaderLagged
from .atomic import fence_acquire
from .cursor import ReaderCursor
from .layout import F_FIRST, F_GAP, F_LAST, F_OOB, F_WHOLE, SLOT_HEADER_BYTES, SLOT_REST, SLOT_REST_OFFSET

_NOTHING: Any = object()  # what _take_ahead returns when the next entry is not a whole message

Decoder = Callable[[memoryview | bytes | bytearray, bool], Any]


class MessageTaking(ReaderCursor):
    """``get_nowait`` and what it calls to decode; a base of ``ShmSource``, which sets these
    attributes (see its ``__init__``)."""

    _decode: Decoder
    _partial_msg: int
    _partial_fill: int
    _partial_flags: int
    _pending: tuple[int, bytearray, int] | None
    ahead: deque[Any]
    _ahead_ok: bool
    _ahead_max: int | None
    _failed: tuple[int, int, Exception] | None

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
        # The cursor is stored before the queue is filled, with no call between the two: a
        # Ctrl-C's KeyboardInterrupt is raised only at a call or a backward jump, so it finds
        # both done or neither (queued but not taken, they would be delivered twice).
        self._next_msg = msg + 1
        self._cursor = c
        w[self._cur_word] = c
        if more:
            self.ahead.extend(more)
        self._moved(c0, c, c - c0)
        return first

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
