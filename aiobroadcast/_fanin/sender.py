"""A sending end of a fan-in: what both front ends share (``SenderBase``: every method that does
not wait), and the role of an event loop (``Sender``). ``BlockingSender`` (``blocking``) is the
other front end over the same base."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from time import monotonic
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Generic, NoReturn, Protocol, TypeVar, final

from .._base import fork as _fork
from .._base.codec import Buffer
from .._base.errors import BroadcastError
from .._base.files import unlink_quietly
from .._base.handle import Handle
from .._broadcast.channel import WriterChannel
from .._broadcast.writer import Writer
from .._broadcast.writer import _private as _writer_token
from .handle import SENDER_FIX, CollectorHandle
from .rendezvous import check_sender, guard, orphaned

T_contra = TypeVar("T_contra", contravariant=True)

_private = object()


class _PutsNow(Protocol):
    """What ``SenderBase`` asks of its writer (``Writer``, ``BlockingWriter``)."""

    def put_nowait(self, obj: Any) -> None: ...


class SenderBase(Generic[T_contra]):
    """What ``Sender`` and ``BlockingSender`` share: their ring (a channel the collector's place
    was reserved in) and its writer, the checks around a put (``check_sender``), ``put_nowait``,
    and what they answer. Only the waiting differs: a front end's ``put``, ``put_many`` and
    close. ``_ROLE``/``_TITLE``: the role's name and how ``repr`` names it; ``_RECEIVE``: what
    receives instead (``get``'s error). Each front end's ``__init__`` is the same few lines but
    for the writer it makes (``Writer``, ``BlockingWriter``): the one thing that differs."""

    _ROLE: ClassVar[str]
    _TITLE: ClassVar[str]
    _RECEIVE: ClassVar[str]
    _w: _PutsNow  #: the ring's writer, the front end's own (made before this ``__init__``)

    def __init__(self, channel: WriterChannel, name: str, collector: CollectorHandle) -> None:
        self._ch = channel
        self._pub = channel.pub
        self._words = channel.seg.words
        self._active, self._watch = guard(channel, collector)
        self._remote = channel.handle if channel.serving.server is not None else None
        self._name = name
        self._collector = collector

    def _check_token(self, token: object, mine: object) -> None:
        """``token`` is the factories' (``mine``, the module's): nothing else builds a role."""
        if token is not mine:
            raise TypeError(
                f"{self._ROLE} cannot be built directly; use {self._TITLE.rpartition('.')[0]}.open_sender()"
            )

    @property
    def name(self) -> str:
        return self._name

    @property
    def handle(self) -> CollectorHandle:
        """The collector's handle."""
        return self._collector

    @property
    def remote_handle(self) -> Handle | None:
        """A remote sender's (``open_sender(..., tcp=...)``): what the collector attaches, with
        ``collector.attach(remote_handle, name=...)`` (JSON-able; it holds the TCP keys). None
        for a sender of this host."""
        return self._remote

    def put_nowait(self, obj: T_contra) -> None:
        """Send ``obj`` now, or raise ``WouldBlock`` if the ring is full. Raises like the writer's
        ``put_nowait``, and ``CollectorGone``. After the put, as ``put``: the collector is looked
        at again only if its place went inactive meanwhile (a collector that left may have taken
        the item; one that died with its place active is seen by the next put, before it
        publishes)."""
        self._check()
        self._w.put_nowait(obj)
        if not self._words[self._active]:
            self._check(after=True)

    def _closed(self) -> bool:
        """Whether no put may begin (closed, or closing)."""
        return self._pub.closed

    def _check(self, after: bool = False) -> None:
        """``check_sender`` before a put, or ``after`` one (then an item the collector took before
        it left is not reported as lost)."""
        pub = self._pub
        check_sender(
            self._closed(),
            pub.refusal,
            self._owner,
            self._words,
            self._active,
            self._watch,
            self._collector,
            self._name,
            pub.head if after else None,
        )

    def _owner(self) -> int:
        return self._ch.owner

    def _orphaned(self) -> bool:
        """Whether no collector will ever drain the ring: the sender removes it as it closes."""
        return orphaned(self._words, self._active, self._collector)

    def _remove_ring(self) -> None:
        unlink_quietly(self._ch.handle.path)

    def __repr__(self) -> str:
        state = "closed" if self._closed() else f"sent={self._pub.msg}"
        return f"<{self._TITLE} {self._name!r} to {self._collector.name} {state}>"

    # __reduce__ and the hidden methods as CollectorBase's: one set per role base, each message
    # naming its own role and fix.
    def __reduce__(self) -> NoReturn:
        raise BroadcastError(
            f"a {self._ROLE} cannot be pickled or sent to another process: send the collector's handle "
            "and open_sender there"
        )

    if not TYPE_CHECKING:

        @property
        def get(self) -> NoReturn:
            raise AttributeError(f"a {self._ROLE} has no get(): only the collector receives ({self._RECEIVE})")

        get_nowait = get_many = get


