"""A task's sleep on an inbox (``_shm.wake.Inbox``): the event-loop side of the wake-up socket.

``_shm`` knows nothing of event loops: its ``Inbox`` is the socket (and the writer's pidfd it
watches), and ``Inbox.wait`` hands over to the ``LoopWaiter`` made for it here, which the reader
layer gives ``_shm`` (``wake.serve_event_loops``). A thread without an event loop waits on the
inbox's descriptor itself (``Inbox.wait_blocking``, ``_broadcast.reader.sleep_blocking``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio

from .._shm.wake import Inbox

_sniffed: Any
try:
    from sniffio import thread_local as _sniffed
except ImportError:  # then trio is not installed either (it needs sniffio): asyncio is the only loop
    _sniffed = None


class LoopWaiter:
    """How tasks sleep on one inbox.

    Under asyncio the inbox's descriptors (its socket; and, if it has one, the watch: the
    writer's pidfd, readable once the writer's process has exited) are registered with the
    running event loop once, at the first sleep, and stay registered: a sleep is then one future
    (one timer, armed again only when it fires, ends sleeps at their limit). Registering and
    unregistering per sleep (``anyio.wait_readable``) cost two ``epoll_ctl`` calls and a cancel
    scope per message, and the event loop woke on an epoll instance that itself woke on the
    socket. Elsewhere (trio) both are waited on through one epoll instance, itself a readable
    file descriptor (``Inbox.waitable``)."""

    def __init__(self, inbox: Inbox) -> None:
        self.inbox = inbox
        #: The asyncio event loop the inbox's descriptors are registered with (None: none is).
        self._loop: asyncio.AbstractEventLoop | None = None
        #: The future the task asleep in ``wait`` awaits, under asyncio: True for a datagram.
        self._waiter: asyncio.Future[bool] | None = None
        #: The watch fired (under asyncio): it is no longer registered, and is dropped at the end
        #: of the current or next sleep.
        self._watch_fired = False
        #: The timer that ends sleeps at their limit (under asyncio), and the current limit.
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0

    async def wait(self, limit_s: float) -> bool:
        """Sleep until a datagram arrives, the watch fires or ``limit_s`` seconds pass. True if
        a datagram came. Raises ``anyio.ClosedResourceError`` if the inbox is closed meanwhile.
        One task at a time."""
        if _sniffed is not None and _sniffed.name is not None:
            # Trio, even as a guest on a running asyncio loop: its tasks cannot await a future.
            return await self._wait_generic(limit_s)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not asyncio
            return await self._wait_generic(limit_s)
        inbox = self.inbox
        if inbox.sock.fileno() < 0:
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
        if inbox.sock.fileno() < 0:  # close() woke us
            raise anyio.ClosedResourceError
        if self._watch_fired:
            self._drop_watch()
        return woken

    async def _wait_generic(self, limit_s: float) -> bool:
        """``wait`` through anyio: register the epoll instance (or the socket) for this sleep only."""
        inbox = self.inbox
        with anyio.move_on_after(limit_s):
            await anyio.wait_readable(inbox.waitable)
        if inbox.sock.fileno() < 0:  # closed while the wait was ending
            raise anyio.ClosedResourceError
        return inbox.drain()

    def _register(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Register the inbox's descriptors with ``loop`` (and take them out of the loop they
        were registered with before, if it is still open). False if ``loop`` cannot watch file
        descriptors (then every sleep takes the generic path)."""
        self._unregister()
        inbox = self.inbox
        # A datagram left for the previous loop to take (see _on_datagram) may be gone, taken by
        # the generic path: the new loop must not drop the next one in its stead. (If it is still
        # there, it wakes the next sleep early, which then looks at the ring and sleeps again.)
        inbox.owed = False
        try:
            loop.add_reader(inbox.sock.fileno(), self._on_datagram)
        except NotImplementedError:
            return False
        self._loop = loop
        if inbox.watch is not None and not self._watch_fired:
            try:
                loop.add_reader(inbox.watch, self._on_watch)
            except BaseException:
                self._unregister()
                raise
        return True

    def _unregister(self) -> None:
        """Take the inbox's descriptors out of the loop they are registered with, unless it is
        closed (then they are not registered anywhere any more)."""
        loop = self._loop
        if loop is None:
            return
        self._loop = None
        timer, self._timer = self._timer, None
        if loop.is_closed():
            return
        if timer is not None:
            timer.cancel()
        inbox = self.inbox
        loop.remove_reader(inbox.sock.fileno())
        if inbox.watch is not None and not self._watch_fired:
            loop.remove_reader(inbox.watch)

    def _on_datagram(self) -> None:
        """The socket is readable (called by the event loop). A sleeper is woken at once and its
        datagram left in the socket: taking it is a system call, which the loop's next round
        (after the woken task has run) makes, calling this again. Any other datagram is taken
        and dropped: it came while nobody slept, and only meant "look at the ring again"."""
        inbox = self.inbox
        waiter = self._waiter
        if not inbox.owed and waiter is not None and not waiter.done():
            waiter.set_result(True)
            inbox.owed = True
            return
        inbox.owed = False
        try:
            data = inbox.sock.recv(64)
        except OSError:  # BlockingIOError (taken meanwhile), InterruptedError
            return
        if data != b"\0":
            inbox.knocked = True
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
        assert self._loop is not None and self.inbox.watch is not None
        self._loop.remove_reader(self.inbox.watch)
        self._watch_fired = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(False)

    def _drop_watch(self) -> None:
        self._watch_fired = False
        self.inbox.drop_watch()

    def closing(self) -> None:
        """The inbox is about to close its descriptors (called by ``Inbox.close``): a loop that
        still watched one would watch whatever file reuses its number next, so take them out of
        it first; and wake the task parked in ``wait``, which raises ``ClosedResourceError``."""
        self._unregister()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(False)  # the task parked in wait() raises ClosedResourceError
        try:
            # A task parked in the generic wait (trio) raises ClosedResourceError.
            anyio.notify_closing(self.inbox.waitable)
        except RuntimeError:  # no event loop here, so no task can be parked
            pass

    def forget(self) -> None:
        """In a fork child (called by the inbox): our registrations with the parent's event loop
        are the parent's. The child's copy of that loop shares its epoll instance with the
        parent, so touching it here would take the parent's descriptors out of the parent's loop.
        Forget them instead."""
        self._loop = None
        self._waiter = None
        self._timer = None
