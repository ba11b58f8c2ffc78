"""The writing side of a channel: everything ``Writer`` (async), ``BlockingWriter`` and a relay
share. The role classes are facades over one ``WriterChannel``.

It owns the ring's ``Publisher``, the writer's wake-up inbox (readers wake a writer that waits
for room), its files and its two parts, each with one job: ``publishing``
(``channel_put.Publishing``: what a put does, the order in which the writer's tasks take turns)
and ``serving`` (``channel_server.Serving``: the TCP server supervisor, the statistics, what
held a put whose time passed). This module sets a channel up and closes it (once, for both front
ends), and forgets it in a fork child.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import anyio

from .._base import fork as _fork
from .._base.codec import JsonCodec, PickleEncoder, SchemaCodec
from .._base.files import unlink_quietly
from .._base.handle import Handle
from .._shm.arena import ArenaWriter
from .._shm.layout import CODECS, W_CODEC
from .._shm.publisher import Publisher
from .._shm.segment import Segment
from .._shm.wake import Inbox
from .channel_put import Publishing, Turns
from .channel_server import Serving

if TYPE_CHECKING:
    from .._tcp.supervisor import ServerProcess

__all__ = ["Turns", "WriterChannel"]


class WriterChannel:
    """One open channel, from its writer's side: its files, its two parts, its close."""

    def __init__(
        self,
        seg: Segment,
        handle: Handle,
        encoder: PickleEncoder | SchemaCodec | JsonCodec,
        max_message_bytes: int | None,
        arena_bytes: int = 0,
    ) -> None:
        self.seg = seg
        self.handle = handle
        self.pub = pub = Publisher(seg, handle.policy == "block")
        #: The tensor arena (docs/design.md, "The arena"), if ``open_writer(arena_bytes=...)``.
        self.arena = arena = ArenaWriter(seg, arena_bytes, lambda: pub.head) if arena_bytes else None
        self.inbox = Inbox(seg.sock_path("w"))
        self.serving = serving = Serving(pub, arena)
        #: What a put does; the roles bind it once (their ``_publishing``).
        self.publishing = Publishing(pub, self.inbox, encoder, max_message_bytes, arena, serving.restarting)
        if arena is not None:
            arena.probe = lambda: pub.records.reap(1 << 63, pub.head, serving.restarting)
        #: Set once the first ``aclose`` is over (made by it): a second one waits for it.
        self.closed_event: anyio.Event | None = None
        # The readers' sockets too: a reader that died unnoticed (never reaped) leaves its own.
        # Inherited by fork children (atexit hooks and finalizers are), so they carry our pid.
        self.owner = os.getpid()
        extra = (self.arena.path,) if self.arena is not None else ()
        self._finalizer = weakref.finalize(
            self, _cleanup_files, self.owner, seg.path, self.inbox.path, *extra, *pub.records.sock_paths
        )
        atexit.register(self._finalizer)
        _fork.track(self)

    def set_codec(self, codec: str, schema_path: str | None) -> None:
        """The channel carries another channel's bodies as they are: say how to decode them."""
        self.handle = self.handle.model_copy(update={"codec": codec, "schema_path": schema_path})
        self.pub.seg.words[W_CODEC] = CODECS.index(codec)

    def serve_tcp(self, server: ServerProcess, handle: Handle) -> None:
        self.serving.server = server
        self.handle = handle
        # A writer dropped without closing (or left open at exit): its server drains, then stops.
        weakref.finalize(self, server.abandon)

    # --- closing -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def closing(self, abandon: bool = False) -> Iterator[ServerProcess | None]:
        """A close, written once for both front ends: mark the ring closed (readers drain what
        was published, then ``EndOfStream``; ``abandon``: as if this process had died, then
        ``WriterGone``), and hand over the TCP server, if any, for the front end to stop (remote
        readers drain what it holds, within its drain timeout), waiting its own way: the thread
        blocks, a task waits for a thread. The files, sockets and mapping are released on every
        way out, a cancellation included: the writer is marked closed already, so a second close
        would do nothing, and what was cut short would stay in /dev/shm until the process exits."""
        if abandon:
            self.pub.abandon()
            _fork.untrack(self)
        else:
            self.mark_closed()
        serving = self.serving
        server, serving.server = serving.server, None
        try:
            yield server
        finally:
            self.release()

    def close_blocking(self) -> None:
        """Close, from a thread (or a channel without a server yet): waits for the server here."""
        with self.closing() as server:
            if server is not None:
                server.stop()

    def mark_closed(self) -> None:
        """The first step of a close: readers drain what was published, then ``EndOfStream``."""
        self.pub.mark_closed()
        _fork.untrack(self)

    async def aclose(self) -> None:
        """Close from the writer's event loop (``closing``). A second ``aclose`` (another task's)
        returns once the first one is over."""
        if self.closed_event is not None:
            await self.closed_event.wait()
            return
        if self.pub.closed:
            return
        closed = self.closed_event = anyio.Event()
        try:
            with self.closing() as server:
                await self.serving.stop_server(server)
        finally:
            closed.set()

    async def abandon(self) -> None:
        """Stop as if this process had died: readers drain, then get ``WriterGone``; the server
        sees the writer gone and tells remote readers."""
        if self.pub.closed:
            return
        with self.closing(abandon=True) as server:
            await self.serving.stop_server(server)

    def release(self) -> None:
        """The last step of a close: unlink the files, close the sockets, unmap the ring."""
        self.inbox.close()
        self.pub.outbox.close()
        self._finalizer()
        atexit.unregister(self._finalizer)
        if self.arena is not None:
            self.arena.close()
        self.seg.close()

    def leave_segment(self) -> None:
        """Do not remove the segment on close, at exit or when dropped: its one reader removes it
        once it has drained it (a fan-in sender's ring, which its collector may attach after
        the sender closed). The writer's wake-up socket is still removed."""
        self._finalizer.detach()
        atexit.unregister(self._finalizer)
        self._finalizer = weakref.finalize(self, _cleanup_files, self.owner, self.inbox.path)
        atexit.register(self._finalizer)

    def _forget_in_child(self) -> None:
        """In a fork child: the channel is the parent's. Refuse every use from now on and close
        this process's copy of the TCP server's pipes (the server stops when the parent closes
        its stdin: a copy left open here would keep it serving). Nothing is removed, stored or
        woken: the parent goes on with its channel (docs/design.md, "Fork")."""
        self.pub.closed = True
        if self.arena is not None:
            self.arena.forget_in_child()
        self.pub.refusal = _fork.refusal("writer", self.owner)
        self.closed_event = None  # a close under way in the parent is not this process's to wait for
        serving = self.serving
        server, serving.server = serving.server, None
        if server is not None:
            server.forget_in_child()


def _cleanup_files(owner: int, *paths: str) -> None:
    if os.getpid() != owner:
        return  # a fork child exiting: the files are its parent's
    for path in paths:
        unlink_quietly(path)
