"""The reader role: one public class over a transport-specific source, and how its tasks wait
(``TaskWaits``, ``sleep_steps``). What both front ends share (``ReaderBase``: every method that
does not wait), and the role of an event loop (``Reader``); ``BlockingReader`` (``blocking``) is
the other front end over the same base."""

from __future__ import annotations

import os
import threading
import warnings
from collections import deque
from collections.abc import Awaitable, Callable, Generator
from functools import partial
from threading import get_ident as _get_ident
from time import perf_counter_ns
from typing import Any, ClassVar, Generic, NoReturn, Protocol, TypeVar, final

import anyio
import anyio.lowlevel

from .._base import fork as _fork
from .._base import tuning as _tuning
from .._base.errors import BroadcastError, ClosedResourceError, EndOfStream, WouldBlock
from .._base.handle import Handle
from .._base.stats import ReaderStatistics
from .._base.steps import Sleep, Steps, poll_steps, run, run_blocking
from .._shm.wake import serve_event_loops, wait_readable
from .closable import AsyncClosable
from .wakeup import LoopWaiter

T_co = TypeVar("T_co", covariant=True)

# A task sleeps on an inbox (a reader's, a writer's, a collector's) through its event-loop side:
# _shm has none of its own (docs/design.md, "Layers").
serve_event_loops(LoopWaiter)

_private = object()
_NOTHING: Any = object()  # what _take returns when no message is ready


def poll_budget(spin_ns: int | None, slept_ns: int) -> int:
    """How long a waiting reader polls before it sleeps, given its ``spin_us`` (None: adaptive)
    and how long its previous sleep lasted."""
    if spin_ns is None:
        return _tuning.POLL_NS if slept_ns < _tuning.DENSE_NS else 0
    if slept_ns >= _tuning.IDLE_NS:
        return 0  # the stream went idle (the last sleep lasted): sleep again at once
    return spin_ns


def wait_steps(spin_ns: int, ready: Callable[[], bool], limit_s: Callable[[], float]) -> Steps[int]:
    """A waiting reader's wait, written once for ``Reader`` and ``BlockingReader`` (``_steps``):
    polls ``ready`` for ``spin_ns`` (``poll_budget``), then sleeps once on the source for up to
    ``limit_s()`` (asked after the poll, which took some time). Returns how long it slept, in ns
    (0 if the poll found the source ready): the next ``poll_budget`` depends on it."""
    if spin_ns and (yield from poll_steps(ready, spin_ns)):
        return 0
    start = perf_counter_ns()
    yield Sleep(limit_s())
    return perf_counter_ns() - start


def sleep_steps(src: Sleeper, limit_s: float) -> Generator[Sleep, bool, bool]:
    """One sleep of a reader on its source's inbox, written once for both front ends (``_steps``):
    announce the sleep (``begin_sleep``: from now on a new message wakes the inbox), re-check
    (done by ``begin_sleep``: if something came meanwhile, no sleep), wait for a wake-up for up to
    ``limit_s``, end the sleep (``end_sleep``: on a quiet end, the source checks the writer is
    alive). In that order, so no wake-up is lost: a message published before the announcement
    is seen by the re-check, one after it wakes the inbox. The wait is the one step a front end
    does its own way (``sleep_async``, ``sleep_blocking``); ``end_sleep`` runs on every way out of
    it (cancellation, a close). True if a wake-up came."""
    if src.begin_sleep():
        return False
    woken = False
    try:
        woken = yield Sleep(limit_s)
    finally:
        src.end_sleep(woken)
    return woken


async def sleep_async(src: Sleeper, limit_s: float) -> bool:
    """``sleep_steps`` in a task: the wait is the source's own in the running event loop. A close
    meanwhile ends it quietly (the caller looks at its own closed state).

    Driven here by hand, not through ``_base.steps.run``, and called straight from ``Reader._wait``
    when the reader does not poll first (a paced or idle stream: a waiting worker's every
    request): a pool's worker wakes once per call, with its code and data cold, and each
    coroutine frame between the wake-up and ``get`` returning costs there (docs/performance.md).
    The steps' ``finally`` (``end_sleep``) runs on every way out: ``close`` on an error or a
    cancellation, the last ``send`` otherwise."""
    steps = sleep_steps(src, limit_s)
    try:
        step = next(steps)
    except StopIteration as done:  # the ring changed while the sleep was announced
        return done.value  # type: ignore[no-any-return]
    try:
        woken = await src.sleep(step.seconds)
    except anyio.ClosedResourceError:
        steps.close()
        return False  # closed by aclose() meanwhile (the sleep is ended): Reader raises ClosedResourceError
    except BaseException:
        steps.close()
        raise
    try:
        steps.send(woken)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    raise AssertionError("sleep_steps sleeps once")


