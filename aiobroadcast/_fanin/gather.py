"""The collector's engine, with no event loop (``Gather``): its inbox, the turns it takes among
its senders' rings, and its one sleeper's wait (``sleep_steps``), shared by both front ends."""

from __future__ import annotations

import json
import os
import shutil
from collections import deque
from collections.abc import Callable, Iterable
from time import monotonic, perf_counter_ns
from typing import Any

from pydantic import BaseModel

from .._base import fork as _fork
from .._base import tuning as _tuning
from .._base.errors import (
    BroadcastError,
    ClosedResourceError,
    DeserializationError,
    EndOfStream,
    InvalidArgument,
    ReaderLagged,
    TransportError,
    WouldBlock,
    WriterGone,
)
from .._base.files import unlink_quietly
from .._base.handle import (
    require,
)
from .._base.steps import Steps, poll_steps
from .._shm import segment as _segment
from .._shm.layout import fence
from .._shm.wake import Inbox, Outbox
from .deaths import SenderDeaths
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


def take_many(g: Gather, limit: int) -> list[Any]:
    """The next delivery (``g.take()``; an empty list if none is ready), then, up to ``limit``,
    the deliveries ``g.take()`` would hand out next from what the collector holds already: the
    rest of the batch the current sender's ring gave in this turn (``Gather.take``'s fast path).
    So a batch is what as many takes would return, in their order, and holds at most one ring's
    batch of decoded items (``AHEAD_MESSAGES``, about ``AHEAD_BYTES`` of bodies): a batch of
    large items never piles up the whole of every ring. Only the first take touches a ring, so
    only it can raise (nothing taken) or be interrupted."""
    obj = g.take()
    if obj is NOTHING:
        return []
    out = [obj]
    f = g._cur
    if f is not None:
        # What ``take``'s fast path would do for each (count the turn and the item, hand out
        # the next decoded one), for the run at once: a take per item cost the collector as
        # much again as the Item it builds.
        ahead = f.ahead
        n = min(limit - 1, _tuning.AHEAD_MESSAGES - g._turn, len(ahead))
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
            g._turn += taken
            g.received += taken
    return out


def check_max_items(max_items: object) -> int:
    if type(max_items) is not int or max_items < 1:
        raise InvalidArgument(f"max_items must be a positive integer, not {max_items!r}")
    return max_items


