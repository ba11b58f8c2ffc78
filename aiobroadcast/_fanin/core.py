"""Fan-in: many senders, one collector (docs/fan-in.md).

Each sender owns a private ring (an ordinary channel with one reader place) and the collector is
that ring's only reader. Everything the broadcast side guarantees per channel (order, lossless
back-pressure with bounded memory, dead-writer detection, fork safety, encoding errors) holds per
sender; this module adds the rendezvous (a directory the collector owns), one wake-up inbox for
all of a collector's rings, and the turns the collector takes among them.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from threading import get_ident as _get_ident
from time import monotonic, perf_counter_ns
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, NamedTuple, NoReturn, TypeVar, final, overload

import anyio
import anyio.lowlevel
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .._base import fork as _fork
from .._base import tuning as _tuning
from .._base.codec import Buffer, import_schema
from .._base.errors import (
    BroadcastError,
    ClosedResourceError,
    CollectorGone,
    DeserializationError,
    EndOfStream,
    InvalidArgument,
    InvalidHandle,
    ReaderLagged,
    TooManyReaders,
    TransportError,
    WaitTimeout,
    WouldBlock,
    WriterGone,
)
from .._base.files import unlink_quietly
from .._base.handle import (
    _UNIX_PATH_MAX,
    Codec,
    CurveKeys,
    Handle,
    Policy,
    _first_problem,
    check_directory,
    handle_kind,
    path_problem,
    require,
)
from .._base.steps import Sleep, Steps, poll_steps, run
from .._broadcast.channel import WriterChannel
from .._broadcast.open import _Opening
from .._broadcast.reader_open import _decoder
from .._broadcast.writer import Writer
from .._broadcast.writer import _private as _writer_token
from .._broadcast.writer_open import DEFAULT_DIRECTORY, _open_channel, _WriterSpec
from .._shm import segment as _segment
from .._shm.atomic import Words
from .._shm.layout import R_ACTIVE, R_CURSOR, R_PID, fence
from .._shm.subscriber import ShmSource
from .._shm.wake import Inbox, Outbox, knock
from .deaths import SenderDeaths
from .remote import NoWatch, RemoteOptions, remote_spec, server_place

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
T_contra = TypeVar("T_contra", contravariant=True)
M = TypeVar("M", bound=BaseModel)

_private = object()
_NOTHING: Any = object()  # what _Gather.take returns when nothing is ready

#: A sender's name: a file name in the rendezvous directory, and the reader-visible ``source``.
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:@+-]{0,63}$")
_DIR_RE = r"^aiobroadcast-fanin-[0-9a-f]{32}$"
#: How often a sender waiting for the collector to attach its ring knocks again (a knock is a
#: hint: the collector also looks at the directory every ``LIVENESS_S``).
_KNOCK_S = 0.05
#: Liveness and discovery checks while the collector is busy: every this many takes at most.
_CHECK_EVERY = 256
#: What a fork child may do instead of using an inherited collector, or sender (``_fork.role``).
COLLECTOR_FIX = "open a sender with open_sender(collector.handle, name=...)"
SENDER_FIX = "open your own with open_sender(sender.handle, name=...) under a name of its own"


# --- what the collector hands out ---------------------------------------------------------------
@dataclass(slots=True)
class Item(Generic[T_co]):
    """One item a sender put: ``source`` is the sender's name (``match`` it as
    ``case Item(source, value)``)."""

    source: str
    value: T_co


@dataclass(frozen=True, slots=True)
class SourceClosed:
    """The sender ``source`` closed; every item it put was delivered before this. Once per sender."""

    source: str


@dataclass(frozen=True, slots=True)
class SourceGone:
    """The sender ``source`` (process ``pid``) died without closing (SIGKILL, OOM); every item it
    had put in its ring was delivered before this. Once per sender, within about a second."""

    source: str
    pid: int


@dataclass(frozen=True, slots=True)
class SourceLagged:
    """Policy ``"lag"`` only: the sender ``source`` overwrote ``missed`` items the collector had
    not taken yet. The next item of that sender is the oldest it still holds."""

    source: str
    missed: int


#: Everything ``Collector.get`` returns.
Delivery = Item[T_co] | SourceClosed | SourceGone | SourceLagged


class SenderInfo(NamedTuple):
    """One attached sender, as the collector sees it."""

    name: str
    pid: int
    received: int  #: items the collector took from it
    lag: int  #: ring entries it has put that the collector has not taken yet


class CollectorStatistics(NamedTuple):
    received: int  #: items delivered (``Item`` only)
    senders: tuple[SenderInfo, ...]  #: the senders attached now
    closed: int  #: senders reported closed (``SourceClosed``)
    gone: int  #: senders reported dead (``SourceGone``)
    tasks_waiting: int  #: ``get`` calls parked


# --- the handle ---------------------------------------------------------------------------------
class CollectorHandle(BaseModel):
    """Names a collector (fan-in). Frozen, picklable, JSON round-trips. Pass it to
    ``open_sender`` in any process on the host. Not a broadcast channel's ``Handle``: each
    factory refuses the other's handle with an ``InvalidHandle`` that says which to use."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["collector"] = "collector"
    version: Literal[1] = 1
    directory: str = Field(description="where the rendezvous directory and the senders' rings are")
    name: str = Field(pattern=_DIR_RE)
    capacity: int = Field(gt=1, description="slots of each sender's ring")
    slot_bytes: int = Field(ge=64, description="bytes per slot of each sender's ring")
    policy: Policy
    codec: Codec
    schema_path: str | None = None
    max_message_bytes: int | None = Field(default=None, gt=0)
    collector_pid: int

    @model_validator(mode="after")
    def _paths(self) -> CollectorHandle:
        problem = _check_directory(self.directory)
        if problem is not None:
            raise ValueError(problem)
        return self

    @property
    def path(self) -> str:
        """The rendezvous directory."""
        return os.path.join(self.directory, self.name)

    @property
    def inbox_path(self) -> str:
        return os.path.join(self.path, "inbox.sock")

    @property
    def lock_path(self) -> str:
        return os.path.join(self.path, "collector")

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> CollectorHandle:
        """The collector handle ``to_json`` wrote. Raises ``InvalidHandle``."""
        return cls.parse(text)

    @classmethod
    def parse(cls, data: str | bytes | dict[str, Any] | CollectorHandle | Handle) -> CollectorHandle:
        """Build a collector handle from its JSON text or dict. Raises ``InvalidHandle`` (a
        broadcast channel's handle gets one that says so)."""
        if isinstance(data, Handle) or (handle_kind(data) != "collector" and _looks_like_channel(data)):
            raise InvalidHandle(
                "this is a broadcast channel's handle (open_reader takes it), not a collector's: "
                "a sender needs the handle of a collector made by open_collector() (collector.handle)"
            )
        try:
            if isinstance(data, CollectorHandle):
                return cls.model_validate(data.model_dump())
            if isinstance(data, dict):
                return cls.model_validate(data)
            return cls.model_validate_json(data)
        except ValidationError as exc:
            path = path_problem(data, "pass the file's text: CollectorHandle.from_json(Path(path).read_text())")
            raise InvalidHandle(f"not an aiobroadcast collector handle: {path or _first_problem(exc)}") from exc


