"""A writer's channel, its TCP side and its report: the server process that serves remote
readers (attached by ``open_writer(tcp=...)``, stopped on close), and ``statistics()``, which
counts the ring's readers and the server's together."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from ._handle import Handle
from ._shm.layout import W_WAIT_TARGET, holds_writer
from ._shm.publisher import Publisher
from ._stats import WriterStatistics

if TYPE_CHECKING:
    from ._shm.arena import ArenaWriter
    from ._tcp.supervisor import ServerProcess


class Serving:
    """Part of ``WriterChannel`` (which sets these attributes up): its TCP server and its
    statistics."""

    pub: Publisher
    handle: Handle
    arena: ArenaWriter | None
    server: ServerProcess | None
    #: ``spare(pid)``: keep the place of reader ``pid`` although its lock is free (a fan-in
    #: sender keeps the place it reserved for its collector until the collector takes it).
    spare: Callable[[int], bool] | None

    def _restarting(self, pid: int) -> bool:
        if self.spare is not None and self.spare(pid):
            return True
        return self.server is not None and self.server.restarting_from(pid)

    # --- the TCP server --------------------------------------------------------------------------
    def serve_tcp(self, server: ServerProcess, handle: Handle) -> None:
        self.server = server
        self.handle = handle
        # A writer dropped without closing (or left open at exit): its server drains, then stops.
        weakref.finalize(self, server.abandon)

    async def _stop_server(self, server: ServerProcess | None) -> None:
        """Stop ``server`` (handed over by ``closing``) in a thread of its own that the loop
        waits for. A cancellation that gets through the shield (asyncio's own: ``task.cancel()``,
        ``asyncio.timeout``, ``wait_for``, a failing ``TaskGroup`` sibling; no anyio shield stops
        them) ends the wait, never the stop: the stop is finished here, blocking for a bounded
        time, before the cancellation goes on (``ServerProcess.finish``)."""
        if server is None:
            return
        # Not anyio's worker: a worker that had not started the stop when the wait was cancelled
        # would never run it.
        stopper = threading.Thread(target=server.stop, name="aiobroadcast-tcp-stop", daemon=True)
        stopper.start()
        try:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(stopper.join)
        except BaseException:
            server.finish(stopper)
            raise

    # --- state ---------------------------------------------------------------------------------
    def statistics(self, tasks_waiting: int) -> WriterStatistics:
        pub = self.pub
        pub.check_open()
        server = self.server
        readers = pub.records.infos(pub.head, server.pids if server is not None else ())
        target = pub.seg.words[W_WAIT_TARGET]
        state, remote, remote_dropped, rejected = server.report() if server is not None else ("none", (), 0, 0)
        arena = self.arena
        if arena is not None:
            arena.reclaim()
            pinned = arena.pinned_bytes()
            readers = tuple(r._replace(pinned_bytes=pinned.get(r.place, 0)) for r in readers)
        return WriterStatistics(
            sent=pub.sent,
            head=pub.head,
            capacity=pub.layout.capacity,
            readers=readers + remote,
            waiting_for=tuple(r for r in readers if holds_writer(pub.head - r.lag, target)),
            tasks_waiting=tasks_waiting,
            dropped_readers=pub.records.dropped + remote_dropped,
            tcp_server=state,
            tcp_server_restarts=server.restarts if server is not None else 0,
            rejected_frames=rejected,
            tcp_server_health=server.health() if server is not None else "",
            arena_bytes=arena.data_bytes if arena is not None else 0,
            arena_used_bytes=arena.used_bytes() if arena is not None else 0,
            arena_placed=arena.placed if arena is not None else 0,
            arena_fallbacks=arena.fallbacks if arena is not None else 0,
        )
