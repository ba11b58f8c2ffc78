"""What the TCP server process tells back: ``ServerReport``, a JSON file beside the channel's
segment (``<segment>-tcp.json``) that the server renews at every heartbeat (rewritten when it
changed), and how the writer's process judges the server's health from outside it.

The server writes the report (``write_report``); ``Writer.statistics()`` (through the supervisor)
and ``aiobroadcast stats`` read it (``read_report``), and nothing else parses it. This module
imports neither ZeroMQ nor the protocol: the command line reads reports without loading them.
"""

from __future__ import annotations

import os
import resource
import time

from pydantic import BaseModel, ConfigDict, ValidationError

from .._base.files import unlink_quietly
from .._base.stats import ReaderInfo

#: the server is short of descriptors when fewer than this many of its limit are free (or a 64th of
#: it, if more): it cannot accept new readers' connections, nor write its report, for long
FD_SPARE = 8
#: its report is stale (it cannot write it) when it is older than this many heartbeats, plus a second
STALE_HEARTBEATS = 4


class RemoteReaderReport(BaseModel):
    """One remote reader the server serves."""

    model_config = ConfigDict(frozen=True)

    name: str
    pid: int
    host: str = ""
    #: messages it acknowledged
    received: int
    #: messages the server holds beyond those
    lag: int


class ServerReport(BaseModel):
    """The server's report: its pid, what ``ServerProtocol.report()`` counts, its readers. Fields
    a reader of the report does not know are ignored; a file without those it needs is none."""

    model_config = ConfigDict(frozen=True)

    pid: int
    #: the next message number the server holds
    end: int
    #: remote readers dropped, frames refused, and whether a fan-in sender's server gave up
    dropped: int = 0
    rejected_frames: int = 0
    abandoned: bool = False
    readers: tuple[RemoteReaderReport, ...]


def report_path(segment_path: str) -> str:
    """The report of the server of the channel whose segment is ``segment_path``."""
    return f"{segment_path}-tcp.json"


def report_tmp_path(path: str) -> str:
    """Where the server writes the report ``path`` before it replaces the old one (``sweep_stale``
    recognises it as the channel's)."""
    return f"{path}.tmp"


def read_report(path: str) -> ServerReport | None:
    """The report at ``path``; None if there is none, or it is not one this version writes (a
    foreign or partial file: the server replaces it whole, so only another writer makes those)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        return ServerReport.model_validate_json(data)
    except (OSError, ValidationError):
        return None


def write_report(path: str, report: ServerReport) -> None:
    """Replace the report at ``path`` whole (through its temporary file); OSError if it cannot,
    with the temporary file removed and the last report left."""
    tmp = report_tmp_path(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(report.model_dump_json())
        os.replace(tmp, path)
    except OSError:
        unlink_quietly(tmp)
        raise


def remove_report(path: str) -> None:
    """Remove the report at ``path`` and its temporary file, if they are there."""
    unlink_quietly(path)
    unlink_quietly(report_tmp_path(path))


class Reports:
    """The reports of one writer's servers, as the writer reads them: the running server's remote
    readers, and counts that do not go back when a server dies and another takes over."""

    def __init__(self, path: str) -> None:
        self.path = path
        # What servers that died had counted.
        self._dropped_before = 0
        self._rejected_before = 0

    def totals(self) -> tuple[int, int]:
        """The remote readers dropped and the frames refused by the servers that died."""
        return self._dropped_before, self._rejected_before

    def read(self) -> tuple[tuple[ReaderInfo, ...], int, int]:
        """The running server's remote readers, and the readers dropped and frames refused so far."""
        dropped, rejected = self.totals()
        report = read_report(self.path)
        if report is None:
            return (), dropped, rejected
        infos = tuple(
            ReaderInfo(-1, r.name, r.pid, r.received, r.lag, False, transport="tcp", host=r.host)
            for r in report.readers
        )
        return infos, dropped + report.dropped, rejected + report.rejected_frames

    def forget(self) -> int | None:
        """The server died: keep its counts, remove its report (it names readers nobody serves).
        How many remote readers it served, if its report says."""
        report = read_report(self.path)
        remove_report(self.path)
        if report is None:
            return None
        self._dropped_before += report.dropped
        self._rejected_before += report.rejected_frames
        return len(report.readers)


def health(pid: int, path: str, hb_interval: float, since: float) -> str:
    """ "ok" if the running server ``pid``, which writes the report ``path`` every ``hb_interval``
    and has served since ``since`` (``time.monotonic()``), can serve; else what stops it, as far as
    can be seen from outside: its descriptors (counted in /proc, as it may have none left to say
    so itself), or a report it stopped writing."""
    used, limit = _descriptors(pid)
    if limit > 0 and limit - used < max(FD_SPARE, limit // 64):
        return (
            f"out of file descriptors: {used} of {limit} in use, so new connections of remote readers "
            "fail (peers opening connections faster than the handshake limit closes them?)"
        )
    try:
        age = time.time() - os.stat(path).st_mtime
    except OSError:
        age = time.monotonic() - since
    if age > STALE_HEARTBEATS * hb_interval + 1.0:
        return f"its report was last written {age:.1f} s ago: it cannot write it (/dev/shm full?)"
    return "ok"


def _descriptors(pid: int) -> tuple[int, int]:
    """The descriptors process ``pid`` holds and its soft limit; (0, 0) where /proc cannot say
    (not Linux, or the process just ended)."""
    try:
        used = len(os.listdir(f"/proc/{pid}/fd"))
        limit = resource.prlimit(pid, resource.RLIMIT_NOFILE)[0]
    except OSError:
        return 0, 0
    if limit == resource.RLIM_INFINITY:
        return 0, 0
    return used, limit
