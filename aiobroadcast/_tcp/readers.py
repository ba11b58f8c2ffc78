"""The remote readers a TCP server knows, and its control connection with each, without sockets,
threads or clocks (docs/tcp.md): part of the server's sans-IO protocol (``serving.py``).

``Readers`` admits a reader (HELLO: version, channel, room, where it resumes), takes its ACK,
NACK and BYE, drops it when it falls silent or sends a bad frame, and says WELCOME, REFUSED,
UNKNOWN, KEYS and HEARTBEAT: each reader's place, credit and deadlines are here. What each is
sent of the stream (the batches, gaps and END of the data connection) is ``ServerProtocol``'s,
which holds the stream and reads each reader's place and credit from here. Control frames
pile up for ``data_to_send``, which the pump empties; the events and types of the server's
side are defined here too (``serving.py`` exports them).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .._shm.layout import NAME_BYTES, name_key
from . import wire

if TYPE_CHECKING:
    from .seal import WriterMac

#: a frame group for one reader: its ident, and the frames (signed, or sealed)
Outgoing = tuple[bytes, list[Any]]
#: the bytes of sealed bodies a server holds for its readers, at most (``ServerConfig.
#: buffer_bytes``; beyond one body): large messages are bounded by bytes, not only by count
BUFFER_BYTES = 64 << 20


#: A REFUSED reason that starts so refuses the reader's name; who holds it follows
#: (docs/design.md, "Reader names"): the reader's ``open_reader`` raises ``InvalidArgument``.
NAME_TAKEN = "reader name taken: "


class NameClaims(Protocol):
    """Where a remote reader's name is claimed among the channel's readers, remote and local
    (the server's ``RemoteNames``): ``claim`` returns None once the name is the reader's, else
    who holds it; ``release`` gives it back."""

    def claim(self, ident: bytes, info: ClientInfo) -> str | None: ...

    def release(self, ident: bytes) -> None: ...


# The events below are frozen dataclasses alike in shape (as receiving.py's): each is its own
# type, matched by type; a common base would add nothing to match on.
@dataclass(frozen=True, slots=True)
class ClientInfo:
    """Who a remote reader says it is (in its HELLO)."""

    name: str
    pid: int
    host: str


@dataclass(frozen=True, slots=True)
class Admitted:
    """A reader was welcomed: a new one, or one that comes back after it was dropped."""

    ident: bytes
    client: ClientInfo


@dataclass(frozen=True, slots=True)
class Departed:
    """A reader said BYE: it has what it wanted, or is closing."""

    ident: bytes
    client: ClientInfo


@dataclass(frozen=True, slots=True)
class Rejected:
    """A frame group the server refused. ``dropped``: the reader it came from, which was dropped
    and told why (REFUSED); None if the sender was not a reader, or if the frames were not
    authentic (nothing then says which reader they claim to be, so nobody is dropped for them)."""

    ident: bytes
    reason: str
    dropped: ClientInfo | None
    #: frames refused so far, this one included
    total: int


@dataclass(frozen=True, slots=True)
class TimedOut:
    """A reader was silent longer than the heartbeat timeout: dropped (it may come back)."""

    ident: bytes
    client: ClientInfo
    silent_s: float
    acked: int
    end: int


ServerEvent = Admitted | Departed | Rejected | TimedOut


#: what REFUSED says to a reader whose credentials were revoked (docs/security.md, "Revoking a
#: reader"): it is dropped, and the server refuses it from then on
REVOKED = b"revoked: this reader's key was removed from the writer's allow list"


class ReaderFault(Exception):
    """The server protocol failed on a frame one reader sent (``receive``), or on what it owes
    that reader (``transmit``): a bug, which must cost that reader only. Raised to the pump,
    which drops the reader (``reject``, ``drop``), logs why, and serves the others; the
    protocol itself logs nothing and swallows nothing. ``__cause__``: what went wrong."""

    def __init__(self, ident: bytes, reason: str) -> None:
        super().__init__(reason)
        self.ident = ident
        self.reason = reason


@dataclass(slots=True)
class Client:
    """What the server knows of one admitted reader: who it is, its place and its credit."""

    ident: bytes
    info: ClientInfo
    #: the credit granted: messages sent beyond ``acked`` never exceed it
    window: int
    next_send: int
    acked: int
    last_heard: float
    #: when it last had the server send again (HELLO, NACK): at most once a heartbeat
    resent_at: float
    #: signs every data frame group sent to it, under its own key (its WELCOME gives it): the
    #: group key, which every reader holds, does not prove the writer's server sealed a frame
    mac: WriterMac
    #: END was sent; a NACK that rewinds it clears this, so END goes again after the resend
    ended: bool = False
    #: the transport refused the last send (its queue is full, or it is not connected)
    choked: bool = False
    #: its signed control connection's session (insecure mode; None under CurveZMQ)
    session: wire.Session | None = None

    def ack(self, n: int) -> None:
        """It consumed everything before ``n``. More than it was sent it cannot have: a larger
        number (a bug, or a hostile reader trying to release the writer's backpressure under
        "block") counts only up to what was sent."""
        if n > self.acked:
            self.acked = min(n, self.next_send)

    def nack(self, n: int, now: float, hb_interval: float, horizon: int) -> None:
        """It asks for everything from ``n`` again. Rewound to ``n`` within what it may ask for:
        not before what it acknowledged (it has that; going back further would let it make the
        server send its whole buffer again and again), not beyond its credit nor the stream's end
        (the place would then run ahead of what exists). At most once a heartbeat: what it asked
        for a moment ago is on its way, and it asks again if not."""
        if now - self.resent_at < hb_interval:
            return
        self.resent_at = now
        self.next_send = max(self.acked, min(n, self.acked + self.window, horizon))
        self.ended = False


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """What a server grants and how long it waits (``open_writer``'s TCP options)."""

    #: "block" or "lag", as the ring's
    policy: str
    #: the handle's key (insecure mode: control frames are signed with a key derived from it);
    #: None under CurveZMQ
    key: bytes | None
    #: the most credit a reader gets (it asks for its own, maybe smaller)
    window: int
    #: messages held for readers: under "block" the server takes no more from the ring, under
    #: "lag" it keeps the newest
    buffer_max: int
    hb_interval: float
    hb_timeout: float
    max_remote: int
    #: the channel id (the handle's token): a HELLO that names another channel is refused
    channel: str | None = None
    #: the writer's run (``ServerSettings.run``), for WELCOME: a returning reader that names
    #: another run is told its stream ended (``RESTARTED``)
    run: str | None = None
    #: the port of the data socket, for WELCOME
    data_port: int = 0
    #: the password of the data socket's PLAIN handshake (hex), for WELCOME: a peer without it
    #: is refused before it costs the server more than the handshake (docs/security.md)
    data_token: str | None = None
    #: bytes of sealed bodies held, at most (as ``buffer_max``, by size: a server holding a
    #: window of 4 MiB messages would hold a gigabyte)
    buffer_bytes: int = BUFFER_BYTES
    #: a fan-in remote sender's server (docs/fan-in.md, "Remote senders"): its one reader is the
    #: collector. Until it comes, everything taken from the ring is kept (under "block", up to
    #: ``buffer_max``: then the ring holds the sender back), and it starts at the stream's first
    #: message; once it has left (BYE, silence, a refused frame) and none comes back, the
    #: protocol is ``abandoned``: the pump leaves the ring (the sender's ``put`` raises
    #: ``CollectorGone``) and refuses readers from then on.
    sole_reader: bool = False


class Readers:
    """The readers a server admitted, by their ZeroMQ routing id, and what it says to them on
    the control connection. ``ServerProtocol`` feeds it what readers send (``receive``, with the
    stream's horizon) and the heartbeat's time (``time_out``); the pump empties
    ``data_to_send``."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        now: float,
        returning: int,
        keys: Callable[[int], bytes],
        writer_mac: Callable[[], WriterMac],
    ) -> None:
        """``returning``: the server replaces one that died, which served that many readers
        (``awaiting_return``). ``keys``: the sealer's keys message for a reader that starts at a
        given message, for WELCOME. ``writer_mac``:
        a new reader's MAC, under a fresh key (``Sealer.writer_mac``)."""
        self._cfg = config
        self.attendance = Attendance(config.sole_reader, returning, now + 2 * config.hb_timeout)
        self._keys = keys
        #: insecure mode: signs and checks the readers' control frames in their sessions
        self._signer = None if config.key is None else wire.ServerSigner(config.key)
        #: the frame group being taken, and from whom: what an answer outside a session answers
        self._asking: tuple[bytes, wire.Signed] | None = None
        self._writer_mac = writer_mac
        #: the readers admitted
        self.clients: dict[bytes, Client] = {}
        self._out: list[Outgoing] = []
        self.dropped = 0
        self.rejected_frames = 0
        #: where a remote reader's name is claimed, unique among the channel's readers (the
        #: server sets it, ``RemoteNames``); None: names are not checked (the protocol alone)
        self.names: NameClaims | None = None

    def send(self, ident: bytes, frames: list[Any], session: wire.Session | None = None) -> None:
        """Queue a control frame group for ``ident``. Insecure mode: signed in ``session``, or that
        of the reader ``ident``, or as the answer to the frame group being taken from it."""
        if self._signer is not None:
            client = self.clients.get(ident)
            asked = self._asking[1] if self._asking is not None and self._asking[0] == ident else None
            signed = self._signer.sign(frames, session or (client.session if client else None), asked)
            if signed is None:
                return  # nobody authentic asked: nobody would believe it
            frames = signed
        self._out.append((ident, frames))

    def data_to_send(self) -> list[Outgoing]:
        """The control frame groups to send, signed, oldest first (each is taken once)."""
        out, self._out = self._out, []
        return out

    def receive(self, ident: bytes, frames: list[bytes], *, now: float, horizon: int) -> ServerEvent | None:
        """A frame group from ``ident`` (its signature still on). ``horizon``: the number of the
        next message the stream has (the writer published, or the server took). Every field is
        checked before it is acted on; a bad frame costs only its sender (insecure mode: once its
        signature and session are checked; before, it drops nobody and is answered nothing)."""
        signer = self._signer
        if any(len(f) > wire.MAX_CONTROL_FRAME for f in frames):
            # ZeroMQ cuts these off (maxmsgsize) before they reach us; a pump without that limit
            # must not get further.
            return (self.reject if signer is None else self._not_authentic)(
                ident, "a frame larger than a control frame"
            )
        session: wire.Session | None = None
        if signer is not None:
            client = self.clients.get(ident)
            try:
                signed, session = signer.take(frames, client.session if client is not None else None)
            except wire.FrameError as exc:
                self._out += [(ident, refusal) for refusal in signer.refuse_legacy(frames)]
                return self._not_authentic(ident, str(exc))
            if session is None:  # of no session the server holds for it: "who are you?" (not to BYE)
                if signed.frames[:1] != [wire.BYE]:
                    self._out.append((ident, signer.answer([wire.UNKNOWN], signed)))
                return None
            frames, self._asking = signed.frames, (ident, signed)
        try:
            if len(frames) > wire.MAX_CONTROL_FRAMES - (signer is not None):  # the signature included
                return self.reject(ident, f"{len(frames) + (signer is not None)} frames in one message")
            return self._on_frames(ident, frames, now, horizon, session)
        except (wire.FrameError, struct.error) as exc:
            return self.reject(ident, str(exc))
        except Exception as exc:  # a bug: the pump drops this reader (``reject``), not the others
            raise ReaderFault(ident, f"internal error {type(exc).__name__}") from exc
        finally:
            self._asking = None

    def _not_authentic(self, ident: bytes, reason: str) -> Rejected:
        """A frame group that is not authentic, or not fresh: counted, answered with nothing."""
        self.rejected_frames += 1
        return Rejected(ident, reason, None, self.rejected_frames)

    def reject(self, ident: bytes, reason: str) -> Rejected:
        """Refuse a frame from ``ident``: count it, drop that reader (only it), tell it why. The
        pump calls it for a ``ReaderFault`` that ``receive`` raised."""
        self.rejected_frames += 1
        client = self.clients.pop(ident, None)
        session = client.session if client is not None else None
        self.send(ident, [wire.REFUSED, f"malformed frame: {reason}".encode()[:256]], session)
        if client is not None:
            self._release(ident)
            self.reader_left(None)
        return Rejected(ident, reason, client.info if client else None, self.rejected_frames)

    def drop(self, ident: bytes, why: bytes | None = None) -> ClientInfo | None:
        """Forget reader ``ident``: without a word (``why`` None: the pump's answer to a
        ``ReaderFault`` that ``transmit`` raised, what that reader is owed cannot be worked out),
        or telling it ``why`` (REFUSED; ``REVOKED``: its credentials were revoked, and it is told
        even if it was not admitted). Who it was, or None."""
        client = self.clients.pop(ident, None)
        if why is not None:
            self.send(ident, [wire.REFUSED, why], client.session if client is not None else None)
        if client is None:
            return None
        self._release(ident)
        self.reader_left(None)
        return client.info

    def _on_frames(
        self, ident: bytes, frames: list[bytes], now: float, horizon: int, session: wire.Session | None
    ) -> ServerEvent | None:
        if not frames:
            raise wire.FrameError("empty message")
        kind = frames[0]
        client = self.clients.get(ident)
        if kind == wire.HELLO:
            check_arity(frames, 1)
            return self._hello(ident, client, wire.decode_hello(frames[1]), now, horizon, session)
        if kind == wire.ACK or kind == wire.NACK:
            check_arity(frames, 1)
            if len(frames[1]) != wire.U64.size:
                raise wire.FrameError(f"{kind!r} needs a u64, got {len(frames[1])} bytes")
            (n,) = wire.U64.unpack(frames[1])
        elif kind == wire.BYE:
            check_arity(frames, 0)
        else:
            raise wire.FrameError(f"unknown frame kind {kind[:8]!r}")
        if client is None:
            if kind != wire.BYE:
                self.send(ident, [wire.UNKNOWN])  # "who are you?": it says HELLO again
            return None
        client.last_heard = now
        if kind == wire.ACK:
            client.ack(n)
        elif kind == wire.NACK:
            client.nack(n, now, self._cfg.hb_interval, horizon)
        else:
            del self.clients[ident]
            self._release(ident)
            self.reader_left(None)
            return Departed(ident, client.info)
        return None

    def _hello(
        self,
        ident: bytes,
        client: Client | None,
        hello: wire.Hello,
        now: float,
        horizon: int,
        session: wire.Session | None,
    ) -> ServerEvent | None:
        """``session``: the signed session the HELLO came in (insecure mode): the reader's own
        (a repeated HELLO), or a new one, which an admission makes the reader's."""
        refusal = not_served(self._cfg, hello)
        if refusal is not None:
            self.send(ident, refusal)
            return None
        if client is not None and now - client.resent_at < self._cfg.hb_interval:
            return None  # it said HELLO a moment ago; it says it again if the WELCOME is lost
        if self.attendance.abandoned:
            self.send(ident, [wire.REFUSED, b"this sender's collector left: it serves no reader any more"])
            return None
        if client is None and len(self.clients) >= self._cfg.max_remote:
            self.send(ident, [wire.REFUSED, f"all {self._cfg.max_remote} remote reader places are taken".encode()])
            return None
        if hello.resume is not None and hello.resume > horizon:
            raise wire.FrameError(f"resume at {hello.resume}, beyond the stream's next message {horizon}")
        info = ClientInfo(hello.name[:NAME_BYTES], hello.pid, hello.host)
        holder = self._claim_name(ident, client, info)
        if holder is not None:
            self.send(ident, [wire.REFUSED, f"{NAME_TAKEN}{holder}".encode()[:512]])
            return None
        if hello.resume is not None:
            self.attendance.returned()
        # A new reader starts with the next message published, as on shared memory: not with
        # what the server still holds, nor with what is in the ring and not yet taken (a slow
        # reader, policy "block"). A returning one resumes where it says; if that is before
        # what the server holds, transmit tells it exactly what it lost.
        start = horizon if hello.resume is None else hello.resume
        if self._cfg.sole_reader and not self.attendance.had_reader and hello.resume is None:
            # A fan-in sender's collector: everything from the stream's first message is its
            # own. What a server that died took and did not hand over is reported as lost.
            start = 0
        self.attendance.had_reader = True
        window = min(hello.window, self._cfg.window)
        # A reader that says HELLO again keeps its MAC (its key and counter: frames on their way
        # still check, and no nonce repeats); a new one, or one dropped since, gets a fresh key.
        mac = client.mac if client is not None else self._writer_mac()
        self.clients[ident] = Client(ident, info, window, start, start, now, now, mac, session=session)
        self.send(ident, [wire.WELCOME, wire.encode_json(welcome(self._cfg, start, window, self._keys(start), mac))])
        return Admitted(ident, info)

    def _claim_name(self, ident: bytes, client: Client | None, info: ClientInfo) -> str | None:
        """Make ``info.name`` this reader's (docs/design.md, "Reader names") where ``names`` is
        set: None once it is, else who holds it. A reader that says HELLO again under its name
        keeps it; under another one, it is a new reader."""
        if client is not None:
            if name_key(client.info.name) == name_key(info.name):
                return None
            del self.clients[ident]
            self._release(ident)
        return None if self.names is None else self.names.claim(ident, info)

    def _release(self, ident: bytes) -> None:
        """Reader ``ident`` is forgotten: its name is free."""
        if self.names is not None:
            self.names.release(ident)

    # --- time -----------------------------------------------------------------------------------
    def time_out(self, now: float, end: int, beat: list[Any]) -> list[TimedOut]:
        """Drop the readers silent for longer than the timeout; send the others ``beat`` (the
        stream's ``end``, lost if a reader's queue is full: the next one goes a heartbeat later)."""
        out: list[TimedOut] = []
        for ident, client in list(self.clients.items()):
            if now - client.last_heard > self._cfg.hb_timeout:
                del self.clients[ident]
                self._release(ident)
                self.dropped += 1
                out.append(TimedOut(ident, client.info, now - client.last_heard, client.acked, end))
            else:
                self.send(ident, beat)
        self.reader_left(now)
        return out

    def silent_at(self) -> float:
        """A moment (a millisecond) after the first of the readers has been silent for longer
        than the timeout, if nothing more comes from it: ``time_out`` drops it then; infinity
        without readers."""
        heard = min((c.last_heard for c in self.clients.values()), default=math.inf)
        return heard + self._cfg.hb_timeout + 0.001

    def reader_left(self, now: float | None) -> None:
        """A reader left (``now``: at a heartbeat; None: just now): see ``Attendance.left``."""
        self.attendance.left(now, bool(self.clients))


class Attendance:
    """Whether a server waits for readers: those of the server it replaces may come back, for at
    most two silence timeouts (under "block" it keeps what it takes from the ring for them);
    ``sole_reader`` (a fan-in sender's server): once the reader that came has left and none is
    expected back, the stream is abandoned."""

    def __init__(self, sole_reader: bool, returning: int, grace_until: float) -> None:
        self._sole_reader = sole_reader
        self._returning = returning
        self._grace_until = grace_until
        #: ``sole_reader``: a reader was admitted (or the server this one replaces served one)
        self.had_reader = returning > 0
        #: ``sole_reader``: its reader left for good; nothing is taken from the ring any more
        self.abandoned = False

    def returned(self) -> None:
        """A reader resumed: one of the server this one replaces, if any is still expected."""
        if self._returning:
            self._returning -= 1

    def awaiting_return(self, now: float) -> bool:
        """Whether readers of the server this one replaces may still come back."""
        if self._returning and now >= self._grace_until:
            self._returning = 0
        return self._returning > 0

    def left(self, now: float | None, readers_left: bool) -> None:
        """``sole_reader``: its reader left; the stream is abandoned unless one is still admitted
        (``readers_left``) or expected back (a restarted server waits for its readers' return)."""
        if not self._sole_reader or self.abandoned or readers_left or not self.had_reader:
            return
        if self._returning and (now is None or self.awaiting_return(now)):
            return
        self.abandoned = True


def not_served(cfg: ServerConfig, hello: wire.Hello) -> list[bytes] | None:
    """What a server answers a HELLO it serves no stream for (None: it may be admitted): of
    another protocol version, another channel, or another run of this channel's writer."""
    if hello.version != wire.PROTOCOL_VERSION:
        return [wire.REFUSED, wire.version_mismatch(hello.version)]
    if hello.channel is not None and cfg.channel is not None and hello.channel != cfg.channel:
        # Same endpoint and keys (fixed CurveKeys), but the handle of another channel (another
        # channel name, or a writer that drew its channel id at random): its frames would
        # never open here (the channel id is in every seal).
        return [
            wire.REFUSED,
            b"this handle is of another channel than the one served at this endpoint "
            b"(another channel name, or an earlier writer here without a channel name or fixed keys)",
        ]
    if hello.run is not None and cfg.run is not None and hello.run != cfg.run:
        # The same channel (a writer restarted with the same keys and endpoint), but another
        # run: the stream this reader was reading ended with the run, and this one's messages
        # are numbered anew. It is told so (WriterGone), and may open the handle again.
        return [wire.RESTARTED]
    return None


def welcome(cfg: ServerConfig, start: int, window: int, keys: bytes, mac: WriterMac) -> dict[str, Any]:
    """The WELCOME of a reader admitted at ``start`` with credit ``window``."""
    body: dict[str, Any] = {
        "start": start,
        "policy": cfg.policy,
        "hb_interval": cfg.hb_interval,
        "hb_timeout": cfg.hb_timeout,
        "window": window,  # the credit granted: the reader acknowledges every half of it
        # Where the sealed data frames come from, and the keys to open them (secret: this goes
        # over CurveZMQ only; insecure, it holds salts, not keys).
        "data_port": cfg.data_port,
        "keys": keys.hex(),
        # The key of this reader's writer MAC: proof, to it alone, that a data frame is the
        # server's (the group key proves only that a reader or the server sealed it).
        "mac_key": mac.key.hex(),
    }
    if cfg.data_token is not None:
        body["data_token"] = cfg.data_token
    if cfg.run is not None:
        body["run"] = cfg.run
    return body


def check_arity(frames: Sequence[Any], args: int) -> None:
    if len(frames) != 1 + args:
        raise wire.FrameError(f"{bytes(frames[0][:8])!r} takes {args} argument frame(s), got {len(frames) - 1}")
