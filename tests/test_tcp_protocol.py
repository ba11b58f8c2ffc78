"""The TCP protocol's state machines driven directly: frames and times in, events and frames out.

No socket, no process, no clock: every rule of credit, rewind, trim, gaps, END, heartbeats and
refusal is checked by feeding ``ServerProtocol`` and ``ClientProtocol`` frames, the hostile
ones included. Control frames (signed) and data frames (sealed, ``_seal.py``) go through sinks
of their own, as they go through sockets of their own. tests/test_tcp*.py and
tests/test_seal_wire.py run the same rules over real sockets and processes.
"""

from __future__ import annotations

import pickle
import secrets
import subprocess
import sys
from collections import defaultdict
from typing import Any

import _forge
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from aiobroadcast._tcp import seal, wire
from aiobroadcast._tcp.protocol import HEARTBEAT_HEARD, HEARTBEAT_LATEST, IDLE_ACK_HEARTBEATS
from aiobroadcast._tcp.receiving import ClientEvent, ClientProtocol, Ended, Lagged, Messages, Refused, Welcomed
from aiobroadcast._tcp.serving import (
    BUFFER_BYTES,
    Admitted,
    Departed,
    ReaderFault,
    Rejected,
    ServerConfig,
    ServerEvent,
    ServerProtocol,
    TimedOut,
)

KEY = secrets.token_bytes(32)  #: the handle's key (insecure mode): every side derives its keys from it
CONTROL_KEY = wire.control_key(KEY)  #: what signs control frames
DATA_KEY = wire.data_secret(KEY)  #: what the data plane's keys derive from
CHANNEL = secrets.token_hex(16)  #: the channel id (a handle's token) of these servers and clients
HB = 1.0  #: heartbeat interval of these servers
TIMEOUT = 5.0  #: and their silence timeout
DATA_KINDS = (wire.BATCH, wire.LAGGED, wire.END)


class Net:
    """The server's pump: control frames (``flush``, after each call that queues them) go
    through itself, data frames (``transmit``) through ``data``; what each
    reader was sent, in order. A reader whose queue is ``full`` refuses everything (ZeroMQ's
    Again). ``seen`` checks each frame group's signature or seal, and that it came through the
    sink of its kind."""

    def __init__(self, key: bytes | None = KEY) -> None:
        self.key = key
        self.sent: dict[bytes, list[tuple[bool, list[Any]]]] = defaultdict(list)
        self.full: set[bytes] = set()
        #: opens data frames as a reader does, with the keys of the WELCOME and KEYS it saw
        self.opener = seal.Opener(CHANNEL.encode(), secret=None if key is None else wire.data_secret(key))
        #: checks each reader's data frames as it does, with the MAC key of its WELCOME
        self.macs: dict[bytes, seal.WriterMac] = {}
        #: each reader's side of its signed control connection (the frames ``ToSign`` from it)
        self.peers: dict[bytes, wire.ReaderSigner] = {}

    def peer(self, ident: bytes) -> wire.ReaderSigner:
        assert self.key is not None
        if ident not in self.peers:
            self.peers[ident] = wire.ReaderSigner(self.key)
        return self.peers[ident]

    def sign(self, ident: bytes, frames: Any) -> list[Any]:
        """Frames from reader ``ident``: signed in its session if ``ToSign``, else as they are."""
        return self.peer(ident).sign(frames.frames) if isinstance(frames, ToSign) else frames

    def __call__(self, ident: bytes, frames: list[Any]) -> bool:
        return self._put(ident, frames, data=False)

    def data(self, ident: bytes, frames: list[Any]) -> bool:
        return self._put(ident, frames, data=True)

    def _put(self, ident: bytes, frames: list[Any], *, data: bool) -> bool:
        if ident in self.full:
            return False
        self.sent[ident].append((data, frames))
        return True

    # Drive the server as its pump does: what it gives to send goes through these sinks.
    def flush(self, srv: ServerProtocol) -> None:
        """Send the control frames ``srv`` queued."""
        for ident, frames in srv.data_to_send():
            self(ident, frames)

    def receive(
        self, srv: ServerProtocol, ident: bytes, frames: list[Any], *, now: float, published: int
    ) -> ServerEvent | None:
        event = srv.receive(ident, self.sign(ident, frames), now=now, published=published)
        self.flush(srv)
        return event

    def receive_fault(self, srv: ServerProtocol, fault: ReaderFault) -> Rejected:
        """What the pump does with a ``ReaderFault`` from ``receive``: refuse that reader."""
        event = srv.reject(fault.ident, fault.reason)
        self.flush(srv)
        return event

    def heartbeat(self, srv: ServerProtocol, now: float) -> list[TimedOut]:
        out = srv.heartbeat(now)
        self.flush(srv)
        return out

    def send_keys(self, srv: ServerProtocol) -> None:
        srv.send_keys()
        self.flush(srv)

    def transmit(self, srv: ServerProtocol) -> int:
        """Send the data frames ``srv.transmit`` yields, telling it whether each was taken."""
        steps = srv.transmit()
        try:
            ident, frames = next(steps)
            while True:
                ident, frames = steps.send(self.data(ident, frames))
        except StopIteration as done:
            sent: int = done.value
            return sent

    def take(self, ident: bytes) -> list[tuple[bool, list[Any]]]:
        """The frame groups sent to ``ident`` since the last take, as sent: (on the data
        connection, frames)."""
        return self.sent.pop(ident, [])

    def seen(self, ident: bytes) -> list[tuple[Any, ...]]:
        """What ``ident`` was sent, in short: ("msg", seq), ("lagged", from, missed), ("end",
        final, reason), ("welcome", start, window), ("refused", reason), or the kind."""
        out: list[tuple[Any, ...]] = []
        for data, sent in self.take(ident):
            assert data == (sent[0] in DATA_KINDS), sent[0]  # each kind on its own connection
            if data:
                frames = self.macs[ident].check(sent)
            else:
                frames = sent if self.key is None else self.peer(ident).verify(sent)
            kind = frames[0]
            if kind == wire.BATCH:
                first, items = wire.decode_batch(frames[1], frames[2:])
                for k, (body, flags) in enumerate(items):
                    self.opener.open(first + k, flags, body)  # sealed, under a key it was given
                out += [("msg", first + k) for k in range(len(items))]
            elif kind == wire.LAGGED:
                out.append(("lagged", *wire.U64x2.unpack(self.opener.open_control(kind, frames[1]))))
            elif kind == wire.END:
                payload = self.opener.open_control(kind, frames[1])
                out.append(("end", wire.U64.unpack_from(payload)[0], payload[wire.U64.size :]))
            elif kind == wire.KEYS:
                self.opener.install(frames[1])
                out.append((kind,))
            elif kind == wire.WELCOME:
                w = wire.decode_json(frames[1])
                self.opener.install(bytes.fromhex(w["keys"]))
                self.macs[ident] = seal.WriterMac(bytes.fromhex(w["mac_key"]))
                out.append(("welcome", w["start"], w["window"]))
            elif kind == wire.REFUSED:
                out.append(("refused", frames[1].decode()))
            else:
                if kind == wire.UNKNOWN:
                    self.peer(ident).new_session()  # as a reader does: its next HELLO opens one
                out.append((kind,))
        return out


def server(
    policy: str = "lag",
    *,
    window: int = 4,
    buffer_max: int = 16,
    key: bytes | None = KEY,
    max_remote: int = 4,
    start: int = 0,
    returning: int = 0,
    buffer_bytes: int = BUFFER_BYTES,
    data_token: str | None = None,
    sole_reader: bool = False,
) -> ServerProtocol:
    config = ServerConfig(
        policy,
        key,
        window,
        buffer_max,
        hb_interval=HB,
        hb_timeout=TIMEOUT,
        max_remote=max_remote,
        channel=CHANNEL,
        data_port=5555,
        data_token=data_token,
        buffer_bytes=buffer_bytes,
        sole_reader=sole_reader,
    )
    sealer = seal.Sealer(CHANNEL.encode(), secret=None if key is None else wire.data_secret(key))
    return ServerProtocol(config, start=start, now=0.0, returning=returning, sealer=sealer)


class ToSign:
    """Control frames to be signed by whoever sends them (``Net``: as reader ``ident``, in its
    session; ``TestClient.receive``: as the server, in the reader's session)."""

    def __init__(self, frames: list[Any]) -> None:
        self.frames = frames


def signed(*frames: bytes, key: bytes = KEY) -> Any:
    if key != KEY:  # a forger's: signed in a session of its own, with another key
        return wire.ReaderSigner(key).sign(list(frames))
    return ToSign(list(frames))


def from_client(frames: list[Any]) -> list[Any]:
    """What a client sent, its signature checked (not its session: that is the server's)."""
    return wire.verify(CONTROL_KEY, frames, to_reader=False).frames


def hello(
    window: int = 4,
    resume: int | None = None,
    version: int = wire.PROTOCOL_VERSION,
    channel: str | None = CHANNEL,
    name: str = "r",
) -> Any:
    body = {
        "version": version,
        "name": name,
        "pid": 7,
        "host": "h",
        "window": window,
        "resume": resume,
        "channel": channel,
    }
    return signed(wire.HELLO, wire.encode_json(body))


def ack(n: int) -> Any:
    return signed(wire.ACK, wire.U64.pack(n))


def nack(n: int) -> Any:
    return signed(wire.NACK, wire.U64.pack(n))


def publish(srv: ServerProtocol, *seqs: int, size: int = 3) -> None:
    for seq in seqs:
        srv.add(seq, (b"m" * size, 0))


def admit(srv: ServerProtocol, net: Net, ident: bytes = b"r", *, now: float = 0.0, **kw: Any) -> None:
    assert isinstance(net.receive(srv, ident, hello(**kw), now=now, published=srv.end), Admitted)
    assert net.seen(ident)[0][0] == "welcome"


def test_a_new_reader_starts_at_the_next_message_and_gets_at_most_its_window() -> None:
    srv, net = server(window=4), Net()
    publish(srv, 0, 1)
    # the writer has published up to 5; the server took 0 and 1 so far: the reader starts at 5
    assert isinstance(net.receive(srv, b"r", hello(window=100), now=0.0, published=5), Admitted)
    assert net.seen(b"r") == [("welcome", 5, 4)]  # the credit is the smaller window, the server's
    publish(srv, *range(2, 12))
    net.transmit(srv)
    net.transmit(srv)
    assert net.seen(b"r") == [("msg", s) for s in range(5, 9)]  # 4, then nothing: no credit
    net.receive(srv, b"r", ack(7), now=0.1, published=12)
    net.transmit(srv)
    assert net.seen(b"r") == [("msg", 9), ("msg", 10)]  # acked 7: room up to 10


def test_an_ack_beyond_what_was_sent_grants_no_credit_and_old_acks_change_nothing() -> None:
    """A replayed or forged ACK cannot move the reader past what it was sent (under "block" that
    would release the writer's backpressure), nor back."""
    srv, net = server("block", window=4), Net()
    admit(srv, net)
    publish(srv, *range(10))
    net.transmit(srv)
    assert net.seen(b"r") == [("msg", s) for s in range(4)]
    for n in (2**64 - 1, 2**63, 1000):
        net.receive(srv, b"r", ack(n), now=0.1, published=10)
    assert srv.report()["readers"][0]["received"] == 4  # clamped to what was sent
    net.receive(srv, b"r", ack(1), now=0.2, published=10)  # a replay of an old one
    assert srv.report()["readers"][0]["received"] == 4
    srv.trim(0.2)
    assert srv.report()["readers"][0]["lag"] == 6


