"""Wake-ups between processes: one Unix datagram socket per sleeper.

A datagram means only "look at the ring again"; the ring is the truth (docs/design.md). The
sockets live beside the segment, so processes that share /dev/shm (a container sharing the
writer's IPC namespace) reach each other even from another network namespace.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from time import perf_counter_ns

import anyio
import anyio.lowlevel


class Inbox:
    """The socket a sleeper waits on."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            os.unlink(path)  # left over by a dead process that had this place
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.bind(path)
            os.chmod(path, 0o600)
        except BaseException:
            self.sock.close()
            raise
        self.sock.setblocking(False)

    async def wait(self, limit_s: float) -> bool:
        """Sleep until a datagram arrives or ``limit_s`` seconds pass. True if woken.
        Raises ``anyio.ClosedResourceError`` if ``close`` is called meanwhile."""
        with anyio.move_on_after(limit_s):
            await anyio.wait_readable(self.sock)
        if self.sock.fileno() < 0:  # closed while the wait was ending
            raise anyio.ClosedResourceError
        return self.drain()

    def drain(self) -> bool:
        got = False
        while True:
            try:
                self.sock.recv(64)
            except (BlockingIOError, InterruptedError):
                return got
            got = True

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            try:
                anyio.notify_closing(self.sock)  # a task parked in wait() raises ClosedResourceError
            except RuntimeError:  # no event loop here, so no task can be parked
                pass
        self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class Outbox:
    """Sends wake-ups; never blocks and never fails: a missing or full inbox needs none."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)

    def wake(self, path: str) -> None:
        try:
            self.sock.sendto(b"\0", path)
        except (BlockingIOError, ConnectionRefusedError, FileNotFoundError, InterruptedError):
            pass  # full: it is being woken already; gone: nobody to wake

    def close(self) -> None:
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