@final
@_fork.role("sender", SENDER_FIX)
class Sender(SenderBase[T_contra]):
    """One sending end of a fan-in. Built by ``open_sender``; has no ``get``.

    Its items reach the collector in the order put, as ``Item(name, value)``. Under policy
    ``"block"`` (the collector's default) ``put`` waits while its ring is full: memory per sender
    is bounded by the ring. If the collector closes or dies, ``put`` raises ``CollectorGone``.
    """

    _ROLE = "Sender"
    _TITLE = "aiobroadcast.Sender"
    _RECEIVE = "open_collector(), then collector.get() or async for); to receive in this process, open a collector here"

    def __init__(self, token: object, channel: WriterChannel, name: str, collector: CollectorHandle) -> None:
        self._check_token(token, _private)
        self._w: Writer[Any] = Writer(_writer_token, channel)
        super().__init__(channel, name, collector)

    async def put(self, obj: T_contra) -> None:
        """Send ``obj``, waiting while the collector is a full ring behind. Cancel-safe. Raises
        like ``Writer.put``, and ``CollectorGone`` once the collector has closed or died (a
        ``put`` waiting for a dead collector raises within about a second; one into a ring with
        room, within ``SENDER_WATCH_S`` of the death, before it publishes)."""
        pending = self.send_now(obj)
        if pending is not None:
            await self.send_in_turn(pending)

    def send_now(self, obj: object) -> tuple[Sequence[Buffer], int, bool, int, bool] | None:
        """``put`` up to its first await (``Writer.publish_now``): None once sent, else what
        ``send_in_turn`` needs. A worker's reply calls it straight, with no coroutine of ours
        between the reply and the ring."""
        words = self._words
        active = self._active
        # _check, written out for the usual case (open, the collector's place active, no look at
        # its lock due): one put of a small message costs about 2 us here, the two calls 0.15.
        if self._pub.closed or not words[active] or monotonic() >= self._watch.next:
            self._check()
        pending = self._w.publish_now(obj)
        if pending is None and not words[active]:
            self._check(after=True)
        return pending

    async def send_in_turn(self, pending: tuple[Sequence[Buffer], int, bool, int, bool]) -> None:
        """The rest of a ``put`` that ``send_now`` did not finish: wait for room (or yield) in
        turn, publish, then look at the collector as ``put`` does."""
        await self._ch.publishing.put_in_turn(*pending)
        if not self._words[self._active]:
            self._check(after=True)

    async def put_many(self, objs: Iterable[T_contra]) -> None:
        """Send several items, in order, as one operation (``Writer.put_many``)."""
        self._check()
        await self._w.put_many(objs)
        self._check(after=True)

    async def aclose(self) -> None:
        """Close: the collector takes what was sent, then reports ``SourceClosed(name)``."""
        if self._pub.closed:
            return
        orphan = self._orphaned()
        await self._w.aclose()
        if orphan:
            self._remove_ring()

    async def __aenter__(self) -> Sender[T_contra]:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
