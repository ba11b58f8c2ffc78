"""A writer's channel, its TCP side and its report: the server process that serves remote
readers (attached by ``open_writer(tcp=...)``, stopped on close), and ``statistics()``, which
counts the ring's readers and the server's together."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from . import _tuning
from ._constants import TCP_SERVER_READER_NAME
from ._exceptions import InvalidArgument, WaitTimeout
from ._handle import Handle
from ._shm import segment as _segment
from ._shm.layout import W_WAIT_TARGET, holds_writer
from ._shm.publisher import Publisher
from ._stats import ReaderInfo, WriterStatistics
from ._steps import Steps

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

    # --- readers attached --------------------------------------------------------------------
    def attached(self) -> tuple[ReaderInfo, ...]:
        """The readers attached and alive: local ones whose lock is held (a dead one is listed
        by ``statistics()`` until the writer drops it) and remote ones, without the TCP server's
        own place in the ring (it reads for the remote readers, which are listed)."""
        fd = self.pub.seg.fd
        return tuple(
            r
            for r in self.statistics(0).readers
            if r.transport == "tcp"
            or (r.name != TCP_SERVER_READER_NAME and _segment.is_locked(fd, _segment.reader_lock_byte(r.place)))
        )

    @staticmethod
    def wait_readers_steps(
        attached: Callable[[], tuple[ReaderInfo, ...]],
        count: int | None,
        names: Iterable[str] | None,
        timeout: float | None,
    ) -> Steps[tuple[ReaderInfo, ...]]:
        """``wait_readers``, written once for both front ends (``_steps``): looks at ``attached()``
        every ``_tuning.READERS_POLL_S`` until at least ``count`` readers are attached and every
        one of ``names`` is; returns them. ``WaitTimeout`` after ``timeout`` seconds names who is
        missing."""
        if isinstance(names, str):
            raise InvalidArgument("names must be a collection of reader names, not one string")
        wanted = None if names is None else list(dict.fromkeys(names))
        if count is None and wanted is None:
            raise InvalidArgument("wait_readers needs a count of readers, names of readers, or both")
        if count is not None and (type(count) is not int or count < 0):
            raise InvalidArgument(f"count must be a non-negative integer, not {count!r}")
        if timeout is not None and not timeout >= 0:
            raise InvalidArgument(f"timeout must be None or non-negative, not {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            now = attached()
            have = {r.name for r in now}
            missing = [n for n in wanted if n not in have] if wanted is not None else []
            if not missing and (count is None or len(now) >= count):
                return now
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise WaitTimeout(_missing(now, count, missing, timeout))
            yield _tuning.READERS_POLL_S if left is None else min(_tuning.READERS_POLL_S, left)

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


def _missing(now: tuple[ReaderInfo, ...], count: int | None, missing: list[str], timeout: float | None) -> str:
    """Why ``wait_readers`` timed out: the names not attached, or how many of how many are."""
    what = []
    if missing:
        what.append("not attached: " + ", ".join(repr(n) for n in missing))
    if count is not None and len(now) < count:
        what.append(f"{len(now)} of {count} readers attached")
    attached = ", ".join(f"{r.name} ({r.transport})" for r in now) or "none"
    return f"readers still missing after {timeout:g} s: {'; '.join(what)} (attached: {attached})"
