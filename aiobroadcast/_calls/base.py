"""What an async calls role and its blocking twin share: every method that does not wait,
written once (building, the handle and names, statistics, the refusals of pickling and of the
other role's methods, starting to close). ``Caller``/``BlockingCaller`` and
``Worker``/``BlockingWorker`` add only their waiting: calls, ``wait_ready``, taking requests,
closing the rings."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Generic, NoReturn, Protocol, TypeVar

from .._base.errors import BroadcastError
from .._base.handle import Handle
from .._fanin.handle import CollectorHandle
from .machine import _Call, _CallerCore, _why_late
from .types import CallerStatistics, Outcome, PoolHandle, Q, R, _private

if TYPE_CHECKING:
    from .._broadcast.channel import WriterChannel


V = TypeVar("V")


class _Requests(Protocol):
    """The request channel's writer, async or blocking."""

    @property
    def handle(self) -> Handle: ...

    def read_channel(self, read: Callable[[WriterChannel], V]) -> V | None: ...


class _Replies(Protocol):
    """The reply collector, async or blocking."""

    @property
    def handle(self) -> CollectorHandle: ...


W = TypeVar("W", bound=_Requests)  #: the request channel's writer
C = TypeVar("C", bound=_Replies)  #: the reply collector
RD = TypeVar("RD")  #: a worker's reader of the requests
S = TypeVar("S")  #: a worker's reply sender


class _CallerBase(Generic[Q, R, W, C]):
    """A pool's caller, but its waiting: the request channel's writer ``_w``, the reply
    collector ``_c``, the call machine ``_core`` and the pool's handle."""

    #: what the role says of itself: its name, its factory, why it has no ``serve``
    _NAME: ClassVar[str]
    _OPENER: ClassVar[str]
    _NO_SERVE: ClassVar[str]

    def __init__(self, token: object, writer: W, collector: C, workers: tuple[str, ...]) -> None:
        if token is not _private:
            raise TypeError(f"{self._NAME} cannot be built directly; use {self._OPENER}")
        self._w = writer
        self._c = collector
        self._core = _CallerCore(workers)
        self._handle = PoolHandle(requests=writer.handle, replies=collector.handle, workers=workers)

    @property
    def handle(self) -> PoolHandle:
        """What a worker needs: pass it (or its JSON) to ``open_worker`` with one of the names."""
        return self._handle

    @property
    def workers(self) -> tuple[str, ...]:
        return self._core.book.workers

    def statistics(self) -> CallerStatistics:
        return self._core.book.statistics()

    def _late(self, call: _Call, limit: float, unsent: str | None) -> dict[str, Outcome[Any]]:
        """The answer of a call whose deadline passed: each late worker's ``NoReply`` says why
        (``_why_late``), read from the request ring while the writer is open (a blocking
        writer's close waits meanwhile); once it closed, its ring is gone and nothing is said."""
        late = self._w.read_channel(lambda ch: call.result(limit, _why_late(ch, unsent)))
        return call.result(limit) if late is None else late

    def _begin_close(self) -> bool:
        """Whether a close is to be done now (the first close); the caller is closed from here on."""
        if self._core.closed:
            return False
        self._core.closed = True
        return True

    # __reduce__ and the hidden method, as _WorkerBase's below: one set per role base, each
    # message naming its own role and fix.
    def __reduce__(self) -> NoReturn:
        raise BroadcastError(f"a {self._NAME} cannot be pickled: send caller.handle and open_worker there")

    if not TYPE_CHECKING:

        @property
        def serve(self) -> NoReturn:
            raise AttributeError(self._NO_SERVE)


class _WorkerBase(Generic[Q, R, RD, S]):
    """A pool's worker, but its waiting: its reader of the requests ``_r``, its reply sender
    ``_s`` and its name."""

    #: what the role says of itself: its name, its factory, its repr's prefix, why it has no ``call``
    _NAME: ClassVar[str]
    _OPENER: ClassVar[str]
    _SHOWN_AS: ClassVar[str]
    _NO_CALL: ClassVar[str]

    def __init__(self, token: object, reader: RD, sender: S, name: str) -> None:
        if token is not _private:
            raise TypeError(f"{self._NAME} cannot be built directly; use {self._OPENER}")
        self._r = reader
        self._s = sender
        self._name = name
        self._closed = False

    @property
    def name(self) -> str:
        return self._name

    def _begin_close(self) -> bool:
        """Whether a close is to be done now (the first close); the worker is closed from here on."""
        if self._closed:
            return False
        self._closed = True
        return True

    def __repr__(self) -> str:
        return f"<{self._SHOWN_AS} {self._name!r}>"

    def __reduce__(self) -> NoReturn:
        raise BroadcastError(f"a {self._NAME} cannot be pickled: send the pool's handle and open_worker there")

    if not TYPE_CHECKING:

        @property
        def call(self) -> NoReturn:
            raise AttributeError(self._NO_CALL)