def _looks_like_channel(data: object) -> bool:
    try:
        Handle.parse(data)  # type: ignore[arg-type]
    except (InvalidHandle, TypeError, AttributeError):
        return False
    return True


def _check_directory(directory: str) -> str | None:
    problem = check_directory(directory, 1)  # the senders' rings are channels in it
    if problem is not None:
        return problem
    inbox = len(os.fsencode(directory)) + len("/aiobroadcast-fanin-") + 32 + len("/inbox.sock")
    if inbox > _UNIX_PATH_MAX:
        return (
            f"directory {directory!r} is too long for the collector's wake-up socket (at most {_UNIX_PATH_MAX} bytes)"
        )
    return None


# --- the collector's engine (no event loop) ------------------------------------------------------
class _RemoteSource:
    """A remote sender (a writer serving TCP, read over its CurveZMQ/AES-GCM transport) as a feed:
    ``TcpSource`` with the collector's sleep protocol. Its I/O thread wakes the collector's one
    inbox instead of the source's own socket."""

    def __init__(self, src: Any, inbox_path: str) -> None:
        self._src = src
        self.ahead: deque[Any] = src.ahead  # always empty: bodies are decoded by the get
        self._outbox = Outbox()
        outbox = self._outbox

        def wake() -> None:
            outbox.wake(inbox_path)

        src._inbox.wake = wake
        self.get_nowait = src.get_nowait
        self.ready = src.ready

    def announce_sleep(self) -> None:
        self._src.begin_sleep()  # sets the flag the I/O thread looks at, under its lock

    def retract_sleep(self) -> None:
        self._src.end_sleep(False)

    def check_writer(self) -> bool:
        return False  # the transport reports a gone writer itself (END, or silence)

    def statistics(self, tasks_waiting: int) -> Any:
        return self._src.statistics(tasks_waiting)

    def close(self) -> None:
        self._src.close()
        self._outbox.close()


class _Feed:
    """One sender's ring (or remote source), as the collector reads it."""

    __slots__ = ("ahead", "link", "name", "pid", "ring", "src")

    def __init__(self, name: str, pid: int, ring: Handle | None, src: Any, link: str | None) -> None:
        self.ahead = src.ahead
        self.name = name
        self.pid = pid
        self.ring = ring
        self.src = src
        self.link = link


class _Senders:
    """The collector's senders: finding the ones that announced themselves in the rendezvous
    directory and attaching their rings, and checking and adding remote ones. ``_Gather`` takes
    from what this attaches."""

    handle: CollectorHandle
    feeds: list[_Feed]
    closed: bool
    refusal: str | None
    _dir: str
    _schema: type[BaseModel] | None
    _known: set[str]
    _deaths: SenderDeaths

    def rescan(self) -> None:
        """Attach every sender that announced itself in the directory and is not attached yet."""
        try:
            entries = os.listdir(self._dir)
        except OSError:
            return
        for entry in entries:
            if entry.startswith(".") or not entry.endswith(".json"):
                continue
            name = entry[:-5]
            if name in self._known or _name_problem(name) is not None:
                continue
            self._attach(name, os.path.join(self._dir, entry))

    def _attach(self, name: str, link: str) -> None:
        try:
            with open(link, "rb") as f:
                card = json.loads(f.read())
            ring = Handle.parse(card["ring"])
            pid = int(card["pid"])
        except (OSError, ValueError, KeyError, TypeError, InvalidHandle):
            unlink_quietly(link)  # not a sender's card: nothing can attach with it
            return
        h = self.handle
        if ring.codec != h.codec or ring.max_readers != 1 or ring.directory != h.directory:
            unlink_quietly(link)
            return
        try:
            seg = _segment.attach_segment(ring.path, ring.token, ring.capacity, ring.slot_bytes, ring.max_readers)
            try:
                # The place the sender reserved for us at cursor 0: nothing it put is missed.
                src = ShmSource(
                    seg,
                    ring,
                    "collector",
                    _decoder(ring, self._schema),
                    inbox=False,
                    take_over=os.getpid(),
                    reserved=True,
                )
            except BaseException:
                seg.close()
                raise
        except (InvalidHandle, TooManyReaders):
            # Its sender closed, died or gave up before we came: it never joined.
            self._unlink_link(link, ring.name)
            return
        self.feeds.append(_Feed(name, pid, ring, src, link))
        self._known.add(name)
        self._deaths.watch(name, seg)

    def remote_source(self, handle: Handle | str, name: str) -> tuple[Handle, Any]:
        """Check a remote sender's handle and name, and start its ``TcpSource`` (not yet welcomed)."""
        from .._tcp.client import TcpSource

        if self.closed:
            raise ClosedResourceError(self.refusal or "this collector is closed")
        require(_name_problem(name))
        if name in self._known:
            raise InvalidArgument(f"a sender named {name!r} is already attached to this collector")
        h = Handle.parse(handle)
        if h.tcp is None:
            raise InvalidHandle("this channel serves no TCP endpoint: a remote sender opens open_writer(tcp=...)")
        if h.codec != self.handle.codec:
            raise InvalidHandle(f"this channel sends {h.codec}; the collector takes {self.handle.codec}")
        return h, TcpSource(h, "collector", _decoder(h, self._schema))

    def add_remote(self, name: str, h: Handle, src: Any) -> None:
        """The remote sender ``name`` was welcomed: read it in turn with the others."""
        if self.closed or name in self._known:
            src.close()
            raise (
                ClosedResourceError("this collector is closed")
                if self.closed
                else InvalidArgument(f"a sender named {name!r} is already attached to this collector")
            )
        self.feeds.append(_Feed(name, h.writer_pid, None, _RemoteSource(src, self.handle.inbox_path), None))
        self._known.add(name)

    def _unlink_link(self, link: str, ring_name: str) -> None:
        """Remove a sender's card if it still names ``ring_name`` (its name is free again)."""
        try:
            with open(link, "rb") as f:
                if json.loads(f.read())["ring"]["name"] != ring_name:
                    return
        except (OSError, ValueError, KeyError, TypeError):
            pass
        unlink_quietly(link)


