"""A writer's channel, its TCP side and its report: the server process that serves remote
readers (attached by ``open_writer(tcp=...)``, stopped on close), ``statistics()``, which
counts the ring's readers and the server's together, and, from the same records, what a put
whose time passed says held it (``holding``, ``put_timeout``)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from .._base import tuning as _tuning
from .._base.constants import TCP_SERVER_READER_NAME
from .._base.errors import InvalidArgument, WaitTimeout
from .._base.stats import (
    HOLDER_GONE,
    HOLDER_STUCK,
    HOLDER_TCP_SERVER,
    ReaderInfo,
    WriterStatistics,
    remote_holder,
    where,
)
from .._base.steps import Sleep, Steps
from .._shm import segment as _segment
from .._shm.layout import R_GENERATION, W_WAIT_TARGET, has_room, holds_writer, host_name, pack_host, unpack_host
from .._shm.publisher import Publisher, messages_from

if TYPE_CHECKING:
    from .._shm.arena import ArenaWriter
    from .._tcp.supervisor import ServerProcess


class Serving:
    """``WriterChannel.serving``: the channel's TCP server, its statistics and what a put whose
    time passed says held it."""

    def __init__(self, pub: Publisher, arena: ArenaWriter | None) -> None:
        self.pub = pub
        self.arena = arena
        #: Set by ``WriterChannel.serve_tcp``; handed over (and cleared) by its close.
        self.server: ServerProcess | None = None
        #: ``spare(pid)``: keep the place of reader ``pid`` although its lock is free (a fan-in
        #: sender keeps the place it reserved for its collector until the collector takes it).
        self.spare: Callable[[int], bool] | None = None

    def restarting(self, pid: int) -> bool:
        """Keep the place of reader ``pid``: ``spare``'s, or a TCP server's that restarts."""
        if self.spare is not None and self.spare(pid):
            return True
        return self.server is not None and self.server.restarting_from(pid)

    # --- the TCP server --------------------------------------------------------------------------
    @staticmethod
    async def stop_server(server: ServerProcess | None) -> None:
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
            yield Sleep(_tuning.READERS_POLL_S if left is None else min(_tuning.READERS_POLL_S, left))

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

    # --- what holds a put -------------------------------------------------------------------------
    # Read when a wait ends without room (a timeout), from the records statistics() reads: never
    # per put, so the hot path pays nothing for it.
    def holding(self, entries: int | None = None) -> tuple[ReaderInfo, ...]:
        """The readers a put waits for now: with ``entries``, the ring places whose cursor leaves
        no room for that many slots; without, those below the target a waiting put announced
        (``statistics().waiting_for``: another thread's put). Then, if the TCP server's place is
        one of them, the remote readers that hold the server back, slowest first."""
        pub = self.pub
        server = self.server
        head = pub.head
        cap = pub.layout.capacity
        target = pub.seg.words[W_WAIT_TARGET]
        readers = pub.records.infos(head, server.pids if server is not None else ())
        if entries is None:
            out = [r for r in readers if holds_writer(head - r.lag, target)]
        else:
            out = [r for r in readers if not has_room(head, head - r.lag, entries, cap)]
        if server is not None and any(r.transport == "tcp-server" for r in out):
            out += sorted((r for r in server.report()[1] if r.lag), key=lambda r: -r.lag)
        return tuple(out)

    def describe_reader(self, r: ReaderInfo, behind: str | None = None) -> str:
        """A reader of ``holding`` (or of ``statistics().readers``) in words: its name, pid and
        host, how far behind it is (``behind``, else ring entries and messages), and whether its
        process lives."""
        if r.transport == "tcp":
            return "remote reader " + remote_holder(r.name, r.pid, r.host, r.lag)
        pub = self.pub
        seg = pub.seg
        if behind is None:
            messages = messages_from(pub, pub.head - r.lag)
            behind = _count(r.lag, "ring entry", "ring entries") + (
                f" ({_count(messages, 'message', 'messages')})" if messages is not None else ""
            )
            behind += " behind"
        if not seg.words[seg.layout.record_word(r.place, R_GENERATION)]:
            # Never joined: a place kept for a reader to come (a fan-in sender's, for its collector).
            return (
                f"the place reserved for the reader of pid {r.pid}, {behind}, which has not attached yet "
                "(a fan-in collector attaches a new sender's ring when it next looks for items)"
            )
        here = unpack_host(pack_host(host_name()))  # as the ring records it: its first 16 bytes
        mine = ", the pid and host of this process" if r.pid == os.getpid() and r.host == here else ""
        if not _segment.is_locked(seg.fd, _segment.reader_lock_byte(r.place)):
            state = HOLDER_GONE
        elif r.transport == "tcp-server":
            state = HOLDER_TCP_SERVER
        else:
            state = HOLDER_STUCK
        return f"reader {r.name!r} ({where(r.pid, r.host)}{mine}), {behind}: {state}"

    def put_timeout(self, what: str, entries: int, streamed_from: int) -> WaitTimeout:
        """The ``WaitTimeout`` of a put (``what``: "put", "put_many") whose time passed waiting
        for room for ``entries`` ring slots. ``streamed_from``: the head when it began to wait;
        for a message larger than the ring (streamed), the entry of its first fragment."""
        pub = self.pub
        cap = pub.layout.capacity
        if entries <= cap or not pub.block:
            holders = self.holding(entries)
            text = (
                f"{what}: the timeout passed waiting for room for {_count(entries, 'ring slot', 'ring slots')} "
                f"(the ring has {cap})"
            )
            return WaitTimeout(text + self._waited_for(holders), holders=holders)
        # Streamed: it waited for one slot at a time, as its readers took the fragments before.
        holders = self.holding(1)
        sent = pub.head - streamed_from
        text = (
            f"{what}: the timeout passed while a message of {entries} ring slots, {entries / cap:.1f} times the "
            f"ring's capacity of {cap}, streamed through the ring ("
            + (
                f"{sent} of its fragments {'was' if sent == 1 else 'were'} published; readers drop it whole)"
                if sent
                else "none of it published)"
            )
        )

        def progress(r: ReaderInfo) -> str | None:
            if r.transport == "tcp":
                return None
            at = pub.head - r.lag
            if at >= streamed_from:
                taken = at - streamed_from
                return "has not taken its first fragment" if not taken else f"has taken {taken} of its fragments"
            messages = messages_from(pub, at)
            if messages is not None and sent:
                messages -= 1  # the cut-short message took a number: not one it is behind on
            earlier = f" ({_count(messages, 'message', 'messages')})" if messages is not None else ""
            return f"{_count(streamed_from - at, 'ring entry', 'ring entries')}{earlier} behind its first fragment"

        text += self._waited_for(holders, progress)
        text += (
            ". A message larger than the ring streams through it and needs its readers running meanwhile: a "
            "reader that reads only after this put returns (one in the thread or task blocked in it) never lets it "
            "finish. Read from another thread or task, or make the ring larger than the message "
            "(capacity * slot_bytes)"
        )
        return WaitTimeout(text, holders=holders)

    def busy_timeout(self, what: str) -> WaitTimeout:
        """The ``WaitTimeout`` of a blocking put whose time passed while another thread's put of
        the same writer held it (waiting for room, if it announced a target)."""
        holders = self.holding()
        text = f"{what}: the timeout passed while another thread's put held this writer"
        if holders:
            text += self._waited_for(holders, said="; that put waits for: ")
        return WaitTimeout(text, holders=holders)

    def _waited_for(
        self,
        holders: tuple[ReaderInfo, ...],
        behind: Callable[[ReaderInfo], str | None] | None = None,
        said: str = "; the writer waits for: ",
    ) -> str:
        if not holders:
            return "; the readers that held the writer moved on just as the time passed"
        return said + "; ".join(self.describe_reader(r, behind(r) if behind is not None else None) for r in holders)


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _missing(now: tuple[ReaderInfo, ...], count: int | None, missing: list[str], timeout: float | None) -> str:
    """Why ``wait_readers`` timed out: the names not attached, or how many of how many are."""
    what = []
    if missing:
        what.append("not attached: " + ", ".join(repr(n) for n in missing))
    if count is not None and len(now) < count:
        what.append(f"{len(now)} of {count} readers attached")
    attached = ", ".join(f"{r.name} ({r.transport})" for r in now) or "none"
    return f"readers still missing after {timeout:g} s: {'; '.join(what)} (attached: {attached})"
