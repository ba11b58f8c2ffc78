"""Wake-ups between processes: one Unix datagram socket per sleeper.

A datagram means only "look at the ring again"; the ring is the truth (docs/design.md). The
sockets live beside the segment, so processes that share /dev/shm (a container sharing the
writer's IPC namespace) reach each other even from another network namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import select
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.lowlevel

from .. import _fork
from .._exceptions import BroadcastError, os_error
from .._steps import never_sleep, never_sleep_async, poll_steps, run, run_blocking

_sniffed: Any
try:
    from sniffio import thread_local as _sniffed
except ImportError:  # then trio is not installed either (it needs sniffio): asyncio is the only loop
    _sniffed = None


class Inbox:
    """The socket a sleeper waits on; and, if given, a file descriptor it watches as well (the
    writer's pidfd: readable once the writer's process has exited).

    Under asyncio both are registered with the running event loop once, at the first sleep, and
    stay registered: a sleep is then one future (one timer, armed again only when it fires, ends
    sleeps at their limit). Registering and unregistering per
    sleep (``anyio.wait_readable``) cost two ``epoll_ctl`` calls and a cancel scope per message,
    and the event loop woke on an epoll instance that itself woke on the socket. Elsewhere (trio,
    and callers outside an event loop through ``fileno``) both are waited on through one epoll
    instance, itself a readable file descriptor."""

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
        #: The asyncio event loop our descriptors are registered with (None: none is).
        self._loop: asyncio.AbstractEventLoop | None = None
        #: The future the task asleep in ``wait`` awaits, under asyncio: True for a datagram.
        self._waiter: asyncio.Future[bool] | None = None
        #: The watch fired (under asyncio): it is no longer registered, and is dropped at the end
        #: of the current or next sleep.
        self._watch_fired = False
        #: A sleeper was woken by the datagram still in the socket (see ``_on_datagram``).
        self._owed = False
        #: A datagram other than a wake-up came (a fan-in sender's knock, ``knock``): the owner
        #: looks for new senders and clears it.
        self.knocked = False
        #: The timer that ends sleeps at their limit (under asyncio), and the current limit.
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        _fork.track(self)

    def fileno(self) -> int:
        return self._waitable.fileno()

    async def wait(self, limit_s: float) -> bool:
        """Sleep until a datagram arrives, the watch fires or ``limit_s`` seconds pass. True if
        a datagram came. Raises ``anyio.ClosedResourceError`` if ``close`` is called meanwhile.
        One task at a time."""
        if _sniffed is not None and _sniffed.name is not None:
            # Trio, even as a guest on a running asyncio loop: its tasks cannot await a future.
            return await self._wait_generic(limit_s)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not asyncio
            return await self._wait_generic(limit_s)
        if self.sock.fileno() < 0:
            raise anyio.ClosedResourceError
        if self._waiter is not None:
            raise anyio.BusyResourceError("waiting on")
        if loop is not self._loop and not self._register(loop):
            return await self._wait_generic(limit_s)
        if self._watch_fired:
            self._drop_watch()
            return False
        waiter = self._waiter = loop.create_future()
        # The sleep's time limit. One timer serves every sleep: arming and cancelling one per
        # sleep cost about 3 us per message under uvloop (a timer handle made and closed each
        # time). A timer that fires before the current sleep's limit arms itself again for it.
        self._deadline = loop.time() + limit_s
        timer = self._timer
        if timer is None or timer.when() > self._deadline + 0.002:
            # None armed, or armed for a longer limit than this sleep's (the limit changed: the
            # writer's pidfd fired, or a test shortened it): arm one for this sleep.
            if timer is not None:
                timer.cancel()
            self._timer = loop.call_at(self._deadline, self._on_timer)
        try:
            # Cancellation (anyio cancel scopes cancel the task) raises here. A datagram taken for
            # a sleep that is cancelled is lost, which is harmless: it only meant "look at the
            # ring", and a cancelled get looks at the ring again the next time it is called.
            woken: bool = await waiter
        finally:
            self._waiter = None
        if self.sock.fileno() < 0:  # close() woke us
            raise anyio.ClosedResourceError
        if self._watch_fired:
            self._drop_watch()
        return woken

    async def _wait_generic(self, limit_s: float) -> bool:
        """``wait`` through anyio: register the epoll instance (or the socket) for this sleep only."""
        with anyio.move_on_after(limit_s):
            await anyio.wait_readable(self._waitable)
        if self.sock.fileno() < 0:  # closed while the wait was ending
            raise anyio.ClosedResourceError
        return self.drain()

    def _register(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Register our descriptors with ``loop`` (and take them out of the loop they were
        registered with before, if it is still open). False if ``loop`` cannot watch file
        descriptors (then every sleep takes the generic path)."""
        self._unregister()
        # A datagram left for the previous loop to take (see _on_datagram) may be gone, taken by
        # the generic path: the new loop must not drop the next one in its stead. (If it is still
        # there, it wakes the next sleep early, which then looks at the ring and sleeps again.)
        self._owed = False
        try:
            loop.add_reader(self.sock.fileno(), self._on_datagram)
        except NotImplementedError:
            return False
        self._loop = loop
        if self.watch is not None and not self._watch_fired:
            try:
                loop.add_reader(self.watch, self._on_watch)
            except BaseException:
                self._unregister()
                raise
        return True

    def _unregister(self) -> None:
        """Take our descriptors out of the loop they are registered with, unless it is closed
        (then they are not registered anywhere any more)."""
        loop = self._loop
        if loop is None:
            return
        self._loop = None
        timer, self._timer = self._timer, None
        if loop.is_closed():
            return
        if timer is not None:
            timer.cancel()
        loop.remove_reader(self.sock.fileno())
        if self.watch is not None and not self._watch_fired:
            loop.remove_reader(self.watch)

    def _on_datagram(self) -> None:
        """The socket is readable (called by the event loop). A sleeper is woken at once and its
        datagram left in the socket: taking it is a system call, which the loop's next round
        (after the woken task has run) makes, calling this again. Any other datagram is taken
        and dropped: it came while nobody slept, and only meant "look at the ring again"."""
        waiter = self._waiter
        if not self._owed and waiter is not None and not waiter.done():
            waiter.set_result(True)
            self._owed = True
            return
        self._owed = False
        try:
            data = self.sock.recv(64)
        except OSError:  # BlockingIOError (taken meanwhile), InterruptedError
            return
        if data != b"\0":
            self.knocked = True
            if waiter is not None and not waiter.done():
                waiter.set_result(True)  # a sleeper that came after the datagram must look too

    def _on_timer(self) -> None:
        """The timer fired (called by the event loop): end the current sleep if its limit has
        come (within the loop's millisecond resolution), or wait on for it. Without a sleeper
        the timer is not armed again: the next sleep arms it."""
        self._timer = None
        waiter = self._waiter
        loop = self._loop
        if waiter is None or waiter.done() or loop is None:
            return
        if loop.time() >= self._deadline - 0.002:
            waiter.set_result(False)
        else:
            self._timer = loop.call_at(self._deadline, self._on_timer)

    def _on_watch(self) -> None:
        """The watch fired (the writer's process has exited). It stays readable for good, so
        it is taken out of the loop at once; the sleeper wakes without a datagram and checks the
        writer's lock (a task that sleeps later drops the watch first and does the same)."""
        assert self._loop is not None and self.watch is not None
        self._loop.remove_reader(self.watch)
        self._watch_fired = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(False)

    def _drop_watch(self) -> None:
        """Stop watching the watch that fired, and close it: sleeps then go by ``LIVENESS_S``."""
        watch = self.watch
        assert watch is not None
        if self._epoll is not None:
            self._epoll.unregister(watch)
        self.watch = None
        self._watch_fired = False
        os.close(watch)

    def wait_blocking(self, limit_s: float) -> bool:
        """``wait`` for a thread without an event loop: block in ``poll()`` on the same file
        descriptor. Nobody may ``close`` the inbox meanwhile (the blocking roles make sure)."""
        wait_readable((self.fileno(),), limit_s)
        return self.drain()

    def drain(self) -> bool:
        """Read every datagram; True if there was one. Without one, a watch that fired is
        dropped (it stays readable: waiting on it again would return at once, forever)."""
        got = False
        self._owed = False  # whatever was left in the socket is taken now
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
            self._drop_watch()
        return got

    def close(self) -> None:
        if self._forgotten:
            return  # the socket file is the parent's
        _fork.untrack(self)
        if self.sock.fileno() >= 0:
            # Before the descriptors are closed: a loop that still watched one would watch
            # whatever file reuses its number next.
            self._unregister()
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(False)  # the task parked in wait() raises ClosedResourceError
            try:
                # A task parked in the generic wait (trio) raises ClosedResourceError.
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
        # Our registrations with the parent's event loop are the parent's: the child's copy of
        # that loop shares its epoll instance with the parent, so touching it here would take
        # the parent's descriptors out of the parent's loop. Forget them instead.
        self._loop = None
        self._waiter = None
        self._timer = None
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


async def poll(ready: Callable[[], bool], limit_ns: int) -> bool:
    """Re-check ``ready`` for up to ``limit_ns`` instead of sleeping (``_steps.poll_steps``),
    one event-loop round at a time. True once ``ready()`` is; False when time is up."""
    return await run(poll_steps(ready, limit_ns), never_sleep_async)


def poll_blocking(ready: Callable[[], bool], limit_ns: int) -> bool:
    """``poll`` for a thread without an event loop (the same ``_steps.poll_steps``)."""
    return run_blocking(poll_steps(ready, limit_ns), never_sleep)


def wait_readable(fds: Sequence[int], limit_s: float) -> bool:
    """Block this thread until one of ``fds`` is readable or ``limit_s`` seconds pass (rounded
    up to a millisecond, so a short wait sleeps rather than spins). True if one is readable."""
    waiter = select.poll()
    for fd in fds:
        waiter.register(fd, select.POLLIN)
    return bool(waiter.poll(max(0, math.ceil(limit_s * 1000))))
