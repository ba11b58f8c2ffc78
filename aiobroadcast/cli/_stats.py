"""``aiobroadcast stats HANDLE_FILE``: a live view of a running channel from another process.

It maps the channel's segment read-only (``O_RDONLY``, ``PROT_READ``: it cannot disturb the ring)
and reads what docs/design.md lays out: the head, each reader's record (name, pid, host, cursor,
messages received), the waiting bytes, and ``wait_target``, which a blocked writer sets to the
cursor it needs. The readers whose cursor is below it are the ones holding the writer, so a stuck
writer is explained in one line. Liveness is read from the kernel's locks (``F_OFD_GETLK``), as
the writer itself does. Remote (TCP) readers are not in the segment: the writer's TCP server
reads the ring in one place of its own (``tcp-server``), which holds the writer back when a remote
reader is slow, and lists its remote readers in a file beside the segment
(``<segment>-tcp.json``), which is read too when it is there.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

from .._base.constants import TCP_SERVER_READER_NAME
from .._base.errors import InvalidHandle, plural
from .._base.handle import Handle
from .._base.stats import HOLDER_GONE, HOLDER_STUCK, HOLDER_TCP_SERVER, where
from .._shm import layout as _layout
from .._shm import segment as _segment
from .._shm.arena import arena_path, read_usage
from .._shm.layout import (
    R_ACTIVE,
    R_CURSOR,
    R_PID,
    R_RECEIVED,
    W_CLOSED,
    W_HEAD,
    W_NEXT_MSG,
    W_WAIT_TARGET,
    W_WRITER_PID,
)
from .._tcp.report import read_report, report_path
from ._common import EXIT_FAILED, EXIT_OK, HelpFormatter, fail, load_handle, run_sync


# argparse, spelled out per command as in the other cli modules: a table or wrapper of
# add_parser/add_argument calls would only hide argparse's own API.
def register(sub: Any) -> None:
    p = sub.add_parser(
        "stats",
        help="show a running channel: readers by name, pid and host, their lag and rates, who the writer waits for",
        description=(
            "Show the channel named by HANDLE_FILE as it runs, refreshed every --interval seconds: the "
            "writer, each reader (place, name, pid, host, alive, lag in ring entries, messages received, rate) "
            "and, when the writer is blocked, a line 'writer is waiting for: NAME (pid N on HOST) at entry X of "
            "Y' for each reader holding it. A pid is one of the process's own pid namespace, and HOST says where: "
            "its host name (in a container, by default, the container's short id). The segment is mapped "
            "read-only. --once prints one snapshot (rates measured over --interval) and exits. Exit codes: 0 the "
            "writer is alive and the channel open (the live view: also when it closes), 1 the channel is closed "
            "(--once) or its writer died, 2 the handle file is missing or bad or the channel is gone, 130 Ctrl-C."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("handle_file", metavar="HANDLE_FILE", help="the handle file the writer saved")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between snapshots (and for rates)")
    p.set_defaults(func=_run)


@dataclass(frozen=True)
class ReaderRow:
    place: int
    name: str
    pid: int
    host: str
    alive: bool
    cursor: int
    received: int
    sleeping: bool


@dataclass(frozen=True)
class RemoteRow:
    """A remote reader, as the writer's TCP server last reported it."""

    name: str
    pid: int  #: on the reader's host
    host: str
    received: int
    lag: int  #: messages the server holds that this reader has not acknowledged


@dataclass(frozen=True)
class Snapshot:
    at: float
    head: int
    messages: int
    closed: bool
    writer_pid: int
    writer_host: str
    writer_alive: bool
    wait_target: int
    readers: tuple[ReaderRow, ...]
    remote: tuple[RemoteRow, ...] | None = None  #: None: no TCP server, or its report is unreadable
    #: the arena's size, the bytes held in it and the bytes each place's views pin; None: no arena
    arena: tuple[int, int, dict[int, int]] | None = None

    def holding(self) -> list[ReaderRow]:
        """The readers a blocked writer waits for: their cursor is below ``wait_target``."""
        return [r for r in self.readers if _layout.holds_writer(r.cursor, self.wait_target)]