def sleep_blocking(src: Sleeper, limit_s: float) -> bool:
    """``sleep_steps`` in a thread without an event loop: the wait is a ``poll()`` on the inbox's
    descriptor, then the wake-ups in it are taken. Nobody closes the source meanwhile (the
    blocking reader makes sure)."""

    def wait(limit_s: float) -> bool:
        wait_readable((src.inbox_fd,), limit_s)
        return src.drain_inbox()

    return run_blocking(sleep_steps(src, limit_s), wait)


class Sleeper(Protocol):
    """What a source offers the wait machinery (``sleep_steps``, ``TaskWaits``, and the blocking
    roles' ``ThreadWaits``): a reader's transport (``Source``), or a collector's engine
    (``_fanin.gather.Gather``), which sleeps on one inbox for all its rings. A sleep is
    ``sleep_steps`` over ``begin_sleep``/``end_sleep``; its wait is ``sleep`` in a task (raises
    ``anyio.ClosedResourceError`` if the source is closed meanwhile), and in a thread a wait on
    ``inbox_fd`` then ``drain_inbox``."""

    def ready(self) -> bool: ...
    def sleep(self, limit_s: float) -> Awaitable[bool]: ...
    def begin_sleep(self) -> bool: ...
    def end_sleep(self, woken: bool) -> None: ...
    @property
    def sleep_limit_s(self) -> float: ...
    @property
    def inbox_fd(self) -> int: ...
    def drain_inbox(self) -> bool: ...


class Source(Sleeper, Protocol):
    """What a transport (``ShmSource``, ``TcpSource``) provides to both reader front ends.
    ``ahead``: messages the source took and decoded already, in order, which ``get_nowait``
    hands out before anything else; ``Reader`` takes them from it directly. It sleeps as a
    ``Sleeper``; ``interrupt`` wakes a sleeper from another thread."""

    ahead: deque[Any]

    def get_nowait(self) -> Any: ...
    def interrupt(self) -> None: ...
    def statistics(self, tasks_waiting: int) -> ReaderStatistics: ...
    def describe(self) -> str: ...
    def close(self) -> None: ...


class TaskWaits:
    """How the tasks of one role (a ``Reader``, a ``Collector``) wait for its source to change:
    one task sleeps in the source (the leader), the others wait for it on an in-process event,
    made only when one comes (a lone task, the usual case, makes none), so every parked task
    re-checks when anything changes. The leader polls first when the stream is dense
    (``poll_budget``), then sleeps once (``wait_steps``). ``tasks``: the tasks waiting now."""

    __slots__ = ("_followers", "_leading", "_spin_ns", "slept_ns", "tasks")

    def __init__(self, spin_ns: int | None) -> None:
        self._spin_ns = spin_ns
        self.slept_ns = _tuning.DENSE_NS  # no polling before the first sleep
        self._leading = False
        self._followers: anyio.Event | None = None
        self.tasks = 0

    async def wait(
        self, src: Sleeper, closed: Callable[[], bool], left_s: Callable[[], float | None] | None = None
    ) -> None:
        """Wait for ``src`` to change, as its one sleeper or behind it. ``closed``: whether the
        role was closed meanwhile (a poll ends then; the caller raises). ``left_s``: the time
        left before a deadline (None: none); it raises ``WaitTimeout`` once the deadline passed."""
        self.tasks += 1
        try:
            if self._leading:
                followers = self._followers
                if followers is None:
                    followers = self._followers = anyio.Event()
                left = None if left_s is None else left_s()
                if left is None:
                    await followers.wait()
                else:
                    with anyio.move_on_after(left):
                        await followers.wait()
            else:
                self._leading = True
                try:
                    spin = poll_budget(self._spin_ns, self.slept_ns)
                    if not spin and left_s is None:  # wait_steps without its poll, driven by hand (see sleep_async)
                        start = perf_counter_ns()
                        await sleep_async(src, src.sleep_limit_s)
                        self.slept_ns = perf_counter_ns() - start
                    else:
                        steps = wait_steps(*poll_and_limit(src, spin, closed, left_s, None, None))
                        self.slept_ns = await run(steps, partial(sleep_async, src))
                finally:
                    self._leading = False
                    self.wake_all()
        finally:
            self.tasks -= 1

    def wake_all(self) -> None:
        """Wake every task waiting behind the sleeper (the role was closed, or it woke)."""
        followers = self._followers
        if followers is not None:
            self._followers = None
            followers.set()


