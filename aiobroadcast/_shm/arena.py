"""The tensor arena: a second shared-memory file beside the ring, where the writer copies a
message's large out-of-band buffers once, and from which each reader's views live as long as
they are referenced (docs/design.md, "The arena: zero-copy views with a lifetime").

File ``<segment>-arena.shm``, 8-byte little-endian words, then the data region (page aligned):

- word 0 magic ``ABARENA\\x01``, 1 version, 2 data bytes, 3 records ``R``, 4 max readers ``M``,
  5 data offset;
- words ``8 .. 8+R``: the length of record ``k``'s allocation (0: free), written by the writer
  (for ``statistics()`` and ``aiobroadcast stats``);
- words ``8+R .. 8+R+R*M``: the pins, ``pin[k*M + i]``: reader place ``i``'s token on record
  ``k`` (0: no view of it alive). Only the reader of place ``i`` stores into its column (its
  token when it hands out views, 0 when the last of them is freed; 0 everywhere when it joins
  and when it leaves).

A record is reclaimed by the writer once every active reader's ring cursor is past the last
entry of the message that referred to it, and no active place pins it. Every word goes through
``atomic.Words`` (load-acquire, store-release); the scan is preceded by a full fence.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import mmap
import os
import pickle
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .._base import tuning as _tuning
from .._base.codec import _BYTES_KIND, Buffer, decode_pickle, decode_pickle_view, writable_twins
from .._base.errors import BroadcastError, InsufficientSharedMemory, InvalidArgument
from .._base.files import unlink_quietly
from .atomic import Words
from .layout import fence
from .segment import Segment

log = logging.getLogger("aiobroadcast")

MAGIC = int.from_bytes(b"ABARENA\x01", "little")
VERSION = 1
RECORDS = 64
#: set in the first word (the buffer count) of an out-of-band body whose buffers are in the arena
ARENA_BIT = 1 << 62
ALIGN = 64
_U64 = struct.Struct("<Q")
_HEAD_WORDS = 8


def arena_path(segment_path: str) -> str:
    return f"{segment_path}-arena.shm"


def _layout(max_readers: int) -> tuple[int, int]:
    """(first pin word, data offset) for ``max_readers`` places."""
    pin0 = _HEAD_WORDS + RECORDS
    words = pin0 + RECORDS * max_readers
    page = mmap.ALLOCATIONGRANULARITY
    return pin0, (8 * words + page - 1) // page * page


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def is_arena_body(body: Any) -> bool:
    return bool(_U64.unpack_from(body, 0)[0] & ARENA_BIT)


def _parse(mv: memoryview) -> tuple[int, list[int], int, int, memoryview]:
    """(count, length words, record, offset, stream) of an arena body."""
    n = _U64.unpack_from(mv, 0)[0] & ~ARENA_BIT
    words = struct.unpack_from(f"<{n + 3}Q", mv, 8)
    data_len = words[0]
    lens = list(words[1 : n + 1])
    rec, off = words[n + 1], words[n + 2]
    pos = 8 * (n + 4)
    return n, lens, rec, off, mv[pos : pos + data_len]


class _Alloc:
    __slots__ = ("end", "off", "rec", "size")

    def __init__(self, rec: int, off: int, size: int) -> None:
        self.rec = rec
        self.off = off
        self.size = size
        #: the ring entry after the message that refers to it, once published; None before
        self.end: int | None = None


class ArenaHead(bytes):
    """The first part of a body whose buffers are in the arena. The publisher marks it
    published (``committed``). One dropped without that mark was not published (a cancelled or
    failed put), or was by a publish that an interrupt cut short after its commit: either way
    no reader will read it past the head as it is now, which becomes its end."""

    alloc: _Alloc
    arena: ArenaWriter

    def committed(self, end: int) -> None:
        self.alloc.end = end

    def __del__(self) -> None:
        if self.alloc.end is None:
            self.alloc.end = self.arena.head()  # one attribute store: safe from any thread


class ArenaWriter:
    """The writer's side: allocation, reclaiming, the copy, statistics."""

    def __init__(self, seg: Segment, data_bytes: int, head: Callable[[], int]) -> None:
        if data_bytes < ALIGN:
            raise InvalidArgument(f"arena_bytes must be 0 (no arena) or at least {ALIGN}, not {data_bytes}")
        self.path = arena_path(seg.path)
        self.seg = seg
        self.data_bytes = data_bytes = _align(data_bytes)
        self.max_readers = m = seg.layout.max_readers
        self.pin0, self.data_offset = _layout(m)
        size = self.data_offset + data_bytes
        directory = os.path.dirname(self.path)
        st = os.statvfs(directory)
        available = st.f_bavail * st.f_frsize
        if size > available:
            raise InsufficientSharedMemory(size, available, directory)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise InsufficientSharedMemory(size, available, directory) from exc
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            unlink_quietly(self.path)
            raise
        os.close(fd)
        self.words = Words(self.mm, 0, 1, self.pin0)
        self.pins = [Words(self.mm, self.pin0 + k * m, 1, m) for k in range(RECORDS)]
        w = self.words
        for i, v in enumerate((MAGIC, VERSION, data_bytes, RECORDS, m, self.data_offset)):
            w[i] = v
        self.data = memoryview(self.mm)[self.data_offset :]
        self.head = head
        self.lock = threading.Lock()
        self.live: list[_Alloc] = []
        self.free_recs = list(range(RECORDS - 1, -1, -1))
        self.placed = 0
        self.fallbacks = 0
        self._probed = 0.0
        #: ``probe()``: drop the readers found dead (the channel's liveness check; set by it)
        self.probe: Callable[[], None] | None = None

    # --- allocation ---------------------------------------------------------------------
    def _scan(self) -> tuple[list[int], int]:
        """The active places and the slowest active cursor, after a full fence (so a reader
        that joins after this scan starts past every message published before it)."""
        seg = self.seg
        fence()
        head = self.head()
        active = seg.rec_active.tolist()
        cursors = seg.rec_cursor.tolist()
        places = [i for i, a in enumerate(active) if a]
        m = min((cursors[i] for i in places), default=head)
        return places, min(m, head)

    def _reclaim(self) -> None:
        if not self.live:
            return
        places, low = self._scan()
        keep = []
        for a in self.live:
            if a.end is not None and a.end <= low:
                pins = self.pins[a.rec].tolist()
                if not any(pins[i] for i in places):
                    self.words[_HEAD_WORDS + a.rec] = 0
                    self.free_recs.append(a.rec)
                    continue
            keep.append(a)
        self.live = keep

    def _fit(self, size: int) -> int | None:
        if not self.free_recs:
            return None
        at = 0
        for a in sorted(self.live, key=lambda x: x.off):
            if a.off - at >= size:
                return at
            at = max(at, a.off + a.size)
        return at if self.data_bytes - at >= size else None

    def allocate(self, size: int) -> _Alloc | None:
        size = _align(max(size, 1))
        if size > self.data_bytes:
            return None
        with self.lock:
            off = self._fit(size)
            if off is None:
                self._reclaim()
                off = self._fit(size)
            if off is None and self.probe is not None and time.monotonic() - self._probed >= _tuning.ROOM_CHECK_S:
                # Full: a reader killed while it held views pins its records until it is found dead.
                self._probed = time.monotonic()
                self.probe()
                self._reclaim()
                off = self._fit(size)
            if off is None:
                return None
            a = _Alloc(self.free_recs.pop(), off, size)
            self.live.append(a)
            self.words[_HEAD_WORDS + a.rec] = size
            return a

    def _free(self, a: _Alloc) -> None:
        with self.lock:
            if a in self.live:
                self.live.remove(a)
                self.words[_HEAD_WORDS + a.rec] = 0
                self.free_recs.append(a.rec)

    # --- the copy ---------------------------------------------------------------------------
    def place(self, parts: Sequence[Buffer], total: int) -> tuple[Sequence[Buffer], int]:
        """An out-of-band body (``_codec``'s layout) with its buffers moved into the arena: one
        copy of each. The body as it was (counted as a fallback) when the arena has no room."""
        head = memoryview(parts[0])
        n, data_len = struct.unpack_from("<QQ", head, 0)
        lens = struct.unpack_from(f"<{n}Q", head, 16)
        bufs = parts[len(parts) - n :]
        span = sum(_align(ln & ~_BYTES_KIND) for ln in lens)
        a = self.allocate(span)
        if a is None:
            self.fallbacks += 1
            if self.fallbacks == 1 or self.fallbacks % 100 == 0:
                log.info(
                    "aiobroadcast: the arena has no room for %d bytes (%d times so far); copying through the ring",
                    span,
                    self.fallbacks,
                )
            return parts, total
        try:
            data = self.data
            at = a.off
            for buf, ln in zip(bufs, lens, strict=True):
                size = ln & ~_BYTES_KIND
                data[at : at + size] = memoryview(buf).cast("B")
                at += _align(size)
            new = ArenaHead(struct.pack(f"<{n + 4}Q", n | ARENA_BIT, data_len, *lens, a.rec, a.off))
        except BaseException:
            self._free(a)
            raise
        new.alloc = a
        new.arena = self
        self.placed += 1
        return [new, *parts[1 : len(parts) - n]], len(new) + data_len

    # --- state ---------------------------------------------------------------------------------
    def reclaim(self) -> None:
        """Free what no reader needs any more now (``statistics()``; allocation does it itself)."""
        with self.lock:
            self._reclaim()

    def pinned_bytes(self) -> dict[int, int]:
        """Bytes each active place pins, by place."""
        out: dict[int, int] = {}
        lengths = self.words.tolist()[_HEAD_WORDS:]
        active = self.seg.rec_active.tolist()
        for k, ln in enumerate(lengths):
            if not ln:
                continue
            for i, token in enumerate(self.pins[k].tolist()):
                if token and active[i]:
                    out[i] = out.get(i, 0) + ln
        return out

    def used_bytes(self) -> int:
        return sum(self.words.tolist()[_HEAD_WORDS:])

    def close(self) -> None:
        self.words.release()
        for p in self.pins:
            p.release()
        self.data.release()
        try:
            self.mm.close()
        except BufferError:  # pragma: no cover - the writer hands out no views of it
            pass

    def forget_in_child(self) -> None:
        """A fork child holds no role: it reclaims nothing and places nothing."""
        self.probe = None


