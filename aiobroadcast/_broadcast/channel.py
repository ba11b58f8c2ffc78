"""The writing side of a channel: everything ``Writer`` (async), ``BlockingWriter`` and a relay
share. The role classes are facades over one ``WriterChannel``.

It owns the ring's ``Publisher``, the writer's wake-up inbox (readers wake a writer that waits
for room), the order in which the writer's tasks take turns, and the TCP server supervisor.
What a put does is ``_channel_put.Publishing``, the TCP server and the statistics
``_channel_server.Serving``; this module sets a channel up and closes it (once, for both front
ends), and forgets it in a fork child.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import anyio

from .._base import fork as _fork
from .._base import tuning as _tuning
from .._base.codec import JsonCodec, PickleEncoder, SchemaCodec
from .._base.errors import BroadcastError
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


class WriterChannel(Serving, Publishing):
    """One open channel, from its writer's side."""

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
        self._encode = self._arena_source = encoder.encode
        self._max_message_bytes = max_message_bytes
        self.pub = pub = Publisher(seg, handle.policy == "block")
        #: The tensor arena (docs/design.md, "The arena"), if ``open_writer(arena_bytes=...)``.
        self.arena = None
        if arena_bytes:
            self.arena = ArenaWriter(seg, arena_bytes, lambda: pub.head)
            self.arena.probe = lambda: pub.records.reap(1 << 63, pub.head, self._restarting)
            self._encode = self._encode_arena
        #: Encode a message a put is about to publish: the encoder's own method when there is no
        #: size limit to check (one call less per message).
        self.encode = self._encode if max_message_bytes is None else self._encode_checked
        self.payload_bytes = seg.layout.payload_bytes
        self.inbox = Inbox(seg.sock_path("w"))
        # Two locks. `turns` orders the tasks of the writer's event loop (a put waiting for room
        # keeps its turn). `pub.mutex` is held, never across an await, by whoever is writing into
        # the ring right now, from any thread; a put_nowait that cannot take it at once raises
        # WouldBlock. Encoding runs outside both: it may run user code (a __reduce__ that
        # publishes, a logging handler that broadcasts), which must find the writer usable.
        self.turns = Turns()
        self.thread = threading.get_ident()
        self.waiting_tasks = 0
        self.slept_ns = _tuning.DENSE_NS  # no polling before the first sleep
        self.server = None
        #: Set once the first ``aclose`` is over (made by it): a second one waits for it.
        self.closed_event: anyio.Event | None = None
        self.spare = None
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

    def check_thread(self) -> None:
        """``put`` and ``aclose`` wait in the event loop of the thread that opened the writer; its
        task lock and wake-up socket cannot be shared with another thread's loop."""
        if threading.get_ident() != self.thread:
            raise BroadcastError(
                "this writer's put() and aclose() belong to the thread whose event loop opened it; "
                "from another thread use put_nowait(), or anyio.from_thread.run(writer.put, obj)"
            )

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
        server, self.server = self.server, None
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
                await self._stop_server(server)
        finally:
            closed.set()

    async def abandon(self) -> None:
        """Stop as if this process had died: readers drain, then get ``WriterGone``; the server
        sees the writer gone and tells remote readers."""
        if self.pub.closed:
            return
        with self.closing(abandon=True) as server:
            await self._stop_server(server)

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
        server, self.server = self.server, None
        if server is not None:
            server.forget_in_child()


def _cleanup_files(owner: int, *paths: str) -> None:
    if os.getpid() != owner:
        return  # a fork child exiting: the files are its parent's
    for path in paths:
        unlink_quietly(path)
