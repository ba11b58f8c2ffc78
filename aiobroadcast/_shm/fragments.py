"""A message over several slots: its fragments written all at once (``Publisher.publish``, for a
message the ring holds whole) or as room comes (``stream_some``, for a streamed message larger
than the ring), and ``Chunks``, which walks the message's buffers into the slots."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .._base.codec import Buffer
from .arena import ArenaHead
from .atomic import fence_release
from .layout import (
    BUSY,
    F_FIRST,
    F_LAST,
    F_OOB,
    SLOT_HEADER_BYTES,
    SLOT_REST,
    SLOT_REST_OFFSET,
    W_HEAD,
    W_NEXT_MSG,
    free_entries,
)
from .segment import Segment

if TYPE_CHECKING:
    from .publisher import Publisher


class FragmentWriter:
    """Writes a message over several slots: all at once (``Publisher.publish``, for a message the
    ring holds whole) or as room comes (``stream_some``, for a streamed message larger than the
    ring). A ``Publisher`` holds one; ``stream_some`` and ``end_stream`` move that publisher's
    counters (``head``, ``msg``, ``aborted``) under its mutex, as its own methods would."""

    def __init__(self, seg: Segment, block: bool) -> None:
        self._words = seg.words
        self._buf = seg.buf
        self._slot_offset = seg.layout.slot_offset
        self._payload = seg.layout.payload_bytes
        self._block = block

    def write(self, chunks: Chunks, total: int, base_flags: int, msg: int, seq: int, count: int, *, first: bool) -> int:
        """Write the next ``count`` fragments of message ``msg`` from ``chunks`` into the slots of
        entries ``seq`` on, each committed by its seq word; the next entry."""
        w = self._words
        buf = self._buf
        payload = self._payload
        for k in range(count):
            off = self._slot_offset(seq)
            if not self._block:
                w[off >> 3] = BUSY
                fence_release()
            n = chunks.copy_into(buf, off + SLOT_HEADER_BYTES, payload)
            flags = base_flags
            if first and k == 0:
                flags |= F_FIRST
            if chunks.done:
                flags |= F_LAST
            SLOT_REST.pack_into(buf, off + SLOT_REST_OFFSET, msg, n, flags, total)
            w[off >> 3] = seq
            seq += 1
        return seq

    def stream_some(self, pub: Publisher, chunks: Chunks, total: int, oob: bool, msg: int) -> bool:
        """Publish the next fragments of streamed message ``msg`` (larger than the ring) into the
        room there is now. False if another thread holds the mutex (the caller holds the
        writer's turn, so no other put starts now; one may still be finishing): call again."""
        try:  # the mutex taken inside the try (publisher.py, ``_take``)
            if pub.mutex.take(0.0) <= 0:
                return False
            try:
                pub.check_open()
                # Another thread's put_nowait may have taken some of the room since the caller saw it.
                lay = pub.layout
                free = free_entries(pub.head, pub.records.min_cursor, lay.capacity)
                n = min(free, lay.entries_for(total - chunks.pos))
                if n <= 0:
                    return True
                first = chunks.pos == 0
                pub.head = self.write(chunks, total, F_OOB if oob else 0, pub.msg, pub.head, n, first=first)
                if first:
                    self._words[W_NEXT_MSG] = msg + 1
                self._words[W_HEAD] = pub.head
                if chunks.done and type(chunks.first) is ArenaHead:
                    chunks.first.committed(pub.head)
                pub.wake_readers()
                return True
            except BaseException:
                pub.recover()
                raise
        finally:
            pub.mutex.release()

    def end_stream(self, pub: Publisher, chunks: Chunks, msg: int) -> None:
        """After a streamed message, whole or cut short (cancelled, interrupted, timed out) once
        its FIRST fragment went out: its number is used either way (readers drop a message whose
        LAST never comes, and it does not count as sent)."""
        if chunks.pos and pub.msg == msg:
            pub.msg = msg + 1
            if not chunks.done:
                pub.aborted += 1


class Chunks:
    """Walks a list of buffers, copying them into consecutive slots."""

    def __init__(self, parts: Sequence[Buffer]) -> None:
        self._parts = [memoryview(p).cast("B") for p in parts]
        self.first = parts[0] if parts else None
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
