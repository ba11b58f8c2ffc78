"""The receiving end of a fan-in: what both front ends share (``CollectorBase``: every method
that does not wait), and the role of an event loop (``Collector``). ``BlockingCollector``
(``blocking``) is the other front end over the same base."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from threading import get_ident as _get_ident
from time import monotonic
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Generic, NoReturn, TypeVar, final

import anyio
import anyio.lowlevel

from .._base import fork as _fork
from .._base import tuning as _tuning
from .._base.errors import (
    BroadcastError,
    ClosedResourceError,
    EndOfStream,
    WaitTimeout,
    WouldBlock,
)
from .._base.handle import (
    Handle,
)
from .._broadcast.reader import TaskWaits
from .gather import NOTHING, Gather, check_max_items
from .handle import (
    COLLECTOR_FIX,
    CollectorHandle,
)
from .items import CollectorStatistics, Delivery

T_co = TypeVar("T_co", covariant=True)

_private = object()


class CollectorBase(Generic[T_co]):
    """What ``Collector`` and ``BlockingCollector`` share: their engine (``Gather``),
    ``get_nowait``, when iteration ends, and what they answer. Only the waiting differs: a
    front end's ``get``, ``get_many``, ``attach`` and close. ``_take``: the engine's ``take``,
    as the front end calls it (the blocking one under its lock). ``_ROLE``/``_TITLE``: the
    role's name and how ``repr`` names it; ``_SEND``: what sends instead (``put``'s error)."""

    _ROLE: ClassVar[str]
    _TITLE: ClassVar[str]
    _SEND: ClassVar[str]
    _take: Callable[[], Any]

    def __init__(self, token: object, mine: object, gather: Gather) -> None:
        """``token`` is the factories' (``mine``, the module's): nothing else builds a role."""
        if token is not mine:
            raise TypeError(
                f"{self._ROLE} cannot be built directly; use {self._TITLE.rpartition('.')[0]}.open_collector()"
            )
        self._g = gather

    @property
    def handle(self) -> CollectorHandle:
        """What a sender needs: pass it (or its JSON) to ``open_sender`` in any process on the host."""
        return self._g.handle

    def get_nowait(self) -> Delivery[T_co]:
        """The next delivery, or ``WouldBlock``. Raises ``EndOfStream`` once every expected
        sender ended, ``DeserializationError`` (its ``source`` says whose) for an item that
        cannot be decoded here (it is consumed), ``ClosedResourceError`` once closed."""
        obj = self._take()
        if obj is NOTHING:
            raise WouldBlock
        return obj  # type: ignore[no-any-return]

    def _ends_iteration(self, exc: Exception) -> bool:
        """Whether ``exc``, raised by ``get``, ends a ``for`` over the collector: every expected
        sender ended, or the collector was closed (not refused in a fork child)."""
        return isinstance(exc, EndOfStream) or (isinstance(exc, ClosedResourceError) and self._g.refusal is None)

    def __repr__(self) -> str:
        g = self._g
        state = "closed" if g.closed else f"senders={len(g.feeds)} received={g.received}"
        return f"<{self._TITLE} {g.handle.name} {state}>"

    def __del__(self) -> None:
        g = getattr(self, "_g", None)
        if g is not None and not g.closed:
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1, source=self)

    def __reduce__(self) -> NoReturn:
        raise BroadcastError(
            f"a {self._ROLE} cannot be pickled or sent to another process: send collector.handle (or its JSON) "
            "and open_sender there"
        )

    if not TYPE_CHECKING:

        @property
        def put(self) -> NoReturn:
            raise AttributeError(f"a {self._ROLE} has no put(): senders put, each in its own role: {self._SEND}")

        put_nowait = put_many = put


@final
@_fork.role("collector", COLLECTOR_FIX)
class Collector(CollectorBase[T_co]):
    """The receiving end of a fan-in. Built by ``open_collector``; has no ``put``.

    ``get`` returns ``Item(source, value)`` for each item a sender put, in each sender's order,
    senders served in turns; and once per sender ``SourceClosed`` or ``SourceGone`` after its
    last item. ``async for`` ends when the collector is closed, or, opened with ``expect=``,
    once every expected sender has been reported closed or gone.

    Its methods belong to the thread whose event loop opened it (several tasks may share it;
    each ``get`` takes a distinct delivery). Threads without a loop use ``BlockingCollector``.
    """

    _ROLE = "Collector"
    _TITLE = "aiobroadcast.Collector"
    _SEND = "open_sender(collector.handle, name=...).put(item)"

    def __init__(self, token: object, gather: Gather) -> None:
        super().__init__(token, _private, gather)
        self._take = gather.take
        self._thread = threading.get_ident()
        self._waits = TaskWaits(None)  # polls as a reader with an adaptive spin_us does
        self._since_yield = 0

    async def get(self) -> Delivery[T_co]:
        """Wait for the next delivery. Cancel-safe: a cancelled ``get`` has taken nothing. A
        parked ``get`` uses no CPU: it sleeps on one socket that every sender's ring wakes."""
        if _get_ident() != self._thread:
            self._check_thread()
        if self._since_yield >= _tuning.YIELD_EVERY:
            await self._yield_turn()
        g = self._g
        while True:
            obj = g.take()
            if obj is not NOTHING:
                self._since_yield += 1
                return obj  # type: ignore[no-any-return]
            await self._wait()

    async def get_before(self, deadline: float) -> Delivery[T_co]:
        """``get`` until ``deadline`` (``time.monotonic``), then ``WaitTimeout`` having taken
        nothing: the sleeps end at the deadline, without a cancel scope (a caller's call)."""
        # get's loop, written out again rather than shared: get keeps no frame of ours between
        # a take and its return (its every item); get_many's the same way.
        if _get_ident() != self._thread:
            self._check_thread()
        if self._since_yield >= _tuning.YIELD_EVERY:
            await self._yield_turn()
        g = self._g
        while True:
            obj = g.take()
            if obj is not NOTHING:
                self._since_yield += 1
                return obj  # type: ignore[no-any-return]
            await self._wait(lambda: _left(deadline))

    async def get_many(self, max_items: int = _tuning.AHEAD_MESSAGES) -> list[Delivery[T_co]]:
        """Wait for the next delivery, then return it with the ones the collector took with it
        from the same sender's ring (docs/fan-in.md, "Batches"), up to ``max_items``: what as
        many ``get`` calls would return, in their order and turns, for one call. At most one
        ring's batch (32 items, about 256 KiB of bodies). Cancel-safe: a cancelled ``get_many``
        has taken nothing. Raises like ``get``, having taken nothing."""
        check_max_items(max_items)
        if _get_ident() != self._thread:
            self._check_thread()
        if self._since_yield >= _tuning.YIELD_EVERY:
            await self._yield_turn()
        g = self._g
        while True:
            batch = g.take_many(max_items)
            if batch:
                self._since_yield += len(batch)
                return batch
            await self._wait()

    def statistics(self) -> CollectorStatistics:
        return self._g.statistics(self._waits.tasks)

    def check_now(self) -> None:
        """Look for new senders and dead ones now, not at the next due look (a pool's caller,
        waiting for its workers to join)."""
        self._g.check_now()

    async def attach(self, handle: Handle | str, *, name: str, connect_timeout: float = 10.0) -> None:
        """Read a remote sender: ``open_sender(handle, name=..., tcp=...)`` on another host (pass
        its ``remote_handle``), or any writer that serves TCP (``open_writer(tcp=...,
        max_readers=1)``), with the broadcast side's security (CurveZMQ admission, sealed data,
        nothing decoded before it is authenticated). Its items arrive as ``Item(name, value)`` in
        turn with the others (a remote sender's from its first, put before this attach); its
        close as ``SourceClosed``, its death as ``SourceGone``. A remote sender's ``put`` raises
        ``CollectorGone`` once this collector closed or died (a plain writer's does not:
        docs/fan-in.md). Raises ``InvalidHandle``, ``InvalidArgument`` (a name taken), ``TransportError``."""
        h, src = self._g.senders.remote_source(handle, name)
        await src.wait_welcome(connect_timeout)
        self._g.senders.add_remote(name, h, src)

    async def aclose(self) -> None:
        """Close: leave every sender's ring (their ``put`` raises ``CollectorGone``) and remove
        the rendezvous. Parked ``get`` calls end (``ClosedResourceError``; ``async for`` ends)."""
        if self._g.closed:
            return
        self._check_thread()
        self._g.close()
        self._waits.wake_all()

    def __aiter__(self) -> Collector[T_co]:
        return self

    async def __anext__(self) -> Delivery[T_co]:
        try:
            return await self.get()
        except (EndOfStream, ClosedResourceError) as exc:
            if self._ends_iteration(exc):
                raise StopAsyncIteration from None
            raise

    async def __aenter__(self) -> Collector[T_co]:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def _check_thread(self) -> None:
        if threading.get_ident() != self._thread:
            raise BroadcastError(
                "this collector's get() and aclose() belong to the thread whose event loop opened it; "
                "from another thread use get_nowait(), or anyio.from_thread.run(collector.get)"
            )

    async def _yield_turn(self) -> None:
        # As the reader's get: a collector that never has to wait still lets other tasks run
        # once in YIELD_EVERY gets. Before the take, and cancellable: a cancellation here has
        # taken nothing; once an item is taken, get returns it without another await.
        self._since_yield = 0
        await anyio.lowlevel.checkpoint()

    async def _wait(self, left_s: Callable[[], float | None] | None = None) -> None:
        """Wait for a ring to change (the reader's ``TaskWaits``, on the collector's one inbox).
        ``left_s``: the time left before a deadline (None: no deadline); raises ``WaitTimeout``
        once it passed."""
        g = self._g
        await self._waits.wait(g, self._is_closed, left_s)
        if g.closed:
            raise ClosedResourceError(g.refusal or "this collector was closed while get() waited")

    def _is_closed(self) -> bool:
        return self._g.closed


def _left(deadline: float) -> float:
    """Seconds left before ``deadline`` (``time.monotonic``); ``WaitTimeout`` once it passed."""
    left = deadline - monotonic()
    if left <= 0:
        raise WaitTimeout("the deadline passed")
    return left
