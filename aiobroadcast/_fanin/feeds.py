"""The collector's senders: finding the ones that announced themselves in the rendezvous
directory and attaching their rings, and checking and adding remote ones (``Senders``)."""

from __future__ import annotations

import json
import os
from collections import deque
from typing import Any

from pydantic import BaseModel

from .._base.errors import (
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
from .._broadcast.open import _decoder
from .._shm import segment as _segment
from .._shm.subscriber import ShmSource
from .._shm.wake import Outbox
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
    """The collector's senders: finding the ones that announced themselves in the rendezvous
    directory and attaching their rings, and checking and adding remote ones. ``Gather`` takes
    from what this attaches."""

    handle: CollectorHandle
    feeds: list[Feed]
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
        self._deaths.watch(name, seg)

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

    def _unlink_link(self, link: str, ring_name: str) -> None:
        """Remove a sender's card if it still names ``ring_name`` (its name is free again)."""
        try:
            with open(link, "rb") as f:
                if json.loads(f.read())["ring"]["name"] != ring_name:
                    return
        except (OSError, ValueError, KeyError, TypeError):
            pass
        unlink_quietly(link)