def test_under_block_the_server_takes_no_more_than_its_buffer_and_keeps_what_a_reader_lacks() -> None:
    srv, net = server("block", window=2, buffer_max=3), Net()
    admit(srv, net)
    publish(srv, 0, 1, 2)
    assert not srv.wants_ring()  # the ring holds the writer back from here on
    net.transmit(srv)
    srv.trim(0.0)
    assert not srv.wants_ring()  # sent, not acknowledged: still held
    net.receive(srv, b"r", ack(2), now=0.0, published=3)
    srv.trim(0.0)
    assert srv.wants_ring()
    assert "held 2..3" in repr(srv)


def test_under_block_the_server_holds_no_more_bytes_than_its_buffer_but_always_one_body() -> None:
    """Large messages are bounded by size too: a window of 4 MiB messages would otherwise be a
    gigabyte held in the server. One body larger than the whole bound is still taken."""
    srv, net = server("block", window=100, buffer_max=100, buffer_bytes=1000), Net()
    admit(srv, net, window=100)
    publish(srv, 0, 1, size=400)
    assert srv.wants_ring()  # 2 x (400 + the seal's overhead) < 1000
    publish(srv, 2, size=400)
    assert not srv.wants_ring()  # over 1000 bytes held: the ring holds the writer back
    net.transmit(srv)
    srv.trim(0.0)
    assert not srv.wants_ring()  # sent, not acknowledged: still held
    net.receive(srv, b"r", ack(3), now=0.0, published=3)
    srv.trim(0.0)
    assert srv.wants_ring()
    publish(srv, 3, size=5000)  # larger than the bound on its own: taken, since nothing is held
    assert not srv.wants_ring()
    net.transmit(srv)
    assert net.seen(b"r") == [("msg", s) for s in range(4)]


def test_under_lag_the_buffer_keeps_no_more_bytes_than_its_bound_but_the_newest() -> None:
    srv, net = server(window=100, buffer_max=100, buffer_bytes=1000), Net()
    admit(srv, net, window=100, resume=0)
    publish(srv, *range(5), size=300)
    srv.trim(0.0)
    assert "held 2..5 (3)" in repr(srv)  # 3 x (300 + overhead) <= 1000 < 4 x
    publish(srv, 5, size=3000)
    srv.trim(0.0)
    assert "held 5..6 (1)" in repr(srv)  # the newest stays, however large
    net.transmit(srv)
    net.transmit(srv)
    assert net.seen(b"r") == [("lagged", 5, 5), ("msg", 5)]


def test_a_refused_batch_is_not_counted_as_sent_and_goes_again_when_there_is_room() -> None:
    srv, net = server(window=8), Net()
    admit(srv, net)
    publish(srv, *range(3))
    net.full.add(b"r")
    assert net.transmit(srv) == 0
    assert srv.choked
    net.full.clear()
    assert net.transmit(srv) == 3
    assert not srv.choked
    assert net.seen(b"r") == [("msg", 0), ("msg", 1), ("msg", 2)]


def test_a_nack_rewinds_within_what_was_acknowledged_the_credit_and_the_stream() -> None:
    srv, net = server(window=4), Net()
    admit(srv, net)
    publish(srv, *range(6))
    net.transmit(srv)
    net.receive(srv, b"r", ack(2), now=0.0, published=6)
    net.transmit(srv)
    assert net.seen(b"r") == [("msg", s) for s in range(6)]
    net.receive(srv, b"r", nack(3), now=0.5, published=6)  # too soon after the HELLO: ignored
    net.transmit(srv)
    assert net.seen(b"r") == []
    net.receive(srv, b"r", nack(0), now=1.0, published=6)  # before what it acknowledged: from 2
    net.transmit(srv)
    assert net.seen(b"r") == [("msg", s) for s in range(2, 6)]
    net.receive(srv, b"r", nack(4), now=1.5, published=6)  # within a heartbeat of the last
    net.transmit(srv)
    assert net.seen(b"r") == []
    net.receive(srv, b"r", nack(2**64 - 1), now=2.0, published=6)  # beyond credit and stream
    net.transmit(srv)
    assert net.seen(b"r") == []  # nothing exists there: it waits at the end, not beyond it
    publish(srv, 6)
    net.transmit(srv)
    assert net.seen(b"r") == []  # its credit ends at 2 + 4


def test_a_gap_in_the_servers_own_ring_is_reported_exactly_and_what_it_held_still_goes() -> None:
    """Policy "lag": the server's own ring reader lost 3 messages; a remote reader gets what was
    held before the gap, then exactly the gap, then what follows."""
    srv, net = server(window=4), Net()
    admit(srv, net)
    publish(srv, *range(6))
    net.transmit(srv)
    assert net.seen(b"r") == [("msg", s) for s in range(4)]
    srv.lost(9)
    publish(srv, 9, 10)
    srv.add(11, (b"big" * wire.FRAME_ALONE, 0))
    srv.trim(0.0)
    assert srv.end == 12
    got: list[tuple[Any, ...]] = []
    for k in range(6):  # the reader acknowledges what it has
        net.receive(srv, b"r", ack(srv.report()["end"] if k > 3 else 4 + 2 * k), now=0.0, published=12)
        net.transmit(srv)
        got += net.seen(b"r")
    assert got == [("msg", 4), ("msg", 5), ("lagged", 9, 3), ("msg", 9), ("msg", 10), ("msg", 11)]


def test_under_lag_the_buffer_keeps_the_newest_entries_and_a_late_reader_is_told_each_gap() -> None:
    srv, net = server(window=100, buffer_max=4), Net()
    admit(srv, net, window=100, resume=0)
    publish(srv, 0, 1)
    srv.lost(7)
    publish(srv, 7, 8)
    srv.lost(11)
    publish(srv, 11)
    srv.trim(0.0)
    assert "held 1..12 (4)" in repr(srv)
    for _ in range(4):
        net.transmit(srv)
    assert net.seen(b"r") == [
        ("lagged", 1, 1),
        ("msg", 1),
        ("lagged", 7, 5),
        ("msg", 7),
        ("msg", 8),
        ("lagged", 11, 2),
        ("msg", 11),
    ]


def test_end_goes_once_after_everything_and_again_after_a_rewind() -> None:
    srv, net = server(window=8), Net()
    admit(srv, net)
    publish(srv, 0, 1)
    srv.stream_ended("closed")
    assert not srv.wants_ring()
    net.transmit(srv)
    net.transmit(srv)
    net.transmit(srv)
    assert net.seen(b"r") == [("msg", 0), ("msg", 1), ("end", 2, b"closed")]
    net.receive(srv, b"r", nack(1), now=2.0, published=2)
    net.transmit(srv)
    net.transmit(srv)
    assert net.seen(b"r") == [("msg", 1), ("end", 2, b"closed")]
    srv.stop(deadline=100.0)
    assert not srv.finished(3.0)  # it has not acknowledged the end
    net.receive(srv, b"r", ack(2), now=3.0, published=2)
    assert srv.finished(3.0)


def test_a_stopping_server_gives_up_on_readers_at_its_deadline() -> None:
    srv, net = server(), Net()
    admit(srv, net)
    publish(srv, 0)
    srv.stream_ended("gone")
    assert not srv.finished(0.0)  # not asked to stop
    srv.stop(deadline=10.0)
    assert not srv.finished(9.9)
    assert srv.finished(10.0)


def test_a_silent_reader_is_dropped_at_a_heartbeat_and_the_others_hear_one() -> None:
    srv, net = server(), Net()
    admit(srv, net, b"quiet")
    admit(srv, net, b"talks")
    assert not srv.heartbeat_due(0.5)
    assert srv.heartbeat_due(HB)
    assert net.heartbeat(srv, HB) == []
    assert net.seen(b"quiet") == net.seen(b"talks") == [(wire.HEARTBEAT,)]
    net.receive(srv, b"talks", ack(0), now=TIMEOUT, published=0)
    # The next one on its own: HEARTBEAT_LATEST after the last, or sooner, when "quiet" (silent
    # since 0) passes the timeout.
    assert srv.next_heartbeat == pytest.approx(min(HB + HEARTBEAT_LATEST * HB, TIMEOUT), abs=0.01)
    (out,) = net.heartbeat(srv, TIMEOUT + 0.5)
    assert isinstance(out, TimedOut) and out.ident == b"quiet" and out.silent_s == TIMEOUT + 0.5
    assert srv.dropped == 1 and [r["name"] for r in srv.report()["readers"]] == ["r"]
    assert net.seen(b"quiet") == [] and net.seen(b"talks") == [(wire.HEARTBEAT,)]
    # It comes back: "who are you?", then a HELLO with where it was
    assert net.receive(srv, b"quiet", ack(0), now=7.0, published=0) is None
    assert net.seen(b"quiet") == [(wire.UNKNOWN,)]
    assert isinstance(net.receive(srv, b"quiet", hello(resume=0), now=7.0, published=0), Admitted)


def test_an_idle_servers_heartbeat_goes_with_every_second_heartbeat_of_a_reader() -> None:
    """The wake-up a reader's heartbeat costs the server carries the server's heartbeat too, so
    an idle server wakes once a reader's heartbeat, not twice; only every second one (an idle
    reader's come ``IDLE_ACK_HEARTBEATS`` intervals apart), so the reader wakes for the server's
    every fourth interval; with nothing heard, it beats on its own."""
    srv, net = server(), Net()
    admit(srv, net, b"a")
    net.heartbeat(srv, HB)
    net.seen(b"a")
    idle = IDLE_ACK_HEARTBEATS * HB
    # One reader frame always comes between the two bounds, wherever it falls.
    assert idle < HEARTBEAT_HEARD * HB and HEARTBEAT_HEARD * HB + idle < HEARTBEAT_LATEST * HB
    # The reader's idle heartbeats come two intervals apart: the next one is too soon, the one after not.
    assert not srv.heartbeat_due(HB + idle, heard=True)
    assert not srv.heartbeat_due(HB + HEARTBEAT_HEARD * HB - 0.01, heard=True)
    assert not srv.heartbeat_due(HB + 2 * idle)  # nothing heard: not yet due on its own
    assert srv.heartbeat_due(HB + 2 * idle, heard=True)
    net.receive(srv, b"a", ack(0), now=HB + 2 * idle, published=0)
    assert net.heartbeat(srv, HB + 2 * idle) == [] and net.seen(b"a") == [(wire.HEARTBEAT,)]
    # Nothing heard from then on: the next one goes on its own, HEARTBEAT_LATEST after the last
    # (the reader's silence reaches the timeout later than that).
    last = HB + 2 * idle
    assert last + HEARTBEAT_LATEST * HB < last + TIMEOUT
    assert not srv.heartbeat_due(last + HEARTBEAT_LATEST * HB - 0.01)
    assert srv.heartbeat_due(last + HEARTBEAT_LATEST * HB)
    assert srv.next_heartbeat == last + HEARTBEAT_LATEST * HB