def poll_and_limit(
    src: Sleeper,
    spin_ns: int,
    closed: Callable[[], bool],
    left_s: Callable[[], float | None] | None,
    stop: Callable[[], BaseException | None] | None,
    every_s: float | None,
) -> tuple[int, Callable[[], bool], Callable[[], float]]:
    """``wait_steps``'s arguments for a wait on ``src`` (both front ends): the poll (cut to what is
    left before the deadline), what ends it (the role closed, ``src`` ready, ``stop()`` has an
    exception to raise), and the sleep's limit, asked after the poll: ``src.sleep_limit_s``, cut
    to what is left before the deadline and to ``every_s``."""
    if left_s is not None and (left := left_s()) is not None:
        spin_ns = min(spin_ns, int(left * 1e9))
    ready = src.ready

    def woke() -> bool:
        return closed() or ready() or (stop is not None and stop() is not None)

    def limit_s() -> float:
        limit = src.sleep_limit_s
        left = None if left_s is None else left_s()
        if left is not None:
            limit = min(limit, left)
        if every_s is not None:
            limit = min(limit, every_s)
        return limit

    return spin_ns, woke, limit_s


class _Waits(Protocol):
    """How a reader's takers wait (``TaskWaits``, ``ThreadWaits``), as ``statistics`` reads it."""

    @property
    def tasks(self) -> int: ...


class ReaderBase(Generic[T_co]):
    """What ``Reader`` and ``BlockingReader`` share: their source (``_src``), handle and name,
    whether they are closed (``_closed``, and ``_refusal``: why a fork child may not use it),
    ``statistics``, and what they answer (``repr``, the refusal to be pickled, the warning of one
    dropped unclosed). Only the waiting differs: a front end's ``get_nowait`` (under the lock its
    ``get`` takes turns on), ``get``, iteration and close. ``_ROLE``/``_TITLE``: the role's name
    and how ``repr`` names it."""

    _ROLE: ClassVar[str]
    _TITLE: ClassVar[str]
    _waits: _Waits

    def __init__(self, token: object, mine: object, source: Source, handle: Handle, name: str) -> None:
        """``token`` is the factories' (``mine``, the module's): nothing else builds a role."""
        if token is not mine:
            raise TypeError(
                f"{self._ROLE} cannot be built directly; use {self._TITLE.rpartition('.')[0]}.open_reader()"
            )
        self._src = source
        self._handle = handle
        self._name = name
        self._closed = False
        self._refusal: str | None = None  # why a fork child may not use it
        self._owner = os.getpid()

    @property
    def handle(self) -> Handle:
        """The handle this reader attached with."""
        return self._handle

    @property
    def name(self) -> str:
        return self._name

    def statistics(self) -> ReaderStatistics:
        if self._closed:
            raise ClosedResourceError(self._refusal or "this reader is closed")
        return self._src.statistics(self._waits.tasks)

    def __repr__(self) -> str:
        state = "closed" if self._closed else self._src.describe()
        return f"<{self._TITLE} {self._name!r} {state}>"

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1, source=self)

    def __reduce__(self) -> NoReturn:
        raise BroadcastError(
            f"a {self._ROLE} cannot be pickled or sent to another process: send reader.handle (or its JSON) "
            "and open_reader there"
        )

    def _forget_in_child(self) -> None:
        """In a fork child: this reader is the parent's; refuse every use from now on. Its
        source lets go of its own descriptors (docs/design.md, "Fork"). A bound method taken
        before the fork (``get = reader.get``) runs the role class's code, not the inherited
        role's (``_fork.role``): it refuses here."""
        self._closed = True
        self._refusal = _fork.refusal("reader", self._owner)


