"""A remote reader's source: ZeroMQ I/O in a thread, messages handed to the event loop.

The thread keeps the connection alive (heartbeats, acknowledgements, resend requests) even
while the reader's event loop is busy; the loop pops decoded-on-demand messages from a queue
bounded by the credit window. In a paced stream an asyncio loop asleep on that queue takes the
frames itself (docs/tcp.md, "The reader's loop reads while it sleeps").
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any, cast

import anyio
import zmq
from zmq.utils.monitor import recv_monitor_message

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
from . import wire
from .errors import protocol_error, zmq_errors
from .protocol import ACK_BYTES, IDLE_ACK_HEARTBEATS
from .readers import NAME_TAKEN
from .receiving import ClientProtocol, Ended, Lagged, Messages, Refused, Welcomed
from .sockets import recv_parts

#: bytes of data frames the I/O thread opens before it looks at acknowledgements again
DATA_TURN_BYTES = 8 << 20
#: bytes of data frames the reader's event loop opens in a turn of its own (``_Pump.loop_turn``)
#: before it leaves the rest to the I/O thread, which opens the next while the loop hands this out
LOOP_TURN_BYTES = 64 << 10
#: messages queued before the I/O thread wakes a reader asleep on the queue while more frames
#: are coming (once it has opened all that came, it wakes it whatever the count): each wake-up
#: costs the reader a trip through its event loop, which costs more than a message of 64 KiB
WAKE_ITEMS = 32
#: ZMQ_EVENTS and POLLIN as plain ints (pyzmq's enums cost microseconds per use)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


@dataclass(frozen=True, slots=True)
class _Failed:
    """The I/O thread failed (a bug, or a resource it needs broke): nothing more can come. The
    reader raises ``TransportError(reason)`` from ``cause``."""

    reason: str
    cause: BaseException


#: what the reader's queue holds: messages ``(seq, flags, body)``, and the events it raises
#: where they fall in the stream (a refusal after the WELCOME is a ``Refused``)
_Item = tuple[int, int, Any] | Lagged | Ended | Refused | _Failed

#: What the handshake monitor listens to (nothing else: connects and retries are not its business).
_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
#: Handshakes the server cut short, in a row and before any succeeded, that mean a refusal. A
#: CurveZMQ server that cannot decrypt HELLO (the handle's server_key is not its key) closes the
#: connection without a word: the client only sees it closed, each time it reconnects (0.1 s).
#: One such close could be a server going away; three in a row are the server refusing.
_CLOSED_HANDSHAKES_REFUSED = 3


def _wake_waiter(waiter: asyncio.Future[bool], woken: bool) -> None:
    """End a sleep (called by the sleeper's event loop)."""
    if not waiter.done():
        waiter.set_result(woken)


class _Inbox:
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
        self.terminal: Ended | Refused | _Failed | None = None
        self._sleeping = False
        #: the asyncio sleeper's loop and future (set under ``lock`` with ``_sleeping``)
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[bool]] | None = None
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        #: how long the last ``wait`` slept (ns): whether the stream is dense
        self._slept_ns = _tuning.DENSE_NS
        #: the event loop's duplicate of the data connection's descriptor (made by ``_Pump``),
        #: and whether a ``wait`` may poll it now (then that wait closes it, if ``close`` came)
        self.loop_fd = -1
        self._fd_in_loop = False

    def push(self, item: Lagged | Ended | Refused | _Failed) -> None:
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

    async def wait(self, limit_s: float, pump: _Pump | None = None) -> bool:
        """Sleep on a future in this asyncio loop until the I/O thread queues something (or
        ``close`` or ``wake`` is called), or ``limit_s`` passes; True if woken. If nothing is
        queued it announces the sleep under the lock the I/O thread queues under, so a message
        queued meanwhile is seen here or wakes the future: none is missed. Raises
        ``anyio.ClosedResourceError`` once closed.

        With ``pump``, and after a sleep of ``DENSE_NS`` or more (a paced or idle stream), the
        loop also polls the data connection while it sleeps, and takes what comes itself
        (``_Pump.loop_turn``): a paced message then reaches the reader without a wake-up of the
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

    def _readable(self, loop: asyncio.AbstractEventLoop, fd: int, fut: asyncio.Future[bool], pump: _Pump) -> None:
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


class _HandshakeWatch:
    """Watches the CurveZMQ handshake until it succeeds (then it stops, and the happy path
    costs nothing more): a refused handshake fails open_reader at once, with the reason,
    instead of after connect_timeout."""

    def __init__(self, dealer: zmq.Socket[bytes], where: str) -> None:
        self._dealer = dealer
        self._where = where
        self._closed_handshakes = 0
        self.socket = dealer.get_monitor_socket(_HANDSHAKE_EVENTS)
        self.socket.linger = 0
        self.done = False

    def stop(self) -> None:
        if not self.done:
            self.done = True
            self._dealer.disable_monitor()
            self.socket.close(linger=0)

    def refusal(self) -> str | None:
        """Take the monitor's events; the reason if the server refused the handshake."""
        while not self.done:
            try:
                event = recv_monitor_message(self.socket, zmq.NOBLOCK)
            except zmq.Again:
                return None
            kind, value = event["event"], event["value"]
            where = self._where
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.stop()
                return None
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return (
                    f"{where} refused this reader's keys at the handshake (ZAP status {value}): "
                    "the handle's client key pair (insecure=True: its hmac_key) is not this channel's, "
                    "or not on the writer's allow list (revoked, or not issued by 'aiobroadcast keygen --reader') "
                    f"(insecure=True: or the writer's aiobroadcast is older than protocol {wire.PROTOCOL_VERSION})"
                )
            if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                return (
                    f"{where} refused this reader's keys: the handshake failed with {protocol_error(value)} "
                    "(the handle's keys are not that server's, or only one side is insecure=True)"
                )
            # EVENT_HANDSHAKE_FAILED_NO_DETAIL: the server closed the connection mid-handshake
            self._closed_handshakes += 1
            if self._closed_handshakes >= _CLOSED_HANDSHAKES_REFUSED:
                return (
                    f"{where} refused this reader's keys: it closed {self._closed_handshakes} handshakes "
                    "in a row (the handle's server_key is not that server's key, or only one side is "
                    "insecure=True)"
                )
        return None


