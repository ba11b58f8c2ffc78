"""The writer's side of its TCP server process: start it, notice when it dies, start it again.

The server (``server.py``) is a process of its own. If it dies while the writer lives (a
bug, the OOM killer, a stray SIGKILL), a thread of the writer's process that waits for it notices
at once: it logs the death, removes the dead server's report (so ``statistics()`` stops listing
readers nobody serves) and starts a new server on the same endpoint with the same keys, which
takes the dead one's ring place over (docs/design.md, "When the server process dies"). Remote
readers reconnect by themselves, say HELLO with the next message they need, and resume; what the
dead server held and they had not received is reported to them exactly (``ReaderLagged``). If the
new server cannot start (the endpoint was taken meanwhile, say), it tries ``START_ATTEMPTS``
times, then logs an error and reports ``"failed"``; shared-memory readers are not affected.
"""

from __future__ import annotations

import json
import logging
import select
import subprocess
import sys
import threading
import time
from typing import Any

from .._base.stats import ReaderInfo, TcpServerState
from .report import Reports, health, remove_report
from .settings import ServerSettings

log = logging.getLogger("aiobroadcast")

#: how long a server process may take to bind and answer (Python's start-up on a loaded host)
SERVER_START_S = 30.0
#: starts in a row that may fail before the writer gives up on serving remote readers
START_ATTEMPTS = 3
#: the wait before a restart after the server died soon after the previous start, doubling up
#: to RESTART_MAX_S, so a server that keeps dying does not take a core; none after a long run
RESTART_DELAY_S = 0.2
RESTART_MAX_S = 5.0
#: a server that ran this long before dying is restarted at once
STABLE_S = 60.0

#: how long a close that was cancelled still gives the server to hand remote readers the end of the
#: stream (normally milliseconds) before it kills it; the event loop is blocked meanwhile
CANCELLED_STOP_S = 1.0


def read_answer(proc: subprocess.Popen[bytes], limit_s: float) -> dict[str, Any]:
    """The server's one-line answer on its stdout: ``{"endpoint": ...}`` once it is bound, or
    ``{"error": ...}``; an error too if it exits or says nothing within ``limit_s``."""
    assert proc.stdout is not None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], limit_s)
        if not ready:
            return {"error": f"the TCP server process did not answer within {limit_s:g} s"}
        line = proc.stdout.readline()
    except (OSError, ValueError):  # closed under us: the start was given up
        line = b""
    try:
        answer = json.loads(line) if line else None
    except ValueError:
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("endpoint", answer.get("error")), str):
        return answer
    if not line:
        return {"error": "the TCP server process exited before it was serving"}
    return {"error": f"the TCP server process said {line[:200]!r}"}


def spawn_server(settings: ServerSettings) -> subprocess.Popen[bytes]:
    """Start a server process and hand it its settings on its stdin; it answers on its stdout."""
    # The same interpreter finds the package as it is installed (a wheel in site-packages, or
    # an editable install's finder), and inherits PYTHONPATH for a copy found that way; -P: not
    # from the working directory, which ``-m`` would put first (a source checkout there,
    # without its compiled extension, would shadow the installed package).
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "aiobroadcast._tcp.server"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        close_fds=True,
    )
    assert proc.stdin is not None
    try:
        proc.stdin.write(settings.model_dump_json().encode() + b"\n")
        proc.stdin.flush()
    except OSError:
        pass  # it died at once: read_answer says so
    return proc


def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass


