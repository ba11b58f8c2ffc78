"""The collector's engine, with no event loop (``Gather``): the turns it takes among its
senders' rings (``feeds.Senders`` attaches them), batches (``take_many``), and the source its one
sleeper sleeps on (a ``_broadcast.reader.Sleeper``), shared by both front ends."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Iterable
from time import monotonic
from typing import Any

from pydantic import BaseModel

from .._base import fork as _fork
from .._base import tuning as _tuning
from .._base.errors import (
    ClosedResourceError,
    DeserializationError,
    EndOfStream,
    InvalidArgument,
    ReaderLagged,
    TransportError,
    WouldBlock,
    WriterGone,
)
from .._base.handle import (
    require,
)
from .._shm.layout import fence
from .._shm.wake import Outbox
from .feeds import Feed, Senders
from .handle import (
    COLLECTOR_FIX,
    CollectorHandle,
    name_problem,
)
from .items import CollectorStatistics, Item, SenderInfo, SourceClosed, SourceGone, SourceLagged

NOTHING: Any = object()  # what Gather.take returns when nothing is ready
#: Liveness and discovery checks while the collector is busy: every this many takes at most.
_CHECK_EVERY = 256


def check_max_items(max_items: object) -> int:
    if type(max_items) is not int or max_items < 1:
        raise InvalidArgument(f"max_items must be a positive integer, not {max_items!r}")
    return max_items


class Gather:
    """The collector's engine: the turns it takes among its senders' rings (``senders``: the
    rendezvous, the inbox, the rings attached), and what its one sleeper sleeps on. Shared by
    ``Collector`` and ``BlockingCollector``; one taker at a time (the facades make sure)."""

    def __init__(self, handle: CollectorHandle, schema: type[BaseModel] | None, expect: Iterable[str] | None) -> None:
        self.handle = handle
        self._expect = None if expect is None else frozenset(expect)
        if self._expect is not None:
            for n in self._expect:
                require(name_problem(n))
        self.senders = Senders(handle, schema)
        self.feeds = self.senders.feeds  # the same list: read per take
        self.inbox = self.senders.inbox
        self._ended: set[str] = set()
        self._rr = 0
        self._turn = 0
        #: The sender whose turn it is, while it has items taken ahead (``take``'s fast path).
        self._cur: Feed | None = None
        self._taking = False
        self.received = 0
        self.closed_count = 0
        self.gone_count = 0
        self._since_check = 0
        self._last_check = 0.0  # the first take looks at once
        self.closed = False
        self.refusal: str | None = None
        self.owner = os.getpid()
        self._outbox = Outbox()
        _fork.track(self)

    # --- taking ----------------------------------------------------------------------------
    def take(self) -> Any:
        """The next delivery in turn, or ``NOTHING``. Raises ``EndOfStream`` once every expected
        sender has been reported closed or gone, and ``DeserializationError`` (with ``source``).
        With nothing to take, looks for new senders (after a knock) and dead ones (every
        ``LIVENESS_S``)."""
        if self.closed:
            raise ClosedResourceError(self.refusal or "this collector is closed")
        f = self._cur
        if f is not None and self._turn < _tuning.AHEAD_MESSAGES:
            # The usual case: the current sender's turn goes on with items its ring gave ahead.
            ahead = f.ahead
            if ahead:
                self._turn += 1
                self.received += 1
                return Item(f.name, ahead.popleft())
        if self._taking:
            return NOTHING  # called from inside decoding (a __setstate__ that takes): never twice
        self._taking = True
        try:
            obj = self._take()
            if obj is NOTHING:
                if self.inbox.knocked or monotonic() - self._last_check >= _tuning.LIVENESS_S:
                    self.check_now()
                    obj = self._take()
                if obj is NOTHING and self._expect is not None and self._expect <= self._ended:
                    raise EndOfStream
        finally:
            self._taking = False
        return obj

    def take_many(self, limit: int) -> list[Any]:
        """The next delivery (``take()``; an empty list if none is ready), then, up to ``limit``,
        the deliveries ``take()`` would hand out next from what the collector holds already: the
        rest of the batch the current sender's ring gave in this turn (``take``'s fast path). So
        a batch is what as many takes would return, in their order, and holds at most one ring's
        batch of decoded items (``AHEAD_MESSAGES``, about ``AHEAD_BYTES`` of bodies): a batch of
        large items never piles up the whole of every ring. Only the first take touches a ring,
        so only it can raise (nothing taken) or be interrupted."""
        obj = self.take()
        if obj is NOTHING:
            return []
        out = [obj]
        f = self._cur
        if f is not None:
            # What ``take``'s fast path would do for each (count the turn and the item, hand out
            # the next decoded one), for the run at once: a take per item cost the collector as
            # much again as the Item it builds.
            ahead = f.ahead
            n = min(limit - 1, _tuning.AHEAD_MESSAGES - self._turn, len(ahead))
            if n > 0:
                name = f.name
                pop = ahead.popleft
                taken = 0
                try:
                    while taken < n:
                        out.append(Item(name, pop()))
                        taken += 1
                except IndexError:  # another thread's get_nowait took the last one meanwhile
                    pass
                self._turn += taken
                self.received += taken
        return out

    def _take(self) -> Any:
        feeds = self.feeds
        n = len(feeds)
        if n:
            i = self._rr
            if i >= n:
                i = self._turn = 0
            for _ in range(n + 1):
                f = feeds[i]
                if self._turn < _tuning.AHEAD_MESSAGES:
                    src = f.src
                    ahead = src.ahead
                    if ahead:
                        self._rr = i
                        self._cur = f
                        self._turn += 1
                        self.received += 1
                        return Item(f.name, ahead.popleft())
                    # A ring with nothing to take is passed over without a get_nowait: asking
                    # costs a fraction of its WouldBlock, paid for each idle ring a take passes
                    # (a call's collector passes every worker's ring for each answer).
                    if src.ready():
                        try:
                            obj = src.get_nowait()
                        except WouldBlock:
                            pass
                        except EndOfStream:
                            return self._end(i, SourceClosed(f.name))
                        except (WriterGone, TransportError):  # TransportError: a remote writer refused us
                            return self._end(i, SourceGone(f.name, f.pid))
                        except ReaderLagged as exc:
                            self._rr = i
                            return SourceLagged(f.name, exc.missed)
                        except DeserializationError as exc:
                            self._rr = i
                            self._turn += 1
                            exc.source = f.name
                            raise
                        else:
                            self._rr = i
                            self._cur = f
                            self._turn += 1
                            self.received += 1
                            self._since_check += 1
                            if self._since_check >= _CHECK_EVERY:
                                # Busy: still look for new and dead senders now and then.
                                self._since_check = 0
                                if self.inbox.knocked or monotonic() - self._last_check >= _tuning.LIVENESS_S:
                                    self.check_now()
                            return Item(f.name, obj)
                i = i + 1 if i + 1 < n else 0
                self._turn = 0
            self._rr = i
        self._cur = None
        return NOTHING

    def _end(self, i: int, event: Any) -> Any:
        """Sender ``i`` closed or died and was drained: report it once, and let go of its ring."""
        f = self.senders.drop(i)
        self._cur = None
        if self._rr > i:
            self._rr -= 1
        self._turn = 0
        self._ended.add(f.name)
        if isinstance(event, SourceGone):
            self.gone_count += 1
        else:
            self.closed_count += 1
        return event

    def ready(self) -> bool:
        return self.inbox.knocked or any(f.src.ready() for f in self.feeds)

    # --- sleeping: the reader's wait machinery sleeps on the collector as on a reader's source
    # (``_broadcast.reader.Sleeper``: ``TaskWaits``, ``ThreadWaits``), on one inbox for all rings.
    def begin_sleep(self) -> bool:
        """Announce a sleep on every ring, fence once, re-check them all. True if there is no
        need to sleep (then nothing is announced any more)."""
        feeds = self.feeds
        for f in feeds:
            f.src.announce_sleep()
        fence()
        if self.ready():
            for f in feeds:
                f.src.retract_sleep()
            return True
        return False

    def end_sleep(self, woken: bool) -> None:
        """End the sleep ``begin_sleep`` announced; then attach the senders that knocked, and
        look for dead ones if a sender's pidfd fired or a look is due (``LIVENESS_S``)."""
        for f in self.feeds:
            f.src.retract_sleep()
        if self.closed:
            return
        if self.inbox.knocked:
            self.inbox.knocked = False
            self.senders.rescan()
        if self.senders.deaths.fired or monotonic() - self._last_check >= _tuning.LIVENESS_S:
            self.check_now()

    @property
    def sleep_limit_s(self) -> float:
        return _tuning.LIVENESS_S

    def sleep(self, limit_s: float) -> Awaitable[bool]:
        """A task's wait on the inbox every sender's ring knocks, for up to ``limit_s``. Raises
        ``anyio.ClosedResourceError`` once closed."""
        return self.inbox.wait(limit_s)

    @property
    def inbox_fd(self) -> int:
        return self.inbox.fileno()

    def drain_inbox(self) -> bool:
        return self.inbox.drain()

    def interrupt(self) -> None:
        """Wake the thread sleeping on the inbox (from another thread): it looks again."""
        self._outbox.wake(self.inbox.path)

    def check_now(self) -> None:
        """Look for new senders, and for dead ones among those with nothing to read."""
        self._last_check = monotonic()
        self.inbox.knocked = False
        self.senders.deaths.fired = False
        self.senders.look()

    # --- state -----------------------------------------------------------------------------
    def statistics(self, tasks_waiting: int) -> CollectorStatistics:
        if self.closed:
            raise ClosedResourceError(self.refusal or "this collector is closed")
        senders = []
        for f in self.feeds:
            s = f.src.statistics(0)
            senders.append(SenderInfo(f.name, f.pid, s.received, s.lag))
        return CollectorStatistics(self.received, tuple(senders), self.closed_count, self.gone_count, tasks_waiting)

    def close(self) -> None:
        """Leave every ring (their senders' puts raise ``CollectorGone``) and remove the directory."""
        if self.closed:
            return
        self.closed = True
        _fork.untrack(self)
        self._cur = None
        self.senders.close()
        self._outbox.close()

    def _forget_in_child(self) -> None:
        """A fork child's copy: refuse every use (``Senders.forget_in_child``)."""
        self.closed = True
        self.refusal = _fork.refusal("collector", self.owner, COLLECTOR_FIX)
        self.senders.forget_in_child(self.refusal)