def take_many(g: _Gather, limit: int) -> list[Any]:
    """The next delivery (``g.take()``; an empty list if none is ready), then, up to ``limit``,
    the deliveries ``g.take()`` would hand out next from what the collector holds already: the
    rest of the batch the current sender's ring gave in this turn (``_Gather.take``'s fast path).
    So a batch is what as many takes would return, in their order, and holds at most one ring's
    batch of decoded items (``AHEAD_MESSAGES``, about ``AHEAD_BYTES`` of bodies): a batch of
    large items never piles up the whole of every ring. Only the first take touches a ring, so
    only it can raise (nothing taken) or be interrupted."""
    obj = g.take()
    if obj is _NOTHING:
        return []
    out = [obj]
    f = g._cur
    if f is not None:
        # What ``take``'s fast path would do for each (count the turn and the item, hand out
        # the next decoded one), for the run at once: a take per item cost the collector as
        # much again as the Item it builds.
        ahead = f.ahead
        n = min(limit - 1, _tuning.AHEAD_MESSAGES - g._turn, len(ahead))
        if n > 0:
            name = f.name
            pop = ahead.popleft
            taken = 0
            try:
                while taken < n:
                    out.append(Item(name, pop()))
                    taken += 1
            except IndexError:  # another thread's get_nowait took the last one meanwhile
                pass
            g._turn += taken
            g.received += taken
    return out


def check_max_items(max_items: object) -> int:
    if type(max_items) is not int or max_items < 1:
        raise InvalidArgument(f"max_items must be a positive integer, not {max_items!r}")
    return max_items


