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
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from .._base import fork as _fork
from .._base.errors import BroadcastError, os_error


class EventLoopSide(Protocol):
    """How tasks sleep on an inbox (``aiobroadcast._broadcast.wakeup.LoopWaiter``): ``_shm`` knows nothing
    of event loops, the layer above gives it this (``serve_event_loops``)."""

    def wait(self, limit_s: float) -> Awaitable[bool]: ...
    def closing(self) -> None: ...
    def forget(self) -> None: ...


#: Makes an inbox's event-loop side, at its first ``wait``: given by ``serve_event_loops``.
_event_loop_side: Callable[[Inbox], EventLoopSide] | None = None


def serve_event_loops(make: Callable[[Inbox], EventLoopSide]) -> None:
    """Give inboxes their event-loop side (called once by the reader layer, which imports
    ``aiobroadcast._broadcast.wakeup``: ``_shm`` may not)."""
    global _event_loop_side
    _event_loop_side = make


class Inbox:
    """The socket a sleeper waits on; and, if given, a file descriptor it watches as well (the
    writer's pidfd: readable once the writer's process has exited).

    A task waits through ``wait``, which its event-loop side does (``EventLoopSide``); a thread
    without an event loop through ``wait_blocking`` (or its own wait on ``fileno``, then
    ``drain``). With a watch, both descriptors are waited on through one epoll instance, itself a
    readable file descriptor (``waitable``)."""

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
            st = os.stat(path)
            #: the socket file this inbox bound: ``close`` removes it only if the path is still it
            self._file = (st.st_dev, st.st_ino)
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
        self.waitable: socket.socket | select.epoll = self.sock if self._epoll is None else self._epoll
        self._forgotten = False
        #: How tasks sleep on this inbox: made at the first ``wait``.
        self.side: EventLoopSide | None = None
        #: A sleeper was woken by the datagram still in the socket, which an event loop's reader
        #: callback takes in its next round (``_broadcast.wakeup.LoopWaiter._on_datagram``).
        self.owed = False
        #: A datagram other than a wake-up came (a fan-in sender's knock, ``knock``): the owner
        #: looks for new senders and clears it.
        self.knocked = False
        _fork.track(self)

    def fileno(self) -> int:
        return self.waitable.fileno()

    def wait(self, limit_s: float) -> Awaitable[bool]:
        """Sleep in a task until a datagram arrives, the watch fires or ``limit_s`` seconds
        pass. True if a datagram came. Raises ``anyio.ClosedResourceError`` if ``close`` is
        called meanwhile. One task at a time. The event-loop side does it (``EventLoopSide``)."""
        side = self.side
        if side is None:
            if _event_loop_side is None:
                raise BroadcastError("no event-loop side for inboxes: aiobroadcast._broadcast.reader was not imported")
            side = self.side = _event_loop_side(self)
        return side.wait(limit_s)

    def wait_blocking(self, limit_s: float) -> bool:
        """``wait`` for a thread without an event loop: block in ``poll()`` on the same file
        descriptor. Nobody may ``close`` the inbox meanwhile (the blocking roles make sure)."""
        wait_readable((self.fileno(),), limit_s)
        return self.drain()

    def drain(self) -> bool:
        """Read every datagram; True if there was one. Without one, a watch that fired is
        dropped (it stays readable: waiting on it again would return at once, forever)."""
        got = False
        self.owed = False  # whatever was left in the socket is taken now
        while True:
            try:
                data = self.sock.recv(64)
            except (BlockingIOError, InterruptedError):
                break
            got = True
            if data != b"\0":
                self.knocked = True
        watch = self.watch
        if got or self._epoll is None or watch is None:
            return got
        if any(fd == watch for fd, _events in self._epoll.poll(0)):
            self.drop_watch()
        return got

    def drop_watch(self) -> None:
        """Stop watching the watch that fired, and close it: sleeps then go by ``LIVENESS_S``."""
        watch = self.watch
        if watch is None:  # dropped already
            return
        if self._epoll is not None:
            self._epoll.unregister(watch)
        self.watch = None
        os.close(watch)

    def close(self) -> None:
        if self._forgotten:
            return  # the socket file is the parent's
        _fork.untrack(self)
        if self.sock.fileno() >= 0 and self.side is not None:
            # Before the descriptors are closed: an event loop must let go of them, and a task
            # parked in wait() raises ClosedResourceError.
            self.side.closing()
        if self._epoll is not None:
            self._epoll.close()
        if self.watch is not None:
            os.close(self.watch)
            self.watch = None
        self.sock.close()
        # Only our own file: a channel whose id is the same at every run (docs/tcp.md,
        # "Restarts") has the same socket paths, and a reader of a dead run that closes late
        # would otherwise remove the socket a reader of the new run bound at its place since.
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._file:
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _forget_in_child(self) -> None:
        """A fork child's copy: close the descriptors, leave the socket file to the parent, and
        tell no event loop (one inherited from the parent is not this process's to use)."""
        self._forgotten = True
        if self.side is not None:
            self.side.forget()
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
    """Sends wake-ups; never blocks and never fails: a missing or full inbox needs none.

    A wake-up goes through a socket connected to its inbox, made at the first wake-up of that
    inbox and kept: ``sendto`` with a path looks the path up and checks permissions in the
    kernel on every send, which here costs more than the send itself (5-9 us against 2-4 us),
    on the latency path of every paced message. The connection is made again when the inbox's
    ``generation`` changes (a new reader took the place and bound a new socket at the same path)
    or the send fails (the socket it was connected to is closed)."""

    def __init__(self) -> None:
        #: path -> (connected socket, generation of the inbox it was connected for)
        self._links: dict[str, tuple[socket.socket, int]] = {}
        # Connecting happens on the slow path, from any thread (a blocking role's close wakes its
        # own inbox from another thread): one at a time, so no socket is dropped unclosed.
        self._connecting = threading.Lock()
        self._closed = False
        _fork.track(self)

    def wake(self, path: str, generation: int = 0) -> None:
        """Wake the inbox at ``path``. ``generation`` tells apart successive inboxes bound at the
        same path (a reader place's occupants); a change connects again."""
        link = self._links.get(path)
        if link is not None and link[1] == generation:
            try:
                link[0].send(b"\0")
                return
            except (BlockingIOError, InterruptedError):
                return  # full: it is being woken already
            except OSError:
                pass  # its socket is gone (ECONNREFUSED), or ours was closed meanwhile: connect again
        self._reconnect(path, generation)

    def _reconnect(self, path: str, generation: int) -> None:
        with self._connecting:
            if self._closed:
                return
            old = self._links.pop(path, None)
            if old is not None:
                old[0].close()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                sock.setblocking(False)
                sock.connect(path)
            except (ConnectionRefusedError, FileNotFoundError):  # gone: nobody to wake
                sock.close()
                return
            except BaseException:  # anything else (a permission refused) is reported, as sendto did
                sock.close()
                raise
            self._links[path] = (sock, generation)
            # Full: it is being woken already; refused: its socket was closed since.
            with contextlib.suppress(BlockingIOError, InterruptedError, ConnectionRefusedError):
                sock.send(b"\0")

    def forget(self, path: str) -> None:
        """Close the connection to ``path`` (its inbox is gone for good)."""
        with self._connecting:
            link = self._links.pop(path, None)
            if link is not None:
                link[0].close()

    def close(self) -> None:
        _fork.untrack(self)
        with self._connecting:
            self._closed = True
            links, self._links = self._links, {}
        for sock, _generation in links.values():
            sock.close()

    def _forget_in_child(self) -> None:
        # The lock may have been held by another thread of the parent at the fork: not taken here.
        self._closed = True
        links, self._links = self._links, {}
        for sock, _generation in links.values():
            with contextlib.suppress(OSError):
                sock.close()


def knock(path: str) -> bool:
    """Send the inbox at ``path`` a knock: a datagram that is not a wake-up (a fan-in sender
    announcing itself; the inbox sets ``knocked``). False if it could not be sent (no inbox
    there, or its queue is full): a knock is a hint, sent again by a sender still waiting."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        sock.sendto(b"k", path)
    except OSError:
        return False
    finally:
        sock.close()
    return True


def wait_readable(fds: Sequence[int], limit_s: float) -> bool:
    """Block this thread until one of ``fds`` is readable or ``limit_s`` seconds pass (rounded
    up to a millisecond, so a short wait sleeps rather than spins). True if one is readable."""
    waiter = select.poll()
    for fd in fds:
        waiter.register(fd, select.POLLIN)
    return bool(waiter.poll(max(0, math.ceil(limit_s * 1000))))
