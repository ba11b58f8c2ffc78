"""The TCP server's loop takes the ring a turn at a time: at most ``TURN_BYTES`` of bodies (or 4096
messages) before what it sealed is sent. A real ring, and a real server built in this process on
it (its sockets bound on 127.0.0.1), with no reader connected: ``RingFeed.pull`` is one turn's take.
And what a turn does with a reader the protocol fails on: that reader only is dropped."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from aiobroadcast._constants import REKEY_BYTES, REKEY_MESSAGES
from aiobroadcast._shm.segment import attach_segment
from aiobroadcast._tcp import server as tcp_server
from aiobroadcast._tcp import wire
from aiobroadcast._tcp.server import TcpServer
from aiobroadcast._tcp.settings import ServerSettings
from aiobroadcast.blocking import BlockingWriter, open_writer


@pytest.fixture
def ring_and_server(tmp_path: Path) -> Iterator[tuple[BlockingWriter[object], TcpServer]]:
    with open_writer(capacity=64, slot_bytes=70_000, max_readers=2) as writer:
        handle = writer.handle
        seg = attach_segment(handle.path, handle.token, handle.capacity, handle.slot_bytes, handle.max_readers)
        stop_r, stop_w = os.pipe()
        try:
            settings = ServerSettings(
                handle=handle,
                endpoint="tcp://127.0.0.1:0",
                insecure=True,
                hmac_key=os.urandom(32).hex(),
                window=256,
                buffer_max=512,
                hb_interval=1.0,
                hb_timeout=5.0,
                max_remote=2,
                sole_reader=False,
                rekey_messages=REKEY_MESSAGES,
                rekey_bytes=REKEY_BYTES,
                data_port=0,
                report_path=str(tmp_path / "stats.json"),
            )
            server = TcpServer(seg, settings, stop_fd=stop_r)
        except BaseException:
            seg.close()
            raise
        try:
            yield writer, server
        finally:
            server._src.close()  # and the segment with it, as when the server stops
            server._net.close()
            os.close(stop_r)
            os.close(stop_w)


def test_a_turn_takes_large_bodies_up_to_turn_bytes(ring_and_server: tuple[BlockingWriter[object], TcpServer]) -> None:
    writer, server = ring_and_server
    body = b"x" * (16 * 1024)  # pickled: a little more than 16 KiB
    per_turn = -(-tcp_server.TURN_BYTES // len(body))  # the turn ends once the budget is spent
    for _ in range(3 * per_turn):
        writer.put(body)
    taken = [server._ring.pull(server.protocol) for _ in range(4)]
    assert taken == [per_turn, per_turn, per_turn, 0]  # all of it, a turn at a time, nothing twice
    assert server.protocol.wants_ring()


def test_a_turn_takes_one_message_larger_than_turn_bytes(
    ring_and_server: tuple[BlockingWriter[object], TcpServer],
) -> None:
    writer, server = ring_and_server
    for _ in range(3):
        writer.put(b"y" * (tcp_server.TURN_BYTES + 1))
    assert [server._ring.pull(server.protocol) for _ in range(4)] == [1, 1, 1, 0]


def test_small_messages_are_taken_all_in_one_turn(ring_and_server: tuple[BlockingWriter[object], TcpServer]) -> None:
    writer, server = ring_and_server
    for i in range(60):
        writer.put(i)
    assert server._ring.pull(server.protocol) == 60
    assert server._ring.pull(server.protocol) == 0


def test_a_frame_the_protocol_fails_on_drops_that_reader_only_and_the_server_logs_why(
    ring_and_server: tuple[BlockingWriter[object], TcpServer],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A hostile frame that trips a bug of the protocol (``ReaderFault``): the server logs the
    bug, refuses that reader and drops it, and serves the other one on. Two real peers over
    real sockets, the server's turn driven by hand."""
    writer, server = ring_and_server
    key = server.protocol._cfg.key
    assert key is not None  # insecure: signed control frames, PLAIN with the key's password
    ctx = zmq.Context()
    peers: dict[str, zmq.Socket[bytes]] = {}

    def answer(name: str) -> list[bytes]:
        """Serve until ``name`` hears from the server: what it heard, signature checked."""
        deadline = time.monotonic() + 30
        while not peers[name].poll(10):
            assert time.monotonic() < deadline, f"{name} heard nothing"
            server._recv_clients(time.monotonic())
            server._flush()
        return wire.verify(key, peers[name].recv_multipart())

    try:
        for name in ("good", "bad"):
            sock = peers[name] = ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.identity = name.encode()
            sock.plain_username = wire.PLAIN_USER
            sock.plain_password = wire.control_password(key)
            sock.connect(server.endpoint)
            hello: dict[str, Any] = {"version": wire.PROTOCOL_VERSION, "name": name, "pid": 1, "host": "h"}
            hello |= {"window": 4, "resume": None, "channel": writer.handle.token}
            sock.send_multipart(wire.sign(key, [wire.HELLO, wire.encode_json(hello)]))
            assert answer(name)[0] == wire.WELCOME
        proto = server.protocol
        real = proto.readers._on_frames

        def failing(ident: bytes, *args: Any) -> Any:
            if ident == b"bad":
                raise RuntimeError("a bug this frame trips")
            return real(ident, *args)

        monkeypatch.setattr(proto.readers, "_on_frames", failing)
        peers["bad"].send_multipart(wire.sign(key, [wire.ACK, wire.U64.pack(0)]))
        with caplog.at_level(logging.WARNING, logger="aiobroadcast"):
            refused = answer("bad")
        assert refused == [wire.REFUSED, b"malformed frame: internal error RuntimeError"]
        (bug,) = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert "failed on a frame from a remote reader" in bug.getMessage() and bug.exc_info is not None
        assert [r["name"] for r in proto.report()["readers"]] == ["good"]
        proto.heartbeat(time.monotonic() + 0.1)  # the other one is served on
        server._flush()
        assert answer("good")[0] == wire.HEARTBEAT
    finally:
        for sock in peers.values():
            sock.close(linger=0)
        ctx.term()
