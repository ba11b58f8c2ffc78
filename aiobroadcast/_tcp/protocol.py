"""The TCP protocol's two state machines, without sockets, threads or clocks (docs/tcp.md).

``ServerProtocol`` is what the writer's server knows: the messages it holds for remote readers
and each reader's place, credit and deadlines. ``ClientProtocol`` is what one remote reader
knows: the next message it expects, what it has acknowledged, when it last heard the server.
Both take frame groups (as they came off the socket, signature included) and the current time
as arguments, and answer with typed events and frame groups to send. The I/O pumps
(``server.py``, ``client.py``) only move frames between sockets and these objects, so every rule
here is tested by feeding frames (tests/test_tcp_protocol.py).

Frames out, one style for both: neither object calls into I/O, the pump sends what they give.
Control frames go to a list the pump empties (``data_to_send``): neither side needs to know
whether ZeroMQ took one (each is repeated by a later timer, or asked for again, if lost). The
server's data frames come from ``ServerProtocol.transmit``, a generator of ``(ident, frames)``
the pump sends one at a time, answering whether the transport took each: a batch that ZeroMQ
refused (the reader's queue is full) was not sent, so the reader's place must not move past it,
and the protocol has to know that at once, before it decides what goes to that reader next.

Two connections per reader (wire.py): the control frames (signed in insecure mode, CurveZMQ
otherwise) and the data frames (BATCH, LAGGED, END), each sealed by ``_seal.py`` under the
group key that WELCOME and KEYS deliver. The server protocol seals every message once, as it
takes it from the ring, and hands out data frames from ``transmit``; the client protocol
opens them (``receive_data``) and counts what it refuses.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .. import _seal as seal
from .._shm.layout import NAME_BYTES
from . import wire

#: a frame group for one reader: its ident, and the frames (signed, or sealed)
Outgoing = tuple[bytes, list[Any]]
#: what ``ServerProtocol.transmit`` is: it yields the data frame groups to send, one at a time,
#: and is sent back whether the transport took each (False: that reader's queue is full, or it
#: is not connected; nothing was sent); it returns the number of messages the transport took
Transmission = Generator[Outgoing, bool, int]
#: how a stream ended: the writer closed it, or died
StreamEnd = Literal["closed", "gone"]

#: a batch takes no more bodies once it holds this many bytes
BATCH_BYTES = 128 * 1024
#: a reader acknowledges at least every time its user consumed this many bytes (and every half
#: window, and every heartbeat): well below BUFFER_BYTES, so the server, which holds what is
#: not acknowledged, does not wait for acknowledgements of large messages
ACK_BYTES = 2 << 20
#: the bytes of sealed bodies a server holds for its readers, at most (``ServerConfig.
#: buffer_bytes``; beyond one body): large messages are bounded by bytes, not only by count
BUFFER_BYTES = 64 << 20

# --- the server's events -------------------------------------------------------------------------


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
class _Client:
    ident: bytes
    info: ClientInfo
    #: the credit granted: messages sent beyond ``acked`` never exceed it
    window: int
    next_send: int
    acked: int
    last_heard: float
    #: when it last had the server send again (HELLO, NACK): at most once a heartbeat
    resent_at: float
    #: END was sent; a NACK that rewinds it clears this, so END goes again after the resend
    ended: bool = False
    #: the transport refused the last send (its queue is full, or it is not connected)
    choked: bool = False


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """What a server grants and how long it waits (``open_writer``'s TCP options)."""

    #: "block" or "lag", as the ring's
    policy: str
    #: the HMAC key (insecure mode); None under CurveZMQ
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


class _Held:
    """The messages the server holds for its readers: ``items[k]`` is message ``seqs[k]``.

    ``seqs`` ascends; the numbers are the ring's own, so a server started again (after one died)
    numbers the stream the same way. They are consecutive but for gaps (policy "lag": the ring
    overwrote messages before the server took them); a number in ``[base, end)`` that is not in
    ``seqs`` was lost, and a reader that needs it is told so exactly."""

    def __init__(self, start: int) -> None:
        self.items: list[tuple[Any, int]] = []
        self.seqs: list[int] = []
        self.base = start  #: nothing before it is held
        self.end = start  #: the number of the next message the server will have
        self.done: StreamEnd | None = None
        self.sizes: list[int] = []  #: the bytes of each body held (summed in C when trimmed)
        self.nbytes = 0  #: the bytes of the bodies held

    def add(self, seq: int, item: tuple[Any, int], nbytes: int) -> None:
        if seq < self.base and not self.seqs:
            # Only the first message after joining can be numbered below what the ring said
            # then (the writer was between its two stores; docs/design.md, "Joining"). It is
            # still ours to send: start there.
            self.base = seq
        self.items.append(item)
        self.seqs.append(seq)
        self.end = seq + 1
        self.sizes.append(nbytes)
        self.nbytes += nbytes

    def keep_from(self, seq: int) -> None:
        """Forget every message numbered below ``seq`` (policy "block": all readers have them)."""
        self._drop_before(bisect.bisect_left(self.seqs, min(seq, self.end)), min(seq, self.end))

    def keep_newest(self, count: int, max_bytes: int) -> None:
        """Keep the newest ``count`` entries (policy "lag"; gaps do not count: entries do), and
        of those no more than ``max_bytes`` but the newest."""
        sizes = self.sizes
        drop = max(0, len(sizes) - count)
        excess = self.nbytes - max_bytes - sum(sizes[:drop])
        while excess > 0 and drop < len(sizes) - 1:
            excess -= sizes[drop]
            drop += 1
        self._drop_before(drop, self.seqs[drop] if drop < len(self.seqs) else self.end)

    def _drop_before(self, index: int, keep_from: int) -> None:
        """Forget the first ``index`` entries; ``keep_from``: the first number still held."""
        if keep_from > self.base:
            self.nbytes -= sum(self.sizes[:index])
            del self.sizes[:index]
            del self.items[:index]
            del self.seqs[:index]
            self.base = keep_from

    def run(self, lo: int, limit: int) -> tuple[int, int]:
        """From entry ``lo``: how many consecutive messages (no gap) below ``limit`` make one
        batch (at most BATCH_BYTES and one body more), and its first number."""
        seqs = self.seqs
        first = seqs[lo]
        hi = lo + min(limit - first, len(seqs) - lo)
        # seqs ascends without repeats, so seqs[j] - j never falls: the run without a gap ends
        # where it rises, found by a binary search.
        hi = lo + bisect.bisect_right(range(lo, hi), first - lo, key=lambda j: seqs[j] - j)
        count = size = 0
        for body, _flags in self.items[lo:hi]:
            count += 1
            size += len(body)
            if size >= BATCH_BYTES:
                break
        return first, count


class _Sender:
    """What goes to one reader next, from what is held, its place and its credit."""

    def __init__(self, held: _Held, sealer: seal.Sealer) -> None:
        self.held = held
        self._sealer = sealer

    def _sealed(self, kind: bytes, payload: bytes) -> list[Any]:
        """A data frame that is not a message (LAGGED, END), sealed for this send."""
        return [kind, self._sealer.seal_control(kind, payload)]

    def send_to(self, client: _Client, batches: dict[tuple[int, int], list[Any]]) -> Transmission:
        held = self.held
        # A reader that needs what the server no longer holds (policy "lag", a resume after a
        # restart) is told exactly what is lost. No credit is granted for the gap: the reader
        # acknowledges it once it has taken the report, so it never holds more than `window`.
        if client.next_send < held.base and not (yield from self._report_gap(client, held.base)):
            return 0
        # Credit: the reader may hold `window` messages it has not acknowledged, no more. That
        # bounds its queue, and under "block" it is what holds the writer back.
        limit = min(held.end, client.acked + client.window)
        if client.next_send < limit:
            seqs = held.seqs
            lo = bisect.bisect_left(seqs, client.next_send)
            if lo == len(seqs) or seqs[lo] != client.next_send:
                # In a gap of the server's own: say what it holds next, and go on from there.
                if not (yield from self._report_gap(client, seqs[lo] if lo < len(seqs) else held.end)):
                    return 0
                if client.next_send >= limit:
                    return 0  # no credit beyond the gap until the reader takes the report
            first, count = held.run(lo, limit)
            frames = batches.get((first, count))
            if frames is None:
                # Not signed: every body is sealed already, its number and flags bound into
                # its seal, so the header cannot move it either.
                frames = wire.encode_batch(first, held.items[lo : lo + count])
                batches[(first, count)] = frames
            if not (yield client.ident, frames):
                client.choked = True
                return 0
            client.choked = False
            client.next_send += count
            return count
        if held.done and not client.ended and client.next_send >= held.end:
            if (yield client.ident, self._sealed(wire.END, wire.U64.pack(held.end) + held.done.encode())):
                client.ended = True
            else:
                client.choked = True
        return 0

    def _report_gap(self, client: _Client, after: int) -> Generator[Outgoing, bool, bool]:
        """Tell ``client`` that everything from its place up to ``after`` is lost; move it there."""
        lagged = self._sealed(wire.LAGGED, wire.U64x2.pack(after, after - client.next_send))
        if not (yield client.ident, lagged):
            client.choked = True
            return False
        client.next_send = after
        return True


class ServerProtocol:
    """The server's side: what it holds of the stream and what each remote reader may get.

    The pump feeds it the ring (``add``, ``lost``, ``stream_ended``, asking ``wants_ring``
    first), the frame groups readers send (``receive``) and the time, and sends what it gives:
    the control frames that pile up for ``data_to_send``, and the data frames ``transmit``
    yields (every reader what its credit allows). ``trim`` forgets what no reader needs,
    ``heartbeat`` (when ``heartbeat_due``) drops silent readers and tells the others how far
    the stream goes, ``send_keys`` tells every reader the keys after a rekey."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        start: int,
        now: float,
        returning: int = 0,
        sealer: seal.Sealer,
        large: Callable[[bytes | bytearray], Any] | None = None,
    ) -> None:
        """``start``: the number of the next message the ring will give. ``returning``: this
        server replaces one that died, which served that many readers (``_awaiting_return``).
        ``sealer``: seals the data plane under the pump's group key (for ``config.channel``,
        insecure if ``config.key``): the pump draws the key and sets the rekey policy, so this
        object draws no randomness. ``large``: what a large sealed body is held as (the pump
        makes it a ZeroMQ message, shared by every send without a copy)."""
        self._cfg = config
        self._block = config.policy == "block"
        self._returning = returning
        self._grace_until = now + 2 * config.hb_timeout
        self._held = _Held(start)
        self.sealer = sealer
        self._keys_epoch = sealer.epoch  # the sealer's epoch whose keys every reader was sent
        self._large = large
        self._sender = _Sender(self._held, sealer)
        self._clients: dict[bytes, _Client] = {}
        self._out: list[Outgoing] = []
        self._stop_at: float | None = None
        #: when the next heartbeat is due
        self.next_heartbeat = now + config.hb_interval
        self.dropped = 0
        self.rejected_frames = 0
        #: ``sole_reader``: a reader was admitted (or the server this one replaces served one)
        self._had_reader = returning > 0
        #: ``sole_reader``: its reader left for good; nothing is taken from the ring any more
        self.abandoned = False

    # --- the ring's side ------------------------------------------------------------------------
    @property
    def end(self) -> int:
        """The number of the next message the server will have."""
        return self._held.end

    def wants_ring(self) -> bool:
        """Whether to take more from the ring: not after its end, and under "block" not beyond
        ``buffer_max`` held (the ring then holds the writer back, as a slow local reader would)."""
        held = self._held
        return (
            held.done is None
            and not self.abandoned
            and (not self._block or (len(held.seqs) < self._cfg.buffer_max and held.nbytes < self._cfg.buffer_bytes))
        )

    def add(self, seq: int, item: tuple[Any, int]) -> None:
        """Message ``seq`` taken from the ring: ``(body, flags)``; the body may be a view of its
        slot, valid until the next message is taken. Sealed once here, in the ring's order (the
        sealer never seals a number twice under one key): the sealed bytes go to every reader,
        and again after a loss. Sealing is the one copy out of the ring."""
        body, flags = item
        sealed: Any = self.sealer.seal(seq, flags, body)
        n = len(sealed)
        if self._large is not None and n >= wire.FRAME_ALONE:
            sealed = self._large(sealed)
        self._held.add(seq, (sealed, flags), n)

    def rekey(self) -> None:
        """A new group key now (on demand); ``send_keys`` tells the readers."""
        self.sealer.rekey()

    def send_keys(self) -> None:
        """After a rekey (on demand, or by the sealer's policy): every reader gets the keys.
        The next key was announced already, so readers open the first frame under it even if
        this arrives later; one whose queue was full asks again (it meets an unknown key)."""
        if self.sealer.epoch == self._keys_epoch:
            return
        self._keys_epoch = self.sealer.epoch
        msg = [wire.KEYS, self.sealer.keys_message()]
        for ident in list(self._clients):
            self._send(ident, msg)

    def lost(self, next_msg: int) -> None:
        """The ring overwrote messages before the server took them (policy "lag"): the next one
        it gives is ``next_msg``. Readers still get what is held before the gap, then are told
        exactly what it cost them (``transmit``)."""
        self._held.end = max(self._held.end, next_msg)

    def stream_ended(self, how: StreamEnd) -> None:
        self._held.done = how

    # --- frames from readers --------------------------------------------------------------------
    def receive(self, ident: bytes, frames: list[bytes], *, now: float, published: int) -> ServerEvent | None:
        """A frame group from ``ident`` (its signature still on). ``published``: the number of the
        next message the writer will publish (read from the ring now). Every field is checked
        before it is acted on; a bad frame costs only its sender."""
        if len(frames) > wire.MAX_CONTROL_FRAMES:
            return self.reject(ident, f"{len(frames)} frames in one message")
        if any(len(f) > wire.MAX_CONTROL_FRAME for f in frames):
            # ZeroMQ cuts these off (maxmsgsize) before they reach us; a pump without that limit
            # must not get further.
            return self.reject(ident, "a frame larger than a control frame")
        try:
            frames = wire.verify(self._cfg.key, frames)
        except wire.FrameError as exc:
            self.rejected_frames += 1
            return Rejected(ident, str(exc), None, self.rejected_frames)
        try:
            return self._on_frames(ident, frames, now, max(self._held.end, published))
        except (wire.FrameError, struct.error) as exc:
            return self.reject(ident, str(exc))
        except Exception as exc:  # a bug: the pump drops this reader (``reject``), not the others
            raise ReaderFault(ident, f"internal error {type(exc).__name__}") from exc

    def reject(self, ident: bytes, reason: str) -> Rejected:
        """Refuse a frame from ``ident``: count it, drop that reader (only it), tell it why. The
        pump calls it for a ``ReaderFault`` that ``receive`` raised."""
        self.rejected_frames += 1
        client = self._clients.pop(ident, None)
        self._send(ident, [wire.REFUSED, f"malformed frame: {reason}".encode()[:256]])
        if client is not None:
            self._reader_left(None)
        return Rejected(ident, reason, client.info if client else None, self.rejected_frames)

    def _on_frames(self, ident: bytes, frames: list[bytes], now: float, horizon: int) -> ServerEvent | None:
        if not frames:
            raise wire.FrameError("empty message")
        kind = frames[0]
        client = self._clients.get(ident)
        if kind == wire.HELLO:
            _arity(frames, 1)
            return self._hello(ident, client, wire.decode_hello(frames[1]), now, horizon)
        if kind == wire.ACK or kind == wire.NACK:
            _arity(frames, 1)
            if len(frames[1]) != wire.U64.size:
                raise wire.FrameError(f"{kind!r} needs a u64, got {len(frames[1])} bytes")
            (n,) = wire.U64.unpack(frames[1])
        elif kind == wire.BYE:
            _arity(frames, 0)
        else:
            raise wire.FrameError(f"unknown frame kind {kind[:8]!r}")
        if client is None:
            if kind != wire.BYE:
                self._send(ident, [wire.UNKNOWN])  # "who are you?": it says HELLO again
            return None
        client.last_heard = now
        if kind == wire.ACK:
            # It consumed everything before n. More than it was sent it cannot have: a larger
            # number (a bug, or a hostile reader trying to release the writer's backpressure
            # under "block") counts only up to what was sent.
            if n > client.acked:
                client.acked = min(n, client.next_send)
        elif kind == wire.NACK:
            if now - client.resent_at < self._cfg.hb_interval:
                return None  # what it asked for a moment ago is on its way; it asks again if not
            client.resent_at = now
            # Rewind to n, within what it may ask for: not before what it acknowledged (it has
            # that; going back further would let it make the server send its whole buffer again
            # and again), not beyond its credit nor the stream's end (the place would then run
            # ahead of what exists). At most one window per heartbeat is sent again.
            client.next_send = max(client.acked, min(n, client.acked + client.window, horizon))
            client.ended = False
        else:
            del self._clients[ident]
            self._reader_left(None)
            return Departed(ident, client.info)
        return None

    def _hello(
        self, ident: bytes, client: _Client | None, hello: wire.Hello, now: float, horizon: int
    ) -> ServerEvent | None:
        if hello.version != wire.PROTOCOL_VERSION:
            self._send(ident, [wire.REFUSED, b"protocol version mismatch"])
            return None
        if hello.channel is not None and self._cfg.channel is not None and hello.channel != self._cfg.channel:
            # Same endpoint and keys (fixed CurveKeys), but the handle of another writer: its
            # frames would never open here (the channel id is in every seal).
            self._send(ident, [wire.REFUSED, b"this handle is of another channel (an earlier writer at this endpoint)"])
            return None
        if client is not None and now - client.resent_at < self._cfg.hb_interval:
            return None  # it said HELLO a moment ago; it says it again if the WELCOME is lost
        if self.abandoned:
            self._send(ident, [wire.REFUSED, b"this sender's collector left: it serves no reader any more"])
            return None
        if client is None and len(self._clients) >= self._cfg.max_remote:
            self._send(ident, [wire.REFUSED, f"all {self._cfg.max_remote} remote reader places are taken".encode()])
            return None
        if hello.resume is not None and self._returning:
            self._returning -= 1
        if hello.resume is not None and hello.resume > horizon:
            raise wire.FrameError(f"resume at {hello.resume}, beyond the stream's next message {horizon}")
        # A new reader starts with the next message published, as on shared memory: not with
        # what the server still holds, nor with what is in the ring and not yet taken (a slow
        # reader, policy "block"). A returning one resumes where it says; if that is before
        # what the server holds, transmit tells it exactly what it lost.
        start = horizon if hello.resume is None else hello.resume
        if self._cfg.sole_reader and not self._had_reader and hello.resume is None:
            # A fan-in sender's collector: everything from the stream's first message is its
            # own. What a server that died took and did not hand over is reported as lost.
            start = 0
        self._had_reader = True
        info = ClientInfo(hello.name[:NAME_BYTES], hello.pid, hello.host)
        window = min(hello.window, self._cfg.window)
        self._clients[ident] = _Client(ident, info, window, start, start, now, now)
        welcome = {
            "start": start,
            "policy": self._cfg.policy,
            "hb_interval": self._cfg.hb_interval,
            "hb_timeout": self._cfg.hb_timeout,
            "window": window,  # the credit granted: the reader acknowledges every half of it
            # Where the sealed data frames come from, and the keys to open them (secret: this
            # goes over CurveZMQ only; insecure, it holds salts, not keys).
            "data_port": self._cfg.data_port,
            "keys": self.sealer.keys_message().hex(),
        }
        if self._cfg.data_token is not None:
            welcome["data_token"] = self._cfg.data_token
        self._send(ident, [wire.WELCOME, wire.encode_json(welcome)])
        return Admitted(ident, info)

    # --- frames to readers ----------------------------------------------------------------------
    def _send(self, ident: bytes, frames: list[Any]) -> None:
        self._out.append((ident, wire.sign(self._cfg.key, frames)))

    def data_to_send(self) -> list[Outgoing]:
        """The control frame groups to send, signed, oldest first (each is taken once)."""
        out, self._out = self._out, []
        return out

    def transmit(self) -> Transmission:
        """Every reader what its credit allows: the data frame groups to send, one at a time,
        each answered with whether the transport took it; returns the number of messages it
        took (``Transmission``)."""
        sent = 0
        # Readers that keep pace get the same batch: build it once (its bodies are sealed
        # already), keyed by its first number and count, which fix its content within this call.
        batches: dict[tuple[int, int], list[Any]] = {}
        for client in list(self._clients.values()):
            try:
                sent += yield from self._sender.send_to(client, batches)
            except Exception as exc:  # a bug: the pump drops this reader (``drop``), not the others
                raise ReaderFault(client.ident, f"internal error {type(exc).__name__}") from exc
        return sent

    def drop(self, ident: bytes) -> ClientInfo | None:
        """Forget reader ``ident`` without a word: the pump's answer to a ``ReaderFault`` that
        ``transmit`` raised (what that reader is owed cannot be worked out). Who it was."""
        client = self._clients.pop(ident, None)
        if client is None:
            return None
        self._reader_left(None)
        return client.info

    @property
    def choked(self) -> bool:
        """Whether the transport refused a send to some reader (the pump retries soon)."""
        return any(c.choked for c in self._clients.values())

    # --- time -----------------------------------------------------------------------------------
    def trim(self, now: float) -> None:
        """Forget what no reader needs: under "block" what every reader acknowledged (a reader
        that joins later starts after it); under "lag" all but the newest ``buffer_max``."""
        held = self._held
        base = held.base
        if not self._block:
            held.keep_newest(self._cfg.buffer_max, self._cfg.buffer_bytes)
        elif not self._awaiting_return(now) and not (self._cfg.sole_reader and not self._clients):
            held.keep_from(min((c.acked for c in self._clients.values()), default=held.end))
        if held.base > base:  # the keys nothing held is sealed under any more are forgotten
            self.sealer.retire(held.seqs[0] if held.seqs else held.end)

    def _awaiting_return(self, now: float) -> bool:
        """Whether readers of the server this one replaces may still come back (for at most
        two silence timeouts): under "block" it keeps what it takes from the ring for them."""
        if self._returning and now >= self._grace_until:
            self._returning = 0
        return self._returning > 0

    def heartbeat_due(self, now: float) -> bool:
        return now >= self.next_heartbeat

    def heartbeat(self, now: float) -> list[TimedOut]:
        """Drop the readers silent for longer than the timeout; tell the others how far the
        stream goes (lost if a reader's queue is full: the next one goes a heartbeat later)."""
        self.next_heartbeat = now + self._cfg.hb_interval
        out: list[TimedOut] = []
        beat = [wire.HEARTBEAT, wire.U64x2.pack(self._held.end, 1 if self._held.done else 0)]
        for ident, client in list(self._clients.items()):
            if now - client.last_heard > self._cfg.hb_timeout:
                del self._clients[ident]
                self.dropped += 1
                out.append(TimedOut(ident, client.info, now - client.last_heard, client.acked, self._held.end))
            else:
                self._send(ident, beat)
        self._reader_left(now)
        return out

    def _reader_left(self, now: float | None) -> None:
        """``sole_reader``: once the reader that came has left and none is expected back (a
        restarted server waits for its readers' return), the stream is abandoned."""
        if not self._cfg.sole_reader or self.abandoned or self._clients or not self._had_reader:
            return
        if self._returning and (now is None or self._awaiting_return(now)):
            return
        self.abandoned = True

    def stop(self, deadline: float) -> None:
        """Stop once every reader has everything, or at ``deadline``."""
        self._stop_at = deadline

    def finished(self, now: float) -> bool:
        if self._stop_at is None:
            return False
        if self.abandoned:
            return True  # nobody to drain for
        # Every reader has everything (it says BYE when it has the end) or was dropped. A fan-in
        # sender's server waits for its collector, which has not come yet, until the deadline.
        drained = (
            self._held.done is not None
            and (self._had_reader or not self._cfg.sole_reader)
            and all(c.ended and c.acked >= self._held.end for c in self._clients.values())
        )
        return drained or now >= self._stop_at

    # --- introspection --------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """Who is served and how far, for the server's report (``Writer.statistics()``)."""
        end = self._held.end
        return {
            "end": end,
            "dropped": self.dropped,
            "rejected_frames": self.rejected_frames,
            "abandoned": self.abandoned,
            "readers": [
                {
                    "name": c.info.name,
                    "pid": c.info.pid,
                    "host": c.info.host,
                    "received": c.acked,
                    "lag": max(0, end - c.acked),
                }
                for c in self._clients.values()
            ],
        }

    def __repr__(self) -> str:
        h = self._held
        return (
            f"<ServerProtocol [{self._cfg.policy}, held {h.base}..{h.end} ({len(h.seqs)}), "
            f"{len(self._clients)} readers{', ' + h.done if h.done else ''}]>"
        )


def _arity(frames: Sequence[Any], args: int) -> None:
    if len(frames) != 1 + args:
        raise wire.FrameError(f"{bytes(frames[0][:8])!r} takes {args} argument frame(s), got {len(frames) - 1}")


# --- the client ----------------------------------------------------------------------------------


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
    or the server fell ``silent`` for longer than the reader waits."""

    how: Literal["closed", "gone", "silent"]


@dataclass(frozen=True, slots=True)
class Refused:
    """The server refused this reader (before or after its WELCOME)."""

    reason: str
    welcomed: bool


ClientEvent = Welcomed | Messages | Lagged | Ended | Refused

#: what a client drops without a word: a frame that is not authentic or not well formed (a
#: forged or broken server cannot end the stream; a real one repeats what matters)
_BAD_FRAME = (wire.FrameError, ValueError, KeyError, TypeError, IndexError, struct.error)


class ClientProtocol:
    """A remote reader's side. The pump feeds it the server's frame groups (``receive`` for
    the control connection, ``receive_data`` for the data connection) and, at least every half
    heartbeat, the time and how far the user has consumed (``tick``); frames to send pile up
    for ``data_to_send``. The first is the HELLO. ``data_port``: where the data connection
    goes, as the last WELCOME said (None before one)."""

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
        self._key = key
        self._channel = channel
        # Opens the sealed data frames with the keys WELCOME and KEYS deliver (docs/security.md).
        self._opener = seal.Opener(channel.encode(), secret=key)
        #: the port of the server's data socket (a restarted server may take another)
        self.data_port: int | None = None
        #: the data connection's PLAIN password, as the last WELCOME said (None: no handshake)
        self.data_token: str | None = None
        self._credit_base = 0  # the number the server counts this reader's credit from, at least
        self._keys_asked: float | None = None  # when it last asked for the keys again (UnknownKey)
        self._name = name[: wire.NAME_CHARS]  # the server refuses longer ones (and shows 64)
        self._pid = pid
        self._host = host[: wire.HOST_CHARS]
        #: the credit: what the server may send beyond what this reader acknowledged
        self.window = window
        self._gone_timeout = gone_timeout
        #: the server's timers, until its WELCOME says
        self.hb_interval = 0.5
        self.hb_timeout = 3.0
        self.welcomed = False
        #: the next message expected (-1 before WELCOME)
        self.next = -1
        #: what the server said it has (its heartbeats)
        self.server_end = 0
        self._out: list[list[Any]] = []
        self._last_heard = now
        self._last_batch = now
        self._last_ack_sent = -1
        self._next_ack = now + self.hb_interval
        self._hello(None)

    def data_to_send(self) -> list[list[Any]]:
        """The frame groups to send, signed, oldest first (each is taken once)."""
        out, self._out = self._out, []
        return out

    def bye(self) -> list[Any]:
        """The frame group that says this reader leaves."""
        return wire.sign(self._key, [wire.BYE])

    def _send(self, frames: list[Any]) -> None:
        self._out.append(wire.sign(self._key, frames))

    def _hello(self, resume: int | None) -> None:
        hello = {
            "version": wire.PROTOCOL_VERSION,
            "name": self._name,
            "pid": self._pid,
            "host": self._host,
            "window": self.window,
            "resume": resume,
            "channel": self._channel,
        }
        self._send([wire.HELLO, wire.encode_json(hello)])

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
            event = self._on_frames(wire.verify(self._key, frames), now)
        except _BAD_FRAME:
            return None
        self._last_heard = now
        return event

    def _on_frames(self, frames: list[Any], now: float) -> ClientEvent | None:
        kind = frames[0]
        if kind == wire.KEYS:
            _arity(frames, 1)
            self._install_keys(frames[1])
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
        raise wire.FrameError(f"unknown frame kind {bytes(kind[:8])!r}")

    def _on_welcome(self, welcome: dict[str, Any]) -> ClientEvent | None:
        start = int(welcome["start"])
        self.hb_interval = float(welcome["hb_interval"])
        self.hb_timeout = float(welcome["hb_timeout"])
        if "window" in welcome:  # a smaller credit than ours: acknowledge at its half, not ours
            self.window = max(1, min(self.window, int(welcome["window"])))
        keys = bytes.fromhex(str(welcome["keys"]))
        data_port = int(welcome["data_port"])
        if not 0 < data_port < 65536:
            raise wire.FrameError(f"data port {data_port}")
        self._install_keys(keys)
        token = welcome.get("data_token")
        if token is not None and not (isinstance(token, str) and 0 < len(token) <= wire.MAX_DATA_TOKEN):
            raise wire.FrameError("data token")
        self.data_port = data_port  # again after a restart: that server may have another
        self.data_token = token
        self._credit_base = start
        if self.welcomed:
            return None  # a repeated WELCOME (our HELLO went twice): the place stays ours
        self.welcomed = True
        self.next = start
        return Welcomed(start)

    def _install_keys(self, message: Any) -> None:
        try:
            self._opener.install(bytes(message))
        except seal.SealError as exc:
            raise wire.FrameError(str(exc)) from None

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
        if self.next < 0:
            return None  # before WELCOME: nothing to open it with
        if kind == wire.BATCH:
            first, items = wire.decode_batch(frames[1], frames[2:])
            limit = max(consumed, self._credit_base) + self.window
            skip = seal.accept_range(first, len(items), self.next, limit)
            opener = self._opener
            opened = [
                (opener.open(first + k, flags, body), flags) for k, (body, flags) in enumerate(items) if k >= skip
            ]
            self._last_batch = now
            self.next = first + len(items)
            return Messages(first + skip, opened)
        if kind == wire.LAGGED:
            _arity(frames, 1)
            from_seq, _missed = wire.U64x2.unpack(self._opener.open_control(kind, frames[1]))
            if from_seq > self.next >= 0:
                lagged = Lagged(from_seq - self.next, from_seq)
                self.next = from_seq
                return lagged
            return None
        if kind == wire.END:
            _arity(frames, 1)
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
        is consumed): acknowledged every half window, and at least every heartbeat (the ACK is
        the reader's heartbeat too). ``ack``: acknowledge it now (the user consumed
        ``ACK_BYTES`` since the last time: the server holds what is not acknowledged, and is
        bounded in bytes)."""
        gone_after = self._gone_timeout if self._gone_timeout is not None else 3 * self.hb_timeout
        if self.welcomed and now - self._last_heard > gone_after:
            return Ended("silent")
        if not self.welcomed:
            if now - self._last_heard > self.hb_interval * 4:
                self._hello(None)  # maybe lost before the connection was up
                self._last_heard = now
            return None
        if (
            consumed - self._last_ack_sent >= max(1, self.window // 2)
            or now >= self._next_ack
            or (ack and consumed > self._last_ack_sent)
        ):
            self._send([wire.ACK, wire.U64.pack(consumed)])
            self._last_ack_sent = consumed
            self._next_ack = now + self.hb_interval
        # Starved while the server has more and we have room: something was lost in transit.
        if (
            self.server_end > self.next
            and self.next - consumed < self.window
            and now - self._last_batch > self.hb_interval * 2
        ):
            self._send([wire.NACK, wire.U64.pack(self.next)])
            self._last_batch = now
        return None

    def __repr__(self) -> str:
        state = f"next {self.next}" if self.welcomed else "connecting"
        return f"<ClientProtocol [{self._name!r}, {state}, window {self.window}]>"