def test_the_wake_up_set_for_a_readers_silence_moves_on_once_every_reader_is_heard() -> None:
    """After a heartbeat the server's next wake-up is the moment the first reader's silence
    would pass the timeout, when that comes before its next heartbeat on its own. A frame from
    that reader moves the moment on, so an idle server does not wake then to beat (and wake
    every reader) for a reader that is no longer silent; a reader still silent keeps it."""
    srv, net = server(), Net()
    admit(srv, net, b"a")
    admit(srv, net, b"b")  # both heard at 0
    net.heartbeat(srv, HB)
    latest = HB + HEARTBEAT_LATEST * HB
    assert latest > TIMEOUT
    assert srv.next_heartbeat == pytest.approx(TIMEOUT, abs=0.01)  # set for their silence
    net.receive(srv, b"a", ack(0), now=2 * HB, published=0)
    assert not srv.heartbeat_due(2 * HB, heard=True)
    assert srv.next_heartbeat == pytest.approx(TIMEOUT, abs=0.01)  # "b" is still silent since 0
    net.receive(srv, b"b", ack(0), now=3 * HB, published=0)
    assert not srv.heartbeat_due(3 * HB, heard=True)
    assert srv.next_heartbeat == latest  # nobody's silence comes before the next heartbeat now
    assert not srv.heartbeat_due(TIMEOUT + 0.01)
    assert srv.heartbeat_due(latest)
    assert net.heartbeat(srv, latest) == []  # nobody dropped


def test_a_reader_silent_past_its_timeout_is_dropped_by_a_heartbeat_of_its_own() -> None:
    """With no reader talking, the server's own heartbeats still come, and still drop the
    silent: the last one comes when the reader's silence passes the timeout."""
    srv, net = server(), Net()
    admit(srv, net, b"quiet")
    now = 0.0
    dropped: list[TimedOut] = []
    while not dropped:
        now = srv.next_heartbeat
        assert srv.heartbeat_due(now)
        dropped = net.heartbeat(srv, now)
    assert TIMEOUT < now <= TIMEOUT + 0.01
    assert [d.ident for d in dropped] == [b"quiet"]


def test_bye_leaves_and_a_full_server_refuses_more_readers() -> None:
    srv, net = server(max_remote=1), Net()
    admit(srv, net, b"a")
    assert net.receive(srv, b"b", hello(), now=0.0, published=0) is None
    assert net.seen(b"b") == [("refused", "all 1 remote reader places are taken")]
    assert isinstance(net.receive(srv, b"a", signed(wire.BYE), now=0.0, published=0), Departed)
    assert net.receive(srv, b"a", signed(wire.BYE), now=0.0, published=0) is None  # a replay
    admit(srv, net, b"b")


def test_a_fan_in_senders_server_keeps_everything_for_its_collector_and_is_abandoned_once_it_left() -> None:
    """``sole_reader`` (a remote fan-in sender): with no reader yet, nothing is trimmed and the
    ring is taken only up to the buffer (then the ring holds the sender back); the collector
    starts at message 0, whatever was published; once it left, the server takes no more from the
    ring, refuses readers, and a stop finishes at once."""
    srv, net = server("block", window=4, buffer_max=6, max_remote=1, sole_reader=True), Net()
    publish(srv, *range(6))
    srv.trim(100.0)
    assert not srv.wants_ring()  # all 6 held for the collector
    assert isinstance(net.receive(srv, b"c", hello(), now=100.0, published=9), Admitted)
    assert net.seen(b"c") == [("welcome", 0, 4)]
    net.transmit(srv)
    assert net.seen(b"c") == [("msg", s) for s in range(4)]
    net.receive(srv, b"c", ack(4), now=100.0, published=9)
    srv.trim(100.0)
    assert srv.wants_ring() and not srv.abandoned
    srv.stop(1000.0)
    assert not srv.finished(100.0)  # the collector has not everything yet
    assert isinstance(net.receive(srv, b"c", signed(wire.BYE), now=100.0, published=9), Departed)
    assert srv.abandoned and not srv.wants_ring() and srv.finished(100.0)
    assert net.receive(srv, b"d", hello(), now=100.0, published=9) is None
    assert net.seen(b"d")[0][0] == "refused"


def test_a_fan_in_senders_collector_dropped_for_silence_abandons_and_a_restarted_server_reports_the_loss() -> None:
    srv, net = server("block", sole_reader=True), Net()
    srv.stop(1000.0)
    publish(srv, 0)
    assert not srv.finished(1.0)  # a closed sender's server waits for its collector to come
    admit(srv, net, b"c", now=1.0)
    net.heartbeat(srv, 1.0 + TIMEOUT + 1)
    assert srv.abandoned
    # A server started again over a ring no collector read yet (the dead one took 0..4):
    again, net2 = server("block", start=5, sole_reader=True), Net()
    publish(again, 5, 6)
    assert isinstance(net2.receive(again, b"c", hello(), now=0.0, published=7), Admitted)
    net2.transmit(again)
    assert net2.seen(b"c") == [("welcome", 0, 4), ("lagged", 5, 5)]
    net2.receive(again, b"c", ack(5), now=0.1, published=7)  # it took the report
    net2.transmit(again)
    assert net2.seen(b"c") == [("msg", 5), ("msg", 6)]


def test_a_replayed_hello_within_a_heartbeat_gets_no_second_welcome() -> None:
    srv, net = server(), Net()
    admit(srv, net)
    assert net.receive(srv, b"r", hello(), now=0.5, published=0) is None
    assert net.seen(b"r") == []
    assert isinstance(net.receive(srv, b"r", hello(resume=0), now=1.5, published=0), Admitted)


def test_a_returning_reader_past_what_a_new_server_holds_is_told_what_it_lost() -> None:
    srv, net = server(start=10, returning=1), Net()
    publish(srv, 10, 11)
    admit(srv, net, resume=7)
    net.transmit(srv)
    net.transmit(srv)
    # the gap takes no credit, but it is not acknowledged yet: one message fits in 7 + 4
    assert net.seen(b"r") == [("lagged", 10, 3), ("msg", 10)]
    net.receive(srv, b"r", ack(10), now=0.1, published=12)
    net.transmit(srv)
    assert net.seen(b"r") == [("msg", 11)]


def test_under_block_a_new_server_keeps_everything_for_its_returning_readers_for_a_while() -> None:
    srv = server("block", start=0, returning=1)
    publish(srv, 0, 1, 2)
    srv.trim(1.0)
    assert "held 0..3 (3)" in repr(srv)  # nobody acknowledged it, but a reader may come back
    srv.trim(2 * TIMEOUT)  # the grace is over: nobody is there, nothing is kept
    assert "held 3..3 (0)" in repr(srv)


#: reader frame groups that are authentic (signed with the key) and each wrong in its own way
HOSTILE = {
    "unknown kind": [b"Z"],
    "ACK without its number": [wire.ACK],
    "ACK with 3 bytes": [wire.ACK, b"abc"],
    "NACK with 9 bytes": [wire.NACK, b"\0" * 9],
    "ACK with two numbers": [wire.ACK, wire.U64.pack(1), wire.U64.pack(2)],
    "BYE with an argument": [wire.BYE, b"x"],
    "HELLO without a body": [wire.HELLO],
    "HELLO not JSON": [wire.HELLO, b"{version: 3"],
    "HELLO window 0": [wire.HELLO, b'{"version":6,"window":0}'],
    "HELLO window a float": [wire.HELLO, b'{"version":6,"window":4.0}'],
    "HELLO window NaN": [wire.HELLO, b'{"version":6,"window":NaN}'],
    "HELLO resume negative": [wire.HELLO, b'{"version":6,"window":4,"resume":-1}'],
    "HELLO resume beyond the stream": [wire.HELLO, b'{"version":6,"window":4,"resume":1000}'],
    "HELLO name too long": [wire.HELLO, b'{"version":6,"window":4,"name":"' + b"n" * 300 + b'"}'],
    "HELLO pid a string": [wire.HELLO, b'{"version":6,"window":4,"pid":"1"}'],
    "HELLO an array": [wire.HELLO, b"[1,2]"],
    "HELLO channel a number": [wire.HELLO, b'{"version":6,"window":4,"channel":7}'],
    "HELLO channel too long": [wire.HELLO, b'{"version":6,"window":4,"channel":"' + b"c" * 300 + b'"}'],
    "a data frame sent back": [wire.BATCH, wire.BATCH_HEAD.pack(0, 0)],
    "KEYS from a reader": [wire.KEYS, b"\1\0"],
}
assert wire.PROTOCOL_VERSION == 6  # the HELLOs above are of this version: refused for what they hold


@pytest.mark.parametrize("what", list(HOSTILE))
def test_a_hostile_frame_from_an_admitted_reader_drops_it_only_and_tells_it_why(what: str) -> None:
    srv, net = server(), Net()
    admit(srv, net, b"bad")
    admit(srv, net, b"good")
    publish(srv, 0)
    # (after a heartbeat: a HELLO sooner would be taken for a repeat and ignored)
    event = net.receive(srv, b"bad", signed(*HOSTILE[what]), now=1.5, published=1)
    assert isinstance(event, Rejected) and event.dropped is not None and event.total == 1, event
    (refusal,) = net.seen(b"bad")
    assert refusal[0] == "refused" and refusal[1].startswith("malformed frame")
    assert srv.rejected_frames == 1
    assert [r["name"] for r in srv.report()["readers"]] == ["r"]  # only the good one is left
    net.transmit(srv)
    assert net.seen(b"good") == [("msg", 0)] and net.seen(b"bad") == []


