"""The broadcast family's blocking roles: ``BlockingWriter``, ``BlockingReader`` and their
factories (``aiobroadcast.blocking`` documents them and re-exports them)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from time import monotonic
from typing import Any, TypeVar, Unpack, final, overload

from pydantic import BaseModel

from .._base import fork as _fork
from .._base import tuning as _tuning
from .._base.errors import ClosedResourceError, EndOfStream, WaitTimeout, WouldBlock
from .._base.handle import Handle
from .._base.stats import ReaderInfo, ReaderStatistics, WriterStatistics
from .._base.steps import Steps, drive_blocking, run_blocking
from .._shm.owned import Owned as _Owned
from .._shm.owned import left_before as _left
from .channel import WriterChannel
from .closable import Closable
from .reader import ReaderBase, Sleeper, Source, poll_and_limit, poll_budget, sleep_blocking, wait_steps
from .reader_open import ReaderOptions, _ReaderSpec, _shm_source
from .writer import WriterBase
from .writer_open import WriterOptions, _WriterSpec, channel_steps

__all__ = ["BlockingReader", "BlockingWriter", "open_reader", "open_writer"]

T_contra = TypeVar("T_contra", contravariant=True)
T_co = TypeVar("T_co", covariant=True)
M = TypeVar("M", bound=BaseModel)
V = TypeVar("V")

_private = object()


def _deadline(timeout: float | None) -> float | None:
    # A negative timeout is "now", never "forever" (a deadline computed as a difference can go
    # negative; vLLM once passed one to poll() as -1).
    return None if timeout is None else monotonic() + max(0.0, timeout)


# --- the writer --------------------------------------------------------------------------------
@final
@_fork.role("writer")
class BlockingWriter(WriterBase[T_contra], Closable):
    """The sending end of a channel, for code without an event loop. Built by
    ``aiobroadcast.blocking.open_writer``; has no ``get``. Thread-safe (see the module)."""

    _ROLE = "BlockingWriter"
    _TITLE = "aiobroadcast.blocking.BlockingWriter"

    def __init__(self, token: object, channel: WriterChannel) -> None:
        super().__init__(token, _private, channel)
        self._lock = _Owned()
        # close() holds this while it releases the ring; statistics() holds it to read the ring.
        self._close_lock = threading.Lock()
        self._closing = False
        self._closed = False

    def put_nowait(self, obj: T_contra) -> None:
        """Publish ``obj`` now, or raise ``WouldBlock`` if a live reader would be overrun or
        another thread's ``put`` is in progress. Raises like ``Writer.put_nowait``."""
        self._put(obj, None, nowait=True)

    def put(self, obj: T_contra, timeout: float | None = None) -> None:
        """Publish ``obj``, blocking this thread while a live reader would be overrun (policy
        "block") or another thread's ``put`` is in progress. ``timeout``: raise ``WaitTimeout``
        after that many seconds instead, having published nothing (a message larger than the
        whole ring that times out midway is dropped by every reader); it names the readers that
        held the writer (``holders``), or says that another thread's put held it and what that
        one waits for. A message larger than the ring needs its readers reading while it streams:
        one read by this thread only after ``put`` returns never lets it finish (the error says
        so). Raises like ``Writer.put``, and ``ClosedResourceError`` if ``close()`` is called
        meanwhile."""
        self._put(obj, None if timeout is None else _deadline(timeout), nowait=False)

    def put_many(self, objs: Iterable[T_contra], timeout: float | None = None) -> None:
        """Publish several messages, in order, as one operation: all of them or (timed out, an
        object that cannot be encoded) none. Blocks like ``put`` until there is room for the
        whole batch. Raises like ``Writer.put_many``."""
        if self._closing:
            raise ClosedResourceError("this writer is closed")
        deadline = None if timeout is None else _deadline(timeout)
        lock = self._lock
        try:
            try:
                lock.acquire(deadline, wait=True)
            except WaitTimeout:
                raise self._busy_timeout("put_many") from None
            self._check_open()
            w = self._publishing
            batch, entries = w.encode_batch(objs)
            if not batch or w.pub.try_publish_many(batch, entries):
                return
            self._wait(w.batch_steps(batch, entries), deadline, "put_many", entries)
        finally:
            lock.release()

    def statistics(self) -> WriterStatistics:
        """A snapshot, as ``Writer.statistics()``; ``waiting_for`` names the readers a blocked
        ``put`` waits for."""
        with self._close_lock:
            self._check_open()
            return self._ch.serving.statistics(self._lock.waiting)

    def read_channel(self, read: Callable[[WriterChannel], V]) -> V | None:
        """As ``Writer.read_channel``, under the lock ``close()`` holds while it releases the
        ring (as ``statistics`` reads it): a close from another thread waits."""
        with self._close_lock:
            return None if self._closing else read(self._ch)

    def wait_readers(
        self, count: int | None = None, *, names: Iterable[str] | None = None, timeout: float | None = None
    ) -> tuple[ReaderInfo, ...]:
        """As ``Writer.wait_readers``, blocking this thread (asleep between looks, every 50 ms);
        Ctrl-C ends it at once, changing nothing. Raises ``ClosedResourceError`` if ``close()``
        is called meanwhile."""

        def attached() -> tuple[ReaderInfo, ...]:
            with self._close_lock:
                self._check_open()
                return self._ch.serving.attached()

        return run_blocking(self._ch.serving.wait_readers_steps(attached, count, names, timeout), _sleep)

    def close(self) -> None:
        """Close the channel: readers receive what was published, then ``EndOfStream``."""
        if self._lock.mine():
            raise WouldBlock("close() called from inside this writer's own put() on this thread")
        with self._close_lock:
            if self._closed:
                return
            self._closing = True
            w = self._ch
            w.pub.outbox.wake(w.inbox.path)  # a put waiting for room looks up and sees _closing
            try:
                self._lock.acquire(None)
                _close_writer(w)
                self._closed = True
            finally:
                self._lock.release()

    # --- internals ---------------------------------------------------------------------------
    def _ended(self) -> bool:
        return self._closed  # set once close() is over (the ring's own flag is set as it begins)

    def _check_open(self) -> None:
        if self._closing:
            raise ClosedResourceError("this writer is closed")

    def _put(self, obj: object, deadline: float | None, *, nowait: bool) -> None:
        if self._closing:
            raise ClosedResourceError("this writer is closed")
        lock = self._lock
        try:
            try:
                lock.acquire(deadline, wait=not nowait)
            except WaitTimeout:  # another thread's put held the writer: say what that one waits for
                raise self._busy_timeout("put") from None
            self._check_open()
            w = self._publishing
            # Under the lock, so that a put from inside pickling (a __reduce__ that publishes)
            # raises WouldBlock here rather than waiting on itself.
            parts, total, oob, entries = w.encoded(obj)
            if w.pub.try_publish(parts, total, oob, entries):
                return
            if nowait:
                raise WouldBlock
            self._wait(w.publish_steps(parts, total, oob, entries), deadline, "put", entries)
        finally:
            lock.release()

    def _busy_timeout(self, what: str) -> WaitTimeout:
        """``busy_timeout``, read under the close lock as ``statistics()`` reads: this thread does
        not hold the writer, so another one may be closing it (and unmapping the ring)."""
        with self._close_lock:
            if self._closing:
                return WaitTimeout(f"{what}: the timeout passed while another thread held this writer, closing it")
            return self._ch.serving.busy_timeout(what)

    def _wait(self, steps: Steps[None], deadline: float | None, what: str, entries: int) -> None:
        """Run a put's waiting steps (``publish_steps``, ``batch_steps``) in this thread, which
        holds ``self._lock`` (this writer's threads take turns on it), counted as waiting. A
        ``WaitTimeout`` names the readers that held it (``put_timeout``), read when it is raised."""
        self._lock.count(1)
        start = self._ch.pub.head
        try:
            run_blocking(steps, self._sleeper(deadline))
        except WaitTimeout:
            raise self._ch.serving.put_timeout(what, entries, start) from None
        finally:
            self._lock.count(-1)

    def _sleeper(self, deadline: float | None) -> Callable[[float], bool]:
        inbox = self._ch.inbox

        def sleep(limit: float) -> bool:
            left = _left(deadline)
            woken = inbox.wait_blocking(limit if left is None else min(limit, left))
            if self._closing:
                raise ClosedResourceError("this writer was closed while put() waited for room")
            return woken

        return sleep


