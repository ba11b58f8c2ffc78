"""Fan-in for code without an event loop: ``BlockingCollector`` and ``BlockingSender``, over the
same engine (``gather.Gather``), rings and bases (``CollectorBase``, ``SenderBase``) as the async
roles, waiting as the blocking reader does (``ThreadWaits``), and their factories, which take
``open``'s options (docs/fan-in.md). Exported from ``aiobroadcast.blocking``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from time import monotonic
from typing import Any, TypeVar, Unpack, final, overload

from pydantic import BaseModel

from .._base import fork as _fork
from .._base import tuning as _tuning
from .._base.errors import ClosedResourceError, EndOfStream, WaitTimeout, WouldBlock
from .._base.handle import Handle
from .._broadcast.blocking import BlockingWriter, ThreadWaits
from .._broadcast.blocking import _deadline as deadline_after
from .._broadcast.blocking import _private as _blocking_writer_token
from .._broadcast.channel import WriterChannel
from .._shm.owned import Owned
from .collector import CollectorBase
from .gather import NOTHING, Gather, check_max_items
from .handle import COLLECTOR_FIX, SENDER_FIX, CollectorHandle
from .items import CollectorStatistics, Delivery
from .open import CollectorOptions, CollectorSpec, SenderOptions, refuse_unknown, sender_plan
from .remote import blocking_channel
from .sender import SenderBase

T_co = TypeVar("T_co", covariant=True)
T_contra = TypeVar("T_contra", contravariant=True)
M = TypeVar("M", bound=BaseModel)

_private = object()


@final
@_fork.role("collector", COLLECTOR_FIX)
class BlockingCollector(CollectorBase[T_co]):
    """The receiving end of a fan-in, for code without an event loop. Built by
    ``aiobroadcast.blocking.open_collector``; has no ``put``. ``get`` returns what
    ``Collector.get`` returns. Thread-safe: threads each take distinct deliveries."""

    _ROLE = "BlockingCollector"
    _TITLE = "aiobroadcast.blocking.BlockingCollector"
    _SEND = "aiobroadcast.blocking.open_sender(collector.handle, name=...).put(item)"

    def __init__(self, token: object, gather: Gather) -> None:
        super().__init__(token, _private, gather)
        self._lock = Owned()  # one taker at a time
        self._waits = ThreadWaits(None)  # one sleeper at a time; polls as an adaptive reader does
        self._closing = False
        self._take = self._locked_take

    def get(self, timeout: float | None = None) -> Delivery[T_co]:
        """Wait for the next delivery (blocking this thread in ``poll()`` on the collector's one
        socket). ``timeout``: ``WaitTimeout`` after that many seconds, having taken nothing."""
        return self._until(self._g.take, timeout, "get")  # type: ignore[no-any-return]

    def get_many(self, max_items: int = _tuning.AHEAD_MESSAGES, timeout: float | None = None) -> list[Delivery[T_co]]:
        """Wait for the next delivery, then return it with the ones the collector took with it
        (``Collector.get_many``), up to ``max_items``. ``timeout`` as for ``get``."""
        check_max_items(max_items)
        g = self._g
        return self._until(lambda: g.take_many(max_items) or NOTHING, timeout, "get_many")  # type: ignore[no-any-return]

    def statistics(self) -> CollectorStatistics:
        try:
            self._lock.acquire(None)
            return self._g.statistics(self._waits.tasks)
        finally:
            self._lock.release()

    def check_now(self) -> None:
        """As ``Collector.check_now``, under this collector's lock."""
        try:
            self._lock.acquire(None)
            self._g.check_now()
        finally:
            self._lock.release()

    def attach(self, handle: Handle | str, *, name: str, connect_timeout: float = 10.0) -> None:
        """Read a remote sender (``Collector.attach``)."""
        h, src = self._g.senders.remote_source(handle, name)
        src.wait_welcome_blocking(connect_timeout)
        try:
            self._lock.acquire(None)
            self._g.senders.add_remote(name, h, src)
        finally:
            self._lock.release()

    def close(self) -> None:
        """Close: leave every sender's ring (their ``put`` raises ``CollectorGone``), remove the
        rendezvous; parked ``get`` calls raise ``ClosedResourceError``."""
        sleep_lock = self._waits.lock
        if self._lock.mine() or sleep_lock.mine():
            raise WouldBlock("close() called from inside this collector's own get() on this thread")
        g = self._g
        if g.closed:
            return
        self._closing = True
        g.interrupt()  # the sleeping thread looks up and sees _closing
        try:
            sleep_lock.acquire(None)
            try:
                self._lock.acquire(None)
                g.close()
            finally:
                self._lock.release()
        finally:
            sleep_lock.release()

    def __enter__(self) -> BlockingCollector[T_co]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Delivery[T_co]]:
        return self

    def __next__(self) -> Delivery[T_co]:
        try:
            return self.get()
        except (EndOfStream, ClosedResourceError) as exc:
            if self._ends_iteration(exc):
                raise StopIteration from None
            raise

    def _locked_take(self) -> Any:
        lock = self._lock
        try:
            lock.acquire(None)
            return self._g.take()
        finally:
            lock.release()

    def _until(self, take: Callable[[], Any], timeout: float | None, what: str) -> Any:
        """``take()`` under the lock until it finds something (``get``, ``get_many``), sleeping
        on the inbox between tries; ``WaitTimeout`` after ``timeout`` seconds, having taken
        nothing."""
        deadline = None if timeout is None else deadline_after(timeout)
        lock = self._lock
        if lock.mine():
            raise WouldBlock(f"{what}() called from inside this collector's own get() on this thread")
        while True:
            try:
                lock.acquire(None)
                obj = take()
            finally:
                lock.release()
            if obj is not NOTHING:
                return obj
            if self._closing:
                raise ClosedResourceError(f"this collector was closed while {what}() waited")
            self._waits.wait(self._g, self._is_closing, deadline)

    def _is_closing(self) -> bool:
        return self._closing or self._g.closed