def test_a_hostile_frame_the_protocol_fails_on_is_raised_to_the_pump_and_costs_that_reader_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug that a reader's frame trips is no reason to take the others down, nor to be hidden:
    ``receive`` raises it as a ``ReaderFault`` naming that reader (logging and dropping are the
    pump's), and the pump's ``reject`` drops that reader only and tells it why."""
    srv, net = server(), Net()
    admit(srv, net, b"bad")
    admit(srv, net, b"good")
    publish(srv, 0)
    real = wire.decode_hello

    def poisoned(body: Any) -> wire.Hello:
        if b"poison" in bytes(body):
            raise RuntimeError("a bug this body trips")
        return real(body)

    monkeypatch.setattr(wire, "decode_hello", poisoned)
    with pytest.raises(ReaderFault) as caught:
        srv.receive(b"bad", net.sign(b"bad", hello(name="poison")), now=1.5, published=1)
    fault = caught.value
    assert fault.ident == b"bad" and fault.reason == "internal error RuntimeError"
    assert isinstance(fault.__cause__, RuntimeError)
    assert srv.data_to_send() == []  # nothing said yet: the pump decides
    event = net.receive_fault(srv, fault)
    assert isinstance(event, Rejected) and event.dropped is not None and srv.rejected_frames == 1
    assert net.seen(b"bad") == [("refused", "malformed frame: internal error RuntimeError")]
    assert [r["name"] for r in srv.report()["readers"]] == ["r"]  # the good one is served on
    net.transmit(srv)
    assert net.seen(b"good") == [("msg", 0)] and net.seen(b"bad") == []


def test_a_reader_the_protocol_fails_to_send_to_is_raised_to_the_pump_and_costs_that_reader_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    srv, net = server(), Net()
    admit(srv, net, b"bad")
    admit(srv, net, b"good")
    publish(srv, 0, 1)
    sender = srv._sender
    real = sender.send_to

    def failing(client: Any, batches: Any) -> Any:
        if client.ident == b"bad":
            raise RuntimeError("a bug in what this reader is owed")
        return real(client, batches)

    monkeypatch.setattr(sender, "send_to", failing)
    with pytest.raises(ReaderFault) as caught:
        net.transmit(srv)
    assert caught.value.ident == b"bad" and isinstance(caught.value.__cause__, RuntimeError)
    assert srv.drop(b"bad") is not None and srv.drop(b"bad") is None
    net.transmit(srv)
    assert net.seen(b"good") == [("msg", 0), ("msg", 1)] and net.seen(b"bad") == []
    assert [r["name"] for r in srv.report()["readers"]] == ["r"] and srv.rejected_frames == 0


def test_frames_that_are_not_authentic_are_counted_and_drop_nobody() -> None:
    srv, net = server(), Net()
    admit(srv, net)
    wrong = secrets.token_bytes(32)
    good = net.sign(b"r", ack(0))
    assert net.receive(srv, b"r", good, now=0.1, published=0) is None
    for frames in (
        [wire.ACK, wire.U64.pack(3)],  # unsigned
        signed(wire.ACK, wire.U64.pack(3), key=wrong),
        [*net.sign(b"r", ack(3))[:-1], b"\0" * wire.SIGNATURE_BYTES],
        [*net.sign(b"r", ack(3))[:-1], b"short"],
        [wire.U64.pack(3), *net.sign(b"r", ack(4))[1:]],  # the kind swapped out
        good,  # a replay
    ):
        event = net.receive(srv, b"r", frames, now=0.1, published=0)
        assert isinstance(event, Rejected) and event.dropped is None
    assert srv.rejected_frames == 6
    assert net.seen(b"r") == []  # no answer to a forgery
    assert len(srv.report()["readers"]) == 1


@pytest.mark.parametrize("key", [None, KEY], ids=["curve", "insecure"])
def test_too_many_or_too_large_frames_are_refused_before_anything_is_parsed(key: bytes | None) -> None:
    """Under CurveZMQ the peer is authentic (the handshake said so): it is told why. Under
    insecure=True nothing is authentic before its signature is checked: an admitted reader's
    connection that carries such a frame group (injected by an on-path host) is not dropped,
    and nobody is told anything."""
    srv, net = server(key=key), Net(key)
    if key is not None:
        admit(srv, net, b"x")
    for frames in (
        [wire.ACK, b"1", b"2", b"3", b"4"],
        [wire.HELLO, b"{" * (wire.MAX_CONTROL_FRAME + 1)],
    ):
        event = net.receive(srv, b"x", frames, now=0.0, published=0)
        assert isinstance(event, Rejected) and event.dropped is None
        assert [what for what, *_ in net.seen(b"x")] == (["refused"] if key is None else [])
    assert len(srv.report()["readers"]) == (0 if key is None else 1)


def test_a_version_mismatch_is_refused_without_counting_it_as_hostile() -> None:
    srv, net = server(), Net()
    # 3: data frames on the control connection, not sealed; 5: data frames without the writer's MAC
    for version in (2, 3, 5):
        assert net.receive(srv, b"r", hello(version=version), now=0.0, published=0) is None
        ((what, reason),) = net.seen(b"r")
        assert what == "refused"
        assert reason.startswith(f"protocol version mismatch: this reader speaks {version}, the writer's server 6")
        assert "same aiobroadcast version" in reason
    assert srv.rejected_frames == 0


def test_a_hello_with_the_handle_of_another_channel_is_refused_by_name() -> None:
    """A handle of an earlier writer at this endpoint (same keys): its reader could open no
    frame here, so it is told why at once."""
    srv, net = server(), Net()
    assert net.receive(srv, b"r", hello(channel="another"), now=0.0, published=0) is None
    ((what, reason),) = net.seen(b"r")
    assert what == "refused" and "another channel" in reason
    assert srv.rejected_frames == 0 and srv.report()["readers"] == []
    admit(srv, net, b"r", channel=None)  # a HELLO that names none is checked by the seals alone


def test_the_welcome_names_the_data_port_and_holds_the_keys_that_open_the_data_frames() -> None:
    srv, net = server(), Net()
    assert isinstance(net.receive(srv, b"r", hello(), now=0.0, published=0), Admitted)
    ((_, welcome_frames),) = net.take(b"r")
    body = wire.decode_json(net.peer(b"r").verify(welcome_frames)[1])
    assert body["data_port"] == 5555
    opener = seal.Opener(CHANNEL.encode(), secret=DATA_KEY)
    opener.install(bytes.fromhex(body["keys"]))
    publish(srv, 0, 1)
    net.transmit(srv)
    ((data, frames),) = net.take(b"r")
    assert data and frames[0] == wire.BATCH  # not signed by the control HMAC: the seals, and the
    frames = seal.WriterMac(bytes.fromhex(body["mac_key"])).check(frames)  # writer's MAC, authenticate it
    first, items = wire.decode_batch(frames[1], frames[2:])
    assert [bytes(opener.open(first + k, f, b)) for k, (b, f) in enumerate(items)] == [b"mmm", b"mmm"]
    with pytest.raises(seal.NotAuthentic):  # a body moved to another place in the stream
        opener.open(first + 1, items[0][1], items[0][0])


def test_after_a_rekey_every_reader_gets_the_keys_once_and_later_messages_open_with_them() -> None:
    srv, net = server(window=8), Net()
    admit(srv, net, b"a")
    admit(srv, net, b"b")
    publish(srv, 0)
    net.send_keys(srv)
    assert net.seen(b"a") == []  # nothing new to say
    net.transmit(srv)
    srv.rekey()
    publish(srv, 1)
    net.send_keys(srv)
    net.send_keys(srv)
    net.transmit(srv)
    # the keys before what is sealed under the new key (seen() opens every message)
    assert net.seen(b"a") == [("msg", 0), (wire.KEYS,), ("msg", 1)]
    assert net.seen(b"b") == [("msg", 0), (wire.KEYS,), ("msg", 1)]


def test_the_sealers_rekey_policy_sends_the_keys_too() -> None:
    config = ServerConfig("lag", KEY, 8, 16, hb_interval=HB, hb_timeout=TIMEOUT, max_remote=4, channel=CHANNEL)
    sealer = seal.Sealer(CHANNEL.encode(), secret=DATA_KEY, rekey_messages=2)
    srv, net = ServerProtocol(config, start=0, now=0.0, sealer=sealer), Net()
    admit(srv, net, window=8)
    for k in range(5):
        publish(srv, k)
        net.send_keys(srv)
    net.transmit(srv)
    seen = net.seen(b"r")
    assert seen.count((wire.KEYS,)) == 2 and [s for s in seen if s[0] == "msg"] == [("msg", k) for k in range(5)]


def test_a_nack_flood_resends_at_most_one_window_per_heartbeat() -> None:
    srv, net = server(window=4), Net()
    admit(srv, net)
    publish(srv, *range(4), size=1000)
    net.transmit(srv)
    net.take(b"r")
    resent = 0
    for k in range(1, 1001):  # a NACK every 10 ms for 10 heartbeats
        net.receive(srv, b"r", nack(0), now=k * 0.01, published=4)
        net.transmit(srv)
        resent += sum(1 for s in net.seen(b"r") if s[0] == "msg")
    assert resent <= 4 * 10


# --- the client ------------------------------------------------------------------------------


class TestClient(ClientProtocol):
    """A client whose ``receive`` signs ``ToSign`` frames as the server would for it: in its
    session (drawing the server's nonce for each new one), or, UNKNOWN and REFUSED before its
    WELCOME, as the answer to its last frame."""

    __test__ = False
    _session: wire.Session | None = None

    def receive(self, frames: Any, now: float) -> Any:
        if isinstance(frames, ToSign):
            frames = self.as_server(frames.frames)
        return super().receive(frames, now)

    def as_server(self, frames: list[Any]) -> list[Any]:
        signer = self._signer
        assert signer is not None
        if signer.server_nonce is None and frames[0] in (wire.UNKNOWN, wire.REFUSED):
            asked = wire.Signed([], signer.reader_nonce, wire.NO_NONCE, signer._sent - 1)
            return wire.sign_answer(CONTROL_KEY, frames, asked)
        session = self._session
        if session is None or session.reader_nonce != signer.reader_nonce:
            session = self._session = wire.Session(signer.reader_nonce, secrets.token_bytes(wire.NONCE_BYTES), 0)
        return session.sign(CONTROL_KEY, frames)


def client(window: int = 4, key: bytes | None = KEY, gone_timeout: float | None = None) -> TestClient:
    return TestClient(
        key=key, channel=CHANNEL, name="c", pid=1, host="h", window=window, now=0.0, gone_timeout=gone_timeout
    )


class Stream:
    """A server's sealer for the client tests: every message sealed once (a resend is the same
    sealed bytes, as the server sends it), and the MAC of its one reader (``welcome`` gives its
    key), which signs every data frame group."""

    def __init__(self, secret: bytes | None = DATA_KEY, channel: str = CHANNEL, presealed: int = 0) -> None:
        self.sealer = seal.Sealer(channel.encode(), secret=secret)
        self.mac = self.sealer.writer_mac()
        self._sealed: dict[int, Any] = {}
        for seq in range(presealed):  # in order: tests may then ask for them in any order
            self.body(seq)

    def body(self, seq: int) -> Any:
        if seq not in self._sealed:
            self._sealed[seq] = self.sealer.seal(seq, 0, b"%d" % seq)
        return self._sealed[seq]

    def batch(self, first: int, n: int) -> list[Any]:
        return self.mac.sign(wire.encode_batch(first, [(self.body(first + k), 0) for k in range(n)]))

    def control(self, kind: bytes, payload: bytes) -> list[Any]:
        return self.mac.sign([kind, self.sealer.seal_control(kind, payload)])


STREAM = Stream(presealed=64)


def welcome(start: int = 0, window: int = 4, stream: Stream = STREAM, port: int = 5555, **extra: Any) -> Any:
    body: dict[str, Any] = {
        "start": start,
        "policy": "lag",
        "hb_interval": HB,
        "hb_timeout": TIMEOUT,
        "window": window,
        "data_port": port,
        "keys": stream.sealer.keys_message().hex(),
        "mac_key": stream.mac.key.hex(),
        **extra,
    }
    return signed(wire.WELCOME, wire.encode_json(body))


def batch(first: int, n: int) -> list[Any]:
    return STREAM.batch(first, n)


def kinds(c: ClientProtocol) -> list[tuple[bytes, Any]]:
    out: list[tuple[bytes, Any]] = []
    for frames in c.data_to_send():
        body = from_client(frames)
        out.append((body[0], wire.U64.unpack(body[1])[0] if body[0] in (wire.ACK, wire.NACK) else None))
    return out


def test_the_client_says_hello_then_takes_messages_in_order_and_acknowledges_by_half_windows() -> None:
    c = client(window=8)
    (frames,) = c.data_to_send()
    body = from_client(frames)
    assert body[0] == wire.HELLO and wire.decode_hello(body[1]).channel == CHANNEL
    assert c.receive_data(batch(0, 2), 0.0, consumed=0) is None  # before its WELCOME: not its messages yet
    assert c.data_port is None
    assert c.receive(welcome(5, window=4), 0.0) == Welcomed(5)
    assert c.window == 4  # the server's smaller credit
    assert c.data_port == 5555  # where the pump connects the data connection
    event = c.receive_data(batch(5, 3), 0.1, consumed=5)
    assert isinstance(event, Messages) and event.first == 5 and [bytes(b) for b, _ in event.items] == [b"5", b"6", b"7"]
    assert c.tick(0.1, consumed=6) is None
    assert kinds(c) == [(wire.ACK, 6)]  # the first tick after the WELCOME
    c.tick(0.2, consumed=7)
    assert kinds(c) == []  # 1 more consumed: less than half the window
    c.tick(0.3, consumed=8)
    assert kinds(c) == [(wire.ACK, 8)]
    c.tick(0.3 + IDLE_ACK_HEARTBEATS * HB, consumed=8)
    assert kinds(c) == [(wire.ACK, 8)]  # again anyway: it is the reader's heartbeat too
    assert c.rejected_frames == 0


def test_an_idle_clients_heartbeat_goes_every_second_interval_and_one_with_news_every_interval() -> None:
    """An ACK that says nothing new is only the reader's heartbeat: idle, it goes every
    ``IDLE_ACK_HEARTBEATS`` intervals (the idle server and reader wake half as often); as soon as
    something came or was consumed, the next goes a heartbeat after the last, as before. Either
    way the server, which drops a reader after ``hb_timeout``, hears it well within that."""
    assert IDLE_ACK_HEARTBEATS * HB * 2 < TIMEOUT  # two idle heartbeats may be lost before a drop
    c = client(window=100)
    c.data_to_send()
    c.receive(welcome(0, window=100), 0.0)
    c.receive_data(batch(0, 1), 0.0, consumed=0)
    c.tick(0.0, consumed=1, ack=True)
    assert kinds(c) == [(wire.ACK, 1)]
    # Nothing since: the next is due two intervals on, not one (and the I/O thread sleeps until then).
    assert c.next_tick(consumed=1) == IDLE_ACK_HEARTBEATS * HB
    c.tick(HB, consumed=1)
    assert kinds(c) == []
    c.tick(IDLE_ACK_HEARTBEATS * HB, consumed=1)
    assert kinds(c) == [(wire.ACK, 1)]
    last = IDLE_ACK_HEARTBEATS * HB
    # A message comes (not consumed yet): the next heartbeat is an interval after the last again.
    c.receive_data(batch(1, 1), last + 0.1, consumed=1)
    assert c.next_tick(consumed=1) == last + HB
    c.tick(last + HB, consumed=1)
    assert kinds(c) == [(wire.ACK, 1)]
    last += HB
    # Consumed since the last ACK, with nothing new come: news too, an interval after the last.
    assert c.next_tick(consumed=2) == last + HB
    assert c.next_tick(consumed=1) == last + IDLE_ACK_HEARTBEATS * HB
    c.tick(last + HB, consumed=2)
    assert kinds(c) == [(wire.ACK, 2)]


def test_the_client_acknowledges_at_once_when_asked_to_and_never_twice_the_same() -> None:
    """The reader's source asks for an ACK after ACK_BYTES consumed (large messages: the server
    holds what is not acknowledged); an ACK that says nothing new is not sent."""
    c = client(window=100)
    c.data_to_send()
    assert c.receive(welcome(0, window=100), 0.0) == Welcomed(0)
    c.tick(0.1, consumed=1)
    assert kinds(c) == []  # less than half the window, within a heartbeat
    c.tick(0.1, consumed=1, ack=True)
    assert kinds(c) == [(wire.ACK, 1)]
    c.tick(0.2, consumed=1, ack=True)
    assert kinds(c) == []  # nothing new consumed


def test_the_client_asks_again_for_a_gap_and_keeps_only_the_new_part_of_a_resend() -> None:
    c = client()
    c.data_to_send()
    c.receive(welcome(0), 0.0)
    c.receive_data(batch(0, 2), 0.0, consumed=0)
    assert c.receive_data(batch(3, 1), 0.1, consumed=0) is None  # 2 is missing
    assert kinds(c) == [(wire.NACK, 2)]
    event = c.receive_data(batch(1, 3), 0.2, consumed=0)
    assert isinstance(event, Messages) and event.first == 2 and len(event.items) == 2
    assert c.receive_data(batch(0, 2), 0.3, consumed=0) is None  # all old: a replay, nothing asked
    assert kinds(c) == []
    assert c.rejected == {"out_of_window": 1, "replayed": 1}


def test_a_batch_beyond_the_credit_is_refused_whole() -> None:
    """The server may send no more than the window beyond what the reader consumed: a frame
    that reaches past it (a replay of an old stream, a broken server) is not queued at all."""
    c = client(window=4)
    c.data_to_send()
    c.receive(welcome(0), 0.0)
    assert c.receive_data(batch(0, 5), 0.1, consumed=0) is None
    assert c.next == 0 and c.rejected == {"out_of_window": 1}
    event = c.receive_data(batch(0, 4), 0.2, consumed=0)
    assert isinstance(event, Messages) and len(event.items) == 4
    event = c.receive_data(batch(4, 3), 0.3, consumed=3)  # room up to 3 + 4
    assert isinstance(event, Messages) and event.first == 4


def test_a_starved_client_asks_again_when_the_server_says_it_has_more() -> None:
    c = client()
    c.data_to_send()
    c.receive(welcome(0), 0.0)
    c.receive(signed(wire.HEARTBEAT, wire.U64x2.pack(3, 0)), 0.5)
    c.tick(0.5, consumed=0)
    c.data_to_send()
    c.tick(2 * HB + 0.1, consumed=0)
    assert (wire.NACK, 0) in kinds(c)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("heartbeat"), st.integers(0, 12)),
            st.tuples(st.just("batch"), st.integers(1, 4)),
            st.tuples(st.just("consume"), st.integers(0, 4)),
            st.tuples(st.just("sleep"), st.floats(0.0, 0.999)),
            st.tuples(st.just("wake"), st.floats(0.0, 2.0)),
        ),
        max_size=40,
    ),
    st.booleans(),
    st.sampled_from([None, 0.7, 7.0]),
)
# a full queue while the server has more: no NACK (nothing to ask for room for), and no timer for one
@example([("batch", 4), ("heartbeat", 12), ("wake", 0.5), ("wake", 0.5), ("sleep", 0.5)], True, None)
# starved with room: the NACK's time
@example([("batch", 2), ("heartbeat", 12), ("sleep", 0.9), ("wake", 0.0), ("wake", 1.5)], True, None)
# idle after an ACK, then starved: the NACK a tick sends does not make a later ACK due in the past
@example([("wake", 0.0), ("sleep", 0.75), ("heartbeat", 1)], True, None)
def test_a_client_that_sleeps_until_next_tick_misses_nothing(
    ops: list[tuple[str, Any]], welcomed: bool, gone_timeout: float | None
) -> None:
    """The reader's I/O thread sleeps until ``next_tick`` (or a frame, or the user's ACK
    request): ``tick`` at any time before it does nothing, and after ``tick`` the next one is
    not in the past (the thread never spins on a timer that does not act)."""
    c = client(window=4, gone_timeout=gone_timeout)
    c.data_to_send()
    now, consumed = 0.0, 0
    if welcomed:
        assert c.receive(welcome(0), now) == Welcomed(0)
        c.tick(now, consumed)
        c.data_to_send()
    for op, arg in ops:
        if op == "heartbeat":
            c.receive(signed(wire.HEARTBEAT, wire.U64x2.pack(arg, 0)), now)
        elif op == "batch" and c.welcomed:
            c.receive_data(batch(c.next, min(arg, consumed + c.window - c.next) or 1), now, consumed)
        elif op == "consume":
            consumed = min(max(c.next, 0), consumed + arg)
        elif op == "sleep":  # woken early (by anything): tick has nothing to do
            due = c.next_tick(consumed)
            t = now + arg * (due - now)
            c.data_to_send()
            assert c.tick(t, consumed) is None
            assert c.data_to_send() == [], (op, arg, now, due)
            now = t
            continue
        else:  # the timer: at its time, or later
            now = max(now, c.next_tick(consumed)) + arg
            if c.tick(now, consumed) is not None:
                return  # the server taken for gone: the thread stops
        c.tick(now, consumed)  # a wake-up's tick, as the I/O loop does after every frame
        c.data_to_send()
        assert c.next_tick(consumed) >= now


def test_the_client_reports_gaps_end_refusal_and_silence() -> None:
    c = client()
    c.data_to_send()
    c.receive(welcome(0), 0.0)
    lagged = STREAM.control(wire.LAGGED, wire.U64x2.pack(5, 5))
    assert c.receive_data(lagged, 0.1, consumed=0) == Lagged(5, 5)
    assert c.receive_data(lagged, 0.1, consumed=5) is None  # a replay of it
    assert c.receive_data(STREAM.control(wire.LAGGED, wire.U64x2.pack(3, 3)), 0.1, consumed=5) is None  # old news
    closed = wire.U64.pack(7) + b"closed"
    assert c.receive_data(STREAM.control(wire.END, closed), 0.1, consumed=5) is None  # it lacks 5 and 6
    c.receive_data(batch(5, 2), 0.2, consumed=5)
    assert c.receive_data(STREAM.control(wire.END, wire.U64.pack(7) + b"gone"), 0.2, consumed=5) == Ended("gone")
    assert c.receive_data(STREAM.control(wire.END, closed), 0.2, consumed=5) == Ended("closed")
    assert c.receive(signed(wire.REFUSED, b"why"), 0.3) == Refused("why", welcomed=True)
    assert c.tick(0.3 + 3 * TIMEOUT, consumed=7) is None
    assert c.tick(0.31 + 3 * TIMEOUT, consumed=7) == Ended("silent")
    assert c.rejected == {"replayed": 1}


def test_a_client_the_server_forgot_says_hello_again_with_where_it_is() -> None:
    c = client()
    c.data_to_send()
    c.receive(welcome(0), 0.0)
    c.receive_data(batch(0, 3), 0.0, consumed=0)
    c.receive(signed(wire.UNKNOWN), 0.1)
    (frames,) = c.data_to_send()
    body = from_client(frames)
    assert body[0] == wire.HELLO and wire.decode_hello(body[1]).resume == 3
    assert c.receive(welcome(3), 0.2) is None  # the same place: no second Welcomed


def test_a_client_takes_the_keys_of_a_rekey_and_asks_again_for_a_key_it_lacks() -> None:
    stream = Stream()
    c = client(window=16)
    c.data_to_send()
    c.receive(welcome(0, window=16, stream=stream), 0.0)
    assert isinstance(c.receive_data(stream.batch(0, 1), 0.1, consumed=0), Messages)
    stream.sealer.rekey()  # the next key was announced: it opens without the KEYS
    assert isinstance(c.receive_data(stream.batch(1, 1), 0.2, consumed=0), Messages)
    stream.sealer.rekey()  # a key it was never told of
    assert c.receive_data(stream.batch(2, 1), 0.3, consumed=0) is None
    (frames,) = c.data_to_send()  # it asks for the keys again: a HELLO that resumes where it is
    body = from_client(frames)
    assert body[0] == wire.HELLO and wire.decode_hello(body[1]).resume == 2
    assert c.receive_data(stream.batch(2, 1), 0.4, consumed=0) is None
    assert c.data_to_send() == []  # at most once a heartbeat
    assert c.receive(signed(wire.KEYS, stream.sealer.keys_message()), 0.5) is None
    assert isinstance(c.receive_data(stream.batch(2, 1), 0.6, consumed=0), Messages)
    assert c.rejected == {"unknown_key": 2}


def test_a_client_repeats_its_hello_until_welcomed_and_a_refusal_before_is_final() -> None:
    c = client()
    c.data_to_send()
    c.tick(4 * HB * 0.5, consumed=0)
    assert c.data_to_send() == []
    c.tick(2.01, consumed=0)
    (frames,) = c.data_to_send()
    assert from_client(frames)[0] == wire.HELLO
    assert c.receive(signed(wire.REFUSED, b"full"), 2.1) == Refused("full", welcomed=False)
    assert c.tick(1000.0, consumed=0) is None  # not welcomed: never "silent"


@pytest.mark.parametrize(
    "frames",
    [
        [wire.HEARTBEAT, b"\1\2\3"],
        [wire.KEYS, b"\1\0"],  # a truncated keys message
        [wire.KEYS],
        [wire.WELCOME, b"{not json"],
        [wire.WELCOME, b'{"start": "x"}'],
        [wire.WELCOME, b"[]"],
        [b"Q", b""],
        # data frames have no place on the control connection
        [wire.LAGGED, wire.U64x2.pack(5, 5)],
        [wire.END, wire.U64.pack(0), b"closed"],
    ],
)
def test_a_malformed_server_frame_is_dropped_and_is_no_sign_of_life(frames: list[bytes]) -> None:
    c = client()
    c.data_to_send()
    c.receive(welcome(0), 0.0)
    assert c.receive(signed(*frames), 10.0) is None
    assert c.receive(frames, 10.0) is None  # unsigned
    assert c.tick(3 * TIMEOUT + 0.01, consumed=0) == Ended("silent")  # heard last at 0.0
    assert c.next == 0


def test_a_welcome_with_keys_of_the_other_mode_or_no_data_port_is_dropped() -> None:
    encrypting = Stream(secret=None)  # a key message of the CurveZMQ mode, to an insecure reader
    c = client()
    c.data_to_send()
    bad = [
        welcome(0, stream=encrypting),
        welcome(0, port=0),
        welcome(0, port=70000),
        welcome(0, mac_key="ab" * 16),  # a writer's MAC key of 16 bytes, not 32
        welcome(0, mac_key="not hex"),
        signed(wire.WELCOME, wire.encode_json({"start": 0, "hb_interval": HB, "hb_timeout": TIMEOUT})),
        signed(
            wire.WELCOME,
            wire.encode_json({k: v for k, v in wire.decode_json(welcome(0).frames[1]).items() if k != "mac_key"}),
        ),
    ]
    for frames in bad:
        assert c.receive(frames, 0.1) is None
    assert not c.welcomed and c.data_port is None


def test_the_welcome_gives_the_data_connections_password_and_a_bad_one_drops_it() -> None:
    c = client()
    c.data_to_send()
    for token in (7, "", "x" * (wire.MAX_DATA_TOKEN + 1), ["ab"]):
        assert c.receive(welcome(0, data_token=token), 0.1) is None
        assert not c.welcomed and c.data_token is None
    assert c.receive(welcome(0, data_token="ab" * 16), 0.1) == Welcomed(0)
    assert c.data_token == "ab" * 16  # the pump connects the data connection with it (PLAIN)
    assert c.receive(welcome(0, data_token="cd" * 16), 0.2) is None  # a restarted server's
    assert c.data_token == "cd" * 16


def test_the_servers_welcome_names_its_data_password() -> None:
    for token in (None, "ef" * 16):
        srv, net = server(data_token=token), Net()
        assert isinstance(net.receive(srv, b"r", hello(), now=0.0, published=0), Admitted)
        ((_, welcome_frames),) = net.take(b"r")
        assert wire.decode_json(net.peer(b"r").verify(welcome_frames)[1]).get("data_token") == token


@pytest.mark.parametrize(
    "frames",
    [
        [wire.BATCH, b"\0" * 5, b""],
        [wire.BATCH, wire.BATCH_HEAD.pack(0, 1) + wire.ENTRY.pack(10, 0), b"abc"],
        [wire.BATCH, wire.BATCH_HEAD.pack(0, 2) + wire.ENTRY.pack(3, 0), b"abc"],
        [wire.BATCH, wire.BATCH_HEAD.pack(0, 1) + wire.ENTRY.pack(3, 0)],
        [wire.BATCH],
        [wire.BATCH, wire.BATCH_HEAD.pack(0, 1) + wire.ENTRY.pack(3, 0), b"abc"],  # not sealed
        [wire.LAGGED, b"x"],
        [wire.LAGGED, wire.U64x2.pack(5, 5)],  # not sealed
        [wire.END],
        [wire.END, wire.U64.pack(0), b"closed"],  # not sealed
        [wire.HEARTBEAT, wire.U64x2.pack(3, 0)],  # a control frame on the data connection
        [b"Q", b""],
        [],
    ],
)
def test_a_malformed_data_frame_is_refused_counted_and_is_no_sign_of_life(frames: list[bytes]) -> None:
    c = client()
    c.data_to_send()
    c.receive(welcome(0), 0.0)
    assert c.receive_data(frames, 10.0, consumed=0) is None
    assert c.rejected_frames == 1
    assert c.tick(3 * TIMEOUT + 0.01, consumed=0) == Ended("silent")  # heard last at 0.0
    assert c.next == 0


def test_a_forged_server_without_the_key_is_never_believed() -> None:
    c = client()
    c.data_to_send()
    wrong = secrets.token_bytes(32)
    assert c._signer is not None
    body = welcome(0).frames
    # the forger saw the reader's nonce on the wire, but lacks the key
    nonces = {"reader_nonce": c._signer.reader_nonce, "server_nonce": secrets.token_bytes(wire.NONCE_BYTES)}
    forged = wire.sign(wire.control_key(wrong), body, to_reader=True, counter=1, **nonces)
    for frames in (forged, body, [*body, b"\0" * wire.SIGNATURE_BYTES], [*body, forged[-1][: wire.TRAILER.size]]):
        assert c.receive(frames, 0.1) is None
    assert not c.welcomed and "connecting" in repr(c)
    # Welcomed by the real server, the reader opens nothing a forger sealed, with its own key
    # id or with the real one, nor a real body moved or tampered with.
    c.receive(welcome(0), 0.2)
    forger = Stream(secret=wrong)
    real = bytearray(STREAM.body(0))
    tampered = bytes(real[:-1]) + bytes([real[-1] ^ 1])
    for frames in (
        forger.batch(0, 1),
        wire.encode_batch(0, [(bytes(real[:4]) + bytes(forger.body(0))[4:], 0)]),  # the real key id
        wire.encode_batch(0, [(tampered, 0)]),
        wire.encode_batch(1, [(STREAM.body(0), 0)]),  # message 0 shown as 1
        wire.encode_batch(0, [(STREAM.body(0), 1)]),  # other flags
        forger.control(wire.END, wire.U64.pack(0) + b"closed"),
    ):
        assert c.receive_data(frames, 0.3, consumed=0) is None
    assert c.next == 0 and c.rejected_frames == 6
    event = c.receive_data(batch(0, 1), 0.4, consumed=0)
    assert isinstance(event, Messages) and bytes(event.items[0][0]) == b"0"


# --- where a gap starts --------------------------------------------------------------------------


def _deliver(c: ClientProtocol, sent: list[tuple[bool, list[Any]]], now: float, consumed: int) -> list[ClientEvent]:
    """Feed ``c`` frame groups as the server sent them (control or data); the events it gives."""
    events = [c.receive_data(f, now, consumed) if data else c.receive(f, now) for data, f in sent]
    return [e for e in events if e is not None]


def test_a_lagged_sealed_for_another_reader_does_not_move_this_one() -> None:
    """The seal binds a LAGGED to its channel, key and counter, not to its reader, so A's LAGGED
    opens at B. Its gap starts where A was: B, still before that, must not take it (it would skip
    messages the server still holds for it). It refuses it as out of its window and asks for
    what it lacks; the server then sends B everything it holds, and B's own exact gap."""
    srv, net = server(window=16), Net()
    a, b = client(window=16), client(window=16)
    macs: dict[bytes, seal.WriterMac] = {}
    for ident, c in ((b"a", a), (b"b", b)):
        for frames in c.data_to_send():
            net.receive(srv, ident, frames, now=0.0, published=0)
        sent = net.take(ident)
        # insecure mode: a reader's writer-MAC key crosses in clear in its WELCOME
        macs[ident] = seal.WriterMac(bytes.fromhex(wire.decode_json(sent[0][1][1])["mac_key"]))
        assert _deliver(c, sent, 0.0, 0) == [Welcomed(0)]
    publish(srv, 0, 1, 2)
    net.full.add(b"b")  # B's queue is full: the batch goes to A only
    net.transmit(srv)
    assert [type(e) for e in _deliver(a, net.take(b"a"), 0.1, 0)] == [Messages]
    srv.lost(10)
    publish(srv, 10)
    net.transmit(srv)
    (lagged, _batch) = net.take(b"a")
    assert lagged[1][0] == wire.LAGGED
    # An on-path host copies A's LAGGED into B's data connection: A's MAC does not check at B.
    assert b.receive_data(lagged[1], 0.2, consumed=0) is None
    assert b.next == 0 and b.rejected == {"not_authentic": 1}
    # Under insecure=True it read B's MAC key in B's WELCOME, and puts B's MAC on A's LAGGED:
    # the gap starts past B's place, so B takes it for nothing.
    macs[b"b"].counter = 10**6
    assert b.receive_data(macs[b"b"].sign(lagged[1][:-1]), 0.2, consumed=0) is None
    assert b.next == 0 and b.rejected == {"not_authentic": 1, "out_of_window": 1}
    assert kinds(b) == [(wire.NACK, 0)] * 2  # each refusal asks for what follows what it has
    net.full.discard(b"b")
    net.transmit(srv)
    net.transmit(srv)
    net.transmit(srv)
    events = _deliver(b, net.take(b"b"), 0.3, 0)
    assert [(type(e), getattr(e, "first", None)) for e in events] == [(Messages, 0), (Lagged, None), (Messages, 10)]
    assert events[1] == Lagged(missed=7, resume_at=10)
    assert [bytes(body) for body, _ in events[0].items] == [b"mmm"] * 3  # type: ignore[union-attr]


