"""The writer role: a facade over the channel's writing side (``channel.WriterChannel``). What
both front ends share (``WriterBase``: every method that does not wait), and the role of an event
loop (``Writer``); ``BlockingWriter`` (``blocking``) is the other front end over the same base."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from threading import get_ident as _get_ident
from typing import ClassVar, Generic, NoReturn, TypeVar, final

import anyio

from .._base import fork as _fork
from .._base import tuning as _tuning
from .._base.codec import Buffer
from .._base.errors import BroadcastError, WouldBlock
from .._base.handle import Handle
from .._base.stats import ReaderInfo, WriterStatistics
from .._base.steps import run
from .channel import WriterChannel
from .closable import AsyncClosable

T_contra = TypeVar("T_contra", contravariant=True)
V = TypeVar("V")

_private = object()


class WriterBase(Generic[T_contra]):
    """What ``Writer`` and ``BlockingWriter`` share: their channel (``_ch``) and what a put does
    (``_publishing``, bound once: the put paths read it directly), the handle, and what they
    answer (``repr``, the refusal to be pickled, the warning of one dropped unclosed). Only the
    waiting differs: a front end's ``put_nowait`` (which takes the turn its own ``put`` takes),
    ``put``, ``put_many``, ``statistics`` (what counts as waiting), ``read_channel``,
    ``wait_readers`` and close. ``_ROLE``/``_TITLE``: the role's name and how ``repr`` names it."""

    _ROLE: ClassVar[str]
    _TITLE: ClassVar[str]

    def __init__(self, token: object, mine: object, channel: WriterChannel) -> None:
        """``token`` is the factories' (``mine``, the module's): nothing else builds a role."""
        if token is not mine:
            raise TypeError(
                f"{self._ROLE} cannot be built directly; use {self._TITLE.rpartition('.')[0]}.open_writer()"
            )
        self._ch = channel
        #: What a put does (``channel.publishing``), bound once: the put path reads it directly.
        self._publishing = channel.publishing

    @property
    def handle(self) -> Handle:
        """What a reader needs to attach: pass it (or its JSON) to ``open_reader`` (blocking or async)."""
        return self._ch.handle

    def _ended(self) -> bool:
        """Whether this writer is closed, as ``repr`` and ``__del__`` tell."""
        return self._ch.pub.closed

    def __repr__(self) -> str:
        ch = self._ch
        state = "closed" if self._ended() else f"sent={ch.pub.msg}"
        return f"<{self._TITLE} {ch.handle.name} {ch.handle.policy} {state}>"

    def __del__(self) -> None:
        if getattr(self, "_ch", None) is not None and not self._ended():
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1, source=self)

    def __reduce__(self) -> NoReturn:
        raise BroadcastError(
            f"a {self._ROLE} cannot be pickled or sent to another process: send writer.handle (or its JSON) "
            "and open_reader there"
        )


