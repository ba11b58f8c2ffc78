"""A remote reader's source: ZeroMQ I/O in a thread, messages handed to the event loop.

The thread keeps the connection alive (heartbeats, acknowledgements, resend requests) even
while the reader's event loop is busy; the loop only pops decoded-on-demand messages from a
queue bounded by the credit window.
"""

from __future__ import annotations

import collections
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import zmq
from zmq.utils.monitor import recv_monitor_message

from . import _seal as seal
from . import _wire as wire
from ._exceptions import (
    DeserializationError,
    EndOfStream,
    InvalidHandle,
    ReaderLagged,
    TransportError,
    WouldBlock,
    WriterGone,
)
from ._handle import Handle
from ._ring import host_name
from ._stats import ReaderStatistics

_MSG, _LAG, _END, _GONE, _ERROR = range(5)
#: bytes of data frames the I/O thread opens before it looks at acknowledgements again
DATA_TURN_BYTES = 8 << 20

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


class TcpSource:
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
        self._window = window
        self._key = handle.hmac_key.encode() if handle.insecure and handle.hmac_key else None
        self._lock = threading.Lock()
        self._items: collections.deque[tuple[int, Any, Any]] = collections.deque()
        self._sleeping = False
        self._consumed = 0  # next seq the user has not consumed
        self._received = 0
        self._lagged_total = 0
        self._closed = False
        self._terminal: tuple[int, Any, Any] | None = None
        self._welcome = threading.Event()
        self._welcome_error: str | None = None
        self._hb_interval = 0.5
        self._hb_timeout = 3.0
        self._gone_timeout = gone_timeout
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._ctrl_r, self._ctrl_w = socket.socketpair()
        self._ctrl_r.setblocking(False)
        self._ctrl_w.setblocking(False)
        # Opens the sealed data frames with the keys WELCOME and KEYS deliver (docs/security.md).
        self._opener = seal.Opener(handle.token.encode(), secret=self._key)
        self._credit_base = 0  # the seq the server counts this reader's credit from, at least
        self._keys_asked = 0.0  # when it last asked for the keys again (UnknownKey)
        self._ctx = zmq.Context()
        d = self._dealer = self._ctx.socket(zmq.DEALER)
        # The data connection: plain ZeroMQ, every frame sealed. It has the control connection's
        # routing id, which is how the server knows whose it is; it connects once WELCOME says
        # where.
        dd = self._data = self._ctx.socket(zmq.DEALER)
        self._data_endpoint: str | None = None
        # Watches the handshake until it succeeds (then it is closed): a refused handshake fails
        # open_reader at once instead of after connect_timeout.
        self._monitor: zmq.Socket[bytes] | None = None
        self._closed_handshakes = 0
        try:
            d.linger = 0
            d.sndhwm = 0
            d.rcvhwm = 0
            d.maxmsgsize = wire.DEFAULT_MAX_FRAME
            d.reconnect_ivl = 100
            d.reconnect_ivl_max = 1000
            d.routing_id = os.urandom(16)
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
            self._monitor = d.get_monitor_socket(_HANDSHAKE_EVENTS)
            self._monitor.linger = 0
            d.connect(handle.tcp)
        except BaseException as exc:
            self._close_sockets()
            for s in (self._wake_r, self._wake_w, self._ctrl_r, self._ctrl_w):
                s.close()
            if isinstance(exc, zmq.ZMQError):  # bad keys or an endpoint ZeroMQ cannot use
                raise TransportError(f"cannot connect to the writer at {handle.tcp}: {exc}") from exc
            raise
        self._thread = threading.Thread(target=self._run, name="aiobroadcast-tcp-reader", daemon=True)
        self._stop = False
        self._thread.start()

    async def wait_welcome(self, limit_s: float) -> None:
        try:
            got = await anyio.to_thread.run_sync(self._welcome.wait, limit_s, abandon_on_cancel=True)
        except BaseException:  # cancelled while connecting: nobody will use this source
            self.close()
            raise
        self._check_welcome(got, limit_s)

    def wait_welcome_blocking(self, limit_s: float) -> None:
        """``wait_welcome`` for a thread without an event loop."""
        try:
            got = self._welcome.wait(limit_s)
        except BaseException:  # interrupted while connecting: nobody will use this source
            self.close()
            raise
        self._check_welcome(got, limit_s)

    def _check_welcome(self, got: bool, limit_s: float) -> None:
        if self._welcome_error is not None or not got:
            reason = self._welcome_error or (
                f"no answer from the writer at {self._handle.tcp} within {limit_s:g} s "
                "(not reachable, not running, or it does not hold the key in the handle)"
            )
            self.close()
            raise TransportError(reason)

    # --- Source ----------------------------------------------------------------------------
    def get_nowait(self) -> Any:
        with self._lock:
            if not self._items:
                raise WouldBlock
            kind, a, b = self._items[0]
            if kind == _LAG:
                self._items.popleft()
        if kind == _MSG:
            # Taken only once decoded, or found undecodable: a BaseException from decoding (Ctrl-C,
            # SystemExit) leaves it first in the queue for the next get. One consumer at a time
            # (Reader), and the I/O thread only appends: the head is still this message after.
            seq, flags = a[0], a[1]
            try:
                obj = self._decode(b, bool(flags & 1))
            except Exception as exc:  # consumed, like a local reader's undecodable message
                self._consume(seq)
                raise DeserializationError(seq, exc) from exc
            self._consume(seq)
            return obj
        if kind == _LAG:
            self._lagged_total += a
            self._consumed = max(self._consumed, b)  # the gap counts as taken: credit for what follows
            self._poke()
            raise ReaderLagged(a)
        if kind == _END:
            raise EndOfStream
        if kind == _GONE:
            raise WriterGone(self._handle.writer_pid)
        raise TransportError(str(a))

    def _consume(self, seq: int) -> None:
        with self._lock:
            self._items.popleft()
        self._consumed = seq + 1
        self._received += 1
        if self._consumed % max(1, self._window // 2) == 0:
            self._poke()

    def ready(self) -> bool:
        with self._lock:
            return bool(self._items)

    async def sleep(self) -> None:
        if self.begin_sleep():
            return
        try:
            with anyio.move_on_after(self.sleep_limit_s):
                await anyio.wait_readable(self._wake_r)
            self.drain_inbox()
        finally:
            self.end_sleep(False)

    # The sleep protocol of ShmSource, for a caller outside an event loop (the blocking reader).
    def begin_sleep(self) -> bool:
        """Announce a sleep; True if there is no need (something is queued)."""
        with self._lock:
            if self._items:
                return True
            self._sleeping = True
        return False

    def end_sleep(self, woken: bool) -> None:
        with self._lock:
            self._sleeping = False

    @property
    def sleep_limit_s(self) -> float:
        return self._hb_interval * 2

    @property
    def inbox_fd(self) -> int:
        return self._wake_r.fileno()

    def drain_inbox(self) -> bool:
        got = False
        try:
            while self._wake_r.recv(64):
                got = True
        except BlockingIOError:
            pass
        return got

    def interrupt(self) -> None:
        """Wake the sleeper (from another thread): it looks at the queue again."""
        self._wake_sleeper()

    def statistics(self, tasks_waiting: int) -> ReaderStatistics:
        return ReaderStatistics(
            name=self._name,
            place=-1,
            received=self._received,
            lagged=self._lagged_total,
            lag=len(self._items),
            tasks_waiting=tasks_waiting,
            writer_pid=self._handle.writer_pid,
            writer_closed=self._terminal is not None and self._terminal[0] == _END,
            rejected_frames=sum(self._opener.rejected.values()),
        )

    @property
    def rejected(self) -> dict[str, int]:
        """Data frames refused, by reason (not_authentic, unknown_key, replayed, out_of_window)."""
        return dict(self._opener.rejected)

    def describe(self) -> str:
        return f"tcp {self._handle.tcp} received={self._received}"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop = True
        self._poke()
        self._thread.join()
        for s in (self._wake_r, self._wake_w, self._ctrl_r, self._ctrl_w):
            s.close()
        self._welcome.set()  # releases a worker thread left waiting by a cancelled wait_welcome

    # --- the I/O thread ----------------------------------------------------------------------
    def _poke(self) -> None:
        try:
            self._ctrl_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass

    def _push(self, kind: int, a: Any = None, b: Any = None) -> None:
        with self._lock:
            if kind == _LAG and self._items and self._items[-1][0] == _LAG:
                # Gaps reported one after another while the user did not read: one report, like
                # a local reader's (and the queue stays bounded by the window).
                self._items[-1] = (_LAG, self._items[-1][1] + a, b)
            else:
                self._items.append((kind, a, b))
            if kind in (_END, _GONE, _ERROR):
                self._terminal = (kind, a, b)
            wake = self._sleeping
        if wake:
            self._wake_sleeper()

    def _push_batch(self, first: int, items: list[tuple[memoryview, int]]) -> None:
        """Queue a batch's messages: one lock and at most one wake-up for all of them."""
        with self._lock:
            self._items.extend((_MSG, (first + k, flags), body) for k, (body, flags) in enumerate(items))
            wake = self._sleeping
        if wake:
            self._wake_sleeper()

    def _wake_sleeper(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except BlockingIOError:
            pass  # full: the sleeper is being woken already

    def _send(self, frames: list[bytes]) -> None:
        try:
            self._dealer.send_multipart(wire.sign(self._key, frames), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _hello(self, resume: int | None) -> None:
        hello = {
            "version": wire.PROTOCOL_VERSION,
            "name": self._name[: wire.NAME_CHARS],  # the server refuses longer ones (and shows 64)
            "pid": os.getpid(),
            "host": host_name()[: wire.HOST_CHARS],
            "window": self._window,
            "resume": resume,
            "channel": self._handle.token,
        }
        self._send([wire.HELLO, wire.encode_json(hello)])

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            try:
                self._send([wire.BYE])
            finally:
                self._close_sockets()

    def _close_sockets(self) -> None:
        self._stop_monitor()
        self._dealer.close(linger=0)
        self._data.close(linger=0)
        self._ctx.term()

    def _stop_monitor(self) -> None:
        if self._monitor is None:
            return
        self._dealer.disable_monitor()
        self._monitor.close(linger=0)
        self._monitor = None

    def _on_handshake_event(self) -> bool:
        """Handle the monitor's events; True when the handshake was refused (the error is set)."""
        assert self._monitor is not None
        while self._monitor is not None:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return False
            kind, value = event["event"], event["value"]
            where = f"the writer's server at {self._handle.tcp}"
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._stop_monitor()  # from here on, the happy path costs nothing more
                return False
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                reason = (
                    f"{where} refused this reader's keys at the CurveZMQ handshake (ZAP status {value}): "
                    "the handle's client key pair is not this channel's"
                )
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                reason = (
                    f"{where} refused this reader's keys: the handshake failed with {_protocol_error(value)} "
                    "(the handle's keys are not that server's, or only one side is insecure=True)"
                )
            else:  # EVENT_HANDSHAKE_FAILED_NO_DETAIL: the server closed the connection mid-handshake
                self._closed_handshakes += 1
                if self._closed_handshakes < _CLOSED_HANDSHAKES_REFUSED:
                    continue
                reason = (
                    f"{where} refused this reader's keys: it closed {self._closed_handshakes} handshakes "
                    "in a row (the handle's server_key is not that server's key, or only one side is "
                    "insecure=True)"
                )
            self._welcome_error = reason
            self._welcome.set()
            return True
        return False

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._dealer, zmq.POLLIN)
        poller.register(self._data, zmq.POLLIN)
        poller.register(self._ctrl_r, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        self._next = -1  # next seq expected; -1 before WELCOME
        self._hello(None)
        last_heard = time.monotonic()
        last_ack_sent = -1
        next_ack = time.monotonic() + self._hb_interval
        last_batch = time.monotonic()
        server_end = 0
        while not self._stop:
            poller.poll(int(self._hb_interval * 500))
            try:
                self._ctrl_r.recv(4096)
            except BlockingIOError:
                pass
            if self._monitor is not None:
                monitor = self._monitor
                if self._on_handshake_event():
                    return  # refused: open_reader raises the reason
                if self._monitor is None:
                    poller.unregister(monitor)
            now = time.monotonic()
            for _ in range(256):
                try:
                    msg = self._dealer.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                # Large frames stay ZeroMQ's buffers (the bodies are views of them, copied once
                # when decoded); small ones become bytes.
                frames = [f.buffer if len(f) >= wire.FRAME_ALONE else f.bytes for f in msg]
                try:
                    frames = wire.verify(self._key, frames)
                    got = self._on_frames(frames)
                except (wire.FrameError, ValueError, KeyError, TypeError, IndexError, struct.error):
                    continue  # not authentic or malformed: dropped, the stream goes on
                last_heard = now
                if got is not None:
                    server_end = max(server_end, got[1])
            # Opening costs time in proportion to the bytes (unlike taking frames in did): after
            # DATA_TURN_BYTES the loop goes round, so acknowledgements and NACKs are not held
            # back for seconds behind large bodies (the server would take the reader for silent).
            budget = DATA_TURN_BYTES
            for _ in range(256):
                if budget <= 0:
                    break
                try:
                    msg = self._data.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                budget -= sum(len(f) for f in msg)
                frames = [f.buffer if len(f) >= wire.FRAME_ALONE else f.bytes for f in msg]
                try:
                    if self._on_data(frames):
                        last_batch = now
                    last_heard = now  # authentic: the writer's server is alive
                except seal.SealError as exc:
                    self._on_refused(exc, now)
                except (wire.FrameError, ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
                    self._on_refused(seal.NotAuthentic(f"malformed: {exc}"), now)  # dropped, asked for again
            if self._terminal is not None:
                return  # the writer closed or is gone: everything it sent is queued
            gone_after = self._gone_timeout if self._gone_timeout is not None else 3 * self._hb_timeout
            if self._welcome.is_set() and now - last_heard > gone_after:
                self._push(_GONE)
                return
            if not self._welcome.is_set():
                if now - last_heard > self._hb_interval * 4:
                    self._hello(None)  # maybe lost before the connection was up
                    last_heard = now
                continue
            consumed = self._consumed
            if consumed - last_ack_sent >= max(1, self._window // 2) or now >= next_ack:
                self._send([wire.ACK, wire.U64.pack(consumed)])
                last_ack_sent = consumed
                next_ack = now + self._hb_interval
            # Starved while the server has more and we have room: something was lost in transit.
            if (
                server_end > self._next
                and self._next - consumed < self._window
                and now - last_batch > self._hb_interval * 2
            ):
                self._send([wire.NACK, wire.U64.pack(self._next)])
                last_batch = now

    def _on_refused(self, exc: seal.SealError, now: float) -> None:
        """A data frame that did not open or is not wanted (counted by the opener): nothing of
        it was queued. Ask for what follows what we have; the keys again if we lack its key."""
        self._opener.count(exc)
        if self._next < 0 or isinstance(exc, seal.Replayed):
            return  # a copy of what we have: nothing to ask for
        if isinstance(exc, seal.UnknownKey):
            if now - self._keys_asked >= self._hb_interval:
                self._keys_asked = now
                self._hello(self._next)  # WELCOME brings the keys, and the stream resumes
            return
        self._send([wire.NACK, wire.U64.pack(self._next)])  # the server resends (at most once a heartbeat)

    def _on_data(self, frames: list[Any]) -> bool:
        """A frame of the data connection; True for a batch taken. Raises ``SealError`` (or
        ``FrameError``) with nothing queued unless every body in it opened."""
        kind = frames[0]
        if self._next < 0:
            return False  # before WELCOME: nothing to open it with
        if kind == wire.BATCH:
            first, items = wire.decode_batch(frames[1], frames[2:])
            limit = max(self._consumed, self._credit_base) + self._window
            skip = seal.accept_range(first, len(items), self._next, limit)
            opener = self._opener
            opened = [
                (opener.open(first + k, flags, body), flags) for k, (body, flags) in enumerate(items) if k >= skip
            ]
            self._push_batch(first + skip, opened)
            self._next = first + len(items)
            return True
        if kind == wire.LAGGED:
            from_seq, _missed = wire.U64x2.unpack(self._opener.open_control(kind, frames[1]))
            if from_seq > self._next >= 0:
                self._push(_LAG, from_seq - self._next, from_seq)
                self._next = from_seq
            return False
        if kind == wire.END:
            payload = self._opener.open_control(kind, frames[1])
            (final,) = wire.U64.unpack_from(payload)
            if self._next >= final:
                self._push(_END if payload[wire.U64.size :] == b"closed" else _GONE)
            return False
        raise wire.FrameError(f"unknown data frame kind {kind[:8]!r}")

    def _install_keys(self, message: bytes) -> None:
        try:
            self._opener.install(message)
        except seal.SealError as exc:
            raise wire.FrameError(str(exc)) from None

    def _connect_data(self, port: int) -> None:
        """Connect the data connection to ``port`` of the writer's host (again if a restarted
        server took another port)."""
        assert self._handle.tcp is not None
        endpoint = f"{self._handle.tcp.rsplit(':', 1)[0]}:{port}"
        if endpoint == self._data_endpoint:
            return
        if self._data_endpoint is not None:
            try:
                self._data.disconnect(self._data_endpoint)
            except zmq.ZMQError:
                pass
        self._data.connect(endpoint)
        self._data_endpoint = endpoint

    def _on_frames(self, frames: list[Any]) -> tuple[str, int] | None:
        kind = frames[0]
        if kind == wire.KEYS:
            self._install_keys(frames[1])
            return None
        if kind == wire.HEARTBEAT:
            end, _done = wire.U64x2.unpack(frames[1])
            return ("end", end)
        if kind == wire.WELCOME:
            welcome = wire.decode_json(frames[1])
            start = int(welcome["start"])
            self._hb_interval = float(welcome["hb_interval"])
            self._hb_timeout = float(welcome["hb_timeout"])
            if "window" in welcome:  # a smaller credit than ours: acknowledge at its half, not ours
                self._window = max(1, min(self._window, int(welcome["window"])))
            self._install_keys(bytes.fromhex(str(welcome["keys"])))
            self._connect_data(int(welcome["data_port"]))
            self._credit_base = start
            if self._next < 0:
                self._next = start
                self._consumed = start
            self._welcome.set()
            return None
        if kind == wire.LAGGED:
            from_seq, _missed = wire.U64x2.unpack(frames[1])
            if from_seq > self._next >= 0:
                self._push(_LAG, from_seq - self._next, from_seq)
                self._next = from_seq
            return None
        if kind == wire.END:
            (final,) = wire.U64.unpack(frames[1])
            if self._next >= final:
                self._push(_END if frames[2] == b"closed" else _GONE)
            return None
        if kind == wire.UNKNOWN:
            self._hello(self._next if self._next >= 0 else None)  # the server dropped us: resume
            return None
        if kind == wire.REFUSED:
            reason = frames[1].decode("utf-8", "replace")
            if not self._welcome.is_set():
                self._welcome_error = f"the writer refused this reader: {reason}"
                self._welcome.set()
            else:
                self._push(_ERROR, f"the writer refused this reader: {reason}")
            return None
        raise wire.FrameError(f"unknown frame kind {kind[:8]!r}")


def _protocol_error(code: int) -> str:
    """A ZMTP/ZAP protocol error's name, e.g. ``ZMTP_MECHANISM_MISMATCH``."""
    for name in dir(zmq):
        if name.startswith("PROTOCOL_ERROR_") and getattr(zmq, name) == code:
            return name.removeprefix("PROTOCOL_ERROR_")
    return f"protocol error {code:#x}"