def _sleep(limit_s: float) -> bool:
    time.sleep(limit_s)
    return False


def _close_writer(w: WriterChannel) -> None:
    """``WriterChannel.aclose`` for a thread: the same steps, waiting for the TCP server here."""
    w.close_blocking()


# --- the reader --------------------------------------------------------------------------------
class ThreadWaits:
    """How the threads of one blocking role (a ``BlockingReader``, a ``BlockingCollector``) wait
    for its source to change: one thread sleeps in the source, holding ``lock``; the others queue
    for its place, and each looks at the source again before it sleeps. The sleeper polls first
    when the stream is dense (``poll_budget``), then sleeps once (``wait_steps``), as a task of
    the async role does (``TaskWaits``). ``tasks``: the threads waiting now."""

    __slots__ = ("_spin_ns", "lock", "slept_ns")

    def __init__(self, spin_ns: int | None) -> None:
        self._spin_ns = spin_ns
        self.slept_ns = _tuning.DENSE_NS  # no polling before the first sleep
        self.lock = _Owned()  # one sleeper at a time

    @property
    def tasks(self) -> int:
        return self.lock.waiting + (self.lock.owner != 0)

    def wait(
        self,
        src: Sleeper,
        closing: Callable[[], bool],
        deadline: float | None,
        stop: Callable[[], BaseException | None] | None = None,
        stop_every_s: float | None = None,
        poll_ns: int | None = None,
    ) -> None:
        """Wait until ``src`` may have something, or ``closing()``. ``deadline``: ``WaitTimeout``
        once it passed; ``stop()`` is asked while polling (an exception to end the wait with, or
        None); a sleep lasts at most ``stop_every_s``; ``poll_ns`` overrides how long to poll."""
        lock = self.lock
        try:
            lock.acquire(deadline)
            if closing():
                return
            spin = poll_budget(self._spin_ns, self.slept_ns) if poll_ns is None else poll_ns

            def left_s() -> float | None:
                return _left(deadline)

            steps = wait_steps(*poll_and_limit(src, spin, closing, left_s, stop, stop_every_s))
            self.slept_ns = run_blocking(steps, partial(sleep_blocking, src))
        finally:
            lock.release()


