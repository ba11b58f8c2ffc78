"""A reader's shared-memory side: joining the ring, sleeping, statistics; taking entries is in
``taking.py`` and ``cursor.py``, the bases of ``ShmSource``."""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable
from typing import Any

from .._base import tuning as _tuning
from .._base.handle import Handle
from .._base.stats import ReaderStatistics
from . import segment as _segment
from .arena import ArenaReader
from .layout import BUSY, EMPTY, W_CLOSED, W_HEAD, W_WRITER_PID, fence
from .place import ReaderPlace
from .segment import Segment
from .taking import Decoder, MessageTaking
from .wake import Inbox, Outbox


class ShmSource(MessageTaking):
    """Takes entries from the ring for one reader place. Used by one ``Reader``; only one task
    at a time calls ``sleep``. Taking messages (``get_nowait``) is ``MessageTaking``'s
    (taking.py); moving the cursor, giving slots back and catching up after a lag are
    ``ReaderCursor``'s (cursor.py); this class joins and leaves the ring, sleeps, and reports."""

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
        unique: bool = True,
    ) -> None:
        """``take_over``: the pid of a dead reader whose place to take, cursor and all, if the
        writer has not dropped it yet (policy "block" only; see ``_take_over``). ``inbox=False``:
        no wake-up socket of its own (a fan-in collector's ring: the collector sleeps with
        ``announce_sleep``/``retract_sleep`` on its one inbox instead of ``sleep``); ``reserved``:
        ``take_over`` names the place a fan-in sender reserved for its collector (see
        ``ReaderPlace.join``). ``take_ahead``: at most how many messages ``_take_ahead`` takes
        at once (``None``: ``_tuning.AHEAD_MESSAGES``, read at each take). ``unique=False``: join
        without claiming the name (the writer's TCP server only; ``ReaderPlace.join``)."""
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
            self._cursor, self._next_msg = place.join(take_over, inbox, reserved, unique)
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
