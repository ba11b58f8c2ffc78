"""A sending end of a fan-in in an event loop (``Sender``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from time import monotonic
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, NoReturn, TypeVar, final

from .._base import fork as _fork
from .._base.codec import Buffer
from .._base.errors import (
    BroadcastError,
)
from .._base.files import unlink_quietly
from .._base.handle import (
    Handle,
)
from .._broadcast.writer import Writer
from .handle import (
    SENDER_FIX,
    CollectorHandle,
)
from .rendezvous import check_sender, guard, orphaned

T_contra = TypeVar("T_contra", contravariant=True)

_private = object()


@final
@_fork.role("sender", SENDER_FIX)
class Sender(Generic[T_contra]):
    """One sending end of a fan-in. Built by ``open_sender``; has no ``get``.

    Its items reach the collector in the order put, as ``Item(name, value)``. Under policy
    ``"block"`` (the collector's default) ``put`` waits while its ring is full: memory per sender
    is bounded by the ring. If the collector closes or dies, ``put`` raises ``CollectorGone``.
    """

    def __init__(self, token: object, writer: Writer[Any], name: str, collector: CollectorHandle) -> None:
        if token is not _private:
            raise TypeError("Sender cannot be built directly; use aiobroadcast.open_sender()")
        self._w = writer
        self._pub = writer._ch.pub
        self._words = writer._ch.seg.words
        self._active, self._watch = guard(writer._ch, collector)
        self._remote = writer.handle if writer._ch.server is not None else None
        self._name = name
        self._collector = collector

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

    def _check(self, after: bool = False) -> None:
        """``check_sender`` before a put, or ``after`` one (then an item the collector took before
        it left is not reported as lost)."""
        pub = self._pub
        check_sender(
            pub.closed,
            pub.refusal,
            lambda: self._w._ch.owner,
            self._words,
            self._active,
            self._watch,
            self._collector,
            self._name,
            pub.head if after else None,
        )

    def put_nowait(self, obj: T_contra) -> None:
        """Send ``obj`` now, or raise ``WouldBlock`` if the ring is full. Raises like
        ``Writer.put_nowait``, and ``CollectorGone``."""
        self._check()
        self._w.put_nowait(obj)
        if not self._words[self._active]:
            self._check(after=True)

    async def put(self, obj: T_contra) -> None:
        """Send ``obj``, waiting while the collector is a full ring behind. Cancel-safe. Raises
        like ``Writer.put``, and ``CollectorGone`` once the collector has closed or died (a
        ``put`` waiting for a dead collector raises within about a second; one into a ring with
        room, within ``SENDER_WATCH_S`` of the death, before it publishes)."""
        pending = self._send_now(obj)
        if pending is not None:
            await self._send_in_turn(pending)

    def _send_now(self, obj: object) -> tuple[Sequence[Buffer], int, bool, int, bool] | None:
        """``put`` up to its first await (``Writer._publish_now``): None once sent, else what
        ``_send_in_turn`` needs. A worker's reply calls it straight, with no coroutine of ours
        between the reply and the ring."""
        words = self._words
        active = self._active
        # _check, written out for the usual case (open, the collector's place active, no look at
        # its lock due): one put of a small message costs about 2 us here, the two calls 0.15.
        if self._pub.closed or not words[active] or monotonic() >= self._watch.next:
            self._check()
        pending = self._w._publish_now(obj)
        if pending is None and not words[active]:
            self._check(after=True)
        return pending

    async def _send_in_turn(self, pending: tuple[Sequence[Buffer], int, bool, int, bool]) -> None:
        """The rest of a ``put`` that ``_send_now`` did not finish: wait for room (or yield) in
        turn, publish, then look at the collector as ``put`` does."""
        await self._w._ch.put_in_turn(*pending)
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
        orphan = orphaned(self._words, self._active, self._collector)
        await self._w.aclose()
        if orphan:
            unlink_quietly(self._w.handle.path)

    async def __aenter__(self) -> Sender[T_contra]:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._pub.closed else f"sent={self._pub.msg}"
        return f"<aiobroadcast.Sender {self._name!r} to {self._collector.name} {state}>"

    def __reduce__(self) -> NoReturn:
        raise BroadcastError(
            "a Sender cannot be pickled or sent to another process: send the collector's handle and open_sender there"
        )

    if not TYPE_CHECKING:

        @property
        def get(self) -> NoReturn:
            raise AttributeError(
                "a Sender has no get(): only the collector receives (open_collector(), then "
                "collector.get() or async for); to receive in this process, open a collector here"
            )

        get_nowait = get_many = get
