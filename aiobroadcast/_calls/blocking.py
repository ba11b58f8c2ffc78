"""The blocking calls roles (``aiobroadcast.blocking``): ``BlockingCaller``, ``BlockingRequest``,
``BlockingWorker``, for code without an event loop; they drive the call machine as the async
roles do."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from time import monotonic
from typing import Any, final

from .._base import fork as _fork
from .._base.errors import BroadcastError, ClosedResourceError, EndOfStream, WaitTimeout
from .._broadcast.blocking import BlockingReader, BlockingWriter
from .._fanin.blocking import BlockingCollector, BlockingSender
from .._shm.owned import Owned
from .base import _CallerBase, _WorkerBase
from .machine import (
    _DONE,
    _PUT,
    CallHandler,
    NextRequest,
    SendFailure,
    SendReply,
    _Answer,
    serve_steps,
)
from .types import CALLER_FIX, WORKER_FIX, Outcome, Q, R, _check_timeout


# --- blocking ---------------------------------------------------------------------------------------
@final
@_fork.role("caller", CALLER_FIX)
class BlockingCaller(_CallerBase[Q, R, BlockingWriter[Any], BlockingCollector[Any]]):
    """``Caller`` for code without an event loop (``aiobroadcast.blocking.open_caller``)."""

    _NAME = "BlockingCaller"
    _OPENER = "aiobroadcast.blocking.open_caller()"
    _NO_SERVE = "a BlockingCaller has no serve(): workers serve (open_worker(caller.handle, name=...).serve(fn))"

    def __init__(
        self, token: object, writer: BlockingWriter[Any], collector: BlockingCollector[Any], workers: tuple[str, ...]
    ) -> None:
        super().__init__(token, writer, collector, workers)
        # Calls and wait_ready take turns on it. A call from inside this thread's own call (a
        # request's __reduce__, a signal handler) is refused instead of waiting for itself.
        self._lock = Owned()

    def call(self, request: Q, *, timeout: float) -> dict[str, Outcome[R]]:
        """As ``Caller.call``; calls from several threads take turns (the wait counts in the timeout)."""
        _check_timeout(timeout)
        lock = self._lock
        if lock.mine():
            raise BroadcastError("call() called from inside this caller's own call on this thread")
        try:
            lock.acquire(None)  # inside the try: a Ctrl-C anywhere leaves it free (_shm/owned.py)
            try:
                return self._call(request, timeout)
            finally:
                self._core.book.busy = False  # the call is over (_Book.begin)
        finally:
            lock.release()

    def _call(self, request: Q, timeout: float) -> dict[str, Outcome[R]]:
        call = self._core.start(request)
        deadline = monotonic() + timeout
        need = call.need()
        unsent = None
        while need is not _DONE:
            left = max(0.0, deadline - monotonic())
            try:
                if need is _PUT:
                    self._w.put(call.message, left)
                    need = call.sent()
                else:
                    need = call.take(self._c.get(left))
            except EndOfStream:
                need = call.ended()
            except WaitTimeout as exc:
                if need is _PUT:
                    unsent = str(exc)  # it names the workers that held the request ring
                break
        if need is _DONE:
            return call.result(timeout)
        return self._late(call, timeout, unsent)

    def wait_ready(self, names: Iterable[str] | None = None, *, timeout: float | None = None) -> None:
        """As ``Caller.wait_ready``; takes turns with calls from other threads."""
        core = self._core
        wanted = core.wanted(names, timeout)
        deadline = None if timeout is None else monotonic() + timeout
        lock = self._lock
        if lock.mine():
            raise BroadcastError("wait_ready() called from inside this caller's own call on this thread")
        try:
            try:
                lock.acquire(deadline)
            except WaitTimeout:
                raise core.not_ready(wanted, timeout) from None
            core.check_open()
            c = self._c
            while core.sweep(wanted, c.get_nowait, c.check_now):
                try:
                    d = c.get(None if deadline is None else max(0.0, deadline - monotonic()))
                except WaitTimeout:
                    raise core.not_ready(wanted, timeout) from None
                core.hello(d)
        except EndOfStream:
            raise core.not_ready(wanted, timeout) from None
        finally:
            lock.release()

    # close and the context-manager methods: Caller's aclose/__aenter__/__aexit__ without await
    # (the protocol each front must spell out for itself).
    def close(self) -> None:
        if not self._begin_close():
            return
        try:
            self._w.close()
        finally:
            self._c.close()

    def __enter__(self) -> BlockingCaller[Q, R]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<aiobroadcast.blocking.BlockingCaller workers={len(self.workers)}>"


def serve_blocking(take: Callable[[], Any], handler: Callable[[Any], Any]) -> int:
    """``serve_steps`` in this thread: ``take()`` returns each request (None at the end: a
    ``BlockingWorker``'s), ``handler`` answers its value, ``reply``/``fail`` send the answer.
    The loop of ``_base.steps.drive_blocking``, written out with the events done inline (as
    ``serve_async`` does): a call per event cost about 100 ns a request here."""
    steps = serve_steps()
    request: Any = None
    answer: Any = None
    try:
        event = next(steps)
        while True:
            try:
                match event:
                    case NextRequest():
                        request = take()
                    case CallHandler():
                        answer = handler(request.value)
                    case SendReply():
                        request.reply(answer)
                    case SendFailure(error=error):
                        request.fail(error)
            except BaseException as exc:
                event = steps.throw(exc)
            else:
                event = steps.send(request)
    except StopIteration as end:
        return end.value  # type: ignore[no-any-return]
    finally:
        steps.close()


@final
class BlockingRequest(_Answer[Q, R]):
    """``Request`` for a ``BlockingWorker``."""

    __slots__ = ()

    # Request.reply and fail without await, written out: a worker's answer per call, and an
    # async and a blocking put cannot share one body.
    def reply(self, value: R) -> None:
        answer = self._reply(value)
        try:
            self._sender.put(answer)
        except BaseException:
            self._unsent()
            raise

    def fail(self, exc: BaseException) -> None:
        self._sender.put(self._failure(exc))


@final
@_fork.role("worker", WORKER_FIX)
class BlockingWorker(_WorkerBase[Q, R, BlockingReader[Any], BlockingSender[Any]]):
    """``Worker`` for code without an event loop (``aiobroadcast.blocking.open_worker``)."""

    _NAME = "BlockingWorker"
    _OPENER = "aiobroadcast.blocking.open_worker()"
    _SHOWN_AS = "aiobroadcast.blocking.BlockingWorker"
    _NO_CALL = "a BlockingWorker has no call(): only the caller calls (open_caller(workers=...))"

    def __init__(self, token: object, reader: BlockingReader[Any], sender: BlockingSender[Any], name: str) -> None:
        super().__init__(token, reader, sender, name)  # a role class has an __init__ of its own (_fork.role)

    def __iter__(self) -> BlockingWorker[Q, R]:
        return self

    def __next__(self) -> BlockingRequest[Q, R]:
        request = self._next()
        if request is None:
            raise StopIteration
        return request

    def _next(self) -> BlockingRequest[Q, R] | None:
        try:
            cid, value = self._r.get()
        except (EndOfStream, ClosedResourceError):
            return None
        return BlockingRequest(self._s, cid, value)

    def serve(self, handler: Any) -> int:
        """As ``Worker.serve``, with a plain function."""
        return serve_blocking(self._next, handler)

    def close(self) -> None:
        if not self._begin_close():
            return
        try:
            self._s.close()
        finally:
            self._r.close()

    def __enter__(self) -> BlockingWorker[Q, R]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


for _public in (BlockingCaller, BlockingRequest, BlockingWorker):
    _public.__module__ = "aiobroadcast.blocking"
