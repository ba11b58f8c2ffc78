"""The call machine, sans-IO: the caller's bookkeeping (``_Book``), one call (``_Call``), what
both callers share (``_CallerCore``), and a worker's serving loop (``serve_steps``) and
answer (``_Answer``). Written once for the async and the blocking roles, which drive them."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Generic

from .._base.errors import BroadcastError, ClosedResourceError, CollectorGone, InvalidArgument, WaitTimeout, WouldBlock
from .._base.stats import where
from .._fanin.items import Item, SourceClosed, SourceGone
from .types import (
    _HELLO,
    CallerStatistics,
    Failed,
    NoReply,
    Outcome,
    Q,
    R,
    Reply,
    _check_timeout,
    _error_reply,
)

if TYPE_CHECKING:
    from .._broadcast.channel import WriterChannel


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


class Need(Enum):
    """What a call needs next (``_Call.need``): a delivery from the collector, the request
    sent, nothing (the call is over)."""

    GET = "get"
    PUT = "put"
    DONE = "done"


class Phase(Enum):
    """A call's phases: waiting for the workers to attach, sending the request, waiting for
    the replies, over."""

    ATTACH = "attach"
    SEND = "send"
    REPLIES = "replies"
    OVER = "over"

    # Hashed by identity, in C (members are singletons: equal means identical): each move
    # looks its phase up in TRANSITIONS, and Enum's own __hash__ is a Python function.
    __hash__ = object.__hash__


# module names for the members: a global is looked up faster than a class's attribute
_GET, _PUT, _DONE = Need.GET, Need.PUT, Need.DONE
_ATTACH, _SEND, _REPLIES, _OVER = Phase.ATTACH, Phase.SEND, Phase.REPLIES, Phase.OVER

#: Every move a call makes, and the only ones (``_Call.move`` refuses any other). From ATTACH
#: to SEND once every worker attached or ended (``take``, ``need``, ``ended``: then nobody is
#: left to miss the request); to REPLIES once the request is out (``sent``); to OVER once
#: every worker the request went to answered or ended (``take``, ``need``, ``ended``).
TRANSITIONS: Final[Mapping[Phase, frozenset[Phase]]] = MappingProxyType(
    {
        _ATTACH: frozenset({_SEND}),
        _SEND: frozenset({_REPLIES}),
        _REPLIES: frozenset({_OVER}),
        _OVER: frozenset(),
    }
)
_MOVES = dict(TRANSITIONS)  # the same, looked up without the proxy


class _Call:
    """One call, sans-IO: its id, its request and the answers it gathered. The front end asks
    ``need()`` and does it (``Need.GET``: take a delivery from the collector and hand it to
    ``take``, or say ``ended`` when every worker ended; ``Need.PUT``: send ``message``, then say
    ``sent``); each of these returns what is needed next, until ``Need.DONE`` or the call's
    deadline passes; then ``result``. The front end ends the call (``_Book.busy``) whatever
    happened. Its phase moves only as ``TRANSITIONS`` allows: the moves the front end's events
    make (``sent``, ``ended``) go through ``move``, which refuses one out of turn (``sent``
    before the call needed a send, ``ended`` while it sends); ``need`` and ``take`` write theirs
    out, each right after the test of the phase it moves from (once per call: a method call
    there was a measurable part of the machine's cost per call).
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

    @property
    def phase(self) -> Phase:
        return self._phase

    def move(self, to: Phase) -> None:
        """Go to phase ``to``: ``BroadcastError`` if ``TRANSITIONS`` has no such move (the call
        stays where it was)."""
        if to not in _MOVES[self._phase]:
            allowed = ", ".join(sorted(p.name for p in TRANSITIONS[self._phase])) or "none"
            raise BroadcastError(
                f"call {self.cid} cannot go from {self._phase.name} to {to.name} (from {self._phase.name}: {allowed})"
            )
        self._phase = to

    def need(self) -> Need:
        phase = self._phase
        if phase is _ATTACH:
            if self._book.unready():
                return _GET  # first, the workers not attached yet (a request would miss them)
            self._phase = _SEND  # ATTACH to SEND (TRANSITIONS), written out: once per call
            return _PUT
        if phase is _SEND:
            return _PUT
        if phase is _REPLIES:
            if self._book.waiting(self._got):
                return _GET
            self._phase = _OVER  # REPLIES to OVER (TRANSITIONS), as in take
        return _DONE

    def take(self, delivery: object) -> Need:
        book = self._book
        book.absorb(delivery, self.cid, self._got)
        if self._phase is _REPLIES:  # the usual case, written out: a reply came
            if book.waiting(self._got):
                return _GET
            self._phase = _OVER  # REPLIES to OVER (TRANSITIONS), written out: once per call
            return _DONE
        return self.need()

    def ended(self) -> Need:
        """Every worker ended (the collector's stream ended): nobody is left to wait for."""
        phase = self._phase
        if phase is not _OVER:
            self.move(_SEND if phase is _ATTACH else _OVER)
        return self.need()

    def sent(self) -> Need:
        self.move(_REPLIES)
        self._book.sent()
        return self.need()

    def result(self, timeout: float, why: Callable[[str], str] | None = None) -> dict[str, Outcome[Any]]:
        return self._book.result(self._got, timeout, why)


class _CallerCore:
    """What ``Caller`` and ``BlockingCaller`` share (no I/O, no handle: built from the
    workers' names alone): the bookkeeping, whether the caller is closed, starting a call,
    and ``wait_ready``'s sweep and error. Each front end holds one and adds its own waiting
    and turn-taking."""

    __slots__ = ("book", "closed")

    def __init__(self, workers: tuple[str, ...]) -> None:
        self.book = _Book(workers)
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


def _unsent(ch: WriterChannel) -> str:
    """Why a request was not sent by its deadline: the readers that held the request ring."""
    return str(ch.serving.put_timeout("put", ch.publishing.wanted, ch.pub.head))


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
        return "it has not taken the request: its " + ch.serving.describe_reader(r)

    return why


# --- a worker's serving loop ---------------------------------------------------------------------------
# What serving asks its driver to do (``serve_steps``), as h11's events: each driver (the async
# one in ``roles.py``, the blocking one in ``blocking.py``) matches them and does it. The events
# of every request carry nothing: the driver holds the request it took and the handler's
# answer, and each is made once (no object made per request on this path).
@dataclass(frozen=True, slots=True)
class NextRequest:
    """Take the next request; send it in (None once the pool closed)."""


@dataclass(frozen=True, slots=True)
class CallHandler:
    """Call the handler with the value of the request taken; throw in what it raised."""


@dataclass(frozen=True, slots=True)
class SendReply:
    """Reply the handler's answer to the request taken; throw in what the reply raised."""


@dataclass(frozen=True, slots=True)
class SendFailure:
    """Answer the request taken with ``error`` (the caller gets ``Failed``)."""

    error: BaseException


ServeEvent = NextRequest | CallHandler | SendReply | SendFailure
ServeSteps = Generator[ServeEvent, Any, int]
NEXT_REQUEST: Final = NextRequest()
CALL_HANDLER: Final = CallHandler()
SEND_REPLY: Final = SendReply()


def serve_steps() -> ServeSteps:
    """A worker's ``serve`` loop, written once for ``Worker`` and ``BlockingWorker``: yields
    ``NextRequest``, ``CallHandler``, ``SendReply`` or ``SendFailure``; the driver does it and
    sends in the request it holds (the one it took; None once the pool closed), or throws what
    it raised. An exception of the handler fails that call and serving goes on; so does a reply
    that cannot be sent (unpicklable, too large), but not a collector that is gone. Returns the
    number of requests served."""
    served = 0
    while True:
        request = yield NEXT_REQUEST
        if request is None:
            return served
        try:
            yield CALL_HANDLER
        except Exception as exc:
            yield SendFailure(exc)
        else:
            try:
                yield SEND_REPLY
            except CollectorGone:
                raise
            except BroadcastError as exc:
                yield SendFailure(exc)
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
