"""The TCP protocol's two state machines, without sockets, threads or clocks (docs/tcp.md).

``ServerProtocol`` is what the writer's server knows: the messages it holds for remote readers
and what each is sent of them; each reader's place, credit and deadlines, and the control
frames to and from it, are its ``Readers`` (readers.py). ``ClientProtocol`` is what one remote reader
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
group key that WELCOME and KEYS deliver, and each group signed for its reader by the server
(``_seal.WriterMac``, its key in that reader's WELCOME). The server protocol seals every
message once, as it takes it from the ring, and hands out data frames from ``transmit``; the
client protocol checks and opens them (``receive_data``) and counts what it refuses.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from . import seal, wire
from .readers import (
    BUFFER_BYTES,
    REVOKED,
    Admitted,
    Client,
    ClientInfo,
    Departed,
    Outgoing,
    ReaderFault,
    Readers,
    Rejected,
    ServerConfig,
    ServerEvent,
    TimedOut,
    check_arity,
)

__all__ = [
    "ACK_BYTES",
    "BATCH_BYTES",
    "BUFFER_BYTES",
    "Admitted",
    "ClientEvent",
    "ClientInfo",
    "ClientProtocol",
    "Departed",
    "Ended",
    "Lagged",
    "Messages",
    "Outgoing",
    "ReaderFault",
    "Refused",
    "Rejected",
    "ServerConfig",
    "ServerEvent",
    "ServerProtocol",
    "StreamEnd",
    "TimedOut",
    "Transmission",
    "Welcomed",
]

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
#: a reader keeps at most this many bytes of buffers to open large bodies into (``seal.Buffers``)
OPENED_KEEP_BYTES = 8 * ACK_BYTES
#: an idle server's heartbeat goes with a reader's frame that comes at least this many heartbeat
#: intervals after its last one (``ServerProtocol.heartbeat_due``): an idle reader's heartbeat
#: comes every ``IDLE_ACK_HEARTBEATS`` (2) intervals, so the server's goes with every second one
#: at most, and a reader wakes for it about every four intervals (2 s), not every two ...
HEARTBEAT_HEARD = 2.25
#: ... or on its own this many intervals after the last, or sooner when a reader's silence
#: reaches the timeout then (it is dropped at that heartbeat). Above ``HEARTBEAT_HEARD`` by more
#: than an idle reader's interval, so a reader's frame always comes in between; a reader takes
#: the server for gone after 18 intervals of silence, four times this.
HEARTBEAT_LATEST = 4.5
#: a reader's ACK that has nothing new to say (its user consumed nothing and nothing came since
#: the last) is its heartbeat only, and goes this many heartbeat intervals after the last: an
#: idle remote channel wakes the server, and the reader for the server's answer, half as often.
#: The server still drops a reader silent for ``hb_timeout`` (6 intervals: 3 idle ACKs missed),
#: and any ACK with news goes within one interval, as before.
IDLE_ACK_HEARTBEATS = 2


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

    def send_to(self, client: Client, batches: dict[tuple[int, int], list[Any]]) -> Transmission:
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
            if not (yield client.ident, client.mac.sign(frames)):
                client.choked = True
                return 0
            client.choked = False
            client.next_send += count
            return count
        if held.done and not client.ended and client.next_send >= held.end:
            end = self._sealed(wire.END, wire.U64.pack(held.end) + held.done.encode())
            if (yield client.ident, client.mac.sign(end)):
                client.ended = True
            else:
                client.choked = True
        return 0

    def _report_gap(self, client: Client, after: int) -> Generator[Outgoing, bool, bool]:
        """Tell ``client`` that everything from its place up to ``after`` is lost; move it there."""
        lagged = self._sealed(wire.LAGGED, wire.U64x2.pack(after, after - client.next_send))
        if not (yield client.ident, client.mac.sign(lagged)):
            client.choked = True
            return False
        client.next_send = after
        return True


class KeyRounds:
    """The group key's rounds as the readers learn them: a revocation, and every reader told
    the keys it needs after a rekey (by the sealer's policy, on demand, or a revocation's)."""

    def __init__(self, sealer: seal.Sealer, readers: Readers) -> None:
        self._sealer = sealer
        self._readers = readers
        self._epoch = sealer.epoch  # the sealer's epoch whose keys every reader was sent

    def revoke(self, idents: Iterable[bytes]) -> list[ClientInfo]:
        """Readers ``idents`` are shut out for good (their credentials were revoked): each is
        dropped and told so (REFUSED "revoked"), and the group key changes so that nothing
        sealed from now on opens under a key any of them holds (``Sealer.exclude``: the current
        key and the announced next one are both left behind). The others get the new keys with
        ``send``. Who was dropped."""
        dropped = [self._readers.drop(ident, REVOKED) for ident in idents]
        self._sealer.exclude()
        return [info for info in dropped if info is not None]

    def send(self) -> None:
        """After a rekey: every reader gets the keys it needs from what it acknowledged on
        (``Sealer.keys_message``). The next key was announced already, so readers open the first
        frame under it even if this arrives later; one whose queue was full asks again (it meets
        an unknown key)."""
        if self._sealer.epoch == self._epoch:
            return
        self._epoch = self._sealer.epoch
        keys_message = self._sealer.keys_message
        for ident, client in list(self._readers.clients.items()):
            self._readers.send(ident, [wire.KEYS, keys_message(client.acked)])


class ServerProtocol:
    """The server's side: what it holds of the stream and what each remote reader may get.

    The pump feeds it the ring (``add``, ``lost``, ``stream_ended``, asking ``wants_ring``
    first), the frame groups readers send (``receive``) and the time, and sends what it gives:
    the control frames that pile up for ``data_to_send``, and the data frames ``transmit``
    yields (every reader what its credit allows). ``trim`` forgets what no reader needs,
    ``heartbeat`` (when ``heartbeat_due``) drops silent readers and tells the others how far
    the stream goes, ``send_keys`` tells every reader the keys after a rekey. Who the readers
    are, and their control connection, is ``readers`` (readers.py); this class is the stream
    and its fan-out to them."""

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
        server replaces one that died, which served that many readers (``Readers.
        awaiting_return``). ``sealer``: seals the data plane under the pump's group key (for
        ``config.channel``, insecure if ``config.key``): the pump draws the key and sets the
        rekey policy, so this object draws no randomness. ``large``: what a large sealed body is
        held as (the pump makes it a ZeroMQ message, shared by every send without a copy)."""
        self._cfg = config
        self._block = config.policy == "block"
        self._held = _Held(start)
        self.sealer = sealer
        self._large = large
        self._sender = _Sender(self._held, sealer)
        #: the readers admitted, and the control frames to them
        self.readers = Readers(
            config, now=now, returning=returning, keys=sealer.keys_message, writer_mac=sealer.writer_mac
        )
        #: the group key's rounds, and telling the readers
        self.keys = KeyRounds(sealer, self.readers)
        self._stop_at: float | None = None
        #: when the next heartbeat is due at the latest (``heartbeat_due``): ``_beat_latest``,
        #: or sooner when a reader's silence passes the timeout then
        self.next_heartbeat = self._beat_latest = now + config.hb_interval
        self._last_beat = now  # when the last heartbeat went

    @property
    def dropped(self) -> int:
        """Readers dropped for their silence."""
        return self.readers.dropped

    @property
    def rejected_frames(self) -> int:
        return self.readers.rejected_frames

    @property
    def abandoned(self) -> bool:
        """``sole_reader``: its reader left for good; nothing is taken from the ring any more."""
        return self.readers.attendance.abandoned

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
        """A new group key now (on demand), or with the first message sealed once there is room
        for one more old key (``Sealer.rekey``); ``send_keys`` tells the readers."""
        self.sealer.rekey()

    def revoke(self, idents: Iterable[bytes]) -> list[ClientInfo]:
        """``KeyRounds.revoke``: readers ``idents`` are shut out for good; who was dropped."""
        return self.keys.revoke(idents)

    def send_keys(self) -> None:
        """``KeyRounds.send``: after a rekey, every reader gets the keys it needs."""
        self.keys.send()

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
        before it is acted on; a bad frame costs only its sender. A bug it trips is raised as a
        ``ReaderFault``: the pump drops that reader (``reject``)."""
        return self.readers.receive(ident, frames, now=now, horizon=max(self._held.end, published))

    def reject(self, ident: bytes, reason: str) -> Rejected:
        """Refuse a frame from ``ident``: count it, drop that reader (only it), tell it why."""
        return self.readers.reject(ident, reason)

    def drop(self, ident: bytes) -> ClientInfo | None:
        """Forget reader ``ident`` without a word (``ReaderFault`` from ``transmit``); who it was."""
        return self.readers.drop(ident)

    # --- frames to readers ----------------------------------------------------------------------
    def data_to_send(self) -> list[Outgoing]:
        """The control frame groups to send, signed, oldest first (each is taken once)."""
        return self.readers.data_to_send()

    def transmit(self) -> Transmission:
        """Every reader what its credit allows: the data frame groups to send, one at a time,
        each answered with whether the transport took it; returns the number of messages it
        took (``Transmission``)."""
        sent = 0
        # Readers that keep pace get the same batch: build it once (its bodies are sealed
        # already), keyed by its first number and count, which fix its content within this call.
        batches: dict[tuple[int, int], list[Any]] = {}
        for client in list(self.readers.clients.values()):
            try:
                sent += yield from self._sender.send_to(client, batches)
            except Exception as exc:  # a bug: the pump drops this reader (``drop``), not the others
                raise ReaderFault(client.ident, f"internal error {type(exc).__name__}") from exc
        return sent

    @property
    def choked(self) -> bool:
        """Whether the transport refused a send to some reader (the pump retries soon)."""
        return any(c.choked for c in self.readers.clients.values())

    # --- time -----------------------------------------------------------------------------------
    def trim(self, now: float) -> None:
        """Forget what no reader needs: under "block" what every reader acknowledged (a reader
        that joins later starts after it); under "lag" all but the newest ``buffer_max``."""
        held = self._held
        base = held.base
        if not self._block:
            held.keep_newest(self._cfg.buffer_max, self._cfg.buffer_bytes)
        elif not self.readers.attendance.awaiting_return(now) and not (
            self._cfg.sole_reader and not self.readers.clients
        ):
            held.keep_from(min((c.acked for c in self.readers.clients.values()), default=held.end))
        if held.base > base:  # the keys nothing held is sealed under any more are forgotten
            self.sealer.retire(held.seqs[0] if held.seqs else held.end)

    def heartbeat_due(self, now: float, heard: bool = False) -> bool:
        """Whether to send a heartbeat now. ``heard``: a reader's frame came in this turn of the
        pump (its heartbeat, mostly); then one is due ``HEARTBEAT_HEARD`` heartbeats after the
        last.

        An idle server's heartbeat so goes out in a wake-up its readers' heartbeats cost it
        anyway (they come every ``hb_interval``, or every ``IDLE_ACK_HEARTBEATS`` when idle, so
        one always comes between ``HEARTBEAT_HEARD`` and ``HEARTBEAT_LATEST`` heartbeats after the
        last), and at most with every second one: the server wakes once a reader's heartbeat,
        not twice, and an idle reader wakes for the server's about every fourth interval. Without
        readers, or with readers that fell silent, it goes on its own
        ``HEARTBEAT_LATEST`` heartbeats after the last, so the readers still hear the server at
        least that often (they take it for gone after three silence timeouts), or sooner, at
        the moment a reader's silence passes the timeout (``heartbeat``): a silent reader is
        dropped then, not up to a heartbeat later."""
        interval = self._cfg.hb_interval
        if heard:
            if now >= self._last_beat + HEARTBEAT_HEARD * interval:
                return True
            # A reader was heard: the moment its silence would pass the timeout moved on, and
            # so does a wake-up set for that moment (not a heartbeat for a reader no longer silent).
            self.next_heartbeat = min(self._beat_latest, self.readers.silent_at())
        return now >= self.next_heartbeat

    def heartbeat(self, now: float) -> list[TimedOut]:
        """Drop the readers silent for longer than the timeout; tell the others how far the
        stream goes (lost if a reader's queue is full: the next one goes a heartbeat later)."""
        self._last_beat = now
        beat = [wire.HEARTBEAT, wire.U64x2.pack(self._held.end, 1 if self._held.done else 0)]
        out = self.readers.time_out(now, self._held.end, beat)
        self._beat_latest = now + HEARTBEAT_LATEST * self._cfg.hb_interval
        self.next_heartbeat = min(self._beat_latest, self.readers.silent_at())
        return out

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
            and (self.readers.attendance.had_reader or not self._cfg.sole_reader)
            and all(c.ended and c.acked >= self._held.end for c in self.readers.clients.values())
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
                for c in self.readers.clients.values()
            ],
        }

    def __repr__(self) -> str:
        h = self._held
        return (
            f"<ServerProtocol [{self._cfg.policy}, held {h.base}..{h.end} ({len(h.seqs)}), "
            f"{len(self.readers.clients)} readers{', ' + h.done if h.done else ''}]>"
        )


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