class ServerProcess:
    """The TCP server process of one writer, kept running while the writer is open."""

    def __init__(self, settings: ServerSettings) -> None:
        """``settings``: the server's (keys included: they go to the process on its stdin, never
        on the command line); the servers started again get them too, with their endpoint the
        one the first bound."""
        self._settings = settings
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        #: the server ``stop`` waits for (``finish`` may kill it)
        self._stopping: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self.state: TcpServerState = "running"
        self.restarts = 0
        #: the exit code of the server ``stop`` stopped (0: it drained and stopped by itself)
        self.returncode: int | None = None
        self._served_at = time.monotonic()
        #: every server process this writer started (their ring places are named after them)
        self.pids: set[int] = set()
        self._reports = Reports(settings.report_path)

    # --- starting --------------------------------------------------------------------------
    def spawn(self) -> subprocess.Popen[bytes]:
        """Start a server process with this writer's settings; it answers on its stdout."""
        return spawn_server(self._settings)

    def serve(self, proc: subprocess.Popen[bytes], endpoint: str) -> None:
        """``proc`` answered that it serves ``endpoint``: watch it from now on. A server started
        again binds that same endpoint (the port that was read back, not port 0)."""
        self._settings = self._settings.model_copy(update={"endpoint": endpoint})
        self._proc = proc
        self._served_at = time.monotonic()
        self.pids.add(proc.pid)
        self._thread = threading.Thread(target=self._watch, args=(proc,), name="aiobroadcast-tcp-watch", daemon=True)
        self._thread.start()

    # --- what the writer reads ---------------------------------------------------------------
    def report(self) -> tuple[TcpServerState, tuple[ReaderInfo, ...], int, int]:
        """The server's state, the remote readers the running server serves, and the readers
        dropped and frames refused so far, from the report it writes every heartbeat. The state
        is read once (the watcher thread changes it): no remote reader is listed unless it says
        "running"."""
        state = self.state
        if state != "running":
            return (state, (), *self._reports.totals())
        return (state, *self._reports.read())

    def health(self) -> str:
        """ "ok" if the running server can serve, else what stops it (``report.health``); ""
        unless the state is "running"."""
        proc, s = self._proc, self._settings
        if self.state != "running" or proc is None:
            return ""
        return health(proc.pid, s.report_path, s.hb_interval, self._served_at)

    def restarting_from(self, pid: int) -> bool:
        """Whether ``pid`` is a server that died and is being replaced: the writer keeps its
        ring place (the new server takes it over) instead of dropping it as a dead reader."""
        return self.state == "restarting" and pid in self.pids

    # --- stopping --------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the server to stop once remote readers have drained (it sees its stdin close),
        wait for it (killing it after ``stop_s``), and remove its report. Blocking."""
        proc = self._stopping = self._detach()
        stop_s = self._settings.stop_s
        if proc is not None:
            try:
                proc.wait(stop_s)
            except subprocess.TimeoutExpired:
                log.warning("aiobroadcast: the TCP server did not stop in %.0f s; killed it", stop_s)
                proc.kill()
                proc.wait()
            self.returncode = proc.returncode
        if self._thread is not None:
            self._thread.join()
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()
        remove_report(self._reports.path)

    def finish(self, stopper: threading.Thread) -> None:
        """``stopper`` runs ``stop`` and its caller may not wait for it any longer (its close was
        cancelled): give the server ``CANCELLED_STOP_S`` more to drain, then kill it, and return
        once ``stop`` is done (the server is gone, its report removed). Blocking, for about
        ``CANCELLED_STOP_S`` at most."""
        stopper.join(CANCELLED_STOP_S)
        if stopper.is_alive():
            proc = self._stopping
            if proc is not None and proc.poll() is None:
                log.warning(
                    "aiobroadcast: the writer's close was cancelled and its TCP server had not stopped "
                    "%.1f s later; killed it (remote readers may not receive the end of the stream)",
                    CANCELLED_STOP_S,
                )
                proc.kill()
            stopper.join()

    def abandon(self) -> None:
        """The writer is gone without closing (garbage collected, or the interpreter exits): let
        the server drain and stop by itself. Never blocks."""
        self._detach()

    def forget_in_child(self) -> None:
        """In a fork child of the writer's process: the server is the parent's. Close this
        process's copies of its pipes (a copy left open would keep it serving after the parent
        closed its stdin); never stop or restart it from here. The parent's watcher thread is not
        in the child, and may have held the parent's locks at the fork: use fresh ones."""
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._stopped.set()
        self._thread = None
        proc, self._proc = self._proc, None
        if proc is not None:
            _close_pipes(proc)

    def _detach(self) -> subprocess.Popen[bytes] | None:
        """Mark the server as stopping (the watcher restarts nothing from now on) and close its
        stdin, which tells it to drain and stop."""
        with self._lock:
            self._stopped.set()
            proc, self._proc = self._proc, None
        if proc is not None and proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
        return proc

    # --- the watcher thread ------------------------------------------------------------------
    def _watch(self, proc: subprocess.Popen[bytes]) -> None:
        """Watch the server; restart it when it dies. If this thread itself fails (a new server
        cannot even be spawned: no memory, no executable), it says so as a failed restart does:
        state "failed" (so the writer drops the dead server's ring place instead of keeping it
        for a server that never comes, which would hold a "block" writer forever) and an error
        logged, instead of dying silently with the state left at "restarting"."""
        try:
            self._watch_server(proc)
        except BaseException as exc:
            with self._lock:
                if self._stopped.is_set():
                    return
                self.state = "failed"
            log.error(
                "aiobroadcast: watching the TCP server on %s failed (%r). Remote readers are NOT served any "
                "more; shared-memory readers are. Close the writer and open a new one to serve them again",
                self._settings.endpoint,
                exc,
            )

    def _watch_server(self, proc: subprocess.Popen[bytes]) -> None:
        started = time.monotonic()
        quick_deaths = 0
        while True:
            code = proc.wait()
            ran = time.monotonic() - started
            with self._lock:
                if self._stopped.is_set():
                    if proc.stdout is not None:
                        proc.stdout.close()  # stop() does too; abandon() leaves it to us
                    return
                self.state = "restarting"
                self._proc = None
            _close_pipes(proc)
            served = self._reports.forget()  # the dead server's readers: nobody serves them
            # The new server takes the dead one's ring place, where the writer keeps what it had
            # not taken yet, and keeps what it takes for the readers coming back (if the report
            # that counts them is gone, for as long as they may take).
            returning = self._settings.max_remote if served is None else served
            self._settings = self._settings.model_copy(update={"take_over": proc.pid, "returning": returning})
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            log.warning(
                "aiobroadcast: the TCP server (pid %d) %s after %.1f s; starting a new one on %s",
                proc.pid,
                how,
                ran,
                self._settings.endpoint,
            )
            quick_deaths = 0 if ran >= STABLE_S else quick_deaths + 1
            delay = 0.0 if quick_deaths <= 1 else min(RESTART_MAX_S, RESTART_DELAY_S * 2 ** (quick_deaths - 2))
            new = self._restart(delay)
            if new is None:
                return
            proc = new
            started = time.monotonic()

    def _restart(self, delay: float) -> subprocess.Popen[bytes] | None:
        """Start a new server; the process, or None if the writer is stopping or it failed."""
        error = ""
        for _attempt in range(START_ATTEMPTS):
            if self._stopped.wait(delay):
                return None
            with self._lock:
                if self._stopped.is_set():
                    return None
                proc = self._proc = self.spawn()
            answer = read_answer(proc, SERVER_START_S)
            with self._lock:
                if self._stopped.is_set():
                    return None  # stop() has it now
                if "endpoint" in answer:
                    self._served_at = time.monotonic()
                    self.state = "running"
                    self.restarts += 1
                    self.pids.add(proc.pid)
                    log.warning(
                        "aiobroadcast: a new TCP server (pid %d) serves %s; remote readers resume",
                        proc.pid,
                        answer["endpoint"],
                    )
                    return proc
                self._proc = None
            error = str(answer["error"])
            proc.kill()
            proc.wait()
            _close_pipes(proc)
            self._reports.forget()
            log.warning("aiobroadcast: the new TCP server did not start: %s", error)
            delay = max(RESTART_DELAY_S, min(RESTART_MAX_S, 2 * delay))
        with self._lock:
            if self._stopped.is_set():
                return None
            self.state = "failed"
        log.error(
            "aiobroadcast: the TCP server on %s could not be started again (%d attempts; last: %s). "
            "Remote readers are NOT served any more; shared-memory readers are. Close the writer "
            "and open a new one to serve them again",
            self._settings.endpoint,
            START_ATTEMPTS,
            error,
        )
        return None