def test_a_readers_own_lagged_that_overtakes_a_lost_batch_is_asked_again_not_taken() -> None:
    """No attacker: the batch 0..2 is lost in transit (a data reconnect), and the reader's own
    LAGGED for 3..9 comes first. Its gap starts after the reader's place: the reader asks for
    what follows what it has, and gets 0..2 (the server still holds them), then the gap."""
    srv, net = server(window=16), Net()
    c = client(window=16)
    for frames in c.data_to_send():
        net.receive(srv, b"c", frames, now=0.0, published=0)
    assert _deliver(c, net.take(b"c"), 0.0, 0) == [Welcomed(0)]
    publish(srv, 0, 1, 2)
    net.transmit(srv)
    net.take(b"c")  # lost
    srv.lost(10)
    publish(srv, 10)
    net.transmit(srv)
    net.transmit(srv)
    assert _deliver(c, net.take(b"c"), 0.1, 0) == []  # LAGGED refused, then batch 10 after a gap
    assert c.next == 0 and c.rejected == {"out_of_window": 2}
    for frames in c.data_to_send():
        assert from_client(frames)[0] == wire.NACK
        net.receive(srv, b"c", frames, now=1.5, published=11)
    for _ in range(3):
        net.transmit(srv)
    events = _deliver(c, net.take(b"c"), 1.6, 0)
    assert [type(e) for e in events] == [Messages, Lagged, Messages]
    assert events[0].first == 0 and len(events[0].items) == 3  # type: ignore[union-attr]
    assert events[1] == Lagged(missed=7, resume_at=10)