class _Gather(_Senders):
    """The collector's state: the rendezvous directory, its one inbox, the senders' rings and
    the turns among them. Shared by ``Collector`` and ``BlockingCollector``; one taker at a time
    (the facades make sure)."""

    def __init__(self, handle: CollectorHandle, schema: type[BaseModel] | None, expect: Iterable[str] | None) -> None:
        self.handle = handle
        self._schema = schema
        self._dir = handle.path
        self._expect = None if expect is None else frozenset(expect)
        if self._expect is not None:
            for n in self._expect:
                require(_name_problem(n))
        self._ended: set[str] = set()
        self.feeds: list[_Feed] = []
        self._known: set[str] = set()
        self._rr = 0
        self._turn = 0
        #: The sender whose turn it is, while it has items taken ahead (``take``'s fast path).
        self._cur: _Feed | None = None
        self._taking = False
        self._events: deque[Any] = deque()
        self.received = 0
        self.closed_count = 0
        self.gone_count = 0
        self._since_check = 0
        self._last_check = 0.0  # the first take looks at once
        self.closed = False
        self.refusal: str | None = None
        self.owner = os.getpid()
        os.mkdir(self._dir, 0o700)
        try:
            self._lock_fd = os.open(handle.lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            if not _segment.try_lock(self._lock_fd, 0):  # pragma: no cover - the file is new
                raise BroadcastError(f"cannot lock {handle.lock_path}")
            os.write(self._lock_fd, json.dumps({"pid": os.getpid()}).encode())
            self.inbox = Inbox(handle.inbox_path)
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._outbox = Outbox()
        #: The senders' pidfds: a death knocks the inbox at once (``_fanin_deaths``).
        self._deaths = SenderDeaths(handle.inbox_path)
        _fork.track(self)

    # --- taking ----------------------------------------------------------------------------
    def take(self) -> Any:
        """The next delivery in turn, or ``_NOTHING``. Raises ``EndOfStream`` once every expected
        sender has been reported closed or gone, and ``DeserializationError`` (with ``source``).
        With nothing to take, looks for new senders (after a knock) and dead ones (every
        ``LIVENESS_S``)."""
        if self.closed:
            raise ClosedResourceError(self.refusal or "this collector is closed")
        f = self._cur
        if f is not None and self._turn < _tuning.AHEAD_MESSAGES:
            # The usual case: the current sender's turn goes on with items its ring gave ahead.
            ahead = f.ahead
            if ahead:
                self._turn += 1
                self.received += 1
                return Item(f.name, ahead.popleft())
        if self._taking:
            return _NOTHING  # called from inside decoding (a __setstate__ that takes): never twice
        self._taking = True
        try:
            obj = self._take()
            if obj is _NOTHING:
                if self.inbox.knocked or monotonic() - self._last_check >= _tuning.LIVENESS_S:
                    self.check_now()
                    obj = self._take()
                if obj is _NOTHING and self._expect is not None and self._expect <= self._ended:
                    raise EndOfStream
        finally:
            self._taking = False
        return obj

    def _take(self) -> Any:
        if self._events:
            return self._events.popleft()
        feeds = self.feeds
        n = len(feeds)
        if n:
            i = self._rr
            if i >= n:
                i = self._turn = 0
            for _ in range(n + 1):
                f = feeds[i]
                if self._turn < _tuning.AHEAD_MESSAGES:
                    src = f.src
                    ahead = src.ahead
                    if ahead:
                        self._rr = i
                        self._cur = f
                        self._turn += 1
                        self.received += 1
                        return Item(f.name, ahead.popleft())
                    # A ring with nothing to take is passed over without a get_nowait: asking
                    # costs a fraction of its WouldBlock, paid for each idle ring a take passes
                    # (a call's collector passes every worker's ring for each answer).
                    if src.ready():
                        try:
                            obj = src.get_nowait()
                        except WouldBlock:
                            pass
                        except EndOfStream:
                            return self._end(i, SourceClosed(f.name))
                        except (WriterGone, TransportError):  # TransportError: a remote writer refused us
                            return self._end(i, SourceGone(f.name, f.pid))
                        except ReaderLagged as exc:
                            self._rr = i
                            return SourceLagged(f.name, exc.missed)
                        except DeserializationError as exc:
                            self._rr = i
                            self._turn += 1
                            exc.source = f.name
                            raise
                        else:
                            self._rr = i
                            self._cur = f
                            self._turn += 1
                            self.received += 1
                            self._since_check += 1
                            if self._since_check >= _CHECK_EVERY:
                                # Busy: still look for new and dead senders now and then.
                                self._since_check = 0
                                if self.inbox.knocked or monotonic() - self._last_check >= _tuning.LIVENESS_S:
                                    self.check_now()
                            return Item(f.name, obj)
                i = i + 1 if i + 1 < n else 0
                self._turn = 0
            self._rr = i
        self._cur = None
        return _NOTHING

    def _end(self, i: int, event: Any) -> Any:
        """Sender ``i`` closed or died and was drained: report it once, and let go of its ring."""
        f = self.feeds.pop(i)
        self._cur = None
        if self._rr > i:
            self._rr -= 1
        self._turn = 0
        self._known.discard(f.name)
        self._ended.add(f.name)
        self._let_go(f)
        if isinstance(event, SourceGone):
            self.gone_count += 1
        else:
            self.closed_count += 1
        return event

    def _let_go(self, f: _Feed) -> None:
        """Leave a sender's ring and remove its files: a sender leaves its ring's segment to its
        collector (it may attach after the sender closed); its card frees its name."""
        f.src.close()
        if f.ring is None or f.link is None:
            return  # a remote sender: nothing of it here
        self._deaths.forget(f.name)
        for path in (f.ring.path, f.ring.path + "-w.sock", f.ring.path + "-r0.sock"):
            unlink_quietly(path)
        self._unlink_link(f.link, f.ring.name)

    def ready(self) -> bool:
        return bool(self._events) or self.inbox.knocked or any(f.src.ready() for f in self.feeds)

    # --- sleeping --------------------------------------------------------------------------
    def begin_sleep(self) -> bool:
        """Announce a sleep on every ring, fence once, re-check them all. True if there is no
        need to sleep (then nothing is announced any more)."""
        feeds = self.feeds
        for f in feeds:
            f.src.announce_sleep()
        fence()
        if self.ready():
            for f in feeds:
                f.src.retract_sleep()
            return True
        return False

    def end_sleep(self) -> None:
        for f in self.feeds:
            f.src.retract_sleep()
        if self.closed:
            return
        if self.inbox.knocked:
            self.inbox.knocked = False
            self.rescan()
        if self._deaths.fired or monotonic() - self._last_check >= _tuning.LIVENESS_S:
            self.check_now()

    @property
    def sleep_limit_s(self) -> float:
        return _tuning.LIVENESS_S

    # --- discovery and liveness ------------------------------------------------------------
    def check_now(self) -> None:
        """Look for new senders, and for dead ones among those with nothing to read."""
        self._last_check = monotonic()
        self.inbox.knocked = False
        self._deaths.fired = False
        for f in self.feeds:
            f.src.check_writer()
        self.rescan()

    # --- state -----------------------------------------------------------------------------
    def statistics(self, tasks_waiting: int) -> CollectorStatistics:
        if self.closed:
            raise ClosedResourceError(self.refusal or "this collector is closed")
        senders = []
        for f in self.feeds:
            s = f.src.statistics(0)
            senders.append(SenderInfo(f.name, f.pid, s.received, s.lag))
        return CollectorStatistics(self.received, tuple(senders), self.closed_count, self.gone_count, tasks_waiting)

    def close(self) -> None:
        """Leave every ring (their senders' puts raise ``CollectorGone``) and remove the directory."""
        if self.closed:
            return
        self.rescan()  # senders not attached yet learn it too: their place is left, not kept
        self.closed = True
        _fork.untrack(self)
        for f in self.feeds:
            self._let_go(f)
        self.feeds = []
        self._cur = None
        self._deaths.close()
        self.inbox.close()
        self._outbox.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        os.close(self._lock_fd)

    def _forget_in_child(self) -> None:
        """A fork child's copy: refuse every use; the rings' sources and the inbox let go of
        their own copies (they are tracked themselves); nothing is removed."""
        self.closed = True
        self.refusal = _fork.refusal("collector", self.owner, COLLECTOR_FIX)
        try:
            os.close(self._lock_fd)
        except OSError:
            pass
        self._deaths.forget_in_child()


def _name_problem(name: object) -> str | None:
    if not isinstance(name, str) or not NAME_RE.match(name):
        return (
            f"sender name {name!r} must be 1-64 characters of letters, digits and _.:@+- "
            "(not starting with a punctuation mark)"
        )
    return None


def _collector_alive(handle: CollectorHandle) -> bool:
    try:
        fd = os.open(handle.lock_path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        return _segment.is_locked(fd, 0)
    finally:
        os.close(fd)


class CollectorWatch:
    """A sender's look at its collector's liveness lock, at most once in ``SENDER_WATCH_S``, on
    the put path, before the item is published: a collector that died while the ring had room
    makes ``put`` raise ``CollectorGone`` within that time, with the item not taken (the ring's
    active word tells only of a collector that closed, or that the writer found dead when the
    ring was full)."""

    __slots__ = ("_handle", "next")

    def __init__(self, handle: CollectorHandle) -> None:
        self._handle = handle
        #: When the next look is due (``monotonic``): ``dead`` is False before it.
        self.next = monotonic() + _tuning.SENDER_WATCH_S

    def dead(self) -> bool:
        now = monotonic()
        if now < self.next:
            return False
        self.next = now + _tuning.SENDER_WATCH_S
        return not _collector_alive(self._handle)


def _guard(ch: WriterChannel, collector: CollectorHandle) -> tuple[int, CollectorWatch | NoWatch]:
    """What a sender watches: the active word of its collector's place (place 0, or for a remote
    sender its TCP server's, which the server leaves once the collector is gone), and the
    collector's lock (a local one only)."""
    if ch.server is None:
        return ch.seg.layout.record_word(0, R_ACTIVE), CollectorWatch(collector)
    return ch.seg.layout.record_word(server_place(ch), R_ACTIVE), NoWatch()


# --- the collector (async) ------------------------------------------------------------------------
@final
@_fork.role("collector", COLLECTOR_FIX)
class Collector(Generic[T_co]):
    """The receiving end of a fan-in. Built by ``open_collector``; has no ``put``.

    ``get`` returns ``Item(source, value)`` for each item a sender put, in each sender's order,
    senders served in turns; and once per sender ``SourceClosed`` or ``SourceGone`` after its
    last item. ``async for`` ends when the collector is closed, or, opened with ``expect=``,
    once every expected sender has been reported closed or gone.

    Its methods belong to the thread whose event loop opened it (several tasks may share it;
    each ``get`` takes a distinct delivery). Threads without a loop use ``BlockingCollector``.
    """

    def __init__(self, token: object, gather: _Gather) -> None:
        if token is not _private:
            raise TypeError("Collector cannot be built directly; use aiobroadcast.open_collector()")
        self._g = gather
        self._thread = threading.get_ident()
        self._slept_ns = _tuning.DENSE_NS
        self._leading = False
        self._followers: anyio.Event | None = None
        self._tasks_waiting = 0
        self._since_yield = 0

    @property
    def handle(self) -> CollectorHandle:
        """What a sender needs: pass it (or its JSON) to ``open_sender`` in any process on the host."""
        return self._g.handle

    def get_nowait(self) -> Delivery[T_co]:
        """The next delivery, or ``WouldBlock``. Raises ``EndOfStream`` once every expected
        sender ended, ``DeserializationError`` (its ``source`` says whose) for an item that
        cannot be decoded here (it is consumed), ``ClosedResourceError`` after ``aclose``."""
        obj = self._g.take()
        if obj is _NOTHING:
            raise WouldBlock
        return obj  # type: ignore[no-any-return]

    async def get(self) -> Delivery[T_co]:
        """Wait for the next delivery. Cancel-safe: a cancelled ``get`` has taken nothing. A
        parked ``get`` uses no CPU: it sleeps on one socket that every sender's ring wakes."""
        if _get_ident() != self._thread:
            self._check_thread()
        if self._since_yield >= _tuning.YIELD_EVERY:
            await self._yield_turn()
        g = self._g
        while True:
            obj = g.take()
            if obj is not _NOTHING:
                self._since_yield += 1
                return obj  # type: ignore[no-any-return]
            await self._wait()

    async def _get_before(self, deadline: float) -> Delivery[T_co]:
        """``get`` until ``deadline`` (``time.monotonic``), then ``WaitTimeout`` having taken
        nothing: the sleeps end at the deadline, without a cancel scope (a caller's call)."""
        if _get_ident() != self._thread:
            self._check_thread()
        if self._since_yield >= _tuning.YIELD_EVERY:
            await self._yield_turn()
        g = self._g
        while True:
            obj = g.take()
            if obj is not _NOTHING:
                self._since_yield += 1
                return obj  # type: ignore[no-any-return]
            await self._wait(lambda: _left(deadline))

    async def get_many(self, max_items: int = _tuning.AHEAD_MESSAGES) -> list[Delivery[T_co]]:
        """Wait for the next delivery, then return it with the ones the collector took with it
        from the same sender's ring (docs/fan-in.md, "Batches"), up to ``max_items``: what as
        many ``get`` calls would return, in their order and turns, for one call. At most one
        ring's batch (32 items, about 256 KiB of bodies). Cancel-safe: a cancelled ``get_many``
        has taken nothing. Raises like ``get``, having taken nothing."""
        check_max_items(max_items)
        if _get_ident() != self._thread:
            self._check_thread()
        if self._since_yield >= _tuning.YIELD_EVERY:
            await self._yield_turn()
        g = self._g
        while True:
            batch = take_many(g, max_items)
            if batch:
                self._since_yield += len(batch)
                return batch
            await self._wait()

    def statistics(self) -> CollectorStatistics:
        return self._g.statistics(self._tasks_waiting)

    async def attach(self, handle: Handle | str, *, name: str, connect_timeout: float = 10.0) -> None:
        """Read a remote sender: ``open_sender(handle, name=..., tcp=...)`` on another host (pass
        its ``remote_handle``), or any writer that serves TCP (``open_writer(tcp=...,
        max_readers=1)``), with the broadcast side's security (CurveZMQ admission, sealed data,
        nothing decoded before it is authenticated). Its items arrive as ``Item(name, value)`` in
        turn with the others (a remote sender's from its first, put before this attach); its
        close as ``SourceClosed``, its death as ``SourceGone``. A remote sender's ``put`` raises
        ``CollectorGone`` once this collector closed or died (a plain writer's does not:
        docs/fan-in.md). Raises ``InvalidHandle``, ``InvalidArgument`` (a name taken), ``TransportError``."""
        h, src = self._g.remote_source(handle, name)
        await src.wait_welcome(connect_timeout)
        self._g.add_remote(name, h, src)

    async def aclose(self) -> None:
        """Close: leave every sender's ring (their ``put`` raises ``CollectorGone``) and remove
        the rendezvous. Parked ``get`` calls end (``ClosedResourceError``; ``async for`` ends)."""
        if self._g.closed:
            return
        self._check_thread()
        self._g.close()
        if self._followers is not None:
            self._followers.set()

    def __aiter__(self) -> Collector[T_co]:
        return self

    async def __anext__(self) -> Delivery[T_co]:
        try:
            return await self.get()
        except EndOfStream:
            raise StopAsyncIteration from None
        except ClosedResourceError:
            if self._g.refusal is None:
                raise StopAsyncIteration from None
            raise

    async def __aenter__(self) -> Collector[T_co]:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        g = self._g
        state = "closed" if g.closed else f"senders={len(g.feeds)} received={g.received}"
        return f"<aiobroadcast.Collector {g.handle.name} {state}>"

    def __del__(self) -> None:
        g = getattr(self, "_g", None)
        if g is not None and not g.closed:
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1, source=self)

    def __reduce__(self) -> NoReturn:
        raise BroadcastError(
            "a Collector cannot be pickled or sent to another process: send collector.handle (or its JSON) "
            "and open_sender there"
        )

    if not TYPE_CHECKING:

        @property
        def put(self) -> NoReturn:
            raise AttributeError(
                "a Collector has no put(): senders put, each in its own role: "
                "open_sender(collector.handle, name=...).put(item)"
            )

        put_nowait = put_many = put

    def _check_thread(self) -> None:
        if threading.get_ident() != self._thread:
            raise BroadcastError(
                "this collector's get() and aclose() belong to the thread whose event loop opened it; "
                "from another thread use get_nowait(), or anyio.from_thread.run(collector.get)"
            )

    async def _yield_turn(self) -> None:
        # As the reader's get: a collector that never has to wait still lets other tasks run
        # once in YIELD_EVERY gets. Before the take, and cancellable: a cancellation here has
        # taken nothing; once an item is taken, get returns it without another await.
        self._since_yield = 0
        await anyio.lowlevel.checkpoint()

    async def _wait(self, left_s: Callable[[], float | None] | None = None) -> None:
        """Wait for the ring to change: as the one sleeper, or behind it. ``left_s``: the time
        left before a deadline (None: no deadline); raises ``WaitTimeout`` once it passed."""
        self._tasks_waiting += 1
        try:
            if self._leading:
                followers = self._followers
                if followers is None:
                    followers = self._followers = anyio.Event()
                left = None if left_s is None else left_s()
                with anyio.move_on_after(float("inf") if left is None else left):
                    await followers.wait()
            else:
                self._leading = True
                try:
                    await self._sleep(left_s or _no_deadline)
                finally:
                    self._leading = False
                    followers = self._followers
                    if followers is not None:
                        self._followers = None
                        followers.set()
        finally:
            self._tasks_waiting -= 1
        g = self._g
        if g.closed:
            raise ClosedResourceError(g.refusal or "this collector was closed while get() waited")

    async def _sleep(self, left_s: Callable[[], float | None]) -> None:
        g = self._g
        self._slept_ns = await run(sleep_steps(g, self._slept_ns, lambda: g.closed, left_s), self._sleep_inbox)

    async def _sleep_inbox(self, limit_s: float) -> bool:
        try:
            return await self._g.inbox.wait(limit_s)
        except anyio.ClosedResourceError:
            return False


def _no_deadline() -> float | None:
    return None


def _left(deadline: float) -> float:
    """Seconds left before ``deadline`` (``time.monotonic``); ``WaitTimeout`` once it passed."""
    left = deadline - monotonic()
    if left <= 0:
        raise WaitTimeout("the deadline passed")
    return left


def sleep_steps(g: _Gather, slept_ns: int, stop: Callable[[], bool], left_s: Callable[[], float | None]) -> Steps[int]:
    """A collector's one sleeper, waiting for an item (both front ends): poll for a while when
    items came densely (it was woken recently), else sleep on the inbox, that every sender's
    ring knocks, for up to ``g.sleep_limit_s`` (or what ``left_s`` says is left of a deadline;
    ``left_s`` raises once it passed). ``stop``: the collector is closing. Returns the new
    ``slept_ns`` (how long the last sleep took: 0 after a poll that found an item)."""
    spin = _tuning.POLL_NS if slept_ns < _tuning.DENSE_NS else 0
    left = left_s()
    if left is not None:
        spin = min(spin, int(left * 1e9))
    if spin and (yield from poll_steps(lambda: stop() or g.ready(), spin)):
        return 0
    limit = g.sleep_limit_s
    left = left_s()
    if left is not None:
        limit = min(limit, left)
    if g.begin_sleep():
        return slept_ns
    start = perf_counter_ns()
    try:
        yield Sleep(limit)
    finally:
        g.end_sleep()
    return perf_counter_ns() - start


# --- the sender (async) ---------------------------------------------------------------------------
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
        self._active, self._watch = _guard(writer._ch, collector)
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
        orphan = _orphaned(self._words, self._active, self._collector)
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


# --- opening ----------------------------------------------------------------------------------------
class _CollectorSpec:
    """``open_collector``'s arguments, checked; shared by the async and blocking factories."""

    def __init__(
        self,
        *,
        expect: Iterable[str] | None,
        schema: type[BaseModel] | None,
        codec: Literal["pickle", "json"],
        capacity: int,
        slot_bytes: int,
        policy: Policy,
        max_message_bytes: int | None,
        directory: str,
    ) -> None:
        # The rings' own checks (capacity, slot_bytes, policy, codec), as open_writer makes them.
        ring = _WriterSpec(
            capacity=capacity,
            slot_bytes=slot_bytes,
            max_readers=1,
            policy=policy,
            schema=schema,
            codec=codec,
            max_message_bytes=max_message_bytes,
            directory=directory,
        )
        require(_check_directory(directory))
        if max_message_bytes is not None and max_message_bytes <= 0:
            raise InvalidArgument("max_message_bytes must be positive")
        self.expect = None if expect is None else tuple(expect)
        if isinstance(expect, str):
            raise InvalidArgument("expect must be a collection of sender names, not one string")
        self.schema = schema
        self.handle = CollectorHandle(
            directory=directory,
            name=f"aiobroadcast-fanin-{secrets.token_hex(16)}",
            capacity=ring.capacity,
            slot_bytes=ring.slot_bytes,
            policy=policy,
            codec="pydantic-json" if schema is not None else codec,
            schema_path=None if schema is None else _schema_path(schema),
            max_message_bytes=max_message_bytes,
            collector_pid=os.getpid(),
        )

    def create(self) -> _Gather:
        sweep_stale_collectors(self.handle.directory)
        try:
            return _Gather(self.handle, self.schema, self.expect)
        except OSError as exc:
            raise BroadcastError(
                f"cannot create the collector's directory in {self.handle.directory!r}: {exc}"
            ) from exc


_RENDEZVOUS_RE = re.compile(_DIR_RE)


def sweep_stale_collectors(directory: str) -> list[str]:
    """Remove the rendezvous directories of collectors that died (SIGKILL cannot clean up): those
    whose ``collector`` lock nobody holds, older than ``STALE_MIN_AGE_S``. Only this user's
    directories, never through a symbolic link. Returns what was removed."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not _RENDEZVOUS_RE.match(name):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            if time.time() - st.st_mtime < _tuning.STALE_MIN_AGE_S:
                continue
            fd = os.open(os.path.join(path, "collector"), os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if not _segment.try_lock(fd, 0):
                continue  # its collector lives
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def _schema_path(schema: type[BaseModel]) -> str:
    from .._base.codec import schema_path

    return schema_path(schema)


@overload
def open_collector(
    *,
    expect: Iterable[str] | None = ...,
    schema: None = ...,
    codec: Literal["pickle", "json"] = ...,
    capacity: int = ...,
    slot_bytes: int = ...,
    policy: Policy = ...,
    max_message_bytes: int | None = ...,
    directory: str = ...,
) -> _Opening[Collector[Any]]: ...
@overload
def open_collector(
    *,
    expect: Iterable[str] | None = ...,
    schema: type[M],
    codec: Literal["pickle", "json"] = ...,
    capacity: int = ...,
    slot_bytes: int = ...,
    policy: Policy = ...,
    max_message_bytes: int | None = ...,
    directory: str = ...,
) -> _Opening[Collector[M]]: ...
def open_collector(
    *,
    expect: Iterable[str] | None = None,
    schema: type[BaseModel] | None = None,
    codec: Literal["pickle", "json"] = "pickle",
    capacity: int = 64,
    slot_bytes: int = 1 << 16,
    policy: Policy = "block",
    max_message_bytes: int | None = None,
    directory: str = DEFAULT_DIRECTORY,
) -> _Opening[Collector[Any]]:
    """Create a collector (the receiving end of a fan-in) and return it.

    - ``expect``: the names of the senders to wait for: iteration ends once each of them has
      been reported closed or gone (others may join too). Default: iteration ends at ``aclose``.
    - ``schema``/``codec``/``max_message_bytes``: what every sender sends, as ``open_writer``.
    - ``capacity``/``slot_bytes``: each sender's ring (a sender may choose its own); memory per
      sender is bounded by it. ``policy``: ``"block"`` (lossless, a sender waits) or ``"lag"``.
    - ``directory``: where the rendezvous and the rings live (``/dev/shm``).

    Raises ``InvalidArgument`` for bad arguments, ``BroadcastError`` if the directory cannot be made.
    """
    spec = _CollectorSpec(
        expect=expect,
        schema=schema,
        codec=codec,
        capacity=capacity,
        slot_bytes=slot_bytes,
        policy=policy,
        max_message_bytes=max_message_bytes,
        directory=directory,
    )

    async def make() -> Collector[Any]:
        return Collector(_private, spec.create())

    return _Opening(make)


@dataclass(frozen=True, slots=True)
class SenderArgs:
    """``open_sender``'s arguments that every sender has (``RemoteOptions``: a remote one's)."""

    handle: CollectorHandle | str
    name: str
    schema: type[BaseModel] | None
    capacity: int | None
    slot_bytes: int | None
    connect_timeout: float


class _SenderStart:
    """Opening a sender (shared by the async and blocking factories): create the ring with a
    place reserved for the collector, claim the name, knock."""

    def __init__(self, args: SenderArgs) -> None:
        h = CollectorHandle.parse(args.handle)
        name, schema = args.name, args.schema
        require(_name_problem(name))
        if not args.connect_timeout > 0:
            raise InvalidArgument(f"connect_timeout must be positive, not {args.connect_timeout!r}")
        if h.codec == "pydantic-json" and schema is None:
            if h.schema_path is None:
                raise InvalidHandle("schema collector without schema_path: pass schema=")
            try:
                schema = import_schema(h.schema_path)
            except (ImportError, AttributeError, TypeError, ValueError) as exc:
                raise InvalidHandle(f"cannot import the collector's schema {h.schema_path!r} here: {exc}") from exc
        elif h.codec != "pydantic-json" and schema is not None:
            raise InvalidArgument(f"this collector takes {h.codec}, not a schema: open it with schema= to send models")
        if not _collector_alive(h):
            raise CollectorGone(h.collector_pid, name)
        self.handle = h
        self.name = name
        self.deadline = monotonic() + args.connect_timeout
        spec = _WriterSpec(
            capacity=h.capacity if args.capacity is None else args.capacity,
            slot_bytes=h.slot_bytes if args.slot_bytes is None else args.slot_bytes,
            max_readers=1,
            policy=h.policy,
            schema=schema,
            codec="json" if h.codec == "json" else "pickle",
            max_message_bytes=h.max_message_bytes,
            directory=h.directory,
        )
        self.channel = ch = spec.create()
        try:
            # The ring's writer wakes the collector's one inbox, not a socket of the reader place.
            ch.pub.records.sock_paths[0] = h.inbox_path
            # Place 0 waits for the collector from the start, at cursor 0: nothing put before the
            # collector attaches is lost, and a full ring holds the sender back meanwhile. The
            # place is kept while the collector lives, though nobody holds its lock yet.
            seg = ch.seg
            w = seg.words
            lay = seg.layout
            w[lay.record_word(0, R_PID)] = h.collector_pid
            w[lay.record_word(0, R_CURSOR)] = 0
            w[lay.record_word(0, R_ACTIVE)] = 1
            collector_pid = h.collector_pid
            ch.spare = lambda pid: pid == collector_pid and _collector_alive(h)
            ch.leave_segment()
            self.link = os.path.join(h.path, f"{name}.json")
            self._claim()
        except BaseException:
            _close_channel(ch)
            unlink_quietly(ch.handle.path)
            raise
        knock(h.inbox_path)

    def _claim(self) -> None:
        """Announce the ring under our name: one card, linked in whole (a name is taken once)."""
        h = self.handle
        card = json.dumps({"ring": self.channel.handle.model_dump(), "pid": os.getpid()}).encode()
        tmp = os.path.join(h.path, f".{self.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileNotFoundError as exc:
            raise CollectorGone(h.collector_pid, self.name) from exc
        except OSError as exc:
            raise BroadcastError(f"cannot announce sender {self.name!r} to the collector: {exc}") from exc
        try:
            try:
                os.write(fd, card)
            finally:
                os.close(fd)
            while True:
                try:
                    os.link(tmp, self.link)
                    return
                except FileExistsError:
                    holder = _holder_alive(self.link)
                    if holder is not None:
                        raise InvalidArgument(
                            f"a sender named {self.name!r} is already attached to this collector (pid {holder}): "
                            "sender names must be unique"
                        ) from None
                    # Its sender died or closed: the collector frees the name once it reported it.
                    if monotonic() > self.deadline:
                        raise TransportError(
                            f"the name {self.name!r} is still held by a sender that ended; the collector "
                            "did not release it in time"
                        ) from None
                    if not _collector_alive(h):
                        raise CollectorGone(h.collector_pid, self.name) from None
                    knock(h.inbox_path)
                    time.sleep(_KNOCK_S)
        except OSError as exc:
            raise BroadcastError(f"cannot announce sender {self.name!r} to the collector: {exc}") from exc
        finally:
            unlink_quietly(tmp)


def _holder_alive(link: str) -> int | None:
    """The pid of the live sender whose card ``link`` is, or None (gone, or no card)."""
    try:
        with open(link, "rb") as f:
            card = json.loads(f.read())
        ring = Handle.parse(card["ring"])
        fd = os.open(ring.path, os.O_RDONLY | os.O_NOFOLLOW)
    except (OSError, ValueError, KeyError, TypeError, InvalidHandle):
        return None
    try:
        return int(card["pid"]) if _segment.is_locked(fd, _segment.WRITER_LOCK_BYTE) else None
    finally:
        os.close(fd)


def _sender_refusal(owner: int) -> str:
    """What a fork child's use of an inherited sender raises."""
    return _fork.refusal("sender", owner, SENDER_FIX)