class _Connections:
    """A remote reader's two connections to the writer's server, both DEALER sockets of one
    context: the control connection (CurveZMQ, or PLAIN with the HMAC key's password), whose
    handshake ``watch`` follows until it succeeds, and the data connection, made once WELCOME
    says where. Their options, their keys and endpoints, sending without blocking, closing."""

    def __init__(self, handle: Handle) -> None:
        assert handle.tcp is not None
        self._tcp = handle.tcp
        self._ctx = zmq.Context()
        self.dealer = self._ctx.socket(zmq.DEALER)
        # The data connection: ZeroMQ without CurveZMQ, every frame sealed. It has the control
        # connection's routing id, which is how the server knows whose it is; it connects once
        # WELCOME says where, and with which PLAIN password.
        self.data = self._ctx.socket(zmq.DEALER)
        self._data_endpoint: str | None = None
        self._data_token: str | None = None
        self.watch: _HandshakeWatch | None = None
        try:
            # Bad keys, or an endpoint ZeroMQ cannot use, fail here.
            with zmq_errors(TransportError, f"cannot connect to the writer at {handle.tcp}"):
                self._configure(handle)
        except BaseException:
            self.close()
            raise

    def _configure(self, handle: Handle) -> None:
        assert handle.tcp is not None
        d = self.dealer
        d.linger = 0
        d.sndhwm = 0
        d.rcvhwm = 0
        d.maxmsgsize = wire.DEFAULT_MAX_FRAME
        d.reconnect_ivl = 100
        d.reconnect_ivl_max = 1000
        d.routing_id = os.urandom(16)
        dd = self.data
        dd.linger = 0
        dd.sndhwm = 0
        dd.rcvhwm = 0
        dd.maxmsgsize = wire.DEFAULT_MAX_FRAME
        dd.reconnect_ivl = 100
        dd.reconnect_ivl_max = 1000
        dd.routing_id = d.routing_id
        if not handle.insecure:
            assert handle.server_key and handle.client_public_key and handle.client_secret_key
            d.curve_serverkey = handle.server_key.encode()
            d.curve_publickey = handle.client_public_key.encode()
            d.curve_secretkey = handle.client_secret_key.encode()
        else:  # PLAIN, with the password the server derives from the same HMAC key
            assert handle.hmac_key
            d.plain_username = wire.CONTROL_USER
            d.plain_password = wire.control_password(handle.hmac_key.encode())
        self.watch = _HandshakeWatch(d, f"the writer's server at {handle.tcp}")
        d.connect(handle.tcp)

    def send(self, frames: list[Any]) -> None:
        """Send on the control connection; a frame ZeroMQ does not take now is dropped."""
        try:
            self.dealer.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def connect_data(self, port: int, token: str | None) -> None:
        """Connect the data connection to ``port`` of the writer's host, with the PLAIN password
        ``token`` (again if a restarted server took another port or password)."""
        endpoint = f"{self._tcp.rsplit(':', 1)[0]}:{port}"
        if (endpoint, token) == (self._data_endpoint, self._data_token):
            return
        if self._data_endpoint is not None:
            try:
                self.data.disconnect(self._data_endpoint)
            except zmq.ZMQError:
                pass
        # Options apply to the connections made after they are set (reconnections included);
        # without a password, the NULL mechanism (a server that asks for none).
        if token is not None:
            self.data.plain_username = wire.PLAIN_USER
            self.data.plain_password = token.encode()
        self.data.connect(endpoint)
        self._data_endpoint = endpoint
        self._data_token = token

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        self.dealer.close(linger=0)
        self.data.close(linger=0)
        self._ctx.term()