#: What ``ShmSource`` and ``TcpSource`` offer both reader front ends (one protocol).
_Source = Source


@final
@_fork.role("reader")
class BlockingReader(ReaderBase[T_co], Closable):
    """The receiving end of a channel, for code without an event loop. Built by
    ``aiobroadcast.blocking.open_reader``; has no ``put``. Thread-safe (see the module)."""

    # Declared as BlockingWriter is, line for line: what the base's messages call the role, and
    # an __init__ of the role class's own (``_fork.role`` wraps it), which passes the base its token.
    _ROLE = "BlockingReader"
    _TITLE = "aiobroadcast.blocking.BlockingReader"

    def __init__(self, token: object, source: _Source, handle: Handle, name: str, spin_us: float | None = None) -> None:
        super().__init__(token, _private, source, handle, name)
        self._lock = _Owned()  # one taker at a time
        self._waits: ThreadWaits = ThreadWaits(None if spin_us is None else int(spin_us * 1000))
        # One close at a time, and no wake-up of the source while it is being closed: a second
        # close (another thread's, a ``with`` around a close) waits for the first, then returns.
        self._close_lock = threading.Lock()
        self._closing = False
        _fork.track(self)

    def get_nowait(self) -> T_co:
        """Take the next message, or raise ``WouldBlock`` if none is ready. Raises like
        ``Reader.get_nowait``."""
        lock = self._lock
        try:
            lock.acquire(None)
            if self._closed:
                raise ClosedResourceError(self._refusal or "this reader is closed")
            return self._src.get_nowait()  # type: ignore[no-any-return]
        finally:
            lock.release()

    def get(self, timeout: float | None = None) -> T_co:
        """Wait for the next message and return it, blocking this thread in ``poll()`` (no CPU
        while it waits). ``timeout``: raise ``WaitTimeout`` after that many seconds instead,
        having taken nothing. Raises like ``Reader.get``, and ``ClosedResourceError`` if
        ``close()`` is called meanwhile."""
        lock = self._lock
        tried = False
        try:
            if lock.try_acquire():  # the common case first: a message is there, nobody else takes
                if self._closed:
                    raise ClosedResourceError(self._refusal or "this reader is closed")
                tried = True
                return self._src.get_nowait()  # type: ignore[no-any-return]
        except WouldBlock:
            pass
        finally:
            lock.release()
        return self._get(None if timeout is None else _deadline(timeout), tried=tried)  # type: ignore[no-any-return]

    def statistics(self) -> ReaderStatistics:
        """A snapshot, as ``Reader.statistics()``, taken between two takes (under the takers' lock)."""
        lock = self._lock
        try:
            lock.acquire(None)
            return super().statistics()
        finally:
            lock.release()

    def close(self) -> None:
        """Detach: the writer stops waiting for this reader at once; parked ``get`` calls raise
        ``ClosedResourceError``."""
        sleep_lock = self._waits.lock
        if self._lock.mine() or sleep_lock.mine():
            raise WouldBlock("close() called from inside this reader's own get() on this thread")
        with self._close_lock:
            if self._closed:
                return
            self._closing = True
            self._src.interrupt()  # the sleeping thread wakes up, and the others after it
            try:
                sleep_lock.acquire(None)
                try:
                    self._lock.acquire(None)
                    self._closed = True
                    _fork.untrack(self)
                    self._src.close()
                finally:
                    self._lock.release()
            finally:
                sleep_lock.release()

    def __iter__(self) -> Iterator[T_co]:
        return self

    def __next__(self) -> T_co:
        try:
            return self.get()
        except EndOfStream:
            raise StopIteration from None

    # --- internals ---------------------------------------------------------------------------
    def _forget_in_child(self) -> None:
        super()._forget_in_child()
        self._closing = True  # as close() leaves it

    def _get(
        self,
        deadline: float | None,
        stop: Callable[[], BaseException | None] | None = None,
        stop_every_s: float | None = None,
        poll_ns: int | None = None,
        *,
        tried: bool = False,
    ) -> Any:
        """``get`` with the knobs of ``aiobroadcast.vllm``: ``stop()`` is asked before each wait
        and while polling, and returns an exception to end the wait with (or None); a sleep lasts
        at most ``stop_every_s`` (for a condition nothing signals; ``_interrupt`` wakes it
        otherwise); ``poll_ns`` overrides how long to poll before sleeping. ``tried``: the caller
        found nothing an instant ago (``get``'s first look), so the first wait comes first."""
        if self._lock.mine():
            raise WouldBlock("get() called from inside this reader's own get() on this thread")
        while True:
            if tried:
                tried = False
            else:
                try:
                    return self.get_nowait()
                except WouldBlock:
                    pass
            if self._closing:
                raise ClosedResourceError("this reader was closed while get() waited")
            if stop is not None and (exc := stop()) is not None:
                raise exc
            self._waits.wait(self._src, self._is_closing, deadline, stop, stop_every_s, poll_ns)

    def _is_closing(self) -> bool:
        return self._closing

    def _interrupt(self) -> None:
        """Wake the thread sleeping in ``get`` (from another thread): it looks again, and asks
        its ``stop``. Nothing once closed."""
        with self._close_lock:
            if not self._closed:
                self._src.interrupt()


