"""A reader's cursor in the ring: giving entries back to the writer (and waking it when that
makes the room it waits for), holding a zero-copy slot, and finding where to go on when the entry
at the cursor is not there (not published yet, the end, or overwritten: a lag to report)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._base.errors import EndOfStream, ReaderLagged, WouldBlock, WriterGone
from .atomic import Words, fence_acquire
from .layout import (
    BUSY,
    EMPTY,
    F_FIRST,
    SLOT_REST,
    SLOT_REST_OFFSET,
    W_CLOSED,
    W_HEAD,
    W_WAIT_TARGET,
    W_WRITER_PID,
    crossed,
    fence,
    has_room,
)
from .wake import Outbox


class ReaderCursor:
    """Where one reader is in the ring and how it moves on; a base of ``ShmSource``, which sets
    these attributes when it joins (its paths per message read them as attributes of one object)."""

    _words: Words
    _buf: memoryview
    _cap: int
    _slot_offset: Callable[[int], int]
    _block: bool
    _hold_slot: bool
    _held: bool
    _cursor: int
    _next_msg: int
    _received: int
    _lagged_total: int
    _partial: bytearray | None
    _writer_gone: bool
    _cur_word: int
    _recv_word: int
    _outbox: Outbox
    _writer_sock: str

    def _take(self, c: int) -> None:
        """Entry ``c`` (a whole message) is delivered: release its slot, or hold it (zero-copy)."""
        if self._hold_slot:
            self._hold(c)
        else:
            self._moved(c, c + 1, 1)

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
        # Policy "lag": a writer with no room for its next entry short of entry c overwrites c.
        if (seq != EMPTY and seq != BUSY and seq > c) or (not self._block and not has_room(w[W_HEAD], c, 1, self._cap)):
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
