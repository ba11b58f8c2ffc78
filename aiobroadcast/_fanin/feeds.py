"""The collector's side of the rendezvous (``Senders``): its directory, lock and inbox, and its
senders: finding the ones that announced themselves in the directory and attaching their rings,
checking and adding remote ones, letting go of the ones that ended."""

from __future__ import annotations

import json
import os
import shutil
from collections import deque
from typing import Any

from pydantic import BaseModel

from .._base.errors import (
    BroadcastError,
    ClosedResourceError,
    InvalidArgument,
    InvalidHandle,
    TooManyReaders,
)
from .._base.files import unlink_quietly
from .._base.handle import (
    Handle,
    require,
)
from .._broadcast.reader_open import _decoder
from .._shm import segment as _segment
from .._shm.subscriber import ShmSource
from .._shm.wake import Inbox, Outbox
from .deaths import SenderDeaths
from .handle import (
    CollectorHandle,
    name_problem,
)


class RemoteFeed:
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

        src.wake_instead(wake)
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


class Feed:
    """One sender's ring (or remote source), as the collector reads it."""

    __slots__ = ("ahead", "link", "name", "pid", "ring", "src")

    def __init__(self, name: str, pid: int, ring: Handle | None, src: Any, link: str | None) -> None:
        self.ahead = src.ahead
        self.name = name
        self.pid = pid
        self.ring = ring
        self.src = src
        self.link = link


class Senders:
    """The collector's side of the rendezvous: its directory (made here, removed by ``close``),
    the lock that says it lives, the one inbox every sender's ring wakes, and the senders
    attached: the ones that announced themselves in the directory, and remote ones, checked and
    added. ``Gather`` takes from ``feeds`` in turns (the same list, never replaced)."""

    def __init__(self, handle: CollectorHandle, schema: type[BaseModel] | None) -> None:
        self.handle = handle
        self._schema = schema
        self._dir = handle.path
        self.feeds: list[Feed] = []
        self._known: set[str] = set()
        self.closed = False
        self.refusal: str | None = None
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
        #: The senders' pidfds: a death knocks the inbox at once (``deaths``).
        self.deaths = SenderDeaths(handle.inbox_path)

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
            if name in self._known or name_problem(name) is not None:
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
        self.feeds.append(Feed(name, pid, ring, src, link))
        self._known.add(name)
        self.deaths.watch(name, seg)

    def remote_source(self, handle: Handle | str, name: str) -> tuple[Handle, Any]:
        """Check a remote sender's handle and name, and start its ``TcpSource`` (not yet welcomed)."""
        from .._tcp.client import TcpSource

        if self.closed:
            raise ClosedResourceError(self.refusal or "this collector is closed")
        require(name_problem(name))
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
        self.feeds.append(Feed(name, h.writer_pid, None, RemoteFeed(src, self.handle.inbox_path), None))
        self._known.add(name)

    def look(self) -> None:
        """Look for dead senders among those with nothing to read, and for new ones."""
        for f in self.feeds:
            f.src.check_writer()
        self.rescan()

    def drop(self, i: int) -> Feed:
        """Sender ``i`` closed or died and was drained: let go of its ring, free its name."""
        f = self.feeds.pop(i)
        self._known.discard(f.name)
        self._let_go(f)
        return f

    def _let_go(self, f: Feed) -> None:
        """Leave a sender's ring and remove its files: a sender leaves its ring's segment to its
        collector (it may attach after the sender closed); its card frees its name."""
        f.src.close()
        if f.ring is None or f.link is None:
            return  # a remote sender: nothing of it here
        self.deaths.forget(f.name)
        for path in (f.ring.path, f.ring.path + "-w.sock", f.ring.path + "-r0.sock"):
            unlink_quietly(path)
        self._unlink_link(f.link, f.ring.name)

    def close(self) -> None:
        """Leave every ring (their senders' puts raise ``CollectorGone``) and remove the directory."""
        self.rescan()  # senders not attached yet learn it too: their place is left, not kept
        self.closed = True
        for f in self.feeds:
            self._let_go(f)
        self.feeds.clear()
        self.deaths.close()
        self.inbox.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        os.close(self._lock_fd)

    def forget_in_child(self, refusal: str) -> None:
        """A fork child's copy: refuse every use; the rings' sources and the inbox let go of
        their own copies (they are tracked themselves); nothing is removed."""
        self.closed = True
        self.refusal = refusal
        try:
            os.close(self._lock_fd)
        except OSError:
            pass
        self.deaths.forget_in_child()

    def _unlink_link(self, link: str, ring_name: str) -> None:
        """Remove a sender's card if it still names ``ring_name`` (its name is free again)."""
        try:
            with open(link, "rb") as f:
                if json.loads(f.read())["ring"]["name"] != ring_name:
                    return
        except (OSError, ValueError, KeyError, TypeError):
            pass
        unlink_quietly(link)