# --- insecure mode: signed control frames are bound to their session and direction --------------


def _reader(name: str) -> ClientProtocol:
    return ClientProtocol(key=KEY, channel=CHANNEL, name=name, pid=1, host="h", window=8, now=0.0)


def _join(srv: ServerProtocol, net: Net, ident: bytes, c: ClientProtocol, published: int) -> list[Any]:
    """``c`` says HELLO to ``srv``; the frame groups it was answered (not delivered yet)."""
    for frames in c.data_to_send():
        net.receive(srv, ident, frames, now=0.0, published=published)
    return [frames for _, frames in net.take(ident)]


def test_another_readers_welcome_is_refused_and_the_reader_starts_where_its_own_says() -> None:
    """A joins at 0; messages 0-4 are published; B joins. A's WELCOME, copied into B's control
    connection before B's own, would start B at 0, where the server has nothing for it (it
    starts B at 5): B refuses it (signed for A's nonce) and takes its own."""
    srv, net = server(window=8), Net()
    a, b = _reader("a"), _reader("b")
    (a_welcome,) = _join(srv, net, b"a", a, 0)
    assert a.receive(a_welcome, 0.0) == Welcomed(0)
    (b_welcome,) = _join(srv, net, b"b", b, 5)
    assert b.receive(a_welcome, 0.1) is None and not b.welcomed
    assert b.receive(b_welcome, 0.1) == Welcomed(5)
    assert b.receive(a_welcome, 0.2) is None and b.next == 5