def check_sender(
    closed: bool,
    refusal: object,
    owner: Callable[[], Any],
    words: Words,
    active: int,
    watch: CollectorWatch | NoWatch,
    collector: CollectorHandle,
    name: str,
    published: int | None = None,
) -> None:
    """A sender's check before and after a put (both front ends): ``ClosedResourceError`` once
    it is closed (``refusal``: a fork child's, said so with ``owner()``), ``CollectorGone`` once
    its collector left its place (``words[active]`` is 0) or died. Nothing more is read once closed.

    After a put, ``published`` is the ring's head (one past the entry just published): a
    collector that took every entry up to it before leaving took the item, and the put is done
    (the next one raises). ``CollectorGone`` means "not taken": a put whose item was taken and
    used must not say otherwise (a worker's reply to the call that was the pool's last, say).
    The place's cursor is loaded after its ``active`` word, each with acquire: a collector stores
    its cursor before it leaves, so the cursor read is at least the one it left with."""
    if closed:
        raise ClosedResourceError(_sender_refusal(owner()) if refusal else "this sender is closed")
    if not words[active] or watch.dead():
        if published is not None and words[active - R_ACTIVE + R_CURSOR] >= published:
            return
        raise CollectorGone(collector.collector_pid, name)


def _orphaned(words: Words, active: int, collector: CollectorHandle) -> bool:
    """Whether no collector will ever drain this sender's ring (it left, or it died): then the
    sender removes the segment itself when it closes."""
    return not words[active] or not _collector_alive(collector)


