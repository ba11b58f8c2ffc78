"""Request/reply over a pool of named workers (docs/fan-in.md, "Calls"): a broadcast channel
carries each request to every worker, a fan-in collector brings their replies back.

On the wire a request is ``(call_id, obj)``; a reply ``(call_id, True, value)`` or, when the
handler raised, ``(call_id, False, (type_name, message))``; a worker's first item,
``(0, True, pid)``, says its reader is attached (a request broadcast after it reaches it).
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterable
from inspect import isawaitable
from time import monotonic
from types import TracebackType
from typing import Any, final

import anyio
import anyio.lowlevel

from .._base import fork as _fork
from .._base.errors import BroadcastError, ClosedResourceError, EndOfStream, WaitTimeout, WouldBlock
from .._broadcast.reader import Reader
from .._broadcast.writer import Writer
from .._fanin.collector import Collector
from .._fanin.sender import Sender
from .base import _CallerBase, _WorkerBase
from .machine import (
    _DONE,
    _PUT,
    CallHandler,
    NextRequest,
    SendFailure,
    SendReply,
    _Answer,
    _unsent,
    serve_steps,
)
from .types import CALLER_FIX, WORKER_FIX, Outcome, Q, R, _check_timeout


# --- the caller (async) ------------------------------------------------------------------------------
@final
@_fork.role("caller", CALLER_FIX)
class Caller(_CallerBase[Q, R, Writer[Any], Collector[Any]]):
    """Calls every worker of a pool and gathers their answers. Built by ``open_caller``.

    ``await caller.call(request, timeout=5)`` returns ``{worker: Reply | Failed | NoReply}`` in
    the order the workers were named. Replies are matched by call id: one that comes after its
    call returned is dropped (``statistics().late_replies``), never returned by a later call.
    """

    _NAME = "Caller"
    _OPENER = "aiobroadcast.open_caller()"
    _NO_SERVE = (
        "a Caller has no serve(): workers serve, each in its own role: "
        "open_worker(caller.handle, name=...).serve(handler)"
    )

    def __init__(self, token: object, writer: Writer[Any], collector: Collector[Any], workers: tuple[str, ...]) -> None:
        super().__init__(token, writer, collector, workers)
        self._turn = anyio.Lock()  # concurrent calls take turns
        # call() publishes without a look at the thread (put_nowait): it looks itself, first.
        self._thread = threading.get_ident()

    # The deadline is part of the answer (a NoReply per late worker), not a cancellation.
    async def call(self, request: Q, *, timeout: float) -> dict[str, Outcome[R]]:  # noqa: ASYNC109
        """Broadcast ``request`` to every worker and wait, at most ``timeout`` seconds in all, for
        each worker's answer (first, for workers not attached yet, to attach). Raises what
        ``Writer.put`` raises for the request (``SerializationError``, ``MessageTooLarge``:
        nothing is sent) and ``ClosedResourceError`` after ``aclose``. Concurrent calls take turns
        (the wait counts in the timeout). A worker that ended is not waited for."""
        if threading.get_ident() != self._thread:
            raise BroadcastError(
                "this caller's call() belongs to the thread whose event loop opened it; from another "
                "thread use anyio.from_thread.run(caller.call, ...), or aiobroadcast.blocking.open_caller"
            )
        _check_timeout(timeout)
        deadline = monotonic() + timeout
        turn = self._turn
        try:
            # No call in progress (the usual case): take the turn at once. Waiting for it through
            # a cancel scope and a trip through the event loop cost about 20 us of every paced
            # call here. A cancelled task still raises before anything is sent.
            turn.acquire_nowait()
        except anyio.WouldBlock:
            with anyio.move_on_after(deadline - monotonic()) as scope:
                await turn.acquire()
            if scope.cancelled_caught:  # another call held the turn past this one's deadline
                return self._core.timed_out(timeout)
        else:
            try:
                await anyio.lowlevel.checkpoint_if_cancelled()
            except BaseException:
                turn.release()
                raise
        try:
            return await self._call(request, deadline, timeout)
        finally:
            self._core.book.busy = False  # the call is over (_Book.begin)
            turn.release()

    async def _call(self, request: Q, deadline: float, limit: float) -> dict[str, Outcome[R]]:
        """``_Call`` driven in a task, until ``deadline`` (``time.monotonic``). No cancel scope on
        the usual path: the request is published at once (a scope only if the ring is full), and
        the collector's own sleeps end at the deadline (``Collector.get_before``). A scope per
        call (its timer made and cancelled, the task's state looked up) was a measurable part of
        a paced call's round trip (docs/performance.md, "Calls: fewer frames ...")."""
        call = self._core.start(request)
        need = call.need()
        unsent = None
        while need is not _DONE:
            if need is _PUT:
                try:
                    self._w.put_nowait(call.message)
                except WouldBlock:  # the ring is full: wait for room, until the deadline
                    with anyio.move_on_after(deadline - monotonic()) as scope:
                        await self._w.put(call.message)
                    if scope.cancelled_caught:  # not sent: a cancelled put publishes nothing
                        unsent = self._w.read_channel(_unsent)
                        break
                need = call.sent()
                continue
            try:
                need = call.take(await self._c.get_before(deadline))
            except EndOfStream:
                need = call.ended()
            except WaitTimeout:
                break
        if need is _DONE:
            return call.result(limit)
        return self._late(call, limit, unsent)

    # The timeout is part of the answer (WaitTimeout naming who is missing), as call's is.
    async def wait_ready(
        self,
        names: Iterable[str] | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> None:
        """Return once every worker of ``names`` (default: the whole pool) has said hello: it is
        attached, and a request broadcast now reaches it. A worker restarted under the name of one
        that ended (a new process) is waited for: dead workers are looked for first (their rings'
        locks, not the liveness period), and the reports that free their names are taken, so the
        new process can attach. Raises ``WaitTimeout`` (a ``TimeoutError``) naming the workers
        that did not, after ``timeout`` seconds (None: no limit); ``InvalidArgument`` for a name
        not in the pool. Takes turns with calls; answers it meets are late ones (counted)."""
        core = self._core
        wanted = core.wanted(names, timeout)
        deadline = anyio.current_time() + (float("inf") if timeout is None else timeout)
        with anyio.CancelScope(deadline=deadline) as scope:
            await self._turn.acquire()
        if scope.cancelled_caught:
            raise core.not_ready(wanted, timeout)
        try:
            core.check_open()
            c = self._c
            while core.sweep(wanted, c.get_nowait, c.check_now):
                with anyio.CancelScope(deadline=deadline) as scope:
                    d = await c.get()
                if scope.cancelled_caught:
                    raise core.not_ready(wanted, timeout)
                core.hello(d)
        except EndOfStream:
            raise core.not_ready(wanted, timeout) from None
        finally:
            self._turn.release()

    # aclose and the async context-manager methods: the protocol each role spells out (Worker's
    # below; BlockingCaller's without await).
    async def aclose(self) -> None:
        """Close: workers' iteration ends after the requests already sent; their replies are not
        awaited."""
        if not self._begin_close():
            return
        try:
            await self._w.aclose()
        finally:
            await self._c.aclose()

    async def __aenter__(self) -> Caller[Q, R]:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        s = self._core.book.statistics()
        return f"<aiobroadcast.Caller workers={len(self.workers)} ready={len(s.ready)} calls={s.calls}>"


# --- the worker (async) -------------------------------------------------------------------------------
async def serve_async(requests: AsyncIterator[Any], handler: Any) -> int:
    """``serve_steps`` in a task: takes each request from ``requests`` (a ``Worker``), calls
    ``handler`` (a function or a coroutine function), answers with ``Request.reply``/``fail``.
    The loop of ``_base.steps.drive``, written out with the events done inline (as
    ``serve_blocking`` does): no coroutine per event on the path per request."""
    steps = serve_steps()
    request: Any = None
    answer: Any = None
    try:
        event = next(steps)
        while True:
            try:
                match event:
                    case NextRequest():
                        try:
                            request = await requests.__anext__()
                        except StopAsyncIteration:
                            request = None
                    case CallHandler():
                        answer = handler(request.value)
                        if isawaitable(answer):
                            answer = await answer
                    case SendReply():
                        await request.reply(answer)
                    case SendFailure(error=error):
                        await request.fail(error)
            except BaseException as exc:
                event = steps.throw(exc)
            else:
                event = steps.send(request)
    except StopIteration as end:
        return end.value  # type: ignore[no-any-return]
    finally:
        steps.close()


@final
class Request(_Answer[Q, R]):
    """One call as a worker receives it: ``value``, answered once with ``reply`` or ``fail``."""

    __slots__ = ()

    async def reply(self, value: R) -> None:
        """Answer the call with ``value``. Raises ``InvalidArgument`` the second time, what
        ``Sender.put`` raises (``SerializationError``, ``CollectorGone``)."""
        answer = self._reply(value)
        sender = self._sender
        try:
            # sender.put(answer), without its coroutine when the reply goes out at once.
            pending = sender.send_now(answer)
            if pending is not None:
                await sender.send_in_turn(pending)
        except BaseException:
            self._unsent()
            raise

    async def fail(self, exc: BaseException) -> None:
        """Answer the call with an error: the caller gets ``Failed(worker, type name, message)``."""
        await self._sender.put(self._failure(exc))


@final
@_fork.role("worker", WORKER_FIX)
class Worker(_WorkerBase[Q, R, Reader[Any], Sender[Any]]):
    """One named worker of a pool. Built by ``open_worker``; has no ``call``.

    ``async for request in worker: await request.reply(answer)``, or ``await
    worker.serve(handler)``. Iteration ends when the caller closes the pool (after the requests
    it sent); a dead caller raises ``WriterGone``."""

    _NAME = "Worker"
    _OPENER = "aiobroadcast.open_worker()"
    _SHOWN_AS = "aiobroadcast.Worker"
    _NO_CALL = (
        "a Worker has no call(): only the caller calls (open_caller(workers=...).call(request)); "
        "a worker answers requests: async for request in worker: await request.reply(...)"
    )

    def __init__(self, token: object, reader: Reader[Any], sender: Sender[Any], name: str) -> None:
        super().__init__(token, reader, sender, name)  # a role class has an __init__ of its own (_fork.role)

    def __aiter__(self) -> Worker[Q, R]:
        return self

    async def __anext__(self) -> Request[Q, R]:
        # Taken here, not in a helper: one coroutine less per request (serve takes through it too).
        try:
            cid, value = await self._r.get()
        except (EndOfStream, ClosedResourceError):
            raise StopAsyncIteration from None
        return Request(self._s, cid, value)

    async def serve(self, handler: Any) -> int:
        """Answer every request with ``handler(value)`` (a function or a coroutine function) until
        the caller closes the pool; an exception the handler raises becomes that call's ``Failed``
        and the loop goes on. Returns the number of requests served. A reply that cannot be sent
        (unpicklable, too large) is answered as ``Failed`` with that error."""
        return await serve_async(self, handler)

    async def aclose(self) -> None:
        """Leave the pool: the caller's calls report this worker ``NoReply("closed")``."""
        if not self._begin_close():
            return
        try:
            await self._s.aclose()
        finally:
            await self._r.aclose()

    async def __aenter__(self) -> Worker[Q, R]:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