class SegmentView:
    """A read-only mapping of a channel's segment."""

    def __init__(self, handle: Handle) -> None:
        self.handle = handle
        try:
            view = _segment.SegmentView(
                handle.path, handle.token, handle.capacity, handle.slot_bytes, handle.max_readers
            )
        except InvalidHandle as exc:
            fail(f"{exc} (or its writer runs on another host)")
        self._view = view
        self.layout = view.layout
        self._fd = view.fd
        self._buf = view.buf
        self._words = view.words

    def snapshot(self) -> Snapshot:
        w = self._words
        lay = self.layout
        readers = []
        for i in range(lay.max_readers):
            if not w[lay.record_word(i, R_ACTIVE)]:
                continue
            readers.append(
                ReaderRow(
                    place=i,
                    name=_segment.record_name(self._buf, lay, i),
                    pid=w[lay.record_word(i, R_PID)],
                    host=_segment.record_host(self._buf, lay, i),
                    alive=_segment.is_locked(self._fd, _segment.reader_lock_byte(i)),
                    cursor=w[lay.record_word(i, R_CURSOR)],
                    received=w[lay.record_word(i, R_RECEIVED)],
                    sleeping=bool(w[lay.waiting_word(i)]),
                )
            )
        return Snapshot(
            arena=read_usage(arena_path(self.handle.path)) if self.handle.arena_bytes else None,
            remote=self._remote(),
            at=time.monotonic(),
            head=w[W_HEAD],
            messages=w[W_NEXT_MSG],
            closed=bool(w[W_CLOSED]),
            writer_pid=w[W_WRITER_PID],
            writer_host=_segment.writer_host(self._buf),
            writer_alive=_segment.is_locked(self._fd, _segment.WRITER_LOCK_BYTE),
            wait_target=w[W_WAIT_TARGET],
            readers=tuple(readers),
        )

    def _remote(self) -> tuple[RemoteRow, ...] | None:
        if self.handle.tcp is None:
            return None
        report = read_report(report_path(self.handle.path))
        if report is None:
            return None  # an older writer, or no report yet: show what the ring says
        return tuple(RemoteRow(r.name, r.pid, r.host, r.received, r.lag) for r in report.readers)

    def close(self) -> None:
        self._view.close()