def _close_channel(ch: WriterChannel) -> None:
    if not ch.pub.closed:
        ch.mark_closed()
        ch.release()


class SenderPlan:
    """``open_sender``'s arguments, checked, and what to build from them: shared by the async and
    the blocking factories, which differ only in how they wait for a remote sender's TCP server
    (``_open_channel`` or ``blocking_channel`` of ``remote``). A remote sender's arguments are
    checked here, at once; a local sender's when ``local()`` opens it (it touches the collector's
    directory, so the async factory does it when awaited)."""

    __slots__ = ("_args", "remote")

    def __init__(self, args: SenderArgs, remote: RemoteOptions | None) -> None:
        self._args = args
        #: a remote sender's (``tcp=``) ring, to open with its TCP server, and the collector's
        #: handle; None: a local sender (``local``)
        self.remote: tuple[_WriterSpec, CollectorHandle] | None = None
        if remote is not None:
            h = CollectorHandle.parse(args.handle)
            require(_name_problem(args.name))
            self.remote = remote_spec(h, args.schema, args.capacity, args.slot_bytes, remote), h

    def local(self) -> tuple[WriterChannel, CollectorHandle]:
        """A local sender's ring, its name claimed in the collector's directory, and the
        collector's handle."""
        start = _SenderStart(self._args)
        return start.channel, start.handle


