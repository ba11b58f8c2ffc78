"""A remote reader's queue between its I/O thread and its event loop: the messages and events
the I/O thread (``pump.py``) queues, and the wake-up of a reader asleep on them (a future in an
asyncio loop, else a socket; in a paced stream the sleeping loop polls the data connection
itself, docs/tcp.md, "The reader's loop reads while it sleeps").
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import socket
import threading
from dataclasses import dataclass
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

import anyio

from .._base import tuning as _tuning
from .receiving import Ended, Lagged, Messages, Refused

if TYPE_CHECKING:
    from .pump import Pump


@dataclass(frozen=True, slots=True)
class Failed:
    """The I/O thread failed (a bug, or a resource it needs broke): nothing more can come. The
    reader raises ``TransportError(reason)`` from ``cause``."""

    reason: str
    cause: BaseException


#: what the reader's queue holds: messages ``(seq, flags, body)``, and the events it raises
#: where they fall in the stream (a refusal after the WELCOME is a ``Refused``)
_Item = tuple[int, int, Any] | Lagged | Ended | Refused | Failed


def _wake_waiter(waiter: asyncio.Future[bool], woken: bool) -> None:
    """End a sleep (called by the sleeper's event loop)."""
    if not waiter.done():
        waiter.set_result(woken)


class Inbox:
    """The reader's queue, filled by the I/O thread, and the wake-up of a reader asleep on it.

    Bounded by the credit window: the server sends no more than that beyond what the reader
    acknowledged, and the reader acknowledges only what it took.

    A reader asleep in an asyncio event loop waits on a future, which the I/O thread resolves
    through ``call_soon_threadsafe``: one wake-up of the loop, and the task runs in the same
    round. (Waiting through ``anyio.wait_readable`` on the socket registered and unregistered
    it with the loop, with a cancel scope and a timer, per message: 15-20 us of a paced
    message's path here.) Other sleepers (trio, the blocking reader) wait on the socket."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: collections.deque[_Item] = collections.deque()
        #: how the stream ended (END, silence, refusal, the I/O thread's failure), once queued
        self.terminal: Ended | Refused | Failed | None = None
        self._sleeping = False
        #: the asyncio sleeper's loop and future (set under ``lock`` with ``_sleeping``)
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[bool]] | None = None
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        #: how long the last ``wait`` slept (ns): whether the stream is dense
        self._slept_ns = _tuning.DENSE_NS
        #: the event loop's duplicate of the data connection's descriptor (made by ``Pump``),
        #: and whether a ``wait`` may poll it now (then that wait closes it, if ``close`` came)
        self.loop_fd = -1
        self._fd_in_loop = False

    def push(self, item: Lagged | Ended | Refused | Failed) -> None:
        with self.lock:
            last = self.items[-1] if self.items else None
            if isinstance(item, Lagged) and isinstance(last, Lagged):
                # Gaps reported one after another while the user did not read: one report, like
                # a local reader's (and the queue stays bounded by the window).
                self.items[-1] = Lagged(last.missed + item.missed, item.resume_at)
            else:
                self.items.append(item)
            if not isinstance(item, Lagged):
                self.terminal = item
            wake = self._sleeping
        if wake:
            self.wake()

    def push_batch(self, batch: Messages, wake_at: int) -> None:
        """Queue a batch's messages: one lock and at most one wake-up for all of them. A
        sleeping reader is woken once ``wake_at`` messages are queued (``wake_if_sleeping``
        wakes it for fewer)."""
        first = batch.first
        items = self.items
        with self.lock:
            items.extend((first + k, flags, body) for k, (body, flags) in enumerate(batch.items))
            wake = self._sleeping and len(items) >= wake_at
        if wake:
            self.wake()

    def wake_if_sleeping(self) -> None:
        with self.lock:
            wake = self._sleeping and bool(self.items)
        if wake:
            self.wake()

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            loop, fut = waiter
            try:
                loop.call_soon_threadsafe(_wake_waiter, fut, True)
            except RuntimeError:
                pass  # the loop is closed: nobody sleeps in it
            return
        try:
            self._wake_w.send(b"\0")
        except BlockingIOError:
            pass  # full: the sleeper is being woken already
        except OSError:
            pass  # closed (a wake-up from another thread that lost the race to a close): nobody sleeps

    def begin_sleep(self) -> bool:
        """Announce a sleep; True if there is no need (something is queued)."""
        with self.lock:
            if self.items:
                return True
            self._sleeping = True
        return False

    def end_sleep(self) -> None:
        with self.lock:
            self._sleeping = False

    async def wait(self, limit_s: float, pump: Pump | None = None) -> bool:
        """Sleep on a future in this asyncio loop until the I/O thread queues something (or
        ``close`` or ``wake`` is called), or ``limit_s`` passes; True if woken. If nothing is
        queued it announces the sleep under the lock the I/O thread queues under, so a message
        queued meanwhile is seen here or wakes the future: none is missed. Raises
        ``anyio.ClosedResourceError`` once closed.

        With ``pump``, and after a sleep of ``DENSE_NS`` or more (a paced or idle stream), the
        loop also polls the data connection while it sleeps, and takes what comes itself
        (``Pump.loop_turn``): a paced message then reaches the reader without a wake-up of the
        I/O thread and a second of this loop. In a dense stream the I/O thread takes the frames,
        opening the next while this loop hands out the last."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        with self.lock:
            if self.items:
                self._slept_ns = 0
                return True
            if self._closed:
                raise anyio.ClosedResourceError
            self._sleeping = True
            self._waiter = (loop, fut)
            # The descriptor is this wait's to close from now on, if ``close`` comes meanwhile.
            fd = self.loop_fd if pump is not None and self._slept_ns >= _tuning.DENSE_NS else -1
            self._fd_in_loop = fd >= 0
        polled = pump is not None and pump.sleeps_in_loop(fd >= 0)
        timer = loop.call_later(limit_s, _wake_waiter, fut, False)
        start = perf_counter_ns()
        try:
            if polled:
                assert pump is not None
                loop.add_reader(fd, self._readable, loop, fd, fut, pump)
            return await fut
        finally:
            self._slept_ns = perf_counter_ns() - start
            timer.cancel()
            if polled:
                assert pump is not None
                pump.loop_reads = False
                loop.remove_reader(fd)
            with self.lock:
                self._sleeping = False
                self._waiter = None
                self._fd_in_loop = False
                closed = self._closed
                if closed and fd >= 0:
                    os.close(fd)  # (close left it to this wait)
            if closed:
                raise anyio.ClosedResourceError

    def _readable(self, loop: asyncio.AbstractEventLoop, fd: int, fut: asyncio.Future[bool], pump: Pump) -> None:
        """The data connection's descriptor is readable while a task sleeps in ``wait``."""
        if not pump.loop_turn():
            # The I/O thread holds the connection (its turn may be past the data connection:
            # it is poked for another), or it stopped: stop polling a descriptor this loop
            # would find readable at every turn.
            loop.remove_reader(fd)
            pump.loop_gives_up()
        if self.items and not fut.done():
            fut.set_result(True)

    @property
    def fd(self) -> int:
        return self._wake_r.fileno()

    def drain(self) -> bool:
        got = False
        try:
            while self._wake_r.recv(64):
                got = True
        except BlockingIOError:
            pass
        return got

    def close(self) -> None:
        """Close the wake-up socket. A task of this thread's event loop parked on it (a ``get``
        of the reader being closed) raises ``anyio.ClosedResourceError`` at once: the loop lets go
        of the descriptor before it is closed (else the task sleeps on, and the loop polls a
        closed descriptor, or whatever file reuses its number). A task parked in ``wait`` is
        woken, and raises the same."""
        with self.lock:
            self._closed = True
            waiter = self._waiter
            if self.loop_fd >= 0 and not self._fd_in_loop:
                os.close(self.loop_fd)
            self.loop_fd = -1
        if self._wake_r.fileno() >= 0:
            with contextlib.suppress(RuntimeError):  # no event loop here, so no task can be parked
                anyio.notify_closing(self._wake_r)
        self._wake_r.close()
        self._wake_w.close()
        if waiter is not None:
            loop, fut = waiter
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody sleeps in it
                loop.call_soon_threadsafe(_wake_waiter, fut, False)
