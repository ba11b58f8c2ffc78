"""The ring's write path: copying a message into free slots and publishing it (one writer).

No waiting and no event loop here: the caller (``_broadcast.channel.WriterChannel``) decides when there
is room and who may write. ``mutex`` is held, never across an await, by whoever writes into the
ring, from any thread. docs/design.md gives the store order and why readers never see a torn
message.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._base.codec import Buffer
from .._base.errors import ClosedResourceError
from . import segment as _segment
from ._atomics import Held
from .arena import ArenaHead
from .atomic import fence_release
from .fragments import Chunks as Chunks  # the writer's channel makes them for stream_some
from .fragments import FragmentWriter
from .layout import (
    BUSY,
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
    W_NEXT_MSG,
    fence,
    has_room,
)
from .records import ReaderRecords
from .segment import Segment
from .wake import Outbox

#: A message as ``publish`` takes it: its parts, total length, out-of-band flag and slot count.
Encoded = tuple[Sequence[Buffer], int, bool, int]


class Publisher:
    """Writes messages into one channel's ring. ``head`` is the next entry, ``msg`` the next
    message number; both are also stored in the segment for readers to see. A message over
    several slots, and a streamed one, are written by its ``FragmentWriter`` (fragments.py);
    who sleeps and is woken is its ``records``' (``ReaderRecords``, records.py)."""

    def __init__(self, seg: Segment, block: bool) -> None:
        self.seg = seg
        self.layout = seg.layout
        self.block = block
        self.outbox = Outbox()
        self.records = ReaderRecords(seg, self.outbox)
        self.mutex = Held()
        self.head = 0
        self.msg = 0
        self.aborted = 0  # message numbers used by messages cut short (their LAST never published)
        self.lost_upstream = 0  # message numbers that gap markers took beyond one each
        self.closed = False
        self.refusal: str | None = None  # why a fork child may not use it
        self._words = seg.words
        self._buf = seg.buf
        self._slot_offset = seg.layout.slot_offset  # the layout's function: called per entry
        # The layout's numbers and the bound methods the one-slot path uses, as attributes.
        self._cap = seg.layout.capacity
        # The mutex is taken inside the ``try`` whose ``finally`` gives it back: a Ctrl-C's
        # KeyboardInterrupt can be raised right after a call returns, before a ``try`` begins;
        # ``Held`` (_atomics.c) gives back only what this thread took, so the ``finally`` may
        # run whether or not the take got it (aiobroadcast/_shm/owned.py says more).
        self._take = self.mutex.take
        self._give = self.mutex.release
        self._waiting = seg.waiting
        self._wake_sleepers = self.records.wake_sleepers  # called per message when someone sleeps
        self._fragments = FragmentWriter(seg, block)

    @property
    def sent(self) -> int:
        return self.msg - self.aborted - self.lost_upstream

    def check_open(self) -> None:
        if self.closed:
            raise ClosedResourceError(self.refusal or "this writer is closed")

    def room(self, entries: int) -> bool:
        return self.records.room(self.head, entries)

    def try_publish(self, parts: Sequence[Buffer], total: int, oob: bool, entries: int, gap: int = 0) -> bool:
        """Publish now if no other thread is writing and there is room (or policy "lag")."""
        try:
            if self._take(0.0) <= 0:  # another thread writes (or this one, from a signal handler)
                return False
            if self.closed:  # closed by another thread, or inherited by a fork child
                self.check_open()
            # The cached slowest cursor usually says there is room; ``room`` rescans otherwise.
            if (
                self.block
                and not has_room(self.head, self.records.min_cursor, entries, self._cap)
                and not self.room(entries)
            ):
                return False
            self.publish(parts, total, oob, entries, gap)
            return True
        finally:
            self._give()

    def publish(self, parts: Sequence[Buffer], total: int, oob: bool, entries: int, gap: int = 0) -> None:
        """Write a whole message into ``entries`` free slots and publish it. The caller holds
        ``mutex`` and made sure of the room.

        Store order (docs/design.md): the slot's bytes and header, then its seq word (the
        commit), then W_NEXT_MSG and W_HEAD, then the wake-ups after a fence. Written out in one
        function for the one-slot message (the small messages of a dense stream, and the paced
        message whose latency is measured from ``put`` to the wake-up): each call costs here."""
        w = self._words
        buf = self._buf
        msg = self.msg
        seq = self.head
        try:
            if entries == 1:
                off = self._slot_offset(seq)
                if not self.block:
                    w[off >> 3] = BUSY  # a lagging reader that reads this slot now re-checks
                    fence_release()  # BUSY before the slot's new bytes (docs/design.md, step 6)
                if len(parts) == 1:
                    at = off + SLOT_HEADER_BYTES
                    buf[at : at + total] = parts[0]
                else:  # pickle frames around a large payload, or out-of-band parts: byte buffers
                    at = off + SLOT_HEADER_BYTES
                    for part in parts:
                        end = at + len(part)
                        buf[at:end] = part
                        at = end
                if gap:
                    SLOT_REST.pack_into(buf, off + SLOT_REST_OFFSET, msg, 0, F_FIRST | F_LAST | F_GAP, gap)
                else:
                    SLOT_REST.pack_into(
                        buf, off + SLOT_REST_OFFSET, msg, total, (F_OOB | F_WHOLE) if oob else F_WHOLE, total
                    )
                w[off >> 3] = seq
                seq += 1
            else:
                seq = self._fragments.write(Chunks(parts), total, F_OOB if oob else 0, msg, seq, entries, first=True)
            # A gap marker takes the numbers of the messages it stands for, so a message's number
            # is the same for every reader, local or remote, relayed or not (docs/design.md).
            self.msg = msg = msg + (gap or 1)
            w[W_NEXT_MSG] = msg
            self.head = seq
            w[W_HEAD] = seq
            if oob and type(parts[0]) is ArenaHead:
                parts[0].committed(seq)  # its arena record is reclaimed once readers pass seq
        except BaseException:
            # A KeyboardInterrupt (or any exception a signal handler raises) can land between any
            # two bytecodes of the copy. Readers go by the slots' seq words: whatever was
            # committed before the interrupt is seen, so the writer's own counters must follow.
            self.recover()
            raise
        # The wake-ups, as ``wake_readers`` (inlined: the fence and the look at the waiting words
        # are all a dense stream pays).
        fence()
        if self._waiting.any():
            self._wake_sleepers()

    def try_publish_many(self, batch: Sequence[Encoded], entries: int) -> bool:
        """``try_publish`` for several messages (``entries`` slots in all): all or none."""
        try:
            if self._take(0.0) <= 0:
                return False
            self.check_open()
            if self.block and not self.room(entries):
                return False
            self.publish_many(batch)
            return True
        finally:
            self._give()

    def publish_many(self, batch: Sequence[Encoded]) -> None:
        """Write several messages in order and publish them with one store of the head and one
        round of wake-ups. The caller holds ``mutex`` and made sure of the room for all of them.
        Readers go by the slots' seq words, so each message is readable as soon as its own commit
        is stored; an interrupt leaves the messages committed before it published, whole."""
        w = self._words
        buf = self._buf
        seq = self.head
        try:
            for parts, total, oob, entries in batch:
                if entries == 1:
                    off = self._slot_offset(seq)
                    if not self.block:
                        w[off >> 3] = BUSY
                        fence_release()
                    at = off + SLOT_HEADER_BYTES
                    for part in parts:
                        end = at + len(part)
                        buf[at:end] = part
                        at = end
                    SLOT_REST.pack_into(
                        buf, off + SLOT_REST_OFFSET, self.msg, total, (F_OOB | F_WHOLE) if oob else F_WHOLE, total
                    )
                    w[off >> 3] = seq
                    seq += 1
                else:
                    seq = self._fragments.write(
                        Chunks(parts), total, F_OOB if oob else 0, self.msg, seq, entries, first=True
                    )
                self.msg += 1
                if oob and type(parts[0]) is ArenaHead:
                    parts[0].committed(seq)
            w[W_NEXT_MSG] = self.msg
            self.head = seq
            w[W_HEAD] = seq
        except BaseException:
            self.recover()
            raise
        self.wake_readers()

    def recover(self) -> None:
        """Bring ``head`` and the message number up to the entries whose seq word was stored.

        Before the commit of a one-slot message nothing was stored: nothing is published. After
        it (a few bytecodes of bookkeeping), the message is published whole: readers may have it
        already. Fragments of a larger message that were committed stay, without their LAST:
        readers drop them at the next FIRST fragment, as for a cancelled streamed message."""
        w = self._words
        head = self.head
        msg = self.msg
        whole = True
        while w[(off := self._slot_offset(head)) >> 3] == head:
            number, _length, flags, _total = SLOT_REST.unpack_from(self._buf, off + SLOT_REST_OFFSET)
            msg = number + 1
            whole = bool(flags & F_LAST)
            head += 1
        if head == self.head and w[W_HEAD] == head:
            return
        if not whole:
            self.aborted += 1  # its number is used, but no reader delivers it
        self.head = head
        self.msg = max(self.msg, msg)
        w[W_NEXT_MSG] = self.msg
        w[W_HEAD] = head
        self.wake_all_readers()

    def wake_readers(self) -> None:
        """Wake the readers that announced they sleep (and only once per sleep)."""
        fence()
        if self._waiting.any():
            self._wake_sleepers()

    def wake_all_readers(self) -> None:
        """Wake every attached reader, asleep or not, after a change they must see (closed, gone)."""
        fence()
        self.records.wake_all()

    def stream_some(self, chunks: Chunks, total: int, oob: bool, msg: int) -> bool:
        """Publish the next fragments of a streamed message: ``FragmentWriter.stream_some``."""
        return self._fragments.stream_some(self, chunks, total, oob, msg)

    def end_stream(self, chunks: Chunks, msg: int) -> None:
        """A streamed message ended, whole or cut short: ``FragmentWriter.end_stream``."""
        self._fragments.end_stream(self, chunks, msg)

    def mark_closed(self) -> None:
        """Readers drain what was published, then get ``EndOfStream``."""
        try:
            self._take(-1.0)  # no other thread is writing into the ring from here on
            self.closed = True
        finally:
            self._give()
        self._words[W_CLOSED] = 1
        self.wake_all_readers()

    def abandon(self) -> None:
        """Stop as if this process had died: readers drain, then get ``WriterGone``."""
        try:
            self._take(-1.0)
            self.closed = True
        finally:
            self._give()
        _segment.unlock(self.seg.fd, _segment.WRITER_LOCK_BYTE)
        self.wake_all_readers()  # sleepers find the lock free on waking


def messages_from(pub: Publisher, entry: int) -> int | None:
    """How many messages a reader at ring entry ``entry`` has not finished: the messages ``pub``
    published from the one at ``entry`` on (it may have taken some of that one's fragments); None
    if the slot no longer says. For errors, not for the hot path: reads a slot's header."""
    if entry >= pub.head:
        return 0
    off = pub.layout.slot_offset(entry)
    if entry < pub.head - pub.layout.capacity or pub.seg.words[off >> 3] != entry:  # overwritten ("lag")
        return None
    number: int = SLOT_REST.unpack_from(pub.seg.buf, off + SLOT_REST_OFFSET)[0]
    return max(0, pub.msg - number)