class _Intake:
    """What comes on a remote reader's connections, through the ``ClientProtocol`` into the
    inbox, and what the protocol says back: run with ``lock`` held, by the I/O thread (``_Pump``,
    which holds this object) or by the reader's event loop (``_Pump.loop_turn``)."""

    def __init__(self, proto: ClientProtocol, inbox: _Inbox, conn: _Connections) -> None:
        self._proto = proto
        self._inbox = inbox
        self._conn = conn
        #: the next message the user has not consumed (written by the user's thread only)
        self.consumed = 0
        self.welcome = threading.Event()
        self.welcome_error: str | None = None
        #: who holds this reader's name, if the server refused it for that (``NAME_TAKEN``)
        self.name_holder: str | None = None
        #: Held by whichever thread uses the protocol and the connections' sockets: the I/O
        #: thread on each turn, the reader's event loop in ``_Pump.loop_turn``.
        self.lock = threading.Lock()
        #: a data turn ended before ZMQ_EVENTS said there was no more
        self.data_pending = False
        #: the stream ended (in either thread): the I/O thread stops
        self.ended = False
        #: frames the protocol made in the event loop's turns
        self.out: list[list[Any]] = []

    def flush(self) -> None:
        """Send what the protocol has to say (with the lock held), and what it said in the
        event loop's turns; a frame ZeroMQ does not take now is dropped (the protocol repeats
        whatever matters on a later tick)."""
        out, self.out = self.out, []
        out.extend(self._proto.data_to_send())
        for frames in out:
            self._conn.send(frames)

    def fail(self, exc: BaseException) -> None:
        """The I/O thread (or the loop's turn) failed: end the stream for the reader
        (``TransportError``), after what is queued already, and wake a sleeping ``get``; before
        the WELCOME, ``open_reader`` raises it."""
        reason = f"the remote reader's I/O thread failed: {exc!r}"
        if not self.welcome.is_set():
            self.welcome_error = reason
            self.welcome.set()
        elif self._inbox.terminal is None:  # (a stream that had ended keeps its end)
            self._inbox.push(_Failed(reason, exc))

    def turn(self, control: bool, data: bool) -> bool:
        """The I/O thread's turn with the lock: what came on the control connection (if poll
        found it ready), then on the data connection (``data``: poll found its descriptor readable).
        True when the stream ended."""
        proto = self._proto
        conn = self._conn
        dealer = conn.dealer
        now = time.monotonic()
        # What poll found ready, then ZMQ_EVENTS, say whether a message is there (no
        # exception raised per turn of the loop).
        for _ in range(256 if control else 0):
            if not cast(int, dealer.get(_EVENTS)) & _POLLIN:
                break
            try:
                msg = recv_parts(dealer)
            except zmq.Again:
                break
            # Large frames stay ZeroMQ's buffers (the bodies are views of them, copied once
            # when decoded); small ones become bytes.
            event = proto.receive([f.buffer if len(f) >= wire.FRAME_ALONE else f.bytes for f in msg], now)
            if proto.data_port is not None:
                conn.connect_data(proto.data_port, proto.data_token)
            # The control connection brings a WELCOME or a refusal; batches come on the data one.
            if event is not None and self._on_event(cast("Welcomed | Refused", event)):
                return True
        return self.data_turn(now, WAKE_ITEMS, DATA_TURN_BYTES, data)

    def data_turn(self, now: float, wake_at: int, budget: int, readable: bool) -> bool:
        """Take what came on the data connection (with the lock held), by ZMQ_EVENTS: its
        descriptor, which both threads poll, only says to look. True when the stream ended.
        ``readable``: the descriptor was found readable, so the first receive is tried without
        the question (one call less on the way of a paced message; else ``zmq.Again``, and the
        question).

        Opening costs time in proportion to the bytes (unlike taking frames in did): after
        ``budget`` bytes the turn ends (``data_pending``: the I/O thread comes back at once), so
        acknowledgements and NACKs are not held back for seconds behind large bodies (the server
        would take the reader for silent). A reader asleep on the queue is woken once ``wake_at``
        are queued, or when all that came is opened: not once per batch."""
        proto = self._proto
        data = self._conn.data
        inbox = self._inbox
        self.data_pending = True
        for i in range(256):
            if budget <= 0:
                return False
            if (i or not readable) and not cast(int, data.get(_EVENTS)) & _POLLIN:
                break
            try:
                msg = recv_parts(data)
            except zmq.Again:
                if i or not readable:
                    break
                # (A receive may leave ZeroMQ's commands for later, and the descriptor readable:
                # ZMQ_EVENTS takes them, then says.)
                continue
            frames = []
            for f in msg:
                n = len(f)
                budget -= n
                frames.append(f.buffer if n >= wire.FRAME_ALONE else f.bytes)
            event = proto.receive_data(frames, now, self.consumed)
            if isinstance(event, Messages):
                inbox.push_batch(event, wake_at)
            elif event is not None and self._on_event(event):
                return True
        else:
            return False
        self.data_pending = False
        return False

    def _on_event(self, event: Welcomed | Lagged | Ended | Refused) -> bool:
        """Act on one event of the protocol other than a batch (the data loop queues those
        itself); True when it ends the stream."""
        if isinstance(event, Lagged):
            self._inbox.push(event)
        elif isinstance(event, Welcomed):
            self.consumed = event.start
            self.welcome.set()
        elif isinstance(event, Refused) and not event.welcomed:
            self.welcome_error = f"the writer refused this reader: {event.reason}"
            if event.reason.startswith(NAME_TAKEN):
                self.name_holder = event.reason[len(NAME_TAKEN) :]
            self.welcome.set()
            return True
        else:
            self._inbox.push(event)
            return True
        return False


