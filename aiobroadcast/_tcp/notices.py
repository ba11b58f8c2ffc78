"""What the TCP server tells the outside about its readers: its report file, read by
``Writer.statistics()`` and ``aiobroadcast stats`` (report.py), and its log of readers refused,
dropped for silence, admitted or gone. A flood of refused frames is a few lines, and a report
that cannot be written (a full /dev/shm) changes nothing for the readers served.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from .report import ServerReport, write_report
from .serving import Rejected, ServerEvent, ServerProtocol, TimedOut

log = logging.getLogger("aiobroadcast")

#: a remote peer's refused frames are logged at most once in this many seconds
COMPLAIN_EVERY_S = 60.0
#: peers remembered for that (a flood of new peers is not logged one by one)
COMPLAINTS_KEPT = 256


class Notices:
    """The server's report (``write``) and what it logs of ``protocol``'s events (``on_event``)."""

    def __init__(self, protocol: ServerProtocol, report_path: str) -> None:
        self._protocol = protocol
        self._report_path = report_path
        self._report_failing = False
        self._complaints: dict[bytes, float] = {}
        #: what the report file holds now (``protocol.report()`` when it was last written)
        self._written: dict[str, Any] | None = None

    def write(self) -> None:
        """Who is connected, for ``Writer.statistics()`` and ``aiobroadcast stats``. Only a
        report: if it cannot be written (a full /dev/shm), the last one stays and readers are
        served as before.

        A report that says what the file already says is not written again: only the file's
        time is renewed, which tells the writer's process that the server is alive and its
        report current (``report.health``). An idle channel's heartbeat is then one system call
        here, not a file created, written and renamed, with its JSON built and checked."""
        fields = self._protocol.report()
        try:
            if fields != self._written or not _renewed(self._report_path):
                self._written = None  # if this write fails, the next one is written whole
                write_report(self._report_path, ServerReport.model_validate({"pid": os.getpid(), **fields}))
                self._written = fields
        except OSError as exc:
            if not self._report_failing:
                self._report_failing = True
                log.warning(
                    "aiobroadcast: the TCP server cannot write its report %s (%s); connected remote readers "
                    "are served as before; statistics() shows the last report, and its tcp_server_health "
                    "why, until it can",
                    self._report_path,
                    exc.strerror or exc,
                )
            return
        if self._report_failing:
            self._report_failing = False
            log.warning("aiobroadcast: the TCP server writes its report %s again", self._report_path)

    def on_event(self, event: ServerEvent) -> None:
        if isinstance(event, Rejected):
            self._complain(event)
            if event.dropped is not None:
                self.write()
        elif isinstance(event, TimedOut):
            log.warning(
                "aiobroadcast: remote reader %r (pid %d) silent for %.1f s; dropped it at message %d of %d",
                event.client.name,
                event.client.pid,
                event.silent_s,
                event.acked,
                event.end,
            )
        else:  # admitted (statistics() lists it as soon as open_reader returns), or departed
            self.write()

    def _complain(self, event: Rejected) -> None:
        """Log a refused frame: once per peer per COMPLAIN_EVERY_S, so a flood is a few lines."""
        now = time.monotonic()
        last = self._complaints.get(event.ident)
        if last is not None and now - last < COMPLAIN_EVERY_S:
            return
        if len(self._complaints) >= COMPLAINTS_KEPT:
            self._complaints = {k: t for k, t in self._complaints.items() if now - t < COMPLAIN_EVERY_S}
            if len(self._complaints) >= COMPLAINTS_KEPT:
                return
        self._complaints[event.ident] = now
        client = event.dropped
        who = f"remote reader {client.name!r} (pid {client.pid})" if client else "a remote peer"
        log.warning(
            "aiobroadcast: the TCP server refused a frame from %s: %s%s (%d refused so far)",
            who,
            event.reason[:200],
            "; dropped it" if client else "",
            event.total,
        )


def _renewed(path: str) -> bool:
    """Give the report at ``path`` the current time; False if it cannot (it is not there)."""
    try:
        os.utime(path)
    except OSError:
        return False
    return True