# --- the factories -----------------------------------------------------------------------------
@overload
def open_writer(*, schema: None = ..., **options: Unpack[WriterOptions]) -> BlockingWriter[Any]: ...
@overload
def open_writer(*, schema: type[M], **options: Unpack[WriterOptions]) -> BlockingWriter[M]: ...
def open_writer(*, schema: type[BaseModel] | None = None, **options: Unpack[WriterOptions]) -> BlockingWriter[Any]:
    """Create a channel and return its blocking writer. The keyword arguments, their defaults
    and the errors are those of ``aiobroadcast.open_writer``. Use ``with`` (closes at the end)
    or call ``close()``."""
    return BlockingWriter(_private, _blocking_channel(_WriterSpec(schema=schema, **options)))


def _blocking_channel(spec: _WriterSpec) -> WriterChannel:
    """``channel_steps`` in this thread (``_base.steps.drive_blocking``): the server's answer is
    waited for here."""
    return drive_blocking(channel_steps(spec), lambda start: start.answer())


@overload
def open_reader(
    handle: Handle | str, *, schema: None = ..., **options: Unpack[ReaderOptions]
) -> BlockingReader[Any]: ...
@overload
def open_reader(handle: Handle | str, *, schema: type[M], **options: Unpack[ReaderOptions]) -> BlockingReader[M]: ...
def open_reader(
    handle: Handle | str, *, schema: type[BaseModel] | None = None, **options: Unpack[ReaderOptions]
) -> BlockingReader[Any]:
    """Attach to a channel (made by either API) and return a blocking reader. The keyword
    arguments, their defaults and the errors are those of ``aiobroadcast.open_reader``;
    ``spin_us`` polls in this thread. Use ``with`` (closes at the end) or call ``close()``."""
    h = Handle.parse(handle)
    spec = _ReaderSpec(schema=schema, **options)
    source, reader_name = drive_blocking(
        spec.steps(h), lambda welcome: welcome.wait_welcome_blocking(spec.connect_timeout)
    )
    return BlockingReader(_private, source, h, reader_name, spec.spin_us)


def open_arena_reader(handle: Handle | str, *, name: str) -> BlockingReader[Any]:
    """A shared-memory reader whose arena bodies arrive as views with a lifetime and everything
    else as copies (``aiobroadcast.vllm``'s local readers: vLLM's arena hands out such tensors)."""
    h = Handle.parse(handle)
    decode = _ReaderSpec(name=name).decoder(h)
    source = _shm_source(h, name, decode, False, arena_views=True)
    return BlockingReader(_private, source, h, name, None)


# Public through aiobroadcast.blocking, and named so (repr, pickling by name, the docs).
for _public in (BlockingReader, BlockingWriter, open_reader, open_writer):
    _public.__module__ = "aiobroadcast.blocking"
