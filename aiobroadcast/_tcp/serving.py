"""The server's side of the TCP protocol, without sockets, threads or clocks (docs/tcp.md; the
protocol as a whole, and what both sides agree on: protocol.py).

``ServerProtocol`` is what the writer's server knows: the messages it holds for remote readers
and what each is sent of them; each reader's place, credit and deadlines, and the control
frames to and from it, are its ``Readers`` (readers.py). It takes frame groups (as they came off
the socket, signature included) and the current time as arguments, and answers with typed
events and frame groups to send; the pump (``server.py``) only moves frames between sockets and
it, so every rule here is tested by feeding frames (tests/test_tcp_protocol.py). It seals every
message once, as it takes it from the ring, and hands out data frames from ``transmit``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Generator, Iterable
from typing import Any, Literal

from . import seal, wire
from .protocol import BATCH_BYTES, HEARTBEAT_HEARD, HEARTBEAT_LATEST
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
)

__all__ = [
    "BUFFER_BYTES",
    "Admitted",
    "ClientInfo",
    "Departed",
    "Outgoing",
    "ReaderFault",
    "Rejected",
    "ServerConfig",
    "ServerEvent",
    "ServerProtocol",
    "StreamEnd",
    "TimedOut",
    "Transmission",
]

#: what ``ServerProtocol.transmit`` is: it yields the data frame groups to send, one at a time,
#: and is sent back whether the transport took each (False: that reader's queue is full, or it
#: is not connected; nothing was sent); it returns the number of messages the transport took
Transmission = Generator[Outgoing, bool, int]
#: how a stream ended: the writer closed it, or died
StreamEnd = Literal["closed", "gone"]


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
