"""A reader's cursor in the ring: giving entries back to the writer (and waking it when that
makes the room it waits for), holding a zero-copy slot, and finding where to go on when the entry
at the cursor is not there (not published yet, the end, or overwritten: a lag to report)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from .place import ReaderPlace
    from .segment import Segment


class ReaderCursor:
    """Where one reader is in the ring and how it moves on: one object per reader, which its
    ``MessageTaking`` (taking.py) moves per message and its ``ShmSource`` reports on. Its state is
    in plain attributes, read and written by both: the paths per message bind this object once
    and then read them as attributes of one object, as they would their own."""

    def __init__(self, seg: Segment, block: bool, hold_slot: bool, outbox: Outbox) -> None:
        lay = seg.layout
        self.words: Words = seg.words
        self.buf = seg.buf
        self.cap = lay.capacity
        self.slot_offset: Callable[[int], int] = lay.slot_offset  # the layout's function: called per message
        self.block = block
        #: Zero-copy reads: a delivered message may be a view of its slot, so the slot is
        #: released only at the next take (``hold``, ``release``).
        self.hold_slot = hold_slot
        self.held = False
        #: the entry to take next (the shared cursor, stored at ``cur_word``, lags it by one while
        #: a slot is held)
        self.entry = 0
        self.next_msg = 0
        self.received = 0
        self.lagged_total = 0
        #: the message being assembled from its fragments, dropped when the cursor jumps
        self.partial: bytearray | None = None
        self.writer_gone = False
        self.outbox = outbox
        # The place's words and the writer's socket (``joined``).
        self.cur_word = 0
        self.recv_word = 0
        self.writer_sock = ""

    def joined(self, place: ReaderPlace, entry: int, next_msg: int) -> None:
        """The reader took ``place``: it starts at ``entry``, expecting message ``next_msg``."""
        self.entry = entry
        self.next_msg = next_msg
        self.cur_word = place.cur_word
        self.recv_word = place.recv_word
        self.writer_sock = place.writer_sock

    def take(self, c: int) -> None:
        """Entry ``c`` (a whole message) is delivered: release its slot, or hold it (zero-copy)."""
        if self.hold_slot:
            self.hold(c)
        else:
            self.moved(c, c + 1, 1)

    def count_delivery(self) -> None:
        self.received += 1
        self.words[self.recv_word] = self.received

    def moved(self, old: int, new: int, delivered: int) -> None:
        """Release entries ``old .. new-1``, of which ``delivered`` messages were handed out: store
        the cursor (and the count), fence, and wake the writer if this move reached the room it
        waits for (``crossed``). The one place a reader gives slots back (docs/design.md,
        "Memory ordering", steps 3 and 5)."""
        w = self.words
        self.entry = new
        w[self.cur_word] = new
        if delivered:
            self.received = received = self.received + delivered
            w[self.recv_word] = received
        if self.block:
            fence()
            target = w[W_WAIT_TARGET]
            if target and crossed(old, new, target):
                self.outbox.wake(self.writer_sock)

    def hold(self, c: int) -> None:
        """Take entry ``c`` but keep its slot: the shared cursor stays at ``c``, so the writer does
        not reuse the slot while the message handed out has views of it (zero-copy reads)."""
        self.entry = c + 1
        self.held = True
        self.received += 1
        self.words[self.recv_word] = self.received

    def release(self) -> None:
        """Give back the slot ``hold`` kept, as ``moved`` would have."""
        self.held = False
        self.entry -= 1
        self.moved(self.entry, self.entry + 1, 0)

    def not_ready(self, c: int, seq: int) -> None:
        """Entry ``c`` is not in its slot: raise what that means, or resynchronise and return."""
        w = self.words
        # Policy "lag": a writer with no room for its next entry short of entry c overwrites c.
        if (seq != EMPTY and seq != BUSY and seq > c) or (not self.block and not has_room(w[W_HEAD], c, 1, self.cap)):
            self.resync_after_lag(c)
            return
        if w[W_CLOSED] or self.writer_gone:
            # The writer stored every entry before `closed`; look once more now that we saw it.
            if w[self.slot_offset(c) >> 3] == c:
                return
            self.partial = None
            if w[W_CLOSED]:
                raise EndOfStream
            raise WriterGone(w[W_WRITER_PID])
        raise WouldBlock

    def resync_after_lag(self, c: int) -> None:
        """Policy "lag": the writer overwrote entries we had not read. Skip to the oldest
        entry still held and report exactly how many messages were lost (docs/design.md,
        "Catching up after a lag").

        The count comes only from the header of an intact entry, read under the seqlock. ``head``
        only says where to start looking: it may be stale by the time the slots are read, and
        ``next_msg`` (which the writer stores just before ``head``) cannot be paired with it, so
        neither bounds the search nor gives the count.
        """
        w = self.words
        e, first_kept = oldest_intact(w, self.buf, self.slot_offset, max(c, w[W_HEAD] - self.cap))
        if e == c:
            # The head we loaded was a full ring ahead, but entry c is intact (the writer had not
            # started to overwrite it). Nothing was lost: read it.
            return
        missed = first_kept - self.next_msg
        self.partial = None
        self.entry = e
        w[self.cur_word] = e
        if missed <= 0:
            # Only fragments of a message already given up (counted, or begun before we joined).
            return
        self.next_msg = first_kept
        self.lagged_total += missed
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
