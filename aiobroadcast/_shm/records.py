"""The writer's view of the reader records: the slowest cursor (room), dead readers (reaping),
who sleeps (wake-ups), and the snapshot ``statistics()`` shows."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection
from time import perf_counter_ns

from .._base import tuning as _tuning
from .._base.files import unlink_quietly
from .._base.stats import ReaderInfo
from . import segment as _segment
from .layout import JOINING, R_GENERATION, R_NAME_LEN, R_PID, R_RECEIVED, fence, has_room
from .segment import Segment
from .wake import Outbox

log = logging.getLogger("aiobroadcast")


class ReaderRecords:
    """The reader places of one segment, as the writer reads them."""

    def __init__(self, seg: Segment, outbox: Outbox) -> None:
        self._seg = seg
        self._outbox = outbox
        self._words = seg.words
        self.capacity = seg.layout.capacity
        #: the slowest active cursor when last scanned (a lower bound: cursors only move on)
        self.min_cursor = 0
        self.dropped = 0
        self._notified = [0] * seg.layout.max_readers
        self._woke_ns = 0  # when wake-ups were last sent
        self.sock_paths = [seg.sock_path(f"r{i}") for i in range(seg.layout.max_readers)]

    def rescan(self, head: int) -> None:
        """Recompute the slowest active reader's cursor (docs/design.md, joining). The fence
        orders it after the caller's store of W_WAIT_TARGET: a reader that moves on after our
        scan sees the target and wakes us."""
        fence()
        m = head
        for active, cursor in zip(self._seg.rec_active.tolist(), self._seg.rec_cursor.tolist(), strict=True):
            if active and cursor < m:
                m = cursor
        self.min_cursor = m

    def room(self, head: int, entries: int) -> bool:
        """Whether ``entries`` more entries fit without overrunning a live reader. Scans the
        records only when the cached slowest cursor says no."""
        if has_room(head, self.min_cursor, entries, self.capacity):
            return True
        self.rescan(head)
        return has_room(head, self.min_cursor, entries, self.capacity)

    def wake_sleepers(self) -> None:
        """Wake the readers that announced they sleep, once per sleep (a sleep episode's number
        is what the reader stored in its waiting word). The caller fenced after its stores.

        If one was woken, in a paced stream, give up the CPU once. The kernel counts a wake-up
        through a socket as one the sender will soon follow by sleeping (a synchronous wake-up),
        so it often queues the woken reader on the writer's own CPU, behind the writer. Without
        the yield the reader waits there until the writer's event loop goes back to sleep: 25-30
        us per paced message on this project's 2-CPU machines, the largest single piece of its
        latency. Yielding lets it run now. Only in a paced stream (the previous wake-up was
        ``DENSE_NS`` ago or more): a writer that wakes readers more often than that has the next
        message to publish, and yielding would only slow it down."""
        notified = self._notified
        sent = False
        for i, episode in enumerate(self._seg.waiting.tolist()):
            if episode and episode != notified[i]:
                notified[i] = episode
                # An episode carries its reader's generation in its high half (ReaderPlace.join):
                # the outbox connects again when the place changed hands.
                self._outbox.wake(self.sock_paths[i], episode >> 32)
                sent = True
        if sent:
            now = perf_counter_ns()
            if now - self._woke_ns >= _tuning.DENSE_NS:
                os.sched_yield()
            self._woke_ns = now

    def wake_all(self) -> None:
        lay = self._seg.layout
        for i, active in enumerate(self._seg.rec_active.tolist()):
            if active:
                self._outbox.wake(self.sock_paths[i], self._words[lay.record_word(i, R_GENERATION)])

    def reap(self, target: int, head: int, spare: Callable[[int], bool]) -> None:
        """Drop readers that hold the writer back (cursor below ``target``) and whose process
        is gone: their liveness lock is free. ``spare(pid)``: keep that place anyway (a TCP
        server being restarted takes its place over)."""
        seg = self._seg
        fd = seg.fd
        for i, (active, cursor) in enumerate(zip(seg.rec_active.tolist(), seg.rec_cursor.tolist(), strict=True)):
            if not active or cursor >= target:
                continue
            if spare(self._words[seg.layout.record_word(i, R_PID)]):
                continue
            byte = _segment.reader_lock_byte(i)
            if not _segment.try_lock(fd, byte):
                continue  # alive: it holds its lock
            try:
                name = seg.read_name(i)
                pid = self._words[seg.layout.record_word(i, R_PID)]
                host = seg.read_host(i)
                seg.rec_active[i] = 0
                seg.waiting[i] = 0
                unlink_quietly(self.sock_paths[i])
                self._outbox.forget(self.sock_paths[i])
            finally:
                _segment.unlock(fd, byte)
            self.dropped += 1
            log.warning(
                "aiobroadcast: reader %r (pid %d on %s, place %d) died at entry %d of %d; dropped it",
                name,
                pid,
                host or "?",
                i,
                cursor,
                head,
            )

    def infos(self, head: int, server_pids: Collection[int]) -> tuple[ReaderInfo, ...]:
        """The attached readers (the TCP server's place shown as transport "tcp-server"): not one
        still joining, whose first entry is not fixed yet."""
        seg = self._seg
        lay = seg.layout
        w = self._words
        out = []
        for i, (active, cursor) in enumerate(zip(seg.rec_active.tolist(), seg.rec_cursor.tolist(), strict=True)):
            if not active or active == JOINING:
                continue
            if not w[lay.record_word(i, R_NAME_LEN)] and not w[lay.record_word(i, R_PID)]:
                continue
            pid = w[lay.record_word(i, R_PID)]
            out.append(
                ReaderInfo(
                    place=i,
                    name=seg.read_name(i),
                    pid=pid,
                    received=w[lay.record_word(i, R_RECEIVED)],
                    lag=max(0, head - cursor),
                    sleeping=bool(seg.waiting[i]),
                    transport="tcp-server" if pid in server_pids else "shm",
                    host=seg.read_host(i),
                )
            )
        return tuple(out)