class Gather(Senders):
    """The collector's state: the rendezvous directory, its one inbox, the senders' rings and
    the turns among them. Shared by ``Collector`` and ``BlockingCollector``; one taker at a time
    (the facades make sure)."""

    def __init__(self, handle: CollectorHandle, schema: type[BaseModel] | None, expect: Iterable[str] | None) -> None:
        self.handle = handle
        self._schema = schema
        self._dir = handle.path
        self._expect = None if expect is None else frozenset(expect)
        if self._expect is not None:
            for n in self._expect:
                require(name_problem(n))
        self._ended: set[str] = set()
        self.feeds: list[Feed] = []
        self._known: set[str] = set()
        self._rr = 0
        self._turn = 0
        #: The sender whose turn it is, while it has items taken ahead (``take``'s fast path).
        self._cur: Feed | None = None
        self._taking = False
        self._events: deque[Any] = deque()
        self.received = 0
        self.closed_count = 0
        self.gone_count = 0
        self._since_check = 0
        self._last_check = 0.0  # the first take looks at once
        self.closed = False
        self.refusal: str | None = None
        self.owner = os.getpid()
        os.mkdir(self._dir, 0o700)
        try:
            self._lock_fd = os.open(handle.lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            if not _segment.try_lock(self._lock_fd, 0):  # pragma: no cover - the file is new
                raise BroadcastError(f"cannot lock {handle.lock_path}")
            os.write(self._lock_fd, json.dumps({"pid": os.getpid()}).encode())
            self.inbox = Inbox(handle.inbox_path)
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._outbox = Outbox()
        #: The senders' pidfds: a death knocks the inbox at once (``_fanin_deaths``).
        self._deaths = SenderDeaths(handle.inbox_path)
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

    def _take(self) -> Any:
        if self._events:
            return self._events.popleft()
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
        f = self.feeds.pop(i)
        self._cur = None
        if self._rr > i:
            self._rr -= 1
        self._turn = 0
        self._known.discard(f.name)
        self._ended.add(f.name)
        self._let_go(f)
        if isinstance(event, SourceGone):
            self.gone_count += 1
        else:
            self.closed_count += 1
        return event

    def _let_go(self, f: Feed) -> None:
        """Leave a sender's ring and remove its files: a sender leaves its ring's segment to its
        collector (it may attach after the sender closed); its card frees its name."""
        f.src.close()
        if f.ring is None or f.link is None:
            return  # a remote sender: nothing of it here
        self._deaths.forget(f.name)
        for path in (f.ring.path, f.ring.path + "-w.sock", f.ring.path + "-r0.sock"):
            unlink_quietly(path)
        self._unlink_link(f.link, f.ring.name)

    def ready(self) -> bool:
        return bool(self._events) or self.inbox.knocked or any(f.src.ready() for f in self.feeds)

    # --- sleeping --------------------------------------------------------------------------
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

    def end_sleep(self) -> None:
        for f in self.feeds:
            f.src.retract_sleep()
        if self.closed:
            return
        if self.inbox.knocked:
            self.inbox.knocked = False
            self.rescan()
        if self._deaths.fired or monotonic() - self._last_check >= _tuning.LIVENESS_S:
            self.check_now()

    @property
    def sleep_limit_s(self) -> float:
        return _tuning.LIVENESS_S

    # --- discovery and liveness ------------------------------------------------------------
    def check_now(self) -> None:
        """Look for new senders, and for dead ones among those with nothing to read."""
        self._last_check = monotonic()
        self.inbox.knocked = False
        self._deaths.fired = False
        for f in self.feeds:
            f.src.check_writer()
        self.rescan()

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
        self.rescan()  # senders not attached yet learn it too: their place is left, not kept
        self.closed = True
        _fork.untrack(self)
        for f in self.feeds:
            self._let_go(f)
        self.feeds = []
        self._cur = None
        self._deaths.close()
        self.inbox.close()
        self._outbox.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        os.close(self._lock_fd)

    def _forget_in_child(self) -> None:
        """A fork child's copy: refuse every use; the rings' sources and the inbox let go of
        their own copies (they are tracked themselves); nothing is removed."""
        self.closed = True
        self.refusal = _fork.refusal("collector", self.owner, COLLECTOR_FIX)
        try:
            os.close(self._lock_fd)
        except OSError:
            pass
        self._deaths.forget_in_child()


def sleep_steps(g: Gather, slept_ns: int, stop: Callable[[], bool], left_s: Callable[[], float | None]) -> Steps[int]:
    """A collector's one sleeper, waiting for an item (both front ends): poll for a while when
    items came densely (it was woken recently), else sleep on the inbox, that every sender's
    ring knocks, for up to ``g.sleep_limit_s`` (or what ``left_s`` says is left of a deadline;
    ``left_s`` raises once it passed). ``stop``: the collector is closing. Returns the new
    ``slept_ns`` (how long the last sleep took: 0 after a poll that found an item)."""
    spin = _tuning.POLL_NS if slept_ns < _tuning.DENSE_NS else 0
    left = left_s()
    if left is not None:
        spin = min(spin, int(left * 1e9))
    if spin and (yield from poll_steps(lambda: stop() or g.ready(), spin)):
        return 0
    limit = g.sleep_limit_s
    left = left_s()
    if left is not None:
        limit = min(limit, left)
    if g.begin_sleep():
        return slept_ns
    start = perf_counter_ns()
    try:
        yield limit
    finally:
        g.end_sleep()
    return perf_counter_ns() - start
