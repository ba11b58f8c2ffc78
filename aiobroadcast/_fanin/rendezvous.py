"""How a sender meets its collector and learns that it left: opening a local sender's ring with
a place reserved for the collector and claiming its name in the rendezvous directory
(``SenderStart``, ``SenderPlan``), and the checks before and after each put (``check_sender``,
``CollectorWatch``)."""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from time import monotonic
from typing import Any

from pydantic import BaseModel

from .._base import fork as _fork
from .._base import tuning as _tuning
from .._base.errors import (
    BroadcastError,
    ClosedResourceError,
    CollectorGone,
    InvalidArgument,
    InvalidHandle,
    TransportError,
)
from .._base.files import unlink_quietly
from .._base.handle import (
    Handle,
    require,
)
from .._broadcast.channel import WriterChannel
from .._broadcast.writer_open import _WriterSpec
from .._shm import segment as _segment
from .._shm.atomic import Words
from .._shm.layout import R_ACTIVE, R_CURSOR, R_PID
from .._shm.wake import knock
from .handle import (
    SENDER_FIX,
    CollectorHandle,
    collector_alive,
    name_problem,
    sender_schema,
)
from .remote import NoWatch, RemoteOptions, remote_spec, server_place

#: How often a sender waiting for the collector to attach its ring knocks again (a knock is a
#: hint: the collector also looks at the directory every ``LIVENESS_S``).
_KNOCK_S = 0.05


@dataclass(frozen=True, slots=True)
class SenderArgs:
    """``open_sender``'s arguments that every sender has (``RemoteOptions``: a remote one's)."""

    handle: CollectorHandle | str
    name: str
    schema: type[BaseModel] | None
    capacity: int | None
    slot_bytes: int | None
    connect_timeout: float


class SenderStart:
    """Opening a sender (shared by the async and blocking factories): create the ring with a
    place reserved for the collector, claim the name, knock."""

    def __init__(self, args: SenderArgs) -> None:
        h = CollectorHandle.parse(args.handle)
        name, schema = args.name, args.schema
        require(name_problem(name))
        if not args.connect_timeout > 0:
            raise InvalidArgument(f"connect_timeout must be positive, not {args.connect_timeout!r}")
        schema = sender_schema(h, schema)
        if not collector_alive(h):
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
            ch.serving.spare = lambda pid: pid == collector_pid and collector_alive(h)
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
                    if not collector_alive(h):
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


def orphaned(words: Words, active: int, collector: CollectorHandle) -> bool:
    """Whether no collector will ever drain this sender's ring (it left, or it died): then the
    sender removes the segment itself when it closes."""
    return not words[active] or not collector_alive(collector)


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
            require(name_problem(args.name))
            self.remote = remote_spec(h, args.schema, args.capacity, args.slot_bytes, remote), h

    def local(self) -> tuple[WriterChannel, CollectorHandle]:
        """A local sender's ring, its name claimed in the collector's directory, and the
        collector's handle."""
        start = SenderStart(self._args)
        return start.channel, start.handle


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
        return not collector_alive(self._handle)


def guard(ch: WriterChannel, collector: CollectorHandle) -> tuple[int, CollectorWatch | NoWatch]:
    """What a sender watches: the active word of its collector's place (place 0, or for a remote
    sender its TCP server's, which the server leaves once the collector is gone), and the
    collector's lock (a local one only)."""
    if ch.serving.server is None:
        return ch.seg.layout.record_word(0, R_ACTIVE), CollectorWatch(collector)
    return ch.seg.layout.record_word(server_place(ch), R_ACTIVE), NoWatch()
