"""A remote reader's source: ZeroMQ I/O in a thread, messages handed to the event loop.

The thread (``Pump``, pump.py) keeps the connection alive (heartbeats, acknowledgements, resend
requests) even while the reader's event loop is busy; the loop pops decoded-on-demand messages
from a queue (``Inbox``, inbox.py) bounded by the credit window. In a paced stream an asyncio
loop asleep on that queue takes the frames itself (docs/tcp.md, "The reader's loop reads while
it sleeps"). ``TcpSource`` here is the reader's end of it.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from collections.abc import Callable
from typing import Any

import anyio

from .._base import tuning as _tuning
from .._base.errors import (
    DeserializationError,
    EndOfStream,
    InvalidHandle,
    ReaderLagged,
    TransportError,
    WouldBlock,
    WriterGone,
)
from .._base.handle import Handle
from .._base.stats import ReaderStatistics
from .._base.steps import Sleep, Steps, run, run_blocking
from .._shm.layout import host_name
from .._shm.place import NameTaken
from .inbox import Failed, Inbox
from .protocol import ACK_BYTES
from .pump import Pump
from .receiving import ClientProtocol, Ended, Lagged, Refused


class TcpSource:
    """A remote reader's ``Source``: the reader's thread takes from the inbox, which the I/O
    thread (``Pump``) fills."""

    def __init__(
        self,
        handle: Handle,
        name: str,
        decode: Callable[[Any, bool], Any],
        *,
        window: int = 256,
        gone_timeout: float | None = None,
    ) -> None:
        assert handle.tcp is not None
        # Never fall back to unauthenticated frames because a handle lost its secrets.
        if handle.insecure and not handle.hmac_key:
            raise InvalidHandle("this insecure TCP handle has no hmac_key: frames could not be authenticated")
        if not handle.insecure and not (handle.server_key and handle.client_public_key and handle.client_secret_key):
            raise InvalidHandle("this TCP handle lacks the CurveZMQ keys (server_key, client keys)")
        self._handle = handle
        self._name = name
        self._decode = decode
        self._proto = ClientProtocol(
            key=handle.hmac_key.encode() if handle.insecure and handle.hmac_key else None,
            channel=handle.token,
            name=name,
            pid=os.getpid(),
            host=host_name(),
            window=window,
            now=time.monotonic(),
            gone_timeout=gone_timeout,
        )
        #: Messages decoded ahead (``Source.ahead``): never any here; the pump's queue holds
        #: bodies, each decoded by the get that hands it out.
        self.ahead: collections.deque[Any] = collections.deque()
        self._received = 0
        self._lagged_total = 0
        self._unacked_bytes = 0  # consumed since the pump was last asked to acknowledge
        self._closed = False
        self._inbox = Inbox()
        # the inbox's lock and queue, named here for get_nowait (once per message)
        self._lock, self._items = self._inbox.lock, self._inbox.items
        try:
            self._pump = Pump(handle, self._proto, self._inbox)
        except BaseException:
            self._inbox.close()
            raise
        self._intake = self._pump.intake  # (``consumed``, once per message)

    async def wait_welcome(self, limit_s: float) -> None:
        """Wait for the writer's WELCOME (``welcome_steps``) in a task: in a worker thread, which
        a cancellation abandons (``close`` releases it)."""
        await run(self.welcome_steps(limit_s), self._welcome_in_worker)

    def wait_welcome_blocking(self, limit_s: float) -> None:
        """``wait_welcome`` for a thread without an event loop."""
        run_blocking(self.welcome_steps(limit_s), self._intake.welcome.wait)

    async def _welcome_in_worker(self, limit_s: float) -> bool:
        return await anyio.to_thread.run_sync(self._intake.welcome.wait, limit_s, abandon_on_cancel=True)

    def welcome_steps(self, limit_s: float) -> Steps[None]:
        """The wait for the WELCOME, written once for both drivers (``_steps``): sleeps on it for
        up to ``limit_s``; returns if welcomed, else closes the source and raises
        ``TransportError`` with why (the server's refusal, a refused handshake, the I/O thread's
        failure, or nothing within ``limit_s``). A wait that ends any other way (cancelled,
        interrupted: the driver closes these steps) closes the source too: nobody will use it."""
        try:
            got = yield Sleep(max(limit_s, 0.0))
        except BaseException:
            self.close()
            raise
        if self._intake.name_holder is not None:
            self.close()
            raise NameTaken(self._name, self._intake.name_holder)
        if self._intake.welcome_error is not None or not got:
            reason = self._intake.welcome_error or (
                f"no answer from the writer at {self._handle.tcp} within {limit_s:g} s "
                "(not reachable, not running, or it does not hold the key in the handle)"
            )
            self.close()
            raise TransportError(reason)

    # --- Source ----------------------------------------------------------------------------
    def get_nowait(self) -> Any:
        items = self._items
        with self._lock:
            if not items:
                raise WouldBlock
            item = items[0]
            if isinstance(item, Lagged):
                items.popleft()
        if isinstance(item, tuple):
            # Taken only once decoded, or found undecodable: a BaseException from decoding (Ctrl-C,
            # SystemExit) leaves it first in the queue for the next get. One consumer at a time
            # (Reader), and the I/O thread only appends: the head is still this message after.
            seq, flags, body = item
            try:
                obj = self._decode(body, bool(flags & 1))
            except Exception as exc:  # consumed, like a local reader's undecodable message
                self._consume(seq, len(body))
                raise DeserializationError(seq, exc) from exc
            self._consume(seq, len(body))
            return obj
        if isinstance(item, Lagged):
            self._lagged_total += item.missed
            # The gap counts as taken: the server grants credit for what follows once it is
            # acknowledged, so acknowledge at once.
            self._intake.consumed = max(self._intake.consumed, item.resume_at)
            self._pump.poke()
            raise ReaderLagged(item.missed)
        if isinstance(item, Refused):
            raise TransportError(f"the writer refused this reader: {item.reason}")
        if isinstance(item, Failed):
            raise TransportError(item.reason) from item.cause
        if item.how == "closed":
            raise EndOfStream
        raise WriterGone(self._handle.writer_pid, restarted=item.how == "restarted")

    def _consume(self, seq: int, nbytes: int) -> None:
        with self._lock:
            self._items.popleft()
        self._intake.consumed = consumed = seq + 1
        self._received += 1
        # Half the window consumed: wake the I/O thread to acknowledge it now, or the server,
        # out of credit, sends nothing more until the next heartbeat. (The window is final once
        # welcomed, and nothing is consumed before.) The same after ACK_BYTES: the server
        # holds at most BUFFER_BYTES that are not acknowledged.
        self._unacked_bytes += nbytes
        if self._unacked_bytes >= ACK_BYTES:
            self._unacked_bytes = 0
            self._pump.ack_due = True
            self._pump.poke()
        elif consumed % max(1, self._proto.window // 2) == 0:
            self._unacked_bytes = 0
            self._pump.poke()

    def ready(self) -> bool:
        with self._inbox.lock:
            return bool(self._inbox.items)

    async def sleep(self, limit_s: float) -> bool:
        """A task's wait for the I/O thread's wake-up, for up to ``limit_s`` (the wait of
        ``_reader.sleep_steps``, which announces the sleep and re-checks the queue first). True
        if one came. Raises ``anyio.ClosedResourceError`` once closed."""
        try:
            # In an asyncio task. (Not in trio, even as a guest on a running asyncio loop: its
            # tasks are no asyncio tasks, and cannot await a future.)
            in_asyncio = asyncio.current_task() is not None
        except RuntimeError:  # no asyncio loop runs here
            in_asyncio = False
        if in_asyncio:
            # It announces the sleep again, with its future, under the lock the I/O thread
            # queues under. (A message queued since begin_sleep wakes through the socket
            # instead: its byte only ever ends a later generic or blocking wait early.)
            return await self._inbox.wait(limit_s, self._pump)
        with anyio.move_on_after(limit_s):
            await anyio.wait_readable(self._inbox.fd)
        return self.drain_inbox()

    # The sleep protocol of ShmSource, for a caller outside an event loop (the blocking reader).
    def begin_sleep(self) -> bool:
        """Announce a sleep; True if there is no need (something is queued)."""
        return self._inbox.begin_sleep()

    def end_sleep(self, woken: bool) -> None:
        self._inbox.end_sleep()

    @property
    def sleep_limit_s(self) -> float:
        # A last resort only: the I/O thread wakes the sleeper for what it queues (and again at
        # each of its turns while something is queued), the stream's end and the server's silence.
        return _tuning.REMOTE_SLEEP_S

    @property
    def inbox_fd(self) -> int:
        return self._inbox.fd

    def drain_inbox(self) -> bool:
        return self._inbox.drain()

    def interrupt(self) -> None:
        """Wake the sleeper (from another thread): it looks at the queue again. Nothing once
        closed."""
        if not self._closed:
            self._inbox.wake()

    def wake_instead(self, wake: Callable[[], None]) -> None:
        """Have the I/O thread call ``wake`` wherever it would wake this source's sleeper: a
        fan-in collector reads this source among others, and sleeps on one inbox of its own."""
        self._inbox.wake = wake  # type: ignore[method-assign]

    def statistics(self, tasks_waiting: int) -> ReaderStatistics:
        return ReaderStatistics(
            name=self._name,
            place=-1,
            received=self._received,
            lagged=self._lagged_total,
            lag=len(self._inbox.items),
            tasks_waiting=tasks_waiting,
            writer_pid=self._handle.writer_pid,
            writer_closed=isinstance(self._inbox.terminal, Ended) and self._inbox.terminal.how == "closed",
            rejected_frames=self._proto.rejected_frames,
        )

    @property
    def rejected(self) -> dict[str, int]:
        """Data frames refused, by reason (not_authentic, unknown_key, replayed, out_of_window)."""
        return self._proto.rejected

    def describe(self) -> str:
        return f"tcp {self._handle.tcp} received={self._received}"

    # describe and close as _shm.subscriber's: the close-once guard every source spells out.
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pump.stop()
        self._inbox.close()
        self._intake.welcome.set()  # releases a worker thread left waiting by a cancelled wait_welcome
