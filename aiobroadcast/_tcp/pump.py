"""A remote reader's I/O thread (``Pump``): ZeroMQ I/O in a thread, which keeps the connection
alive (heartbeats, acknowledgements, resend requests) even while the reader's event loop is busy,
and queues what comes into the inbox; what comes in goes through its ``_Intake``, which the
reader's event loop also runs, asleep on the inbox in a paced stream (docs/tcp.md, "The reader's
loop reads while it sleeps").
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from typing import Any, cast

import zmq

from .._base.handle import Handle
from . import wire
from .connections import Connections
from .inbox import Failed, Inbox
from .protocol import IDLE_ACK_HEARTBEATS
from .readers import NAME_TAKEN
from .receiving import ClientProtocol, Ended, Lagged, Messages, Refused, Welcomed
from .sockets import recv_parts

#: bytes of data frames the I/O thread opens before it looks at acknowledgements again
DATA_TURN_BYTES = 8 << 20
#: bytes of data frames the reader's event loop opens in a turn of its own (``Pump.loop_turn``)
#: before it leaves the rest to the I/O thread, which opens the next while the loop hands this out
LOOP_TURN_BYTES = 64 << 10
#: messages queued before the I/O thread wakes a reader asleep on the queue while more frames
#: are coming (once it has opened all that came, it wakes it whatever the count): each wake-up
#: costs the reader a trip through its event loop, which costs more than a message of 64 KiB
WAKE_ITEMS = 32
#: ZMQ_EVENTS and POLLIN as plain ints (pyzmq's enums cost microseconds per use)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


class _Intake:
    """What comes on a remote reader's connections, through the ``ClientProtocol`` into the
    inbox, and what the protocol says back: run with ``lock`` held, by the I/O thread (``Pump``,
    which holds this object) or by the reader's event loop (``Pump.loop_turn``)."""

    def __init__(self, proto: ClientProtocol, inbox: Inbox, conn: Connections) -> None:
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
        #: thread on each turn, the reader's event loop in ``Pump.loop_turn``.
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
            self._inbox.push(Failed(reason, exc))

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


class Pump:
    """The I/O thread of a remote reader: moves frames between its connections to the writer's
    server (``Connections``) and the ``ClientProtocol``, and what the protocol makes of them
    into the inbox. It keeps the connection alive (heartbeats, acknowledgements, resend
    requests) while the reader's event loop is busy. The reader's loop, asleep in a paced
    stream, takes data frames itself (``loop_turn``), under the same lock. What comes in, and
    the state both threads share under that lock, is its ``intake``'s (``_Intake``)."""

    def __init__(self, handle: Handle, proto: ClientProtocol, inbox: Inbox) -> None:
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
            self._conn = Connections(handle)
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
