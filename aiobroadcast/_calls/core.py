"""Request/reply over a pool of named workers (docs/fan-in.md, "Calls"): a broadcast channel
carries each request to every worker, a fan-in collector brings their replies back.

On the wire a request is ``(call_id, obj)``; a reply ``(call_id, True, value)`` or, when the
handler raised, ``(call_id, False, (type_name, message))``; a worker's first item,
``(0, True, pid)``, says its reader is attached (a request broadcast after it reaches it).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Awaitable, Callable, Generator, Iterable
from dataclasses import dataclass
from inspect import isawaitable
from time import monotonic
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, NamedTuple, NoReturn, TypeVar, final

import anyio
import anyio.lowlevel
from pydantic import BaseModel, ConfigDict, ValidationError

from .._base import fork as _fork
from .._base.errors import (
    BroadcastError,
    ClosedResourceError,
    CollectorGone,
    EndOfStream,
    InvalidArgument,
    InvalidHandle,
    NoReplyError,
    WaitTimeout,
    WorkerError,
    WouldBlock,
)
from .._base.handle import Handle, _first_problem, handle_kind, path_problem
from .._base.stats import where
from .._base.steps import drive, drive_blocking
from .._broadcast import blocking as blocking_roles
from .._broadcast.open import DEFAULT_DIRECTORY, _Opening, open_reader, open_writer
from .._broadcast.reader import Reader
from .._broadcast.writer import Writer
from .._fanin import blocking as fanin_blocking
from .._fanin.collector import Collector
from .._fanin.handle import CollectorHandle
from .._fanin.handle import looks_like_channel as _looks_like_channel
from .._fanin.handle import name_problem as _name_problem
from .._fanin.items import Item, SourceClosed, SourceGone
from .._fanin.open import open_collector, open_sender
from .._fanin.sender import Sender
from .._shm.owned import Owned

if TYPE_CHECKING:
    from .._broadcast.channel import WriterChannel

Q = TypeVar("Q")  #: what a call sends
R = TypeVar("R")  #: what a worker answers
R_co = TypeVar("R_co", covariant=True)

_private = object()
_HELLO = 0
#: What a fork child may do instead of using an inherited caller, or worker (``_fork.role``).
CALLER_FIX = "a pool has one caller; open a pool of your own with open_caller(workers=...)"
WORKER_FIX = "open your own with open_worker(pool handle, name=...) under a name no live worker holds"


# --- what a call returns, per worker ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Reply(Generic[R_co]):
    """The worker ``worker`` answered ``value``."""

    worker: str
    value: R_co

    def unwrap(self) -> R_co:
        return self.value


@dataclass(frozen=True, slots=True)
class Failed:
    """The worker's handler raised ``type_name: message`` (text only: nothing foreign is
    unpickled or raised here). ``unwrap()`` raises ``WorkerError``."""

    worker: str
    type_name: str
    message: str

    def unwrap(self) -> NoReturn:
        raise WorkerError(self.worker, self.type_name, self.message)


@dataclass(frozen=True, slots=True)
class NoReply:
    """No answer from ``worker``: ``reason`` is ``"dead"`` (its process died), ``"closed"`` (it
    left the pool) or ``"deadline"`` (the call's timeout passed first). ``unwrap()`` raises
    ``NoReplyError``."""

    worker: str
    reason: Literal["dead", "closed", "deadline"]
    detail: str

    def unwrap(self) -> NoReturn:
        raise NoReplyError(self.worker, self.reason, self.detail)


#: One worker's outcome of a call.
Outcome = Reply[R_co] | Failed | NoReply


class CallerStatistics(NamedTuple):
    calls: int  #: calls made
    ready: tuple[str, ...]  #: workers attached and not ended
    ended: tuple[tuple[str, str], ...]  #: (worker, "dead" | "closed")
    late_replies: int  #: replies to an earlier call that arrived after it returned: dropped
    unknown_replies: int  #: items with an id no call issued, or not a reply at all: dropped


# --- the handle -------------------------------------------------------------------------------------
class PoolHandle(BaseModel):
    """Names a pool: its request channel, its reply collector and its workers' names. Frozen,
    picklable, JSON round-trips. Pass it to ``open_worker``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["pool"] = "pool"
    requests: Handle
    replies: CollectorHandle
    workers: tuple[str, ...]

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> PoolHandle:
        """The pool handle ``to_json`` wrote. Raises ``InvalidHandle``."""
        return cls.parse(text)

    @classmethod
    def parse(cls, data: str | bytes | dict[str, Any] | PoolHandle | Handle | CollectorHandle) -> PoolHandle:
        if isinstance(data, PoolHandle):
            return data
        if isinstance(data, Handle | CollectorHandle) or (
            handle_kind(data) != "pool" and (handle_kind(data) == "collector" or _looks_like_channel(data))
        ):
            raise InvalidHandle(
                "this is a broadcast channel's or a collector's handle, not a pool's: open_worker takes "
                "caller.handle (made by open_caller)"
            )
        try:
            if isinstance(data, dict):
                return cls.model_validate(data)
            return cls.model_validate_json(data)
        except ValidationError as exc:
            path = path_problem(data, "pass the file's text: PoolHandle.from_json(Path(path).read_text())")
            raise InvalidHandle(f"not an aiobroadcast pool handle: {path or _first_problem(exc)}") from exc


def _check_workers(workers: Iterable[str]) -> tuple[str, ...]:
    if isinstance(workers, str):
        raise InvalidArgument("workers must be a collection of worker names, not one string")
    names = tuple(workers)
    if not names:
        raise InvalidArgument("workers must name at least one worker")
    for n in names:
        problem = _name_problem(n)
        if problem is not None:
            raise InvalidArgument(problem)
    if len(set(names)) != len(names):
        raise InvalidArgument(f"worker names must be unique: {names}")
    return names


def _check_timeout(timeout: float) -> None:
    if not timeout >= 0:
        raise InvalidArgument(f"timeout must be a number of seconds >= 0, not {timeout!r}")


def _ready_names(workers: tuple[str, ...], names: Iterable[str] | None, timeout: float | None) -> tuple[str, ...]:
    """``wait_ready``'s arguments, checked: the names to wait for (default: every worker)."""
    if timeout is not None:
        _check_timeout(timeout)
    if names is None:
        return workers
    if isinstance(names, str):
        raise InvalidArgument("names must be a collection of worker names, not one string")
    out = tuple(names)
    for n in out:
        if n not in workers:
            raise InvalidArgument(f"{n!r} is not one of this pool's workers {list(workers)}")
    return out


def _not_ready(book: _Book, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if n not in book.ready]


def _not_ready_error(missing: list[str], timeout: float | None) -> WaitTimeout:
    return WaitTimeout(
        f"{'worker' if len(missing) == 1 else 'workers'} {', '.join(repr(n) for n in missing)} "
        f"did not say hello within {timeout} s "
        "(not started, still starting, or ended)"
    )


#: deliveries ``wait_ready`` takes at most in one sweep of what is ready now
_SWEEP = 4096


# --- the bookkeeping both callers share -----------------------------------------------------------------
class _Book:
    """Who is ready, who ended, which call is current; sorts every delivery (no I/O)."""

    def __init__(self, workers: tuple[str, ...]) -> None:
        self.workers = workers
        self.ready: set[str] = set()
        self.ended: dict[str, NoReply] = {}
        self.next_id = 1
        self.late = 0
        self.unknown = 0
        self.busy = False
        #: The workers the current call's request went to, and why the others were left out.
        self.expect: frozenset[str] = frozenset()
        self.absent: dict[str, NoReply] = {}

    def absorb(self, d: object, current: int, got: dict[str, Reply[Any] | Failed]) -> None:
        if isinstance(d, Item):
            src, msg = d.source, d.value
            if src not in self.workers or type(msg) is not tuple or len(msg) != 3 or type(msg[0]) is not int:
                self.unknown += 1
                return
            cid, ok, payload = msg
            if cid == _HELLO:  # a worker attached: the first time, or again after it ended
                self.ended.pop(src, None)
                self.ready.add(src)
            elif cid == current and src not in got:
                if ok:
                    got[src] = Reply(src, payload)
                else:
                    type_name, message = payload
                    got[src] = Failed(src, str(type_name), str(message))
            elif 0 < cid < self.next_id:
                self.late += 1
            else:
                self.unknown += 1
        elif isinstance(d, SourceClosed):
            self.ready.discard(d.source)
            self.ended[d.source] = NoReply(d.source, "closed", f"worker {d.source!r} closed")
        elif isinstance(d, SourceGone):
            self.ready.discard(d.source)
            self.ended[d.source] = NoReply(d.source, "dead", f"worker {d.source!r} (pid {d.pid}) died")

    # unready and waiting run a few times per call: plain loops, no generator made
    def unready(self) -> bool:
        ready, ended = self.ready, self.ended
        for w in self.workers:  # noqa: SIM110 (any() of a generator costs more, per call)
            if w not in ready and w not in ended:
                return True
        return False

    def sent(self) -> None:
        """The request is out: wait for the workers attached now only (one that attaches again
        meanwhile, after a restart, did not get it)."""
        self.expect = frozenset(w for w in self.workers if w not in self.ended)
        self.absent = dict(self.ended)

    def waiting(self, got: dict[str, Reply[Any] | Failed]) -> bool:
        ended = self.ended
        for w in self.expect:  # noqa: SIM110 (as unready)
            if w not in got and w not in ended:
                return True
        return False

    def begin(self) -> int:
        """A call begins: its id (``BroadcastError`` if one is in progress). The front ends clear
        ``busy`` in the ``finally`` of the turn they hold, whatever happened (returned, timed
        out, failed, cancelled, interrupted on any line, even before the call began): with a
        store, not a call, since a Ctrl-C can be raised on entering a Python function."""
        if self.busy:
            raise BroadcastError("one call at a time: this caller is already in a call (from another thread?)")
        self.busy = True
        self.expect = frozenset()
        self.absent = {}
        cid = self.next_id
        self.next_id += 1
        return cid

    def result(
        self, got: dict[str, Reply[Any] | Failed], timeout: float, why: Callable[[str], str] | None = None
    ) -> dict[str, Outcome[Any]]:
        """Each worker's outcome; ``why(worker)``: what is known of a worker that did not answer
        in time (``_why_late``), added to its ``NoReply``."""
        out: dict[str, Outcome[Any]] = {}
        for w in self.workers:
            g = got.get(w)
            if g is not None:
                out[w] = g
            elif w in self.ended:
                out[w] = self.ended[w]
            elif w in self.absent:
                out[w] = self.absent[w]
            else:
                late = f"worker {w!r} did not answer within {timeout} s"
                out[w] = NoReply(w, "deadline", late if why is None else f"{late}: {why(w)}")
        return out

    def statistics(self) -> CallerStatistics:
        return CallerStatistics(
            self.next_id - 1,
            tuple(w for w in self.workers if w in self.ready),
            tuple((w, e.reason) for w, e in self.ended.items()),
            self.late,
            self.unknown,
        )


#: What a call needs next (``_Call.need``): a delivery from the collector, the request sent, nothing.
_GET, _PUT, _DONE = 0, 1, 2
#: A call's phases: waiting for the workers to attach, sending, waiting for replies, over.
_ATTACH, _SEND, _REPLIES, _OVER = 0, 1, 2, 3


class _Call:
    """One call, sans-IO: its id, its request and the answers it gathered. The front end asks
    ``need()`` and does it (``_GET``: take a delivery from the collector and hand it to ``take``,
    or say ``ended`` when every worker ended; ``_PUT``: send ``message``, then say ``sent``); each
    of these returns what is needed next, until ``_DONE`` or the call's deadline passes; then
    ``result``. The front end ends the call (``_Book.busy``) whatever happened.
    Written once for ``Caller`` and ``BlockingCaller``: which reply answers this call (its id,
    see ``_Book.absorb``: a late reply to an earlier call never does), whom to wait for, and
    what the ones that did not answer get."""

    __slots__ = ("_book", "_got", "_phase", "cid", "message")

    def __init__(self, book: _Book, request: object) -> None:
        self.cid = cid = book.begin()
        self._book = book
        self._got: dict[str, Reply[Any] | Failed] = {}
        self._phase = _ATTACH
        #: what goes on the request channel
        self.message = (cid, request)

    def need(self) -> int:
        phase = self._phase
        if phase == _ATTACH:
            if self._book.unready():
                return _GET  # first, the workers not attached yet (a request would miss them)
            self._phase = phase = _SEND
        if phase == _SEND:
            return _PUT
        if phase == _REPLIES and self._book.waiting(self._got):
            return _GET
        self._phase = _OVER
        return _DONE

    def take(self, delivery: object) -> int:
        book = self._book
        book.absorb(delivery, self.cid, self._got)
        if self._phase == _REPLIES:  # the usual case, written out: a reply came
            if book.waiting(self._got):
                return _GET
            self._phase = _OVER
            return _DONE
        return self.need()

    def ended(self) -> int:
        """Every worker ended (the collector's stream ended): nobody is left to wait for."""
        self._phase = _SEND if self._phase == _ATTACH else _OVER
        return self.need()

    def sent(self) -> int:
        self._book.sent()
        self._phase = _REPLIES
        return self.need()

    def result(self, timeout: float, why: Callable[[str], str] | None = None) -> dict[str, Outcome[Any]]:
        return self._book.result(self._got, timeout, why)


class _CallerCore:
    """What ``Caller`` and ``BlockingCaller`` share (no I/O): the pool's handle, the
    bookkeeping, whether the caller is closed, starting a call, and ``wait_ready``'s sweep and
    error. Each front end holds one and adds its own waiting and turn-taking."""

    __slots__ = ("book", "closed", "handle")

    def __init__(self, requests: Handle, replies: CollectorHandle, workers: tuple[str, ...]) -> None:
        self.book = _Book(workers)
        self.handle = PoolHandle(requests=requests, replies=replies, workers=workers)
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise ClosedResourceError("this caller is closed")

    def start(self, request: object) -> _Call:
        """A new call (``BroadcastError`` if one is in progress)."""
        if self.closed:
            raise ClosedResourceError("this caller is closed")
        return _Call(self.book, request)

    def timed_out(self, timeout: float) -> dict[str, Outcome[Any]]:
        """The answer of a call whose deadline passed before it could begin."""
        return self.book.result({}, timeout, _not_begun)

    def wanted(self, names: Iterable[str] | None, timeout: float | None) -> tuple[str, ...]:
        return _ready_names(self.book.workers, names, timeout)

    def not_ready(self, wanted: tuple[str, ...], timeout: float | None) -> WaitTimeout:
        return _not_ready_error(_not_ready(self.book, wanted), timeout)

    def sweep(
        self, wanted: tuple[str, ...], get_nowait: Callable[[], object], check_now: Callable[[], None]
    ) -> list[str]:
        """Take what is ready, look for dead and new workers now, take what that made ready:
        then ``book.ready`` names no worker whose process has ended (its ring's lock is free).
        Returns the wanted workers not ready."""
        book = self.book
        for look in (False, True):
            if look:
                check_now()
            for _ in range(_SWEEP):
                try:
                    d = get_nowait()
                except WouldBlock:
                    break
                book.absorb(d, 0, {})
        return _not_ready(book, wanted)

    def hello(self, delivery: object) -> None:
        """A delivery taken while waiting for workers to attach (answers met are late ones)."""
        self.book.absorb(delivery, 0, {})


def _not_begun(worker: str) -> str:
    return "the call did not begin: another call of this caller held it past the deadline"


def _why_late(ch: WriterChannel, unsent: str | None) -> Callable[[str], str]:
    """What a call whose deadline passed says of each worker that did not answer: why the
    request was not sent (``unsent``), or where the worker's reader of the requests stands. Read
    from the request ring once the deadline passed, never per call. The request is the last
    message of the ring (calls take turns): a reader at the head has taken it."""
    if unsent is not None:
        return lambda worker: f"the request was not sent; {unsent}"
    readers = {r.name: r for r in ch.pub.records.infos(ch.pub.head, ())}

    def why(worker: str) -> str:
        r = readers.get(worker)
        if r is None:
            return "it has no reader of the requests attached"
        if not r.lag:
            return (
                f"it took the request ({where(r.pid, r.host)}) and has not replied: its handler is still "
                "running, or its process stopped after taking it"
            )
        return "it has not taken the request: its " + ch.describe_reader(r)

    return why


def _error_reply(cid: int, exc: BaseException) -> tuple[int, bool, tuple[str, str]]:
    return (cid, False, (type(exc).__name__, str(exc)))


# --- the caller (async) ------------------------------------------------------------------------------
@final
@_fork.role("caller", CALLER_FIX)
class Caller(Generic[Q, R]):
    """Calls every worker of a pool and gathers their answers. Built by ``open_caller``.

    ``await caller.call(request, timeout=5)`` returns ``{worker: Reply | Failed | NoReply}`` in
    the order the workers were named. Replies are matched by call id: one that comes after its
    call returned is dropped (``statistics().late_replies``), never returned by a later call.
    """

    def __init__(self, token: object, writer: Writer[Any], collector: Collector[Any], workers: tuple[str, ...]) -> None:
        if token is not _private:
            raise TypeError("Caller cannot be built directly; use aiobroadcast.open_caller()")
        self._w = writer
        self._c = collector
        self._core = _CallerCore(writer.handle, collector.handle, workers)
        self._turn = anyio.Lock()  # concurrent calls take turns
        # call() publishes without a look at the thread (put_nowait): it looks itself, first.
        self._thread = threading.get_ident()

    @property
    def handle(self) -> PoolHandle:
        """What a worker needs: pass it (or its JSON) to ``open_worker`` with one of the names."""
        return self._core.handle

    @property
    def workers(self) -> tuple[str, ...]:
        return self._core.book.workers

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
        the collector's own sleeps end at the deadline (``Collector._get_before``). A scope per
        call (its timer made and cancelled, the task's state looked up) was a measurable part of
        a paced call's round trip (docs/performance.md, "Calls: fewer frames ...")."""
        call = self._core.start(request)
        need = call.need()
        unsent = None
        while need != _DONE:
            if need == _PUT:
                try:
                    self._w.put_nowait(call.message)
                except WouldBlock:  # the ring is full: wait for room, until the deadline
                    with anyio.move_on_after(deadline - monotonic()) as scope:
                        await self._w.put(call.message)
                    if scope.cancelled_caught:  # not sent: a cancelled put publishes nothing
                        ch = self._w._ch
                        if not ch.pub.closed:
                            unsent = str(ch.put_timeout("put", ch.wanted, ch.pub.head))
                        break
                need = call.sent()
                continue
            try:
                need = call.take(await self._c._get_before(deadline))
            except EndOfStream:
                need = call.ended()
            except WaitTimeout:
                break
        if need == _DONE or self._w._ch.pub.closed:  # closed meanwhile: its ring is gone
            return call.result(limit)
        return call.result(limit, _why_late(self._w._ch, unsent))

    def statistics(self) -> CallerStatistics:
        return self._core.book.statistics()

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
            while core.sweep(wanted, c.get_nowait, c._g.check_now):
                with anyio.CancelScope(deadline=deadline) as scope:
                    d = await c.get()
                if scope.cancelled_caught:
                    raise core.not_ready(wanted, timeout)
                core.hello(d)
        except EndOfStream:
            raise core.not_ready(wanted, timeout) from None
        finally:
            self._turn.release()

    async def aclose(self) -> None:
        """Close: workers' iteration ends after the requests already sent; their replies are not
        awaited."""
        if self._core.closed:
            return
        self._core.closed = True
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

    def __reduce__(self) -> NoReturn:
        raise BroadcastError("a Caller cannot be pickled: send caller.handle and open_worker there")

    if not TYPE_CHECKING:

        @property
        def serve(self) -> NoReturn:
            raise AttributeError(
                "a Caller has no serve(): workers serve, each in its own role: "
                "open_worker(caller.handle, name=...).serve(handler)"
            )


# --- the worker (async) -------------------------------------------------------------------------------
#: What serving needs next (``serve_steps``): the next request (None once the pool closed), the
#: handler's answer to a request's value, a request replied to, a request failed.
_NEXT, _HANDLE, _REPLY, _FAIL = 0, 1, 2, 3
ServeStep = tuple[int, Any]
ServeSteps = Generator[ServeStep, Any, int]


def serve_steps() -> ServeSteps:
    """A worker's ``serve`` loop, written once for ``Worker`` and ``BlockingWorker``: yields
    ``(_NEXT, None)``, ``(_HANDLE, request)``, ``(_REPLY, (request, answer))`` or ``(_FAIL,
    (request, exc))``; the front end does it and sends the result in (the request, None at the
    end; the answer), or throws what it raised. An exception of the handler fails that call and
    serving goes on; so does a reply that cannot be sent (unpicklable, too large), but not a
    collector that is gone. Returns the number of requests served."""
    served = 0
    while True:
        request = yield _NEXT, None
        if request is None:
            return served
        try:
            answer = yield _HANDLE, request
        except Exception as exc:
            yield _FAIL, (request, exc)
        else:
            try:
                yield _REPLY, (request, answer)
            except CollectorGone:
                raise
            except BroadcastError as exc:
                yield _FAIL, (request, exc)
        served += 1


class _Answer(Generic[Q, R]):
    """What ``Request`` and ``BlockingRequest`` share (no I/O): the request, and its one answer.
    A front end sends ``_reply(value)`` or ``_failure(exc)`` with its sender; a reply that could
    not be sent is ``_unsent()``: the request may still be answered (with ``fail``, say)."""

    __slots__ = ("_answered", "_sender", "id", "value")

    def __init__(self, sender: Any, cid: int, value: Q) -> None:
        self._sender = sender
        self._answered = False
        self.id = cid
        self.value = value

    def _once(self) -> None:
        if self._answered:
            raise InvalidArgument(f"request {self.id} was already answered: one reply per request")
        self._answered = True

    def _reply(self, value: R) -> tuple[int, bool, R]:
        if self._answered:  # _once, inline: a reply is the path per request
            self._once()
        self._answered = True
        return (self.id, True, value)

    def _unsent(self) -> None:
        self._answered = False

    def _failure(self, exc: BaseException) -> tuple[int, bool, tuple[str, str]]:
        self._once()
        return _error_reply(self.id, exc)


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
            pending = sender._send_now(answer)
            if pending is not None:
                await sender._send_in_turn(pending)
        except BaseException:
            self._unsent()
            raise

    async def fail(self, exc: BaseException) -> None:
        """Answer the call with an error: the caller gets ``Failed(worker, type name, message)``."""
        await self._sender.put(self._failure(exc))


@final
@_fork.role("worker", WORKER_FIX)
class Worker(Generic[Q, R]):
    """One named worker of a pool. Built by ``open_worker``; has no ``call``.

    ``async for request in worker: await request.reply(answer)``, or ``await
    worker.serve(handler)``. Iteration ends when the caller closes the pool (after the requests
    it sent); a dead caller raises ``WriterGone``."""

    def __init__(self, token: object, reader: Reader[Any], sender: Sender[Any], name: str) -> None:
        if token is not _private:
            raise TypeError("Worker cannot be built directly; use aiobroadcast.open_worker()")
        self._r = reader
        self._s = sender
        self._name = name
        self._closed = False

    @property
    def name(self) -> str:
        return self._name

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

        async def do(step: ServeStep) -> object:
            what, arg = step
            if what == _NEXT:
                try:
                    return await self.__anext__()
                except StopAsyncIteration:
                    return None
            if what == _HANDLE:
                answer = handler(arg.value)
                return (await answer) if isawaitable(answer) else answer
            request, x = arg
            await (request.reply(x) if what == _REPLY else request.fail(x))
            return None

        return await drive(serve_steps(), do)

    async def aclose(self) -> None:
        """Leave the pool: the caller's calls report this worker ``NoReply("closed")``."""
        if self._closed:
            return
        self._closed = True
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

    def __repr__(self) -> str:
        return f"<aiobroadcast.Worker {self._name!r}>"

    def __reduce__(self) -> NoReturn:
        raise BroadcastError("a Worker cannot be pickled: send the pool's handle and open_worker there")

    if not TYPE_CHECKING:

        @property
        def call(self) -> NoReturn:
            raise AttributeError(
                "a Worker has no call(): only the caller calls (open_caller(workers=...).call(request)); "
                "a worker answers requests: async for request in worker: await request.reply(...)"
            )


# --- opening ----------------------------------------------------------------------------------------
class _PoolSpec:
    """``open_caller``'s arguments, checked; shared by the async and blocking factories."""

    def __init__(
        self,
        workers: Iterable[str],
        capacity: int,
        slot_bytes: int,
        max_request_bytes: int | None,
        max_reply_bytes: int | None,
        directory: str,
    ) -> None:
        self.workers = _check_workers(workers)
        self.capacity = capacity
        self.slot_bytes = slot_bytes
        self.max_request_bytes = max_request_bytes
        self.max_reply_bytes = max_reply_bytes
        self.directory = directory

    def writer_options(self) -> dict[str, Any]:
        """The request channel: one reader place per worker."""
        return {
            "capacity": self.capacity,
            "slot_bytes": self.slot_bytes,
            "max_readers": len(self.workers),
            "max_message_bytes": self.max_request_bytes,
            "directory": self.directory,
        }

    def collector_options(self) -> dict[str, Any]:
        """The reply collector: it waits for the pool's workers."""
        return {
            "expect": self.workers,
            "capacity": self.capacity,
            "slot_bytes": self.slot_bytes,
            "max_message_bytes": self.max_reply_bytes,
            "directory": self.directory,
        }


#: A step of opening a pool's role (``caller_steps``, ``worker_steps``): what to do (a factory's
#: name, ``"put"`` or ``"close"``), with what. Each front end does it with its own factories and
#: methods (``_open_async``, ``_open_blocking``), driven by ``_steps.drive``/``drive_blocking``.
OpenStep = tuple[str, tuple[Any, ...], dict[str, Any]]


def caller_steps(spec: _PoolSpec) -> Generator[OpenStep, Any, tuple[Any, Any]]:
    """Opening a caller, written once: the request channel, then the reply collector; on a
    failure (or a cancellation) the channel is closed again. Returns (writer, collector)."""
    writer = yield "open_writer", (), spec.writer_options()
    try:
        collector = yield "open_collector", (), spec.collector_options()
    except BaseException:
        yield "close", (writer,), {}
        raise
    return writer, collector


def worker_steps(handle: object, name: str) -> Generator[OpenStep, Any, tuple[Any, Any]]:
    """Opening a worker, written once: claim the name (the reply sender), attach to the
    requests, say hello (calls from now on reach us); on a failure, close what was opened.
    Returns (reader, sender)."""
    h = _worker_start(handle, name)
    sender = yield "open_sender", (h.replies,), {"name": name}
    try:
        reader = yield "open_reader", (h.requests,), {"name": name, "transport": "shm"}
        try:
            yield "put", (sender, (_HELLO, True, os.getpid())), {}
        except BaseException:
            yield "close", (reader,), {}
            raise
    except BaseException:
        yield "close", (sender,), {}
        raise
    return reader, sender


_ASYNC_FACTORIES: dict[str, Callable[..., Awaitable[Any]]] = {
    "open_writer": open_writer,
    "open_collector": open_collector,
    "open_sender": open_sender,
    "open_reader": open_reader,
}


async def _open_async(step: OpenStep) -> object:
    what, args, kwargs = step
    if what == "close":
        return await args[0].aclose()
    if what == "put":
        return await args[0].put(args[1])
    return await _ASYNC_FACTORIES[what](*args, **kwargs)


_BLOCKING_FACTORIES: dict[str, Callable[..., object]] = {
    "open_writer": blocking_roles.open_writer,
    "open_collector": fanin_blocking.open_collector,
    "open_sender": fanin_blocking.open_sender,
    "open_reader": blocking_roles.open_reader,
}


def _open_blocking(step: OpenStep) -> object:
    what, args, kwargs = step
    if what == "close":
        return args[0].close()
    if what == "put":
        return args[0].put(args[1])
    return _BLOCKING_FACTORIES[what](*args, **kwargs)


def open_caller(
    *,
    workers: Iterable[str],
    capacity: int = 64,
    slot_bytes: int = 1 << 16,
    max_request_bytes: int | None = None,
    max_reply_bytes: int | None = None,
    directory: str = DEFAULT_DIRECTORY,
) -> _Opening[Caller[Any, Any]]:
    """Create a pool of the named ``workers`` (unique names, as a fan-in's senders) and return its
    caller. Start the workers with ``caller.handle``; ``call`` waits (within its timeout) for
    those not attached yet. ``capacity``/``slot_bytes``: the request ring and each worker's reply
    ring. ``max_request_bytes``/``max_reply_bytes``: size limits (``MessageTooLarge``)."""
    spec = _PoolSpec(workers, capacity, slot_bytes, max_request_bytes, max_reply_bytes, directory)

    async def make() -> Caller[Any, Any]:
        writer, collector = await drive(caller_steps(spec), _open_async)
        return Caller(_private, writer, collector, spec.workers)

    return _Opening(make)


def _worker_start(handle: object, name: str) -> PoolHandle:
    h = PoolHandle.parse(handle)  # type: ignore[arg-type]
    if name not in h.workers:
        raise InvalidArgument(f"{name!r} is not one of this pool's workers {list(h.workers)}")
    return h


def open_worker(handle: PoolHandle | str, *, name: str) -> _Opening[Worker[Any, Any]]:
    """Join the pool of ``handle`` (``caller.handle`` or its JSON) as worker ``name`` (one of the
    names the caller gave). Raises ``InvalidHandle`` (not a pool's handle), ``InvalidArgument``
    (a name not in the pool, or held by a live worker), ``CollectorGone`` (the caller closed)."""

    async def make() -> Worker[Any, Any]:
        reader, sender = await drive(worker_steps(handle, name), _open_async)
        return Worker(_private, reader, sender, name)

    return _Opening(make)


# --- blocking ---------------------------------------------------------------------------------------
@final
@_fork.role("caller", CALLER_FIX)
class BlockingCaller(Generic[Q, R]):
    """``Caller`` for code without an event loop (``aiobroadcast.blocking.open_caller``)."""

    def __init__(self, token: object, writer: Any, collector: Any, workers: tuple[str, ...]) -> None:
        if token is not _private:
            raise TypeError("BlockingCaller cannot be built directly; use aiobroadcast.blocking.open_caller()")
        self._w = writer
        self._c = collector
        self._core = _CallerCore(writer.handle, collector.handle, workers)
        # Calls and wait_ready take turns on it. A call from inside this thread's own call (a
        # request's __reduce__, a signal handler) is refused instead of waiting for itself.
        self._lock = Owned()

    @property
    def handle(self) -> PoolHandle:
        return self._core.handle

    @property
    def workers(self) -> tuple[str, ...]:
        return self._core.book.workers

    def call(self, request: Q, *, timeout: float) -> dict[str, Outcome[R]]:
        """As ``Caller.call``; calls from several threads take turns (the wait counts in the timeout)."""
        _check_timeout(timeout)
        lock = self._lock
        if lock.mine():
            raise BroadcastError("call() called from inside this caller's own call on this thread")
        try:
            lock.acquire(None)  # inside the try: a Ctrl-C anywhere leaves it free (_owned.py)
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
        while need != _DONE:
            left = max(0.0, deadline - monotonic())
            try:
                if need == _PUT:
                    self._w.put(call.message, left)
                    need = call.sent()
                else:
                    need = call.take(self._c.get(left))
            except EndOfStream:
                need = call.ended()
            except WaitTimeout as exc:
                if need == _PUT:
                    unsent = str(exc)  # it names the workers that held the request ring
                break
        if need == _DONE:
            return call.result(timeout)
        w = self._w
        with w._close_lock:  # as its statistics() reads the ring: a close from another thread waits
            if w._closing:
                return call.result(timeout)
            return call.result(timeout, _why_late(w._w, unsent))

    def statistics(self) -> CallerStatistics:
        return self._core.book.statistics()

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

            def check_now() -> None:
                try:
                    c._lock.acquire(None)
                    c._g.check_now()
                finally:
                    c._lock.release()

            while core.sweep(wanted, c.get_nowait, check_now):
                try:
                    d = c.get(None if deadline is None else max(0.0, deadline - monotonic()))
                except WaitTimeout:
                    raise core.not_ready(wanted, timeout) from None
                core.hello(d)
        except EndOfStream:
            raise core.not_ready(wanted, timeout) from None
        finally:
            lock.release()

    def close(self) -> None:
        if self._core.closed:
            return
        self._core.closed = True
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

    def __reduce__(self) -> NoReturn:
        raise BroadcastError("a BlockingCaller cannot be pickled: send caller.handle and open_worker there")

    if not TYPE_CHECKING:

        @property
        def serve(self) -> NoReturn:
            raise AttributeError(
                "a BlockingCaller has no serve(): workers serve (open_worker(caller.handle, name=...).serve(fn))"
            )


@final
class BlockingRequest(_Answer[Q, R]):
    """``Request`` for a ``BlockingWorker``."""

    __slots__ = ()

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
class BlockingWorker(Generic[Q, R]):
    """``Worker`` for code without an event loop (``aiobroadcast.blocking.open_worker``)."""

    def __init__(self, token: object, reader: Any, sender: Any, name: str) -> None:
        if token is not _private:
            raise TypeError("BlockingWorker cannot be built directly; use aiobroadcast.blocking.open_worker()")
        self._r = reader
        self._s = sender
        self._name = name
        self._closed = False

    @property
    def name(self) -> str:
        return self._name

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

        def do(step: ServeStep) -> object:
            what, arg = step
            if what == _NEXT:
                return self._next()
            if what == _HANDLE:
                return handler(arg.value)
            request, x = arg
            (request.reply if what == _REPLY else request.fail)(x)
            return None

        return drive_blocking(serve_steps(), do)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._s.close()
        finally:
            self._r.close()

    def __enter__(self) -> BlockingWorker[Q, R]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<aiobroadcast.blocking.BlockingWorker {self._name!r}>"

    def __reduce__(self) -> NoReturn:
        raise BroadcastError("a BlockingWorker cannot be pickled: send the pool's handle and open_worker there")

    if not TYPE_CHECKING:

        @property
        def call(self) -> NoReturn:
            raise AttributeError("a BlockingWorker has no call(): only the caller calls (open_caller(workers=...))")


def open_blocking_caller(
    *,
    workers: Iterable[str],
    capacity: int = 64,
    slot_bytes: int = 1 << 16,
    max_request_bytes: int | None = None,
    max_reply_bytes: int | None = None,
    directory: str = DEFAULT_DIRECTORY,
) -> BlockingCaller[Any, Any]:
    """``aiobroadcast.blocking.open_caller``: the arguments and errors of ``open_caller``."""
    spec = _PoolSpec(workers, capacity, slot_bytes, max_request_bytes, max_reply_bytes, directory)
    writer, collector = drive_blocking(caller_steps(spec), _open_blocking)
    return BlockingCaller(_private, writer, collector, spec.workers)


def open_blocking_worker(handle: PoolHandle | str, *, name: str) -> BlockingWorker[Any, Any]:
    """``aiobroadcast.blocking.open_worker``: the arguments and errors of ``open_worker``."""
    reader, sender = drive_blocking(worker_steps(handle, name), _open_blocking)
    return BlockingWorker(_private, reader, sender, name)


for _public in (BlockingCaller, BlockingRequest, BlockingWorker):
    _public.__module__ = "aiobroadcast.blocking"
for _fn, _name in ((open_blocking_caller, "open_caller"), (open_blocking_worker, "open_worker")):
    _fn.__module__ = "aiobroadcast.blocking"
    _fn.__name__ = _fn.__qualname__ = _name