@final
@_fork.role("reader")
class Reader(ReaderBase[T_co], AsyncClosable):
    """The receiving end of a channel. Built by ``open_reader``; has no ``put``.

    Receives every message published after it attached, in order. Several tasks of one process
    may share a reader: each ``get`` takes a distinct message, none is lost or duplicated.
    Over shared memory, small messages that are ready together are taken out of the ring and
    decoded a batch at a time (up to 32), ahead of the gets that return them (docs/design.md,
    "Taking ahead").
    """

    _ROLE = "Reader"
    _TITLE = "aiobroadcast.Reader"

    def __init__(self, token: object, source: Source, handle: Handle, name: str, spin_us: float | None = None) -> None:
        super().__init__(token, _private, source, handle, name)
        self._waits: TaskWaits = TaskWaits(None if spin_us is None else int(spin_us * 1000))
        self._since_yield = 0
        # Held while a message is being taken and decoded, by whichever thread: a get_nowait that
        # finds it held (another thread, or a __setstate__ of the message being decoded that
        # reads from this reader) raises WouldBlock instead of taking a message twice.
        self._taking = threading.Lock()
        # Bound once: _take calls them per message.
        self._take_lock = self._taking.acquire
        self._drop_lock = self._taking.release
        self._src_get = source.get_nowait
        self._ahead = source.ahead
        self._thread = threading.get_ident()
        _fork.track(self)

    def get_nowait(self) -> T_co:
        """Take the next message, or raise ``WouldBlock`` if none is ready.

        Raises ``EndOfStream`` once the writer closed and everything was received,
        ``WriterGone`` if the writer died (after everything it published was received),
        ``ReaderLagged`` once when messages were overwritten before this reader read them
        (policy "lag"), ``DeserializationError`` for a message that cannot be decoded here
        (it is consumed; the next call returns the next one), and ``ClosedResourceError``
        after ``aclose``.
        """
        obj = self._take()
        if obj is _NOTHING:
            raise WouldBlock
        return obj  # type: ignore[no-any-return]

    def _take(self) -> Any:
        """Take the next message, or ``_NOTHING`` if none is ready (or another thread is taking
        one): ``get`` waits then, without a ``WouldBlock`` raised and caught per wait."""
        if self._closed:
            raise ClosedResourceError(self._refusal or "this reader is closed")
        ahead = self._ahead
        if ahead:  # taken out of the ring and decoded already (ShmSource._take_ahead)
            try:
                return ahead.popleft()
            except IndexError:  # another thread took the last one meanwhile
                pass
        if not self._take_lock(False):
            return _NOTHING
        try:
            if self._closed:  # closed by another thread meanwhile
                raise ClosedResourceError("this reader is closed")
            return self._src_get()
        except WouldBlock:
            return _NOTHING
        finally:
            self._drop_lock()

    async def get(self) -> T_co:
        """Wait for the next message and return it.

        Cancel-safe: a cancelled ``get`` has taken nothing. Raises like ``get_nowait``
        (never ``WouldBlock``). A parked ``get`` uses no CPU: it sleeps in the event loop.
        """
        if _get_ident() != self._thread:
            self._check_thread()
        if self._since_yield >= _tuning.YIELD_EVERY:
            # A reader that never has to wait still lets other tasks run now and then. Before the
            # take, and cancellable: a cancellation here (an anyio scope, or asyncio's own, which
            # no anyio shield stops) has taken nothing. Once a message is taken, get returns it
            # without another await.
            self._since_yield = 0
            await anyio.lowlevel.checkpoint()
        while True:
            obj = self._take()
            if obj is not _NOTHING:
                self._since_yield += 1
                return obj  # type: ignore[no-any-return]
            # Wait for the source to change (TaskWaits: one task sleeps in it, the others behind
            # it), awaited here rather than through a method of ours: no coroutine frame more
            # between a wake-up and the get returning (see sleep_async).
            await self._waits.wait(self._src, self._is_closed)
            if self._closed:
                raise ClosedResourceError(self._refusal or "this reader was closed while waiting")

    async def aclose(self) -> None:
        """Detach. The writer stops waiting for this reader at once; parked ``get`` calls
        raise ``ClosedResourceError``. In a fork child of the reader's process it does nothing:
        the place in the ring is the parent's."""
        if self._closed:
            return
        self._check_thread()
        self._closed = True
        # Wait for a get_nowait of another thread to finish with the ring before unmapping it
        # (never for this thread's own: an aclose from inside decoding).
        _fork.untrack(self)
        taken = self._taking.acquire(timeout=5)
        try:
            self._src.close()
        finally:
            if taken:
                self._taking.release()
        self._waits.wake_all()

    def __aiter__(self) -> Reader[T_co]:
        return self

    async def __anext__(self) -> T_co:
        try:
            return await self.get()
        except EndOfStream:
            raise StopAsyncIteration from None

    def _check_thread(self) -> None:
        """``get`` and ``aclose`` wait in the event loop of the thread that opened the reader."""
        if threading.get_ident() != self._thread:
            raise BroadcastError(
                "this reader's get() and aclose() belong to the thread whose event loop opened it; "
                "from another thread use get_nowait(), or anyio.from_thread.run(reader.get)"
            )

    def _is_closed(self) -> bool:
        return self._closed