def test_a_recorded_refused_or_old_keys_are_refused_by_a_reader_in_its_session() -> None:
    """A REFUSED the server sent another peer, and a KEYS of earlier in the reader's own session,
    are authentic (signed with the handle's key) but not for this reader now: it refuses both,
    and reads on with the keys it has."""
    srv, net = server(window=8), Net()
    a = _reader("a")
    (welcome_a,) = _join(srv, net, b"a", a, 0)
    a.receive(welcome_a, 0.0)
    stranger = ClientProtocol(key=KEY, channel="another", name="s", pid=2, host="h", window=8, now=0.0)
    (refused,) = _join(srv, net, b"s", stranger, 0)
    assert stranger.receive(refused, 0.0) == Refused(
        "this handle is of another channel than the one served at this endpoint (another channel name, or an "
        "earlier writer here without a channel name or fixed keys)",
        welcomed=False,
    )
    assert a.receive(refused, 0.1) is None  # signed for the stranger's nonce
    srv.rekey()
    net.send_keys(srv)
    ((_, first_keys),) = net.take(b"a")
    assert a.receive(first_keys, 0.2) is None
    srv.rekey()
    net.send_keys(srv)
    ((_, second_keys),) = net.take(b"a")
    a.receive(second_keys, 0.3)
    held = a._opener.key_ids
    assert a.receive(first_keys, 0.4) is None  # a replay: its counter is not above the last taken
    assert a._opener.key_ids == held
    publish(srv, 0, 1)
    net.transmit(srv)
    events = _deliver(a, net.take(b"a"), 0.5, 0)
    assert [type(e) for e in events] == [Messages] and a.rejected_frames == 0


def test_a_recorded_bye_or_hello_drops_nobody_and_a_reflected_frame_is_refused() -> None:
    """A's BYE, copied into B's control connection, is refused (B's session is not A's) and B
    stays; A's own BYE replayed once A left does nothing; a HELLO replayed in its session is a
    replay; a frame sent back to the side that signed it is refused (the direction is signed)."""
    srv, net = server(window=8), Net()
    a, b = _reader("a"), _reader("b")
    a.receive(_join(srv, net, b"a", a, 0)[0], 0.0)
    b.receive(_join(srv, net, b"b", b, 0)[0], 0.0)
    bye = a.bye()
    assert isinstance(net.receive(srv, b"a", bye, now=0.1, published=0), Departed)
    event = net.receive(srv, b"b", bye, now=0.2, published=0)
    assert isinstance(event, Rejected) and event.dropped is None
    assert net.receive(srv, b"a", bye, now=0.3, published=0) is None  # A left: nothing to drop
    assert [r["name"] for r in srv.report()["readers"]] == ["b"] and net.take(b"b") == []
    a.tick(1.0, consumed=0)
    b.tick(1.0, consumed=0)
    (ack_frames,) = b.data_to_send()
    assert net.receive(srv, b"b", ack_frames, now=1.0, published=0) is None
    event = net.receive(srv, b"b", ack_frames, now=1.1, published=0)  # the same ACK again
    assert isinstance(event, Rejected) and "replay" in event.reason and event.dropped is None
    assert b.receive(ack_frames, 1.2) is None  # the reader's own frame, sent back to it
    assert srv.rejected_frames == 2 and [r["name"] for r in srv.report()["readers"]] == ["b"]


def test_a_recorded_hello_neither_moves_nor_replaces_a_readers_session() -> None:
    """A reader's first HELLO (no resume: "start me at the stream's end"), played again in its
    session, is a replay; played again once the reader is in a later session (it was dropped,
    and came back), it is of another session on that reader's connection: refused either way,
    and the reader keeps its place (under "block", a place moved to the end would let the server
    forget what the reader has not read)."""
    srv, net = server("block", window=8), Net()
    b = _reader("b")
    (hello1,) = b.data_to_send()
    assert isinstance(net.receive(srv, b"b", hello1, now=0.0, published=3), Admitted)
    (welcome1,) = [f for _, f in net.take(b"b")]
    assert b.receive(welcome1, 0.0) == Welcomed(3)
    event = net.receive(srv, b"b", hello1, now=2.0, published=9)
    assert isinstance(event, Rejected) and "replay" in event.reason and event.dropped is None
    assert net.heartbeat(srv, TIMEOUT + 1.0)  # silent: dropped
    b.tick(TIMEOUT + 1.0, consumed=3)
    for frames in b.data_to_send():  # its ACK: "who are you?"
        net.receive(srv, b"b", frames, now=TIMEOUT + 1.0, published=9)
    for _, frames in net.take(b"b"):
        b.receive(frames, TIMEOUT + 1.0)
    for frames in b.data_to_send():  # a HELLO of a new session, resuming at 3
        assert isinstance(net.receive(srv, b"b", frames, now=TIMEOUT + 1.0, published=9), Admitted)
    event = net.receive(srv, b"b", hello1, now=TIMEOUT + 9.0, published=9)
    assert isinstance(event, Rejected) and "another session" in event.reason and event.dropped is None
    (reader,) = srv.report()["readers"]
    assert reader["received"] == 3  # its place, not the stream's end


def test_a_reader_of_protocol_5_is_refused_by_name_in_its_own_terms() -> None:
    """A reader of protocol 5 signs its HELLO with the handle's key itself, and checks what it
    is answered the same way: it gets a REFUSED it can check, that names the versions."""
    srv, net = server(), Net()
    body = {"version": 5, "name": "old", "pid": 1, "window": 4, "resume": None, "channel": CHANNEL}
    hello_v5 = wire.legacy_sign(KEY, [wire.HELLO, wire.encode_json(body)])
    assert isinstance(net.receive(srv, b"old", hello_v5, now=0.0, published=0), Rejected)
    ((_, answer),) = net.take(b"old")
    mac = answer[-1]
    assert answer[0] == wire.REFUSED and wire.legacy_sign(KEY, answer[:-1])[-1] == mac
    assert bytes(answer[1]).startswith(b"protocol version mismatch: this server speaks protocol 6")
    assert srv.report()["readers"] == []
    forged = wire.legacy_sign(secrets.token_bytes(32), [wire.HELLO, wire.encode_json(body)])
    net.receive(srv, b"old", forged, now=0.0, published=0)
    assert net.take(b"old") == []  # without the key: no answer


def test_the_keys_of_insecure_mode_are_derived_apart_from_the_handles_key() -> None:
    """The handle's key signs nothing itself: the control key, the control password and the
    data plane's secret are three HKDF outputs under labels of their own."""
    derived = {wire.control_key(KEY), bytes.fromhex(wire.control_password(KEY).decode()), wire.data_secret(KEY)}
    assert len(derived) == 3 and KEY not in derived and all(len(k) == 32 for k in derived)
    assert wire.control_key(KEY) == wire.control_key(KEY) != wire.control_key(secrets.token_bytes(32))


# --- readers that hold the group key: only the writer's server writes ---------------------------


def sealed_reader(name: str) -> ClientProtocol:
    """A reader of a CurveZMQ channel (no HMAC: CurveZMQ protects its control connection)."""
    return ClientProtocol(key=None, channel=CHANNEL, name=name, pid=1, host="h", window=8, now=0.0)


def join(srv: ServerProtocol, net: Net, ident: bytes, c: ClientProtocol, now: float = 0.0) -> bytes:
    """``c`` says HELLO to ``srv`` and takes its WELCOME; the MAC key the WELCOME gave it."""
    for frames in c.data_to_send():
        net.receive(srv, ident, frames, now=now, published=srv.end)
    ((data, frames),) = net.take(ident)
    assert not data and frames[0] == wire.WELCOME
    c.receive(frames, now)
    assert c.welcomed
    return bytes.fromhex(wire.decode_json(frames[1])["mac_key"])