@final
@_fork.role("sender", SENDER_FIX)
class BlockingSender(SenderBase[T_contra]):
    """One sending end of a fan-in, for code without an event loop. Built by
    ``aiobroadcast.blocking.open_sender``; has no ``get``. Thread-safe as ``BlockingWriter``."""

    _ROLE = "BlockingSender"
    _TITLE = "aiobroadcast.blocking.BlockingSender"
    _RECEIVE = "aiobroadcast.blocking.open_collector(), then collector.get()"

    # Sender's class attributes and __init__, with the blocking writer: each role class names its
    # own words and builds its own writer (SenderBase holds the rest).
    def __init__(self, token: object, channel: WriterChannel, name: str, collector: CollectorHandle) -> None:
        self._check_token(token, _private)
        self._w: BlockingWriter[Any] = BlockingWriter(_blocking_writer_token, channel)
        #: ``close`` has begun: no put may begin (the writer is this sender's own; only it closes it)
        self._closing = False
        super().__init__(channel, name, collector)

    def put(self, obj: T_contra, timeout: float | None = None) -> None:
        """Send ``obj``, blocking while the ring is full. Raises like ``BlockingWriter.put``, and
        ``CollectorGone`` once the collector has closed or died."""
        words = self._words
        active = self._active
        # _check, written out for the usual case, as in Sender.send_now (a worker's every reply).
        if self._closing or self._pub.closed or not words[active] or monotonic() >= self._watch.next:
            self._check()
        try:
            self._w.put(obj, timeout)
        except WaitTimeout as exc:
            raise self._timed_out(exc) from None
        if not words[active]:
            self._check(after=True)

    def put_many(self, objs: Iterable[T_contra], timeout: float | None = None) -> None:
        """Send several items as one operation (``BlockingWriter.put_many``)."""
        self._check()
        try:
            self._w.put_many(objs, timeout)
        except WaitTimeout as exc:
            raise self._timed_out(exc) from None
        self._check(after=True)

    def close(self) -> None:
        """Close: the collector takes what was sent, then reports ``SourceClosed(name)``."""
        if self._closing or self._pub.closed:
            self._w.close()  # another thread's close: wait for it
            return
        self._closing = True
        orphan = self._orphaned()
        self._w.close()
        if orphan:
            self._remove_ring()

    def __enter__(self) -> BlockingSender[T_contra]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _closed(self) -> bool:
        return self._closing or self._pub.closed

    def _timed_out(self, exc: WaitTimeout) -> WaitTimeout:
        """A put's ``WaitTimeout`` (it names the holders: the collector's place in this sender's
        ring, or the TCP server and the remote collector behind it), said of this sender."""
        return WaitTimeout(
            f"sender {self._name!r} of collector {self._collector.name!r}, whose ring only the collector reads: {exc}",
            holders=exc.holders,
        )


@overload
def open_collector(*, schema: None = ..., **options: Unpack[CollectorOptions]) -> BlockingCollector[Any]: ...
@overload
def open_collector(*, schema: type[M], **options: Unpack[CollectorOptions]) -> BlockingCollector[M]: ...
def open_collector(
    *, schema: type[BaseModel] | None = None, **options: Unpack[CollectorOptions]
) -> BlockingCollector[Any]:
    """Create a collector and return its blocking role; the arguments, their defaults and the
    errors are those of ``aiobroadcast.open_collector``. Use ``with`` or call ``close()``."""
    refuse_unknown("open_collector", options, CollectorOptions)
    return BlockingCollector(_private, CollectorSpec(schema=schema, **options).create())


@overload
def open_sender(
    handle: CollectorHandle | str, *, name: str, schema: None = ..., **options: Unpack[SenderOptions]
) -> BlockingSender[Any]: ...
@overload
def open_sender(
    handle: CollectorHandle | str, *, name: str, schema: type[M], **options: Unpack[SenderOptions]
) -> BlockingSender[M]: ...
def open_sender(
    handle: CollectorHandle | str, *, name: str, schema: type[BaseModel] | None = None, **options: Unpack[SenderOptions]
) -> BlockingSender[Any]:
    """Attach a blocking sender to a collector (made by either API); the arguments, their
    defaults and the errors are those of ``aiobroadcast.open_sender`` (``tcp=``: a remote
    sender, whose ``remote_handle`` the collector attaches). Use ``with`` or call ``close()``."""
    plan = sender_plan(handle, name, schema, options)
    if plan.remote is None:
        ch, h = plan.local()
    else:
        spec, h = plan.remote
        ch = blocking_channel(spec)
    return BlockingSender(_private, ch, name, h)


# Public through aiobroadcast.blocking, and named so (repr, pickling by name, the docs).
for _public in (BlockingCollector, BlockingSender, open_collector, open_sender):
    _public.__module__ = "aiobroadcast.blocking"
