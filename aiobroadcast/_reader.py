"""The reader role."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Any, Generic, TypeVar, final

import anyio
import anyio.lowlevel

from . import _ring
from ._codec import decode_pickle
from ._exceptions import (
    ClosedResourceError,
    DeserializationError,
    EndOfStream,
    InvalidHandle,
    ReaderLagged,
    TooManyReaders,
    WouldBlock,
    WriterGone,
)
from ._handle import Handle
from ._ring import (
    BUSY,
    EMPTY,
    F_FIRST,
    F_LAST,
    F_OOB,
    F_WHOLE,
    R_ACTIVE,
    R_CURSOR,
    R_GENERATION,
    R_PID,
    R_RECEIVED,
    SLOT_REST,
    W_CLOSED,
    W_HEAD,
    W_NEXT_MSG,
    W_WAIT_TARGET,
    W_WRITER_PID,
    Segment,
    fence,
)
from ._stats import ReaderStatistics
from ._wake import Inbox, Outbox
from ._writer import LIVENESS_S, YIELD_EVERY

T_co = TypeVar("T_co", covariant=True)

_private = object()

Decoder = Callable[[memoryview | bytes | bytearray, bool], Any]


@final
class Reader(Generic[T_co]):
    """The receiving end of a channel. Built by ``open_reader``; has no ``put``.

    Receives every message published after it attached, in order. Several tasks of one process
    may share a reader: each ``get`` takes a distinct message.
    """

    def __init__(self, token: object, seg: Segment, handle: Handle, name: str, decode: Decoder) -> None:
        if token is not _private:
            raise TypeError("Reader cannot be built directly; use aiobroadcast.open_reader()")
        self._seg = seg
        self._handle = handle
        self._name = name
        self._decode = decode
        lay = seg.layout
        self._cap = lay.capacity
        self._slot_bytes = lay.slot_bytes
        self._data = lay.data_offset
        self._block = handle.policy == "block"
        self._words = seg.words
        self._buf = seg.buf
        self._index = -1
        self._cursor = 0
        self._next_msg = 0
        self._received = 0
        self._lagged_total = 0
        self._partial: bytearray | None = None
        self._partial_msg = -1
        self._partial_fill = 0
        self._partial_flags = 0
        self._writer_gone = False
        self._episode = 0
        self._leader: anyio.Event | None = None
        self._tasks_waiting = 0
        self._since_yield = 0
        self._closed = True
        self._inbox: Inbox | None = None
        self._outbox = Outbox()
        self._writer_sock = seg.sock_path("w")
        self._join()
        self._closed = False

    # --- joining and leaving -------------------------------------------------------------
    def _join(self) -> None:
        seg = self._seg
        lay = seg.layout
        w = self._words
        for i in range(lay.max_readers):
            if _ring.try_lock(seg.fd, _ring.reader_lock_byte(i)):
                break
        else:
            raise TooManyReaders(lay.max_readers)
        self._index = i
        try:
            if _ring.is_locked(seg.fd, _ring.WRITER_LOCK_BYTE) is False or w[W_CLOSED]:
                raise InvalidHandle(f"the writer of {self._handle.name} has closed or exited")
            self._inbox = Inbox(seg.sock_path(f"r{i}"))
            self._cur_word = lay.record_word(i, R_CURSOR)
            self._recv_word = lay.record_word(i, R_RECEIVED)
            self._wait_word = lay.waiting_word(i)
            w[lay.record_word(i, R_PID)] = os.getpid()
            w[lay.record_word(i, R_GENERATION)] += 1
            w[self._recv_word] = 0
            seg.write_name(i, self._name)
            w[self._wait_word] = 0
            # docs/design.md, "Joining without missing anything".
            w[self._cur_word] = w[W_HEAD]
            w[lay.record_word(i, R_ACTIVE)] = 1
            fence()
            while True:
                n1 = w[W_NEXT_MSG]
                h2 = w[W_HEAD]
                if w[W_NEXT_MSG] == n1:
                    break
            self._cursor = h2
            self._next_msg = n1
            w[self._cur_word] = h2
        except BaseException:
            self._leave()
            raise

    def _leave(self) -> None:
        seg = self._seg
        i = self._index
        if i < 0:
            return
        w = self._words
        w[seg.layout.record_word(i, R_ACTIVE)] = 0
        w[seg.layout.waiting_word(i)] = 0
        fence()
        if w[W_WAIT_TARGET]:
            self._outbox.wake(self._writer_sock)  # the writer may be waiting for us
        if self._inbox is not None:
            self._inbox.close()
        _ring.unlock(seg.fd, _ring.reader_lock_byte(i))
        self._index = -1

    # --- public API ----------------------------------------------------------------------
    @property
    def handle(self) -> Handle:
        return self._handle

    @property
    def name(self) -> str:
        return self._name

    def get_nowait(self) -> T_co:
        """Take the next message, or raise ``WouldBlock`` if none is ready.

        Raises ``EndOfStream`` once the writer closed and everything was received,
        ``WriterGone`` if the writer died (after everything it published was received),
        ``ReaderLagged`` once when messages were overwritten before this reader read them
        (policy "lag"), ``DeserializationError`` for a message that cannot be decoded here
        (it is consumed), and ``ClosedResourceError`` after ``aclose``.
        """
        if self._closed:
            raise ClosedResourceError("this reader is closed")
        w = self._words
        buf = self._buf
        while True:
            c = self._cursor
            off = self._data + (c % self._cap) * self._slot_bytes
            seq = w[off >> 3]
            if seq != c:
                self._not_ready(c, seq)  # raises, or returns after resynchronising
                continue
            msg, flen, flags, total = SLOT_REST.unpack_from(buf, off + 8)
            if flags & F_WHOLE == F_WHOLE and self._partial is None:
                if self._block:
                    body: memoryview | bytes = buf[off + 32 : off + 32 + flen]
                else:
                    body = bytes(buf[off + 32 : off + 32 + flen])
                    if w[off >> 3] != c:  # overwritten while we copied
                        continue
                try:
                    return self._deliver(msg, body, flags & F_OOB)  # type: ignore[no-any-return]
                finally:
                    self._advance(c, 1)
            # A fragment of a larger message.
            if flags & F_FIRST:
                self._partial = bytearray(total)
                self._partial_msg = msg
                self._partial_fill = 0
                self._partial_flags = flags
                self._next_msg = msg
            elif self._partial is None or msg != self._partial_msg:
                self._advance(c, 0)  # the rest of a message we joined or lagged in the middle of
                continue
            partial = self._partial
            assert partial is not None
            fill = self._partial_fill
            partial[fill : fill + flen] = buf[off + 32 : off + 32 + flen]
            if not self._block and w[off >> 3] != c:
                continue
            self._partial_fill = fill + flen
            self._advance(c, 0)
            if flags & F_LAST:
                self._partial = None
                try:
                    return self._deliver(msg, partial, self._partial_flags & F_OOB)  # type: ignore[no-any-return]
                finally:
                    self._count_delivery()

    async def get(self) -> T_co:
        """Wait for the next message and return it.

        Cancel-safe: a cancelled ``get`` has taken nothing. Raises like ``get_nowait``
        (except ``WouldBlock``). A parked ``get`` uses no CPU.
        """
        while True:
            try:
                obj = self.get_nowait()
            except WouldBlock:
                await self._wait()
                continue
            self._since_yield += 1
            if self._since_yield >= YIELD_EVERY:
                self._since_yield = 0
                await anyio.lowlevel.checkpoint()
            return obj

    def statistics(self) -> ReaderStatistics:
        if self._closed:
            raise ClosedResourceError("this reader is closed")
        w = self._words
        return ReaderStatistics(
            name=self._name,
            index=self._index,
            received=self._received,
            lagged=self._lagged_total,
            lag=max(0, w[W_HEAD] - self._cursor),
            tasks_waiting=self._tasks_waiting,
            writer_pid=w[W_WRITER_PID],
            writer_closed=bool(w[W_CLOSED]),
        )

    async def aclose(self) -> None:
        """Detach: the writer stops waiting for this reader at once."""
        if self._closed:
            return
        self._closed = True
        self._leave()
        self._outbox.close()
        if self._leader is not None:
            self._leader.set()
        self._seg.close()

    def __aiter__(self) -> Reader[T_co]:
        return self

    async def __anext__(self) -> T_co:
        try:
            return await self.get()
        except EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> Reader[T_co]:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"received={self._received} place={self._index}"
        return f"<aiobroadcast.Reader {self._name!r} {self._handle.name} {state}>"

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1, source=self)

    # --- internals -----------------------------------------------------------------------
    def _deliver(self, msg: int, body: memoryview | bytes | bytearray, oob: int) -> Any:
        self._next_msg = msg + 1
        try:
            return self._decode(body, bool(oob))
        except Exception as exc:
            raise DeserializationError(msg, exc) from exc

    def _count_delivery(self) -> None:
        self._received += 1
        self._words[self._recv_word] = self._received

    def _advance(self, c: int, delivered: int) -> None:
        """Release entry ``c``; wake the writer if it waits for exactly this."""
        w = self._words
        self._cursor = c + 1
        w[self._cur_word] = c + 1
        if delivered:
            self._received += 1
            w[self._recv_word] = self._received
        if self._block:
            fence()
            target = w[W_WAIT_TARGET]
            if target and c < target <= c + 1:
                self._outbox.wake(self._writer_sock)

    def _not_ready(self, c: int, seq: int) -> None:
        """Entry ``c`` is not in its slot: raise what that means, or resynchronise and return."""
        w = self._words
        if seq != EMPTY and seq != BUSY and seq > c or (not self._block and w[W_HEAD] - c >= self._cap):
            self._resync_after_lag(c)
            return
        if w[W_CLOSED] or self._writer_gone:
            # The writer stored every entry before `closed`; look once more now that we saw it.
            if w[(self._data + (c % self._cap) * self._slot_bytes) >> 3] == c:
                return
            self._partial = None
            if w[W_CLOSED]:
                raise EndOfStream
            raise WriterGone(w[W_WRITER_PID])
        raise WouldBlock

    def _resync_after_lag(self, c: int) -> None:
        """Policy "lag": the writer overwrote entries we had not read. Skip to the oldest
        entry still held and report how many messages were lost."""
        w = self._words
        buf = self._buf
        while True:
            head = w[W_HEAD]
            new_c = max(c, head - self._cap + 1)
            off = self._data + (new_c % self._cap) * self._slot_bytes
            seq = w[off >> 3]
            msg, _flen, flags, _total = SLOT_REST.unpack_from(buf, off + 8)
            if w[off >> 3] == seq == new_c:
                break
            if new_c == head:  # nothing held yet: everything up to head was lost
                msg, flags = w[W_NEXT_MSG], F_FIRST
                break
        first_kept = msg if flags & F_FIRST else msg + 1
        missed = max(1, first_kept - self._next_msg)
        self._partial = None
        self._next_msg = first_kept
        self._cursor = new_c
        w[self._cur_word] = new_c
        self._lagged_total += missed
        raise ReaderLagged(missed)

    def _ready(self) -> bool:
        """Whether ``get_nowait`` would do anything but raise ``WouldBlock``."""
        w = self._words
        c = self._cursor
        seq = w[(self._data + (c % self._cap) * self._slot_bytes) >> 3]
        return seq == c or (seq != EMPTY and seq != BUSY and seq > c) or bool(w[W_CLOSED]) or self._writer_gone

    async def _wait(self) -> None:
        """Park until the ring may have changed. One task sleeps on the socket; the others
        wait for it on an in-process event."""
        self._tasks_waiting += 1
        try:
            leader = self._leader
            if leader is not None:
                await leader.wait()
                return
            event = self._leader = anyio.Event()
            w = self._words
            try:
                self._episode += 1
                w[self._wait_word] = self._episode
                fence()
                if self._ready():
                    return
                assert self._inbox is not None
                if not await self._inbox.wait(LIVENESS_S) and not self._ready():
                    if not _ring.is_locked(self._seg.fd, _ring.WRITER_LOCK_BYTE):
                        self._writer_gone = True
            finally:
                if not self._closed:
                    w[self._wait_word] = 0
                self._leader = None
                event.set()
        finally:
            self._tasks_waiting -= 1
        if self._closed:
            raise ClosedResourceError("this reader was closed while waiting")