class _Pump:
    """The I/O thread of a remote reader: moves frames between its connections to the writer's
    server (``_Connections``) and the ``ClientProtocol``, and what the protocol makes of them
    into the inbox. It keeps the connection alive (heartbeats, acknowledgements, resend
    requests) while the reader's event loop is busy. The reader's loop, asleep in a paced
    stream, takes data frames itself (``loop_turn``), under the same lock. What comes in, and
    the state both threads share under that lock, is its ``intake``'s (``_Intake``)."""

    def __init__(self, handle: Handle, proto: ClientProtocol, inbox: _Inbox) -> None:
        self._proto = proto
        self._inbox = inbox
        #: the user consumed ACK_BYTES since the last acknowledgement (set by the user's thread)
        self.ack_due = False
        self._stop = False
        #: The reader's event loop polls the data connection (while a task sleeps there): set and
        #: cleared by that loop. ``watching``: whether this thread polls it (set by this thread).
        self.loop_reads = False
        self.watching = True
        self._loop_polled = False  # the loop's last sleep polled the data connection
        self._wake_at = 0.0  # when this thread's poll ends at the latest (set by it, under the lock)
        self._ctrl_r, self._ctrl_w = socket.socketpair()
        self._ctrl_r.setblocking(False)
        self._ctrl_w.setblocking(False)
        try:
            self._conn = _Connections(handle)
            try:
                #: The data connection's descriptor (ZMQ_FD: readable when ZeroMQ has news for
                #: the socket; ZMQ_EVENTS says which). The inbox's ``loop_fd``, a duplicate, is
                #: the event loop's: the inbox closes it once no loop polls it, whenever the
                #: socket itself closes.
                self._data_fd = cast(int, self._conn.data.get(zmq.FD))
                inbox.loop_fd = os.dup(self._data_fd)
            except BaseException:
                self._conn.close()
                raise
        except BaseException:
            self._ctrl_r.close()
            self._ctrl_w.close()
            raise
        self.intake = _Intake(proto, inbox, self._conn)
        self._thread = threading.Thread(target=self._run, name="aiobroadcast-tcp-reader", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Make the thread look at its timers now (from the user's thread)."""
        try:
            self._ctrl_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass

    def stop(self) -> None:
        self._stop = True
        self.poke()
        self._thread.join()
        self._ctrl_r.close()
        self._ctrl_w.close()

    def _run(self) -> None:
        intake = self.intake
        try:
            try:
                self._loop()
            finally:
                with intake.lock:
                    intake.ended = True  # the event loop's turns take nothing more
                    try:
                        self._conn.send(self._proto.bye())
                    finally:
                        self._conn.close()
        except BaseException as exc:  # nothing more can come: say so, or a get would wait forever
            intake.fail(exc)

    def _loop(self) -> None:
        proto = self._proto
        poller = zmq.Poller()
        conn = self._conn
        dealer = conn.dealer
        data_fd = self._data_fd
        poller.register(dealer, zmq.POLLIN)
        poller.register(data_fd, zmq.POLLIN)
        watching = True  # whether this thread polls the data connection
        poller.register(self._ctrl_r, zmq.POLLIN)
        watch = conn.watch
        if watch is not None:
            poller.register(watch.socket, zmq.POLLIN)
        intake = self.intake
        lock = intake.lock
        with lock:
            intake.flush()  # the HELLO
            wait_s = proto.hb_interval
            self._wake_at = time.monotonic() + wait_s
        ctrl = self._ctrl_r
        ctrl_fd = ctrl.fileno()  # what poll names it by
        inbox = self._inbox
        while not self._stop:
            ready = {s for s, _ in poller.poll(max(0, math.ceil(wait_s * 1000)))}
            if ctrl_fd in ready:
                try:
                    ctrl.recv(4096)
                except BlockingIOError:
                    pass
            if watch is not None:
                refusal = watch.refusal()
                if refusal is not None:
                    intake.welcome_error = refusal
                    intake.welcome.set()
                    return  # open_reader raises the reason
                if watch.done:
                    poller.unregister(watch.socket)
                    watch = None
            with lock:
                if intake.ended or intake.turn(dealer in ready, data_fd in ready):
                    intake.flush()
                    return  # the stream ended or the server refused us: everything it sent is queued
                inbox.wake_if_sleeping()
                ack, self.ack_due = self.ack_due, False
                event = proto.tick(time.monotonic(), intake.consumed, ack)
                intake.flush()
                # The data connection is the event loop's while a task sleeps there
                # (``loop_turn``): this thread leaves it out of its poll then, and takes what
                # came at its other turns. Decided under the lock, which a task going to sleep
                # without polling it takes to see whether this thread does (else it pokes it).
                self.watching = not self.loop_reads
                # Until the protocol's next timer (at most an idle ACK's interval, two
                # heartbeats): an idle reader wakes for its heartbeat and the server's, and
                # nothing else.
                now = time.monotonic()
                due = min(proto.next_tick(intake.consumed), now + IDLE_ACK_HEARTBEATS * proto.hb_interval)
                self._wake_at = now if intake.data_pending else due
                wait_s = self._wake_at - now
            if event is not None:
                inbox.push(event)
                return
            if self.watching != watching:
                watching = self.watching
                if watching:
                    poller.register(data_fd, zmq.POLLIN)
                else:
                    poller.unregister(data_fd)

    def sleeps_in_loop(self, direct: bool) -> bool:
        """A task of the reader's event loop goes to sleep on the inbox, and wants to poll the
        data connection itself (``direct``) or not; whether it may. This thread decides whether
        it polls the connection at the end of each turn, with the lock held (``watching``): so
        under the lock, ``loop_reads`` set here is seen by the next such decision, and a thread
        that decided not to poll it is poked if the loop does not either.

        If a turn holds the lock now, the loop polls nothing itself. That turn decides after
        ``loop_reads`` was cleared (it is poked if it did not), unless it decided while the
        last sleep polled: then it is poked too. (Not at every sleep of a dense stream, where
        this thread is in a turn most of the time.)"""
        polled, self._loop_polled = self._loop_polled, direct
        lock = self.intake.lock
        if not lock.acquire(False):
            if polled or not self.watching:
                self.poke()
            self._loop_polled = False
            return False
        try:
            self.loop_reads = direct
            if not direct and not self.watching:
                self.poke()  # this thread left the data connection to the loop: take it back
        finally:
            lock.release()
        return direct

    def loop_gives_up(self) -> None:
        """The loop stops polling the data connection before its sleep ends (``loop_turn``
        found the lock held): this thread takes it back, at once."""
        self.loop_reads = False
        self.poke()

    def loop_turn(self) -> bool:
        """A turn of the reader's event loop, asleep on the inbox, when the data connection's
        descriptor is readable: it takes what came itself, without the hop through this thread
        (docs/tcp.md, "The reader's loop reads while it sleeps"). False if this thread holds
        the connection now (it takes what came, and wakes the sleeper), or it is closing."""
        intake = self.intake
        if not intake.lock.acquire(False):
            return False
        try:
            if self._stop or intake.ended:
                return False
            proto = self._proto
            try:
                intake.ended = intake.data_turn(time.monotonic(), 1 << 30, LOOP_TURN_BYTES, True)
            except BaseException as exc:  # (as in the thread: the stream ends with the reason)
                intake.ended = True
                intake.fail(exc)
            intake.out.extend(proto.data_to_send())
            # What only this thread can do (send; wake sooner than it planned, for a timer this
            # turn moved; take more; stop).
            sooner = proto.next_tick(intake.consumed) < self._wake_at
            poke = bool(intake.out) or intake.ended or intake.data_pending or sooner
        finally:
            intake.lock.release()
        if poke:
            self.poke()
        return True


class TcpSource:
    """A remote reader's ``Source``: the reader's thread takes from the inbox, which the I/O
    thread (``_Pump``) fills."""

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
        self._inbox = _Inbox()
        # the inbox's lock and queue, named here for get_nowait (once per message)
        self._lock, self._items = self._inbox.lock, self._inbox.items
        try:
            self._pump = _Pump(handle, self._proto, self._inbox)
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
        if isinstance(item, _Failed):
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

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pump.stop()
        self._inbox.close()
        self._intake.welcome.set()  # releases a worker thread left waiting by a cancelled wait_welcome
