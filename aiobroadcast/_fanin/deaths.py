"""A fan-in collector's immediate death notice (docs/fan-in.md, "Liveness").

A pidfd per local sender (``os.pidfd_open``: readable once the process has exited), watched by
one thread per collector in one epoll instance. When one fires, the thread sets ``fired`` and
knocks the collector's inbox: the collector wakes (asyncio, trio or blocking alike: it sleeps on
that one socket) and, seeing ``fired``, looks at its rings' writer locks at once instead of at
the next ``LIVENESS_S``. A dead process's locks are released before its pidfd becomes readable,
so that look finds it. Where there is no pidfd (no ``pidfd_open``, another pid namespace, the
process already gone), nothing is watched and the periodic look finds the death as before.
"""

from __future__ import annotations

import os
import select
import threading

from .._shm import layout as _layout
from .._shm import segment as _segment
from .._shm.layout import W_WRITER_PID, W_WRITER_PIDNS
from .._shm.wake import knock


class SenderDeaths:
    """The pidfds of a collector's local senders and the thread that waits on them."""

    def __init__(self, inbox_path: str) -> None:
        self._inbox_path = inbox_path
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}  #: sender name -> its pidfd
        self._epoll: select.epoll | None = None
        self._stop_r = self._stop_w = -1
        self._thread: threading.Thread | None = None
        self._ns = _layout.pid_namespace()
        #: A watched sender's process exited since the collector last looked (set by the thread).
        self.fired = False

    def watch(self, name: str, seg: _segment.Segment) -> None:
        """Watch the writer of ``seg`` (sender ``name``'s ring), if a pidfd can name it."""
        w = seg.words
        if not self._ns or w[W_WRITER_PIDNS] != self._ns or not hasattr(os, "pidfd_open"):
            return
        try:
            fd = os.pidfd_open(w[W_WRITER_PID])
        except OSError:
            return
        # It still holds its lock now that the pidfd is open: the pid was not reused.
        if not _segment.is_locked(seg.fd, _segment.WRITER_LOCK_BYTE):
            os.close(fd)
            return
        with self._lock:
            if self._epoll is None and not self._start():
                os.close(fd)
                return
            assert self._epoll is not None
            old = self._fds.pop(name, None)
            if old is not None:
                self._drop(old)
            self._fds[name] = fd
            self._epoll.register(fd, select.EPOLLIN)

    def forget(self, name: str) -> None:
        """Stop watching sender ``name`` (reported, or let go)."""
        with self._lock:
            fd = self._fds.pop(name, None)
            if fd is not None:
                self._drop(fd)

    def close(self) -> None:
        """Stop the thread and close every descriptor."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                os.write(self._stop_w, b"x")
        if thread is not None:
            thread.join()
        with self._lock:
            self._close_all()

    def forget_in_child(self) -> None:
        """A fork child's copy: the thread is not there; close the inherited descriptors."""
        self._lock = threading.Lock()
        self._thread = None
        self._close_all()

    # --- internals -----------------------------------------------------------------------
    def _start(self) -> bool:
        try:
            self._epoll = select.epoll()
            self._stop_r, self._stop_w = os.pipe()
            self._epoll.register(self._stop_r, select.EPOLLIN)
            self._thread = threading.Thread(target=self._run, name="aiobroadcast-fanin-deaths", daemon=True)
            self._thread.start()
        except (OSError, RuntimeError):
            self._thread = None
            self._close_all()
            return False
        return True

    def _drop(self, fd: int) -> None:
        try:
            if self._epoll is not None:
                self._epoll.unregister(fd)
        except (OSError, ValueError):
            pass
        os.close(fd)

    def _close_all(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for fd in (self._stop_r, self._stop_w):
            if fd >= 0:
                os.close(fd)
        self._stop_r = self._stop_w = -1
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None

    def _run(self) -> None:
        epoll = self._epoll
        stop = self._stop_r
        assert epoll is not None
        while True:
            try:
                events = epoll.poll()
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                continue
            except (OSError, ValueError):  # closed under us: the collector is closing
                return
            died = False
            with self._lock:
                for fd, _mask in events:
                    if fd == stop:
                        return
                    # It stays readable for good: stop watching it (forget closes it later).
                    try:
                        epoll.unregister(fd)
                    except (OSError, ValueError):
                        pass
                    died = True
            if died:
                self.fired = True
                knock(self._inbox_path)