def render(h: Handle, now: Snapshot, before: Snapshot | None) -> list[str]:
    """The lines of one view; rates come from the previous snapshot, when there is one."""
    if now.closed:
        state = "closed by the writer"
    elif not now.writer_alive:
        state = "WRITER GONE (died without closing the channel)"
    elif now.wait_target:
        state = "writer BLOCKED"
    else:
        state = "open"
    span = now.at - before.at if before is not None else 0.0

    def rate(new: int, old: int | None) -> str:
        return f"{(new - old) / span:,.1f}" if old is not None and span > 0 else "-"

    lines = [
        f"channel {h.name}  writer {_where(now.writer_pid, now.writer_host)}  {state}",
        f"  policy {h.policy}, codec {h.codec}, ring {h.capacity} x {h.slot_bytes} B"
        + (f", tcp {h.tcp}" if h.tcp else ""),
        f"  published {plural(now.messages, 'message')} ({plural(now.head, 'ring entry', 'ring entries')})"
        + (f", {rate(now.messages, before.messages)} msg/s" if before is not None and span > 0 else ""),
    ]
    if now.arena is not None:
        size, used, _pins = now.arena
        lines.append(f"  arena {size:,} B, {used:,} B held (by messages not yet read by all, or by views)")
    if not now.readers and not now.remote:
        lines.append("  no readers attached")
    else:
        lines.append(
            f"  {'place':>5}  {'name':<24} {'pid':>8} {'host':<16} {'alive':<5} {'lag':>7} {'received':>10} "
            f"{'msg/s':>10}  state"
        )
    prev = {(r.place, r.pid): r for r in before.readers} if before is not None else {}
    holding = {r.place for r in now.holding()}
    for r in now.readers:
        old = prev.get((r.place, r.pid))
        if r.place in holding:
            what = "HOLDING THE WRITER"
        elif r.sleeping:
            what = "waiting for messages"
        else:
            what = "reading" if r.cursor < now.head else "idle"
        if _is_tcp_server(h, r):
            what += " (the TCP server: reads for the remote readers)"
        if now.arena is not None and now.arena[2].get(r.place):
            what += f", its views pin {now.arena[2][r.place]:,} B of the arena"
        r_rate = rate(r.received, old.received if old else None)
        lines.append(
            f"  {r.place:>5}  {r.name[:24]:<24} {r.pid:>8} {_host(r.host)} {'yes' if r.alive else 'NO':<5} "
            f"{max(0, now.head - r.cursor):>7} {r.received:>10} {r_rate:>10}  {what}"
        )
    prev_remote = {(r.name, r.pid): r for r in (before.remote or ())} if before is not None else {}
    for rr in now.remote or ():
        old_rr = prev_remote.get((rr.name, rr.pid))
        lines.append(
            f"  {'tcp':>5}  {rr.name[:24]:<24} {rr.pid:>8} {_host(rr.host)} {'yes':<5} {rr.lag:>7} {rr.received:>10} "
            f"{rate(rr.received, old_rr.received if old_rr else None):>10}  remote (pid on its host)"
        )
    for r in now.holding():
        line = f"writer is waiting for: {r.name} ({_where(r.pid, r.host)}) at entry {r.cursor} of {now.head}"
        if not r.alive:
            line += f" - {HOLDER_GONE}"
        elif _is_tcp_server(h, r):
            slowest = max(now.remote or (), key=lambda rr: rr.lag, default=None)
            line += f" - {HOLDER_TCP_SERVER}"
            if slowest is not None:
                where = _where(slowest.pid, slowest.host)
                line += f": {slowest.name} (remote {where}, {plural(slowest.lag, 'message')} unacknowledged)"
        else:
            line += f" - {HOLDER_STUCK}"
        lines.append(line)
    if now.wait_target and not holding:
        lines.append("writer is waiting for room; the readers holding it have just moved")
    return lines


_where = where  # a pid and where it means something, as the library's errors say it


def _host(host: str) -> str:
    """The host column: a remote reader's host name may be longer than the ring's 16 bytes."""
    return f"{host[:16] or '-':<16}"


def _is_tcp_server(h: Handle, r: ReaderRow) -> bool:
    return h.tcp is not None and r.name == TCP_SERVER_READER_NAME


def _run(args: argparse.Namespace) -> int:
    if args.interval < 0 or (args.interval == 0 and not args.once):
        return run_sync(lambda: fail("--interval must be more than 0 (or 0 with --once: no rates)"))
    return run_sync(lambda: _stats(args))


def _stats(args: argparse.Namespace) -> int:
    handle = load_handle(args.handle_file)
    view = SegmentView(handle)
    try:
        if args.once:
            before = view.snapshot() if args.interval > 0 else None
            if before is not None:
                time.sleep(args.interval)
            now = view.snapshot()
            print("\n".join(render(handle, now, before)), flush=True)
            return EXIT_OK if now.writer_alive and not now.closed else EXIT_FAILED
        return _live(view, handle, args.interval)
    finally:
        view.close()


def _live(view: SegmentView, handle: Handle, interval: float) -> int:
    out = sys.stdout
    tty = out.isatty()
    before: Snapshot | None = None
    while True:
        now = view.snapshot()
        lines = render(handle, now, before)
        if tty:
            out.write("\x1b[H\x1b[J")  # home and clear: the view updates in place
        out.write("\n".join(lines) + "\n" + ("" if tty else "\n"))
        out.flush()
        if now.closed or not now.writer_alive:
            return EXIT_FAILED if not now.closed else EXIT_OK
        before = now
        time.sleep(interval)
