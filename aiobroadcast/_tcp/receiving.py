"""A remote reader's side of the TCP protocol, without sockets, threads or clocks (docs/tcp.md;
the protocol as a whole, and what both sides agree on: protocol.py).

``ClientProtocol`` is what one remote reader knows: the next message it expects, what it has
acknowledged, when it last heard the server. It takes the server's frame groups (as they came
off the socket, signature included) and the current time as arguments, and answers with typed
events (``ClientEvent``) and frame groups to send; the pump (``pump.py``) only moves frames
between sockets and it, so every rule here is tested by feeding frames
(tests/test_tcp_protocol.py). It checks and opens the data frames (``receive_data``) and
counts what it refuses.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Literal

from . import seal, wire
from .protocol import ACK_BYTES, IDLE_ACK_HEARTBEATS
from .readers import check_arity

__all__ = [
    "ClientEvent",
    "ClientProtocol",
    "Ended",
    "Lagged",
    "Messages",
    "Refused",
    "Welcomed",
]

#: a reader keeps at most this many bytes of buffers to open large bodies into (``seal.Buffers``)
OPENED_KEEP_BYTES = 8 * ACK_BYTES


# The events below are frozen dataclasses alike in shape (as readers.py's): each is its own
# type, matched by type; a common base would add nothing to match on.
@dataclass(frozen=True, slots=True)
class Welcomed:
    """The server admitted this reader; its first message is ``start``."""

    start: int


@dataclass(frozen=True, slots=True)
class Messages:
    """Messages ``first``, ``first + 1``, ...: ``(body, flags)``, each body opened (bytes, or a
    view of the frame it was opened in place in)."""

    first: int
    items: list[tuple[Any, int]]


@dataclass(frozen=True, slots=True)
class Lagged:
    """``missed`` messages are lost to this reader; the next one it gets is ``resume_at``."""

    missed: int
    resume_at: int


@dataclass(frozen=True, slots=True)
class Ended:
    """The stream ended: the writer ``closed`` it, is ``gone`` (it died; the server said so),
    the server fell ``silent`` for longer than the reader waits, or the writer ``restarted`` (a
    new run of it serves the channel now, its messages numbered anew)."""

    how: Literal["closed", "gone", "silent", "restarted"]


@dataclass(frozen=True, slots=True)
class Refused:
    """The server refused this reader (before or after its WELCOME)."""

    reason: str
    welcomed: bool


ClientEvent = Welcomed | Messages | Lagged | Ended | Refused

#: what a client drops without a word: a frame that is not authentic or not well formed (a
#: forged or broken server cannot end the stream; a real one repeats what matters)
_BAD_FRAME = (wire.FrameError, ValueError, KeyError, TypeError, IndexError, struct.error)


def _from_writer(writer: seal.WriterMac, frames: list[Any]) -> tuple[list[Any], seal.WriterCheck | None]:
    """A data frame group without its MAC frame, once the MAC says the writer's server made it
    for this reader (not another holder of the group key: any reader); checked before anything
    in it is used. A batch of one large body is checked in the pass that opens it: the check is
    returned, for ``Opener.open(mac=)``, which returns nothing unless it checks."""
    if (
        frames[0] == wire.BATCH
        and len(frames) == 4
        and memoryview(frames[2]).nbytes >= seal.FUSED_BYTES
        and len(frames[1]) == wire.BATCH_HEAD.size + wire.ENTRY.size  # one body: the whole frame
    ):
        return frames[:-1], writer.begin(frames)
    return writer.check(frames), None


class _AckTimer:
    """When a remote reader's periodic ACK (its heartbeat) is due: a heartbeat after the last
    one, or ``IDLE_ACK_HEARTBEATS`` after it while it would say nothing new (nothing consumed
    and nothing came since: the same ``consumed`` and ``next``)."""

    def __init__(self, now: float) -> None:
        self.at, self.consumed, self.next = now, -1, -1

    def sent(self, now: float, consumed: int, next_: int) -> None:
        self.at, self.consumed, self.next = now, consumed, next_

    def due(self, consumed: int, next_: int, interval: float) -> float:
        quiet = consumed == self.consumed and next_ == self.next
        return self.at + interval * (IDLE_ACK_HEARTBEATS if quiet else 1)


def _install_keys(opener: seal.Opener, message: Any) -> None:
    """The keys of a keys message (WELCOME's, KEYS'), or ``FrameError``: the frame is dropped."""
    try:
        opener.install(bytes(message))
    except seal.SealError as exc:
        raise wire.FrameError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class Welcome:
    """A WELCOME as a reader takes it: every field checked (``FrameError``, or ``SealError`` for
    a writer's MAC key that is not 32 bytes: the WELCOME is dropped)."""

    start: int
    hb_interval: float
    hb_timeout: float
    #: the credit granted (None: the server did not say)
    window: int | None
    #: the keys message that opens the data frames
    keys: bytes
    data_port: int
    #: the writer's run (None: a server that does not say)
    run: str | None
    #: this reader's writer MAC: proof that a data frame is the server's
    mac: seal.WriterMac
    #: the data connection's PLAIN password (None: no handshake)
    data_token: str | None

    @classmethod
    def parse(cls, welcome: dict[str, Any]) -> Welcome:
        data_port = int(welcome["data_port"])
        if not 0 < data_port < 65536:
            raise wire.FrameError(f"data port {data_port}")
        run = welcome.get("run")
        if run is not None and not (isinstance(run, str) and 0 < len(run) <= wire.MAX_RUN):
            raise wire.FrameError("run")
        token = welcome.get("data_token")
        if token is not None and not (isinstance(token, str) and 0 < len(token) <= wire.MAX_DATA_TOKEN):
            raise wire.FrameError("data token")
        return cls(
            start=int(welcome["start"]),
            hb_interval=float(welcome["hb_interval"]),
            hb_timeout=float(welcome["hb_timeout"]),
            window=int(welcome["window"]) if "window" in welcome else None,
            keys=bytes.fromhex(str(welcome["keys"])),
            data_port=data_port,
            run=run,
            mac=seal.WriterMac(bytes.fromhex(str(welcome["mac_key"]))),
            data_token=token,
        )


class ClientProtocol:
    """A remote reader's side. The pump feeds it the server's frame groups (``receive``: the
    control connection, ``receive_data``: the data one), and the time and how far the user has
    consumed (``tick``, by ``next_tick`` at the latest); frames to send pile up for
    ``data_to_send``, the HELLO first. ``data_port``: the data connection's, from WELCOME."""

    def __init__(
        self,
        *,
        key: bytes | None,
        channel: str,
        name: str,
        pid: int,
        host: str,
        window: int,
        now: float,
        gone_timeout: float | None = None,
    ) -> None:
        self._signer = None if key is None else wire.ReaderSigner(key)  # insecure: ``key`` is the handle's
        self._channel = channel
        # Opens the data frames with the keys WELCOME and KEYS deliver (docs/security.md), large
        # bodies into buffers used again once decoded (given back when the stream pauses).
        self._buffers = seal.Buffers(OPENED_KEEP_BYTES)
        secret = None if key is None else wire.data_secret(key)  # insecure: the data plane's (wire.py)
        self._opener = seal.Opener(channel.encode(), secret=secret, buffer=self._buffers.take)
        self._writer: seal.WriterMac | None = None  # the server's MAC for this reader (WELCOME)
        #: the port of the server's data socket (a restarted server may take another)
        self.data_port: int | None = None
        #: the data connection's PLAIN password, as the last WELCOME said (None: no handshake)
        self.data_token: str | None = None
        self._credit_base = 0  # the number the server counts this reader's credit from, at least
        self._keys_asked: float | None = None  # when it last asked for the keys again (UnknownKey)
        self._name = name[: wire.NAME_CHARS]  # the server refuses longer ones (and shows 64)
        self._pid, self._host = pid, host[: wire.HOST_CHARS]
        #: the credit: what the server may send beyond what this reader acknowledged
        self.window = window
        self._gone_timeout = gone_timeout
        #: the server's timers, until its WELCOME says
        self.hb_interval, self.hb_timeout = 0.5, 3.0
        self.welcomed = False
        #: the next message expected (-1 before WELCOME)
        self.next = -1
        #: the writer's run that welcomed this reader (None before WELCOME, or from a server that
        #: does not say): named in the HELLOs that resume, and compared with later WELCOMEs
        self.run: str | None = None
        #: what the server said it has (its heartbeats)
        self.server_end = 0
        self._out: list[list[Any]] = []
        self._last_heard = self._last_batch = now
        self._ack = _AckTimer(now)
        self._hello(None)

    def data_to_send(self) -> list[list[Any]]:
        """The frame groups to send, signed, oldest first (each is taken once)."""
        out, self._out = self._out, []
        return out

    def bye(self) -> list[Any]:
        """The frame group that says this reader leaves."""
        return [wire.BYE] if self._signer is None else self._signer.sign([wire.BYE])

    def _send(self, frames: list[Any]) -> None:
        self._out.append(frames if self._signer is None else self._signer.sign(frames))

    def _hello(self, resume: int | None) -> None:
        who = {"name": self._name, "pid": self._pid, "host": self._host}
        hello = wire.hello(who, window=self.window, resume=resume, channel=self._channel, run=self.run)
        self._send([wire.HELLO, hello])

    @property
    def rejected(self) -> dict[str, int]:
        """Data frames refused, by reason (not_authentic, unknown_key, replayed, out_of_window)."""
        return dict(self._opener.rejected)

    @property
    def rejected_frames(self) -> int:
        return sum(self._opener.rejected.values())

    def receive(self, frames: list[Any], now: float) -> ClientEvent | None:
        """A frame group from the server (signature still on). One that is not authentic or not
        well formed is dropped: it is not even proof that the server lives."""
        try:
            event = self._on_frames(frames if self._signer is None else self._signer.verify(frames), now)
        except _BAD_FRAME:
            return None
        self._last_heard = now
        return event

    def _on_frames(self, frames: list[Any], now: float) -> ClientEvent | None:
        kind = frames[0]
        if kind == wire.KEYS:
            check_arity(frames, 1)
            _install_keys(self._opener, frames[1])
            return None
        if kind == wire.HEARTBEAT:
            end, _done = wire.U64x2.unpack(frames[1])
            self.server_end = max(self.server_end, end)
            return None
        if kind == wire.WELCOME:
            return self._on_welcome(wire.decode_json(frames[1]))
        if kind == wire.UNKNOWN:
            self._hello(self.next if self.next >= 0 else None)  # the server dropped us: resume
            return None
        if kind == wire.REFUSED:
            return Refused(bytes(frames[1]).decode("utf-8", "replace"), self.welcomed)
        if kind == wire.RESTARTED:
            check_arity(frames, 0)
            if not self.welcomed or self.run is None:
                raise wire.FrameError("RESTARTED before a run was named")
            return Ended("restarted")
        raise wire.FrameError(f"unknown frame kind {bytes(kind[:8])!r}")

    def _on_welcome(self, body: dict[str, Any]) -> ClientEvent | None:
        welcome = Welcome.parse(body)  # checked whole before anything of it is taken
        self.hb_interval, self.hb_timeout = welcome.hb_interval, welcome.hb_timeout
        if welcome.window is not None:  # a smaller credit than ours: acknowledge at its half, not ours
            self.window = max(1, min(self.window, welcome.window))
        if self.welcomed and welcome.run != self.run:
            # Welcomed by another run of the writer (a server that does not know our run, or
            # one that did not check it): this reader's stream ended with its run.
            return Ended("restarted")
        _install_keys(self._opener, welcome.keys)
        self._writer = welcome.mac
        # again: a restarted server's may differ
        self.data_port, self.data_token = welcome.data_port, welcome.data_token
        self._credit_base = welcome.start
        if self.welcomed:
            return None  # a repeated WELCOME (our HELLO went twice): the place stays ours
        self.welcomed = True
        self.run = welcome.run
        self.next = welcome.start
        return Welcomed(welcome.start)

    def receive_data(self, frames: list[Any], now: float, consumed: int) -> ClientEvent | None:
        """A frame group of the data connection; ``consumed`` as for ``tick``. Nothing of it is
        delivered unless all of it opened: a frame that did not open, is a replay, lies outside
        the reader's window or is malformed is counted (``rejected``) and dropped, and what
        follows what the reader has is asked for again."""
        try:
            event = self._on_data(frames, now, consumed)
        except seal.SealError as exc:
            self._refused(exc, now)
            return None
        except _BAD_FRAME as exc:
            self._refused(seal.NotAuthentic(f"malformed: {exc}"), now)
            return None
        self._last_heard = now  # authentic: the writer's server is alive
        return event

    def _on_data(self, frames: list[Any], now: float, consumed: int) -> ClientEvent | None:
        if not frames:
            raise wire.FrameError("empty message")
        kind = frames[0]
        if self.next < 0 or self._writer is None:
            return None  # before WELCOME: nothing to open it with
        frames, mac = _from_writer(self._writer, frames)
        if kind == wire.BATCH:
            first, items = wire.decode_batch(frames[1], frames[2:])
            limit = max(consumed, self._credit_base) + self.window
            skip = seal.accept_range(first, len(items), self.next, limit)
            opener = self._opener
            opened = [
                (opener.open(first + k, flags, body, mac), flags) for k, (body, flags) in enumerate(items) if k >= skip
            ]
            self._last_batch = now
            self.next = first + len(items)
            return Messages(first + skip, opened)
        if kind == wire.LAGGED:
            check_arity(frames, 1)
            from_seq, missed = wire.U64x2.unpack(self._opener.open_control(kind, frames[1]))
            if from_seq > self.next >= 0:
                # another reader's, or ours before a lost batch: a gap past our place skips what is held
                if missed > from_seq or from_seq - missed > self.next:
                    raise seal.OutOfWindow(f"a gap from {from_seq - missed}, message {self.next} is expected")
                lagged = Lagged(from_seq - self.next, from_seq)
                self.next = from_seq
                return lagged
            return None
        if kind == wire.END:
            check_arity(frames, 1)
            payload = self._opener.open_control(kind, frames[1])
            (final,) = wire.U64.unpack_from(payload)
            if self.next >= final:  # not before it has everything the server has
                return Ended("closed" if payload[wire.U64.size :] == b"closed" else "gone")
            return None
        raise wire.FrameError(f"unknown data frame kind {bytes(kind[:8])!r}")

    def _refused(self, exc: seal.SealError, now: float) -> None:
        """A data frame that did not open or is not wanted: nothing of it was delivered. Ask
        for what follows what we have; the keys again if we lack its key."""
        self._opener.count(exc)
        if self.next < 0 or isinstance(exc, seal.Replayed):
            return  # a copy of what we have: nothing to ask for
        if isinstance(exc, seal.UnknownKey):
            if self._keys_asked is None or now - self._keys_asked >= self.hb_interval:
                self._keys_asked = now
                self._hello(self.next)  # WELCOME brings the keys, and the stream resumes
            return
        self._send([wire.NACK, wire.U64.pack(self.next)])  # the server resends (at most once a heartbeat)

    def tick(self, now: float, consumed: int, ack: bool = False) -> Ended | None:
        """Timers. ``consumed``: the next message the user has not taken (everything before it
        is consumed): acknowledged every half window, and every heartbeat (its heartbeat too;
        every ``IDLE_ACK_HEARTBEATS`` if idle). ``ack``: acknowledge it now (the user consumed
        ``ACK_BYTES`` since the last time: the server holds what is not acknowledged)."""
        gone_after = self._gone_timeout if self._gone_timeout is not None else 3 * self.hb_timeout
        if self.welcomed and now - self._last_heard > gone_after:
            return Ended("silent")
        if not self.welcomed:
            if now - self._last_heard > self.hb_interval * 4:
                self._hello(None)  # maybe lost before the connection was up
                self._last_heard = now
            return None
        if (
            consumed - self._ack.consumed >= max(1, self.window // 2)
            or now >= self._ack.due(consumed, self.next, self.hb_interval)
            or (ack and consumed > self._ack.consumed)
        ):
            self._send([wire.ACK, wire.U64.pack(consumed)])
            self._ack.sent(now, consumed, self.next)
        if now - self._last_batch > self.hb_interval:
            self._buffers.clear()  # nothing came for a heartbeat: give the idle buffers back
        # Starved while the server has more and we have room: something was lost in transit.
        if (
            self.server_end > self.next
            and self.next - consumed < self.window
            and now - self._last_batch > self.hb_interval * 2
        ):
            self._send([wire.NACK, wire.U64.pack(self.next)])
            self._last_batch = now
        return None

    def next_tick(self, consumed: int) -> float:
        """When ``tick`` may next act on its own (ACK, HELLO, NACK, silence; ``consumed`` as
        for ``tick``): the pump sleeps until then, a frame, or an ACK the user asks for."""
        if not self.welcomed:
            return self._last_heard + self.hb_interval * 4
        gone_after = self._gone_timeout if self._gone_timeout is not None else 3 * self.hb_timeout
        due = min(self._ack.due(consumed, self.next, self.hb_interval), self._last_heard + gone_after)
        if self.server_end > self.next and self.next - consumed < self.window:
            due = min(due, self._last_batch + self.hb_interval * 2)  # a NACK, if still starved
        return due

    def __repr__(self) -> str:
        state = f"next {self.next}" if self.welcomed else "connecting"
        return f"<ClientProtocol [{self._name!r}, {state}, window {self.window}]>"
