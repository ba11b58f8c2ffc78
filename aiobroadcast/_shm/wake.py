"""Wake-ups between processes: one Unix datagram socket per sleeper.

A datagram means only "look at the ring again"; the ring is the truth (docs/design.md). The
sockets live beside the segment, so processes that share /dev/shm (a container sharing the
writer's IPC namespace) reach each other even from another network namespace.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import socket
from collections.abc import Callable, Sequence
from time import perf_counter_ns

import anyio
import anyio.lowlevel

from .. import _fork
from .._exceptions import BroadcastError, os_error


class Inbox:
    """The socket a sleeper waits on; and, if given, a file descriptor it watches as well (the
    writer's pidfd: readable once the writer's process has exited). Both are waited on through
    one epoll instance, itself a readable file descriptor to the event loop."""

    def __init__(self, path: str, watch: int | None = None) -> None:
        """``watch`` is owned by the inbox from now on (closed by ``close``)."""
        self.path = path
        self.watch = watch
        self._epoll: select.epoll | None = None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            try:
                os.unlink(path)  # left over by a dead process that had this place
            except FileNotFoundError:
                pass
            self.sock.bind(path)
            os.chmod(path, 0o600)
            if watch is not None:
                self._epoll = select.epoll()
                self._epoll.register(self.sock.fileno(), select.EPOLLIN)
                self._epoll.register(watch, select.EPOLLIN)
        except BaseException as exc:
            self.sock.close()
            if watch is not None:
                os.close(watch)
            if self._epoll is not None:
                self._epoll.close()
            if isinstance(exc, OSError):
                raise os_error(BroadcastError, f"cannot bind the wake-up socket {path}", exc) from exc
            raise
        self.sock.setblocking(False)
        #: What to wait on for readability: the epoll instance if there is a watch, else the socket.
        self._waitable: socket.socket | select.epoll = self.sock if self._epoll is None else self._epoll
        self._forgotten = False
        _fork.track(self)

    def fileno(self) -> int:
        return self._waitable.fileno()

    async def wait(self, limit_s: float) -> bool:
        """Sleep until a datagram arrives, the watch fires or ``limit_s`` seconds pass. True if
        a datagram came. Raises ``anyio.ClosedResourceError`` if ``close`` is called meanwhile."""
        with anyio.move_on_after(limit_s):
            await anyio.wait_readable(self._waitable)
        if self.sock.fileno() < 0:  # closed while the wait was ending
            raise anyio.ClosedResourceError
        return self.drain()

    def wait_blocking(self, limit_s: float) -> bool:
        """``wait`` for a thread without an event loop: block in ``poll()`` on the same file
        descriptor. Nobody may ``close`` the inbox meanwhile (the blocking roles make sure)."""
        wait_readable((self.fileno(),), limit_s)
        return self.drain()

    def drain(self) -> bool:
        """Read every datagram; True if there was one. Without one, a watch that fired is
        dropped (it stays readable: waiting on it again would return at once, forever)."""
        got = False
        while True:
            try:
                self.sock.recv(64)
            except (BlockingIOError, InterruptedError):
                break
            got = True
        watch = self.watch
        if got or self._epoll is None or watch is None:
            return got
        if any(fd == watch for fd, _events in self._epoll.poll(0)):
            self._epoll.unregister(watch)
            os.close(watch)
            self.watch = None
        return got

    def close(self) -> None:
        if self._forgotten:
            return  # the socket file is the parent's
        _fork.untrack(self)
        if self.sock.fileno() >= 0:
            try:
                # A task parked in wait() raises ClosedResourceError.
                anyio.notify_closing(self._waitable)
            except RuntimeError:  # no event loop here, so no task can be parked
                pass
        if self._epoll is not None:
            self._epoll.close()
        if self.watch is not None:
            os.close(self.watch)
            self.watch = None
        self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _forget_in_child(self) -> None:
        """A fork child's copy: close the descriptors, leave the socket file to the parent, and
        tell no event loop (one inherited from the parent is not this process's to use)."""
        self._forgotten = True
        # Quietly: a descriptor may be closed already (by another hook that closes everything).
        with contextlib.suppress(OSError):
            self.sock.close()
        if self._epoll is not None:
            with contextlib.suppress(OSError):
                self._epoll.close()
        if self.watch is not None:
            with contextlib.suppress(OSError):
                os.close(self.watch)
            self.watch = None


class Outbox:
    """Sends wake-ups; never blocks and never fails: a missing or full inbox needs none."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        _fork.track(self)

    def wake(self, path: str) -> None:
        try:
            self.sock.sendto(b"\0", path)
        except (BlockingIOError, ConnectionRefusedError, FileNotFoundError, InterruptedError):
            pass  # full: it is being woken already; gone: nobody to wake

    def close(self) -> None:
        _fork.untrack(self)
        self.sock.close()

    def _forget_in_child(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


async def poll(ready: Callable[[], bool], limit_ns: int) -> bool:
    """Re-check ``ready`` for up to ``limit_ns`` instead of sleeping: one event-loop round at a
    time (other tasks run meanwhile), yielding the CPU between rounds (so pollers on a busy host
    leave it to the process they wait for). True once ``ready()`` is; False when time is up.
    ``ready`` may raise to end the poll."""
    deadline = perf_counter_ns() + limit_ns
    while True:
        await anyio.lowlevel.checkpoint()
        if ready():
            return True
        if perf_counter_ns() >= deadline:
            return False
        os.sched_yield()


def poll_blocking(ready: Callable[[], bool], limit_ns: int) -> bool:
    """``poll`` for a thread without an event loop: re-check ``ready`` for up to ``limit_ns``,
    yielding the CPU between rounds."""
    deadline = perf_counter_ns() + limit_ns
    while True:
        if ready():
            return True
        if perf_counter_ns() >= deadline:
            return False
        os.sched_yield()


def wait_readable(fds: Sequence[int], limit_s: float) -> bool:
    """Block this thread until one of ``fds`` is readable or ``limit_s`` seconds pass (rounded
    up to a millisecond, so a short wait sleeps rather than spins). True if one is readable."""
    waiter = select.poll()
    for fd in fds:
        waiter.register(fd, select.POLLIN)
    return bool(waiter.poll(max(0, math.ceil(limit_s * 1000))))