@final
@_fork.role("writer")
class Writer(WriterBase[T_contra], AsyncClosable):
    """The sending end of a channel. Built by ``open_writer``; has no ``get``.

    Every attached reader receives every message in order. Under policy ``"block"`` (default)
    ``put`` waits while the slowest live reader is ``capacity`` entries behind; under ``"lag"``
    it never waits and readers that fall behind get ``ReaderLagged``.
    """

    _ROLE = "Writer"
    _TITLE = "aiobroadcast.Writer"

    def __init__(self, token: object, channel: WriterChannel) -> None:
        super().__init__(token, _private, channel)
        self._since_yield = 0

    def put_nowait(self, obj: T_contra) -> None:
        """Publish ``obj`` now, or raise ``WouldBlock`` if a live reader would be overrun (or
        another ``put`` is in progress). Raises ``SerializationError``,
        ``SchemaViolation`` or ``MessageTooLarge`` for a bad object, publishing
        nothing, and ``ClosedResourceError`` after ``aclose``."""
        ch = self._publishing
        pub = ch.pub
        pub.check_open()
        if ch.turns.locked():
            raise WouldBlock
        parts, total, oob, entries = ch.encoded(obj)
        mutex = pub.mutex
        try:  # the mutex taken inside the try (publisher.py, ``_take``)
            if mutex.take(0.0) <= 0:
                raise WouldBlock  # another thread is writing into the ring right now
            pub.check_open()
            # A task's put may have taken its turn while we encoded: it may be streaming a
            # message larger than the ring, which nothing may interleave with.
            if ch.turns.locked() or (pub.block and not pub.room(entries)):
                raise WouldBlock
            pub.publish(parts, total, oob, entries)
        finally:
            mutex.release()

    async def put(self, obj: T_contra) -> None:
        """Publish ``obj``, waiting for room while a live reader would be overrun.

        Cancel-safe: a cancelled ``put`` has published nothing (a message larger than the whole
        ring is streamed; if cancelled midway, readers drop the incomplete message). Raises
        like ``put_nowait``; a reader that dies while the writer waits for it is dropped within
        about a second and the ``put`` goes on.

        A message larger than the ring streams through it while its readers take the fragments:
        a reader that reads only after this ``put`` returns (in the same task) makes it wait
        forever. The writer cannot tell such a reader from a busy one (another task or thread
        may read it any time), so it waits; ``statistics().waiting_for`` names the readers.
        """
        pending = self.publish_now(obj)
        if pending is not None:
            await self._publishing.put_in_turn(*pending)

    def publish_now(self, obj: object) -> tuple[Sequence[Buffer], int, bool, int, bool] | None:
        """``put`` up to its first await: check, encode and, in the usual case, publish. None once
        published; else what ``put_in_turn`` needs to wait for room (or to yield first). Plain
        code, so that a ``put`` of a role built on this one (a fan-in sender's, a worker's reply)
        publishes without a coroutine per layer (docs/performance.md, "Calls: what the roles' layers
        cost")."""
        ch = self._publishing
        pub = ch.pub
        if pub.closed:
            pub.check_open()
        if _get_ident() != ch.thread:
            ch.check_thread()
        # ch.encoded(obj), inline: one call less per message.
        parts, total, oob = ch.encode(obj)  # the object as it is now
        entries = 1 if total <= ch.payload_bytes else ch.entries_for(total)
        # The usual case first: no task waits ahead of this one and there is room. Once in
        # YIELD_EVERY puts, the put yields to the loop first, so that a tight loop of puts does
        # not starve other tasks: in its turn (the tasks behind it wait as for room) and before
        # publishing, so a cancellation there (an anyio scope, or asyncio's own) has published
        # nothing. Once published, put returns without an await.
        if self._since_yield >= _tuning.YIELD_EVERY:
            self._since_yield = 0
            return (parts, total, oob, entries, True)
        if not ch.turns.held and pub.try_publish(parts, total, oob, entries):  # turns.locked(), inline
            self._since_yield += 1
            return None
        return (parts, total, oob, entries, False)

    async def put_many(self, objs: Iterable[T_contra]) -> None:
        """Publish several messages, in order, as one operation: all of them, or (cancelled, or
        an object that cannot be encoded) none. Cheaper per message than ``put`` for small
        messages: one check, one wait for room and one round of wake-ups for the whole batch.
        Readers receive them as separate messages, like ``put``'s.

        Every object is encoded first; the batch must fit in the ring at once (else
        ``InvalidArgument``, publishing nothing). Raises like ``put``. A Ctrl-C while the batch
        is being copied into the ring publishes the messages copied before it, each whole.
        """
        ch = self._publishing
        pub = ch.pub
        pub.check_open()
        ch.check_thread()
        batch, entries = ch.encode_batch(objs)  # the objects as they are now
        if not batch:
            return
        # Yields now and then as put does: first, in turn, and never after publishing.
        yield_first = self._since_yield >= _tuning.YIELD_EVERY
        if yield_first:
            self._since_yield = 0
        if await ch.put_batch(batch, entries, yield_first=yield_first):
            self._since_yield += len(batch)

    def statistics(self) -> WriterStatistics:
        return self._ch.serving.statistics(self._publishing.waiting_tasks)

    def read_channel(self, read: Callable[[WriterChannel], V]) -> V | None:
        """``read(channel)`` while this writer is open, else None (its ring is gone): for the
        package's roles built on a writer (a pool's caller reads where the readers of its
        requests stand)."""
        ch = self._ch
        return None if ch.pub.closed else read(ch)

    async def wait_readers(
        self,
        count: int | None = None,
        *,
        names: Iterable[str] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> tuple[ReaderInfo, ...]:
        """Wait until at least ``count`` readers are attached and (``names``) every reader of
        those names is; return the attached readers. Local and remote (TCP) readers count alike;
        the TCP server's own place does not, nor a reader whose process died. A reader counts
        from the moment it is attached: every message put after this returns reaches it.

        There is no event for "a reader joined": this looks again every 50 ms
        (``_tuning.READERS_POLL_S``), asleep in between. Raises ``WaitTimeout`` (a
        ``TimeoutError``) after ``timeout`` seconds (None: no limit), naming the readers missing
        or saying how many of how many are attached; ``InvalidArgument`` without ``count`` or
        ``names``; ``ClosedResourceError`` once closed. Cancel-safe: it changes nothing."""

        async def sleep(limit_s: float) -> bool:
            await anyio.sleep(limit_s)
            return False

        serving = self._ch.serving
        return await run(serving.wait_readers_steps(serving.attached, count, names, timeout), sleep)

    async def aclose(self) -> None:
        """Close the channel: readers receive what was published, then ``EndOfStream``.
        The segment is removed now; readers already attached keep their mapping. In a fork child
        of the writer's process it does nothing: the channel is the parent's. Closing again does
        nothing; an ``aclose`` while another task's is under way returns once that one is over."""
        closing = self._ch.closed_event
        if self._ch.pub.closed and (closing is None or closing.is_set()):
            return
        self._publishing.check_thread()
        await self._ch.aclose()
