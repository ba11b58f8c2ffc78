"""Fan-in for code without an event loop: ``BlockingCollector`` and ``BlockingSender``, over the
same engine (``_fanin.Gather``) and rings as the async roles (docs/fan-in.md). Exported from
``aiobroadcast.blocking``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from time import monotonic
from typing import TYPE_CHECKING, Any, Generic, Literal, NoReturn, TypeVar, final, overload

from pydantic import BaseModel

from .._base import fork as _fork
from .._base import tuning as _tuning
from .._base.errors import BroadcastError, ClosedResourceError, EndOfStream, WaitTimeout, WouldBlock
from .._base.files import unlink_quietly
from .._base.handle import CurveKeys, Handle, Policy
from .._broadcast import blocking as blocking_roles
from .._broadcast.blocking import ThreadWaits
from .._broadcast.open import DEFAULT_DIRECTORY
from .._shm.owned import Owned
from .gather import NOTHING, Gather, check_max_items
from .handle import COLLECTOR_FIX, SENDER_FIX, CollectorHandle
from .items import CollectorStatistics, Delivery
from .open import CollectorSpec
from .remote import RemoteOptions, blocking_channel
from .rendezvous import SenderArgs, SenderPlan, check_sender, guard, orphaned

T_co = TypeVar("T_co", covariant=True)
T_contra = TypeVar("T_contra", contravariant=True)
M = TypeVar("M", bound=BaseModel)

_private = object()


@final
@_fork.role("collector", COLLECTOR_FIX)
class BlockingCollector(Generic[T_co]):
    """The receiving end of a fan-in, for code without an event loop. Built by
    ``aiobroadcast.blocking.open_collector``; has no ``put``. ``get`` returns what
    ``Collector.get`` returns. Thread-safe: threads each take distinct deliveries."""

    def __init__(self, token: object, gather: Gather) -> None:
        if token is not _private:
            raise TypeError("BlockingCollector cannot be built directly; use aiobroadcast.blocking.open_collector()")
        self._g = gather
        self._lock = Owned()  # one taker at a time
        self._waits = ThreadWaits(None)  # one sleeper at a time; polls as an adaptive reader does
        self._closing = False

    @property
    def handle(self) -> CollectorHandle:
        return self._g.handle

    def get_nowait(self) -> Delivery[T_co]:
        """The next delivery, or ``WouldBlock``. Raises like ``Collector.get_nowait``."""
        obj = self._take()
        if obj is NOTHING:
            raise WouldBlock
        return obj  # type: ignore[no-any-return]

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
        except EndOfStream:
            raise StopIteration from None
        except ClosedResourceError:
            if self._g.refusal is None:
                raise StopIteration from None
            raise

    def __repr__(self) -> str:
        g = self._g
        state = "closed" if g.closed else f"senders={len(g.feeds)} received={g.received}"
        return f"<aiobroadcast.blocking.BlockingCollector {g.handle.name} {state}>"

    def __del__(self) -> None:
        g = getattr(self, "_g", None)
        if g is not None and not g.closed:
            import warnings

            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1, source=self)

    def __reduce__(self) -> NoReturn:
        raise BroadcastError("a BlockingCollector cannot be pickled: send collector.handle and open_sender there")

    if not TYPE_CHECKING:

        @property
        def put(self) -> NoReturn:
            raise AttributeError(
                "a BlockingCollector has no put(): senders put, each in its own role: "
                "aiobroadcast.blocking.open_sender(collector.handle, name=...).put(item)"
            )

        put_nowait = put_many = put

    def _take(self) -> Any:
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
        b = blocking_roles
        deadline = None if timeout is None else b._deadline(timeout)
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
class BlockingSender(Generic[T_contra]):
    """One sending end of a fan-in, for code without an event loop. Built by
    ``aiobroadcast.blocking.open_sender``; has no ``get``. Thread-safe as ``BlockingWriter``."""

    def __init__(self, token: object, writer: Any, name: str, collector: CollectorHandle) -> None:
        if token is not _private:
            raise TypeError("BlockingSender cannot be built directly; use aiobroadcast.blocking.open_sender()")
        self._w = writer
        ch = writer._w
        self._pub = ch.pub
        self._words = ch.seg.words
        self._active, self._watch = guard(ch, collector)
        self._remote: Handle | None = writer.handle if ch.server is not None else None
        self._name = name
        self._collector = collector

    @property
    def name(self) -> str:
        return self._name

    @property
    def handle(self) -> CollectorHandle:
        return self._collector

    @property
    def remote_handle(self) -> Handle | None:
        """As ``Sender.remote_handle``: what a collector attaches (a remote sender), else None."""
        return self._remote

    def _check(self, after: bool = False) -> None:
        """As ``Sender._check``: before a put, or ``after`` one."""
        pub = self._pub
        closed = self._w._closing or pub.closed
        check_sender(
            closed,
            pub.refusal,
            lambda: self._w._w.owner,
            self._words,
            self._active,
            self._watch,
            self._collector,
            self._name,
            pub.head if after else None,
        )

    def put_nowait(self, obj: T_contra) -> None:
        """Send ``obj`` now, or ``WouldBlock``. Raises like ``BlockingWriter.put_nowait``, and
        ``CollectorGone``."""
        self._check()
        self._w.put_nowait(obj)
        self._check(after=True)

    def put(self, obj: T_contra, timeout: float | None = None) -> None:
        """Send ``obj``, blocking while the ring is full. Raises like ``BlockingWriter.put``, and
        ``CollectorGone`` once the collector has closed or died."""
        words = self._words
        active = self._active
        # _check, written out for the usual case, as in Sender.put (a worker's every reply).
        if self._w._closing or self._pub.closed or not words[active] or monotonic() >= self._watch.next:
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

    def _timed_out(self, exc: WaitTimeout) -> WaitTimeout:
        """A put's ``WaitTimeout`` (it names the holders: the collector's place in this sender's
        ring, or the TCP server and the remote collector behind it), said of this sender."""
        return WaitTimeout(
            f"sender {self._name!r} of collector {self._collector.name!r}, whose ring only the collector reads: {exc}",
            holders=exc.holders,
        )

    def close(self) -> None:
        """Close: the collector takes what was sent, then reports ``SourceClosed(name)``."""
        if self._w._closing or self._pub.closed:
            self._w.close()
            return
        orphan = orphaned(self._words, self._active, self._collector)
        self._w.close()
        if orphan:
            unlink_quietly(self._w.handle.path)

    def __enter__(self) -> BlockingSender[T_contra]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<aiobroadcast.blocking.BlockingSender {self._name!r} to {self._collector.name}>"

    def __reduce__(self) -> NoReturn:
        raise BroadcastError("a BlockingSender cannot be pickled: send the collector's handle and open_sender there")

    if not TYPE_CHECKING:

        @property
        def get(self) -> NoReturn:
            raise AttributeError(
                "a BlockingSender has no get(): only the collector receives "
                "(aiobroadcast.blocking.open_collector(), then collector.get())"
            )

        get_nowait = get_many = get


@overload
def open_collector(
    *,
    expect: Iterable[str] | None = ...,
    schema: None = ...,
    codec: Literal["pickle", "json"] = ...,
    capacity: int = ...,
    slot_bytes: int = ...,
    policy: Policy = ...,
    max_message_bytes: int | None = ...,
    directory: str = ...,
) -> BlockingCollector[Any]: ...
@overload
def open_collector(
    *,
    expect: Iterable[str] | None = ...,
    schema: type[M],
    codec: Literal["pickle", "json"] = ...,
    capacity: int = ...,
    slot_bytes: int = ...,
    policy: Policy = ...,
    max_message_bytes: int | None = ...,
    directory: str = ...,
) -> BlockingCollector[M]: ...
def open_collector(
    *,
    expect: Iterable[str] | None = None,
    schema: type[BaseModel] | None = None,
    codec: Literal["pickle", "json"] = "pickle",
    capacity: int = 64,
    slot_bytes: int = 1 << 16,
    policy: Policy = "block",
    max_message_bytes: int | None = None,
    directory: str = DEFAULT_DIRECTORY,
) -> BlockingCollector[Any]:
    """Create a collector and return its blocking role; the arguments and errors are those of
    ``aiobroadcast.open_collector``. Use ``with`` or call ``close()``."""
    spec = CollectorSpec(
        expect=expect,
        schema=schema,
        codec=codec,
        capacity=capacity,
        slot_bytes=slot_bytes,
        policy=policy,
        max_message_bytes=max_message_bytes,
        directory=directory,
    )
    return BlockingCollector(_private, spec.create())


@overload
def open_sender(
    handle: CollectorHandle | str,
    *,
    name: str,
    schema: None = ...,
    capacity: int | None = ...,
    slot_bytes: int | None = ...,
    connect_timeout: float = ...,
    tcp: str | None = ...,
    advertise: str | None = ...,
    keys: CurveKeys | None = ...,
    heartbeat_s: float = ...,
    data_port: int = ...,
) -> BlockingSender[Any]: ...
@overload
def open_sender(
    handle: CollectorHandle | str,
    *,
    name: str,
    schema: type[M],
    capacity: int | None = ...,
    slot_bytes: int | None = ...,
    connect_timeout: float = ...,
    tcp: str | None = ...,
    advertise: str | None = ...,
    keys: CurveKeys | None = ...,
    heartbeat_s: float = ...,
    data_port: int = ...,
) -> BlockingSender[M]: ...
def open_sender(
    handle: CollectorHandle | str,
    *,
    name: str,
    schema: type[BaseModel] | None = None,
    capacity: int | None = None,
    slot_bytes: int | None = None,
    connect_timeout: float = 10.0,
    tcp: str | None = None,
    advertise: str | None = None,
    keys: CurveKeys | None = None,
    heartbeat_s: float = 0.5,
    data_port: int = 0,
) -> BlockingSender[Any]:
    """Attach a blocking sender to a collector (made by either API); the arguments and errors
    are those of ``aiobroadcast.open_sender`` (``tcp=``: a remote sender, whose
    ``remote_handle`` the collector attaches). Use ``with`` or call ``close()``."""
    b = blocking_roles
    plan = SenderPlan(
        SenderArgs(handle, name, schema, capacity, slot_bytes, connect_timeout),
        None if tcp is None else RemoteOptions(tcp, advertise, keys, heartbeat_s, data_port),
    )
    if plan.remote is None:
        ch, h = plan.local()
    else:
        spec, h = plan.remote
        ch = blocking_channel(spec)
    return BlockingSender(_private, b.BlockingWriter(b._private, ch), name, h)


# Public through aiobroadcast.blocking, and named so (repr, pickling by name, the docs).
for _public in (BlockingCollector, BlockingSender, open_collector, open_sender):
    _public.__module__ = "aiobroadcast.blocking"