def test_an_admitted_reader_cannot_make_another_accept_a_frame_it_sealed() -> None:
    """Reader b is admitted, so it holds the group key; on the path to reader a it forges toward
    it: a body sealed under the group key (without a MAC, with b's own writer MAC, with a's MAC
    copied from the genuine batch), a's genuine batch with a body of the same GCM tag that
    opens to a pickle of b's choice, b's own genuine batch, and a LAGGED and an END sealed under
    the group key. Each opens under the group key; a refuses each as not authentic, delivers
    nothing, stays where it is; then the genuine batch gives it every message."""
    channel = CHANNEL.encode()
    srv, net = server(key=None), Net(key=None)
    a, b = sealed_reader("a"), sealed_reader("b")
    key_a, key_b = join(srv, net, b"a", a), join(srv, net, b"b", b)
    assert key_a != key_b  # a key per reader
    bodies = [pickle.dumps(b"y" * 400), pickle.dumps("second")]
    for seq, body in enumerate(bodies):
        srv.add(seq, (body, 0))
    net.transmit(srv)
    ((_, genuine),) = net.take(b"a")
    ((_, genuine_b),) = net.take(b"b")
    assert isinstance(b.receive_data(genuine_b, 0.1, consumed=0), Messages)  # b reads, as it may

    group = b._opener  # what b holds
    mine = _forge.seal_body(group, channel, 0, 0, pickle.dumps("forged"))
    forged = wire.encode_batch(0, [(mine, 0)])
    first_len = wire.ENTRY.unpack_from(genuine[1], wire.BATCH_HEAD.size)[0]
    joined = bytes(genuine[2])
    exploit = _forge.exploit("/nonexistent/pwned")
    collided = _forge.same_tag(group, 0, 0, joined[:first_len], exploit) + joined[first_len:]
    lagged = [wire.LAGGED, _forge.seal_control(group, channel, wire.LAGGED, wire.U64x2.pack(5, 5))]
    end = [wire.END, _forge.seal_control(group, channel, wire.END, wire.U64.pack(0) + b"closed")]
    # Every one of these opens under the group key: the seal alone would let them in.
    check = seal.Opener(channel)
    check.install(srv.sealer.keys_message())
    assert bytes(check.open(0, 0, mine)) == pickle.dumps("forged")
    assert bytes(check.open(0, 0, collided[:first_len])).startswith(exploit)
    assert check.open_control(wire.END, end[1]) == wire.U64.pack(0) + b"closed"
    b_signs = seal.WriterMac(key_b)
    b_signs.counter = 10**6
    forgeries = [
        forged,
        b_signs.sign(forged),
        [*forged, genuine[-1]],
        [genuine[0], genuine[1], collided, genuine[-1]],
        genuine_b,
        [*lagged, genuine[-1]],
        b_signs.sign(lagged),
        [*end, genuine[-1]],
        b_signs.sign(end),
    ]
    for frames in forgeries:
        assert a.receive_data(frames, 0.2, consumed=0) is None
        assert a.next == 0
    assert a.rejected == {"not_authentic": len(forgeries)}
    event = a.receive_data(genuine, 0.3, consumed=0)
    assert isinstance(event, Messages) and event.first == 0
    assert [bytes(body) for body, _ in event.items] == bodies
    assert a.rejected_frames == len(forgeries)


def test_each_reader_has_its_own_mac_key_kept_while_it_stays_admitted() -> None:
    """A reader that joins mid-stream gets its key in its WELCOME and checks its first frame
    with it; one that says HELLO again (it lacked a group key) keeps its key and its counter
    goes on (frames on their way still check, no nonce repeats); one dropped and admitted
    again gets a fresh key, under which the old frames no longer check."""
    srv, net = server(key=None), Net(key=None)
    for seq in range(4):
        srv.add(seq, (b"%d" % seq, 0))
    c = sealed_reader("late")
    key = join(srv, net, b"c", c)
    assert c.next == 4  # it joined after four messages: it starts with the next one
    srv.add(4, (b"4", 0))
    net.transmit(srv)
    ((_, first),) = net.take(b"c")
    assert isinstance(c.receive_data(first, 0.1, consumed=4), Messages)
    # HELLO again, a heartbeat later (as for a key it lacks): the same key, the counter goes on
    c._hello(5)
    assert join(srv, net, b"c", c, now=2 * HB) == key
    srv.add(5, (b"5", 0))
    net.transmit(srv)
    ((_, second),) = net.take(b"c")
    assert wire.U64.unpack_from(second[-1])[0] > wire.U64.unpack_from(first[-1])[0]
    assert isinstance(c.receive_data(second, 2 * HB, consumed=5), Messages)
    # Dropped for its silence, then back: a new key; a frame under the old one is refused.
    net.heartbeat(srv, 2 * HB + TIMEOUT + 1)
    assert srv.report()["readers"] == []
    c._hello(6)
    assert join(srv, net, b"c", c, now=2 * HB + TIMEOUT + 2) != key
    assert c.receive_data(second, 2 * HB + TIMEOUT + 2, consumed=6) is None
    assert c.rejected == {"not_authentic": 1}


# --- both together, over a lossy link ----------------------------------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("publish"), st.integers(1, 6)),
        st.tuples(st.just("ring_loses"), st.integers(1, 5)),
        st.tuples(st.just("to_client"), st.booleans()),  # deliver, or lose in transit
        st.tuples(st.just("to_server"), st.booleans()),
        st.tuples(st.just("consume"), st.integers(1, 8)),
        st.tuples(st.just("time"), st.floats(0.01, 2.5)),
        st.tuples(st.just("hostile"), st.sampled_from(list(HOSTILE))),
        # another reader's frames: delivered to it, lost, or also copied into this reader's data
        # connection by an on-path host (they open there: the seal does not name the reader)
        st.tuples(st.just("other"), st.sampled_from(["deliver", "lose", "copy"])),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, policy=st.sampled_from(["lag", "block"]), window=st.integers(1, 6), buffer_max=st.integers(2, 8))
# the reader's batch is lost, and its own LAGGED for what follows comes: it asks again for 0
@example([("publish", 1), ("to_client", False), ("ring_loses", 1)], "lag", 2, 2)
# the other reader's LAGGED (a gap from 4) copied to this one, which has 0 and 1 and still
# needs 2 and 3 (the server holds them, but this reader's credit is used up)
@example(
    [
        ("publish", 4),
        ("to_client", True),
        ("other", "deliver"),
        ("other", "deliver"),
        ("ring_loses", 2),
        ("publish", 1),
        ("other", "copy"),
    ],
    "lag",
    2,
    8,
)
def test_over_a_lossy_link_a_reader_gets_every_message_once_in_order_or_an_exact_gap(
    ops: list[tuple[str, Any]], policy: str, window: int, buffer_max: int
) -> None:
    """Random publishing, ring losses, frames lost both ways, time passing and hostile frames
    from another peer: what the reader takes is always in order, never twice, every number
    accounted for (a message or a counted gap); the server never sends beyond the credit nor
    holds more than its bound; once the stream ends and the link is good, the reader ends with
    everything accounted for. A gap the reader is told of starts where the reader is, and holds
    only messages the server no longer has (so could not send it), even when another reader's
    gaps are copied into its data connection."""
    srv, net = server(policy, window=window, buffer_max=buffer_max), Net()
    c = ClientProtocol(key=KEY, channel=CHANNEL, name="c", pid=1, host="h", window=window, now=0.0, gone_timeout=1e9)
    other = ClientProtocol(key=KEY, channel=CHANNEL, name="o", pid=2, host="h", window=2, now=0.0, gone_timeout=1e9)
    now, seq = 0.0, 0
    queue: list[ClientEvent] = []  # what the reader has not taken yet
    taken: list[int] = []  # message numbers taken
    accounted = 0  # next number the reader has accounted for (taken or lost)
    consumed = 0

    def to_server(deliver: bool) -> None:
        for frames in c.data_to_send():
            if deliver:
                net.receive(srv, b"c", frames, now=now, published=seq)

    def to_client(deliver: bool) -> None:
        for data, frames in net.take(b"c"):
            if deliver:
                receive(data, frames)

    def receive(data: bool, frames: list[Any]) -> None:
        nonlocal consumed
        before = c.next
        event = c.receive_data(frames, now, consumed) if data else c.receive(frames, now)
        if isinstance(event, Welcomed):
            consumed = event.start
        elif event is not None:
            if isinstance(event, Lagged):
                # where the gap starts is the reader's place, and nothing in it is still held
                assert event.resume_at - event.missed == before >= 0
                held = set(srv._held.seqs)
                assert not any(s in held for s in range(before, event.resume_at)), (before, event, held)
            queue.append(event)

    def to_other(how: str) -> None:
        """The other reader takes what it is sent at once (so it keeps up under "block")."""
        for data, frames in net.take(b"o"):
            if how == "lose":
                continue
            other.receive_data(frames, now, other.next) if data else other.receive(frames, now)
            if how == "copy" and data:
                receive(True, frames)
        other.tick(now, max(other.next, 0), ack=True)
        for frames in other.data_to_send():
            net.receive(srv, b"o", frames, now=now, published=seq)

    def take(n: int) -> None:
        nonlocal accounted, consumed
        while n > 0 and queue:
            event = queue[0]
            if isinstance(event, Messages):
                assert event.first == accounted
                taken.append(event.first)
                accounted += 1
                consumed = accounted
                if len(event.items) > 1:
                    queue[0] = Messages(event.first + 1, event.items[1:])
                else:
                    queue.pop(0)
                n -= 1
            elif isinstance(event, Lagged):
                assert event.resume_at == accounted + event.missed
                accounted = consumed = event.resume_at
                queue.pop(0)
            else:
                assert isinstance(event, Ended)
                return

    def step() -> None:
        net.send_keys(srv)
        net.transmit(srv)
        srv.trim(now)
        held = repr(srv)
        if policy == "lag":
            assert f"({buffer_max + 1})" not in held
        # The credit: the server sends only below what the reader acknowledged plus its window,
        # and the reader acknowledges no more than it took, so it never holds more than that.
        held_by_reader = sum(len(e.items) for e in queue if isinstance(e, Messages))
        assert held_by_reader <= window

    to_server(True)
    to_client(True)
    assert c.welcomed
    accounted = consumed = c.next
    to_other("deliver")
    to_other("deliver")
    assert other.welcomed
    for op, arg in ops:
        if op == "publish":
            for _ in range(arg):
                if srv.wants_ring():
                    srv.add(seq, (b"%d" % seq, 0))
                    seq += 1
        elif op == "ring_loses" and policy == "lag":
            seq += arg
            srv.lost(seq)
        elif op == "to_client":
            to_client(arg)
        elif op == "to_server":
            to_server(arg)
        elif op == "consume":
            take(arg)
        elif op == "time":
            now += arg
            c.tick(now, consumed)
            if srv.heartbeat_due(now):
                # a reader silent too long (its ACKs lost) is dropped: it comes back with a HELLO
                # that says where it is, and is told exactly what it lost meanwhile
                net.heartbeat(srv, now)
        elif op == "hostile":
            net.receive(srv, b"other", signed(*HOSTILE[arg]), now=now, published=seq)
            net.take(b"other")
        elif op == "other":
            to_other(arg)
        step()
    # The stream ends; from here the link is good and the reader reads everything.
    srv.stream_ended("closed")
    for _ in range(4 * (seq + 10)):
        now += 0.6
        c.tick(now, consumed)
        if srv.heartbeat_due(now):
            net.heartbeat(srv, now)
        to_server(True)
        step()
        to_client(True)
        to_other("deliver")
        take(10**6)
        if queue and isinstance(queue[0], Ended):
            break
    assert queue and queue[0] == Ended("closed"), (queue, accounted, seq)
    assert accounted == seq
    assert taken == sorted(set(taken))


def test_the_wire_and_the_protocol_load_no_zeromq() -> None:
    """The CLI takes the server's ring-place name from wire.py, and the protocol is sans-IO:
    importing either must not load ZeroMQ (a fresh interpreter, so nothing else loaded it)."""
    code = (
        "import sys, aiobroadcast._tcp.wire, aiobroadcast._tcp.serving, aiobroadcast._tcp.receiving; "
        "print(sorted(m for m in sys.modules if m == 'zmq' or m.startswith('zmq.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
