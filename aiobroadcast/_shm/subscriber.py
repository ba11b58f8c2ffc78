"""A reader's shared-memory side: joining the ring, sleeping, statistics. Taking entries is its
``MessageTaking`` (taking.py), which moves its ``ReaderCursor`` (cursor.py); it holds both."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from .._base import tuning as _tuning
from .._base.handle import Handle
from .._base.stats import ReaderStatistics
from . import segment as _segment
from .arena import ArenaReader
from .cursor import ReaderCursor
from .layout import W_CLOSED, W_HEAD, W_WRITER_PID, fence
from .place import ReaderPlace
from .segment import Segment
from .taking import Decoder, MessageTaking
from .wake import Inbox, Outbox


class ShmSource:
    """Takes entries from the ring for one reader place. Used by one ``Reader``; only one task
    at a time calls ``sleep``. This class joins and leaves the ring, sleeps, and reports; taking
    messages is its ``taking``'s (``MessageTaking``, taking.py), whose ``get_nowait``, ``ready``
    and ``ahead`` it hands out as its own; where the reader is in the ring, giving slots back
    and catching up after a lag are its ``cursor``'s (``ReaderCursor``, cursor.py)."""

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
        ``ReaderPlace.join``). ``take_ahead``: at most how many messages ``MessageTaking._take_ahead`` takes
        at once (``None``: ``_tuning.AHEAD_MESSAGES``, read at each take). ``unique=False``: join
        without claiming the name (the writer's TCP server only; ``ReaderPlace.join``)."""
        self._seg = seg
        self._handle = handle
        self._name = name
        block = handle.policy == "block"
        self._words = seg.words
        self._closed = True
        self.arena: ArenaReader | None = None
        self._outbox = Outbox()
        # Zero-copy reads: a delivered message may be a view of its slot, so the slot is released
        # only at the next get_nowait (or close). Under policy "lag" the body is copied out of the
        # ring anyway (the seqlock read), so there is nothing to hold.
        self.cursor = cursor = ReaderCursor(seg, block, hold and block, self._outbox)
        self.taking = taking = MessageTaking(cursor, decode, take_ahead)
        # The taking's, as this source's own: the reader calls them per message.
        self.get_nowait: Callable[[], Any] = taking.get_nowait
        self.ready: Callable[[], bool] = taking.ready
        self.ahead = taking.ahead
        self._place = place = ReaderPlace(seg, handle.name, name, block, self._outbox)
        try:
            entry, next_msg = place.join(take_over, inbox, reserved, unique)
        except BaseException:
            self._outbox.close()  # else its socket leaks (ResourceWarning) on TooManyReaders etc.
            raise
        cursor.joined(place, entry, next_msg)
        # The place's words and sockets, as attributes: the sleep's announcement reads them.
        self._inbox: Inbox | None = place.inbox
        self._wait_word = place.wait_word
        self._episode = place.episode
        self._closed = False

    def attach_arena(self, path: str, views: bool) -> None:
        """Decode the channel's arena bodies (docs/design.md, "The arena"): as views that pin their
        record for as long as they live (``views``), else as copies."""
        self.arena = ArenaReader(path, self._place.index)
        self.taking.decode = self.arena.decoder(self.taking.decode, views)

    def statistics(self, tasks_waiting: int) -> ReaderStatistics:
        w = self._words
        cur = self.cursor
        waiting = len(self.ahead)  # taken out of the ring, not handed out yet
        return ReaderStatistics(
            name=self._name,
            place=self._place.index,
            received=cur.received - waiting,
            lagged=cur.lagged_total,
            lag=max(0, w[W_HEAD] - cur.entry) + waiting,
            tasks_waiting=tasks_waiting,
            writer_pid=w[W_WRITER_PID],
            writer_closed=bool(w[W_CLOSED]),
        )

    def describe(self) -> str:
        return f"{self._handle.name} place={self._place.index} received={self.cursor.received - len(self.ahead)}"

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

    def leave_place(self) -> None:
        """Leave this reader's place but keep the mapping (its words are still read): the writer
        stops waiting for it at once. ``close`` does the rest."""
        self._place.leave()

    def sleep(self, limit_s: float) -> Awaitable[bool]:
        """A task's wait for a wake-up on this reader's inbox, for up to ``limit_s`` (the wait of
        ``_broadcast.reader.sleep_steps``, which announces the sleep and re-checks the ring first). True if
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
            self.cursor.writer_gone = True
        return self.cursor.writer_gone

    def end_sleep(self, woken: bool) -> None:
        """End a sleep begun with ``begin_sleep``. ``woken``: a datagram arrived. If the ring has
        nothing new (a timeout, the writer's pidfd, or a wake-up with nothing to read, as from a
        writer that stops without closing), the writer's lock is checked."""
        if self._closed:
            return
        self._words[self._wait_word] = 0
        if not self.ready() and not _segment.is_locked(self._seg.fd, _segment.WRITER_LOCK_BYTE):
            self.cursor.writer_gone = True

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
        return self.cursor.next_msg

    @property
    def inbox_fd(self) -> int:
        """The file descriptor a sleeper polls (for callers outside an event loop)."""
        assert self._inbox is not None
        return self._inbox.fileno()

    def drain_inbox(self) -> bool:
        assert self._inbox is not None
        return self._inbox.drain()