def read_usage(path: str) -> tuple[int, int, dict[int, int]] | None:
    """(arena bytes, bytes held, bytes pinned by place) of the arena at ``path``, read without
    mapping it (``aiobroadcast stats``); None if there is none. Plain reads: a snapshot for people."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        head = os.pread(fd, 8 * _HEAD_WORDS, 0)
        if len(head) < 8 * _HEAD_WORDS:
            return None
        magic, version, data_bytes, records, m, _data = struct.unpack_from("<6Q", head)
        if magic != MAGIC or version != VERSION or records != RECORDS or not 0 < m <= 1 << 16:
            return None
        raw = os.pread(fd, 8 * (RECORDS + RECORDS * m), 8 * _HEAD_WORDS)
        words = struct.unpack(f"<{len(raw) // 8}Q", raw[: len(raw) // 8 * 8])
    finally:
        os.close(fd)
    if len(words) < RECORDS * (m + 1):
        return None
    lengths, pins = words[:RECORDS], words[RECORDS:]
    pinned: dict[int, int] = {}
    for k, ln in enumerate(lengths):
        for i in range(m):
            if ln and pins[k * m + i]:
                pinned[i] = pinned.get(i, 0) + ln
    return data_bytes, sum(lengths), pinned


_tokens = itertools.count(1)


class ArenaReader:
    """A reader place's side: decoding arena bodies (views with a lifetime, or copies) and its
    column of pins."""

    def __init__(self, path: str, place: int) -> None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise BroadcastError(f"cannot open the channel's arena {path}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        head = Words(self.mm, 0, 1, _HEAD_WORDS)
        if head[0] != MAGIC or head[1] != VERSION:
            head.release()
            self.mm.close()
            raise BroadcastError(f"{path} is not an aiobroadcast arena of this version")
        self.max_readers = m = head[4]
        self.data_offset = head[5]
        head.release()
        self.pin0 = _HEAD_WORDS + RECORDS
        self.place = place
        self.pins = Words(self.mm, self.pin0 + place, m, RECORDS)  # this place's column
        self.owner = os.getpid()
        self.closed = False
        self.clear()

    def clear(self) -> None:
        """No view of this place is alive (at join: a dead predecessor's pins are garbage)."""
        for k in range(RECORDS):
            if self.pins[k]:
                self.pins[k] = 0

    def _unpin(self, rec: int, token: int) -> None:
        # A fork child's copies of the views free nothing of the parent's; a closed place has
        # no pins left to clear.
        if os.getpid() != self.owner or self.closed:
            return
        if self.pins[rec] == token:
            self.pins[rec] = 0

    def decoder(self, decode: Callable[[Any, bool], Any], views: bool) -> Callable[[Any, bool], Any]:
        """``decode`` for bodies of this channel: arena bodies as views with a lifetime
        (``views``) or copies for pickle decoders; expanded to an ordinary out-of-band body for any
        other (the TCP server, relays, pickle under a schema)."""
        if decode is decode_pickle_view or (views and decode is decode_pickle):

            def decode_views(body: Any, oob: bool) -> Any:
                if oob and is_arena_body(body):
                    return self._loads_views(memoryview(body))
                return decode(body, oob)

            return decode_views
        if decode is decode_pickle:

            def decode_copies(body: Any, oob: bool) -> Any:
                if oob and is_arena_body(body):
                    return self._loads_copies(memoryview(body))
                return decode_pickle(body, oob)

            return decode_copies

        def decode_expanded(body: Any, oob: bool) -> Any:
            if oob and is_arena_body(body):
                return decode(self.expand(memoryview(body)), oob)
            return decode(body, oob)

        return decode_expanded

    def _loads_views(self, mv: memoryview) -> Any:
        _n, lens, rec, off, stream = _parse(mv)
        span = sum(_align(ln & ~_BYTES_KIND) for ln in lens)
        token = next(_tokens)
        # The pin is stored before the cursor moves past the message (program order, the
        # cursor's store-release): the writer that sees the cursor sees the pin.
        self.pins[rec] = token
        holder = (ctypes.c_ubyte * span).from_buffer(self.mm, self.data_offset + off)
        weakref.finalize(holder, self._unpin, rec, token)
        whole = memoryview(holder).cast("B")
        buffers = []
        twins = writable_twins()
        at = 0
        for ln in lens:
            size = ln & ~_BYTES_KIND
            view = whole[at : at + size]
            ro = view.toreadonly()
            twins[id(ro)] = view
            buffers.append(ro)
            at += _align(size)
        try:
            return pickle.loads(stream, buffers=buffers)
        finally:
            twins.clear()

    def _copy(self, off: int, lens: list[int]) -> list[Buffer]:
        data = memoryview(self.mm)
        try:
            out: list[Buffer] = []
            at = self.data_offset + off
            for ln in lens:
                size = ln & ~_BYTES_KIND
                piece = data[at : at + size]
                out.append(bytes(piece) if ln & _BYTES_KIND else bytearray(piece))
                piece.release()
                at += _align(size)
            return out
        finally:
            data.release()

    def _loads_copies(self, mv: memoryview) -> Any:
        _n, lens, _rec, off, stream = _parse(mv)
        return pickle.loads(stream, buffers=self._copy(off, lens))

    def expand(self, mv: memoryview) -> bytes:
        """The ordinary out-of-band body an arena body stands for (its buffers copied in)."""
        n, lens, _rec, off, stream = _parse(mv)
        head = struct.pack(f"<{n + 2}Q", n, len(stream), *lens)
        return b"".join([head, stream, *self._copy(off, lens)])

    def close(self) -> None:
        """Leave: this place pins nothing any more (views still alive may see their memory
        reused by later messages: docs/design.md)."""
        if self.closed:
            return
        if os.getpid() == self.owner:
            self.clear()
        self.closed = True
        self.pins.release()
        try:
            self.mm.close()
        except BufferError:
            pass  # views are alive: the mapping goes with the last of them

    def forget_in_child(self) -> None:
        self.closed = True