@overload
def open_sender(
    handle: CollectorHandle | str,
    *,
    name: str,
    schema: None = ...,
    capacity: int | None = ...,
    slot_bytes: int | None = ...,
    connect_timeout: float = ...,
    tcp: str | None = ...,
    advertise: str | None = ...,
    keys: CurveKeys | None = ...,
    heartbeat_s: float = ...,
    data_port: int = ...,
) -> _Opening[Sender[Any]]: ...
@overload
def open_sender(
    handle: CollectorHandle | str,
    *,
    name: str,
    schema: type[M],
    capacity: int | None = ...,
    slot_bytes: int | None = ...,
    connect_timeout: float = ...,
    tcp: str | None = ...,
    advertise: str | None = ...,
    keys: CurveKeys | None = ...,
    heartbeat_s: float = ...,
    data_port: int = ...,
) -> _Opening[Sender[M]]: ...
def open_sender(
    handle: CollectorHandle | str,
    *,
    name: str,
    schema: type[BaseModel] | None = None,
    capacity: int | None = None,
    slot_bytes: int | None = None,
    connect_timeout: float = 10.0,
    tcp: str | None = None,
    advertise: str | None = None,
    keys: CurveKeys | None = None,
    heartbeat_s: float = 0.5,
    data_port: int = 0,
) -> _Opening[Sender[Any]]:
    """Attach a sender named ``name`` to the collector of ``handle`` (its ``CollectorHandle`` or
    JSON) and return it. Items put before the collector attaches wait in the ring (a full ring
    holds the sender back): nothing sent is lost.

    - ``name``: unique among the collector's live senders; the collector's items carry it.
    - ``schema``: the collector's pydantic model (default: imported from the handle).
    - ``capacity``/``slot_bytes``: this sender's ring (default: the collector's).
    - ``connect_timeout``: how long to wait for the name to be freed when a sender of that
      name ended and the collector has not reported it yet.

    - ``tcp``: a **remote sender** (the collector on another host): serve this sender's ring on
      this ZeroMQ endpoint (e.g. ``"tcp://10.0.0.5:0"``), with the broadcast side's security, and
      hand ``sender.remote_handle`` to the collector, which reads it with
      ``collector.attach(remote_handle, name=...)``. Nothing put before it attaches is lost (a full
      ring holds the sender back); once it closes or dies, ``put`` raises ``CollectorGone``.
      ``advertise``, ``keys``, ``heartbeat_s``, ``data_port``: as ``open_writer``'s. No rendezvous
      with the collector's directory: ``name`` is what the collector's ``attach`` is given.

    Raises ``InvalidHandle`` (a broadcast channel's handle, or not a handle), ``InvalidArgument``
    (a bad name, or a name a live sender holds), ``CollectorGone`` (the collector closed or died),
    ``TransportError`` (the name of an ended sender was not released within ``connect_timeout``).
    """
    plan = SenderPlan(
        SenderArgs(handle, name, schema, capacity, slot_bytes, connect_timeout),
        None if tcp is None else RemoteOptions(tcp, advertise, keys, heartbeat_s, data_port),
    )

    async def make() -> Sender[Any]:
        if plan.remote is None:
            ch, h = plan.local()
        else:
            spec, h = plan.remote
            ch = await _open_channel(spec)
        return Sender(_private, Writer(_writer_token, ch), name, h)

    return _Opening(make)


__all__ = [
    "Collector",
    "CollectorHandle",
    "CollectorStatistics",
    "Delivery",
    "Item",
    "Sender",
    "SenderInfo",
    "SourceClosed",
    "SourceGone",
    "SourceLagged",
    "open_collector",
    "open_sender",
]
