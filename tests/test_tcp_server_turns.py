"""The TCP server's loop takes the ring a turn at a time: at most ``TURN_BYTES`` of bodies (or 4096
messages) before what it sealed is sent. A real ring, and a real server built in this process on
it (its sockets bound on 127.0.0.1), with no reader connected: ``RingFeed.pull`` is one turn's take.
And what a turn does with a reader the protocol fails on: that reader only is dropped."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from aiobroadcast._base.constants import REKEY_BYTES, REKEY_MESSAGES
from aiobroadcast._shm.segment import attach_segment
from aiobroadcast._tcp import server as tcp_server
from aiobroadcast._tcp import wire
from aiobroadcast._tcp.server import TcpServer
from aiobroadcast._tcp.settings import ServerSettings
from aiobroadcast.blocking import BlockingWriter, open_writer


@pytest.fixture
def ring_and_server(tmp_path: Path) -> Iterator[tuple[BlockingWriter[object], TcpServer]]:
    with _ring_and_server(tmp_path, hb_interval=1.0) as (writer, server, _stop_w):
        yield writer, server


@contextlib.contextmanager
def _ring_and_server(tmp_path: Path, *, hb_interval: float) -> Iterator[tuple[BlockingWriter[object], TcpServer, int]]:
    """A ring, a server on it, and the write end of the pipe that is the server's stdin (closed:
    it stops)."""
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
                hb_interval=hb_interval,
                hb_timeout=5.0 * hb_interval,
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
            yield writer, server, stop_w
        finally:
            server._src.close()  # and the segment with it, as when the server stops
            server._net.close()
            os.close(stop_r)
            with contextlib.suppress(OSError):  # a test that ran the loop closed it to stop it
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
    signers = {name: wire.ReaderSigner(key) for name in ("good", "bad")}  # each its session

    def answer(name: str) -> list[bytes]:
        """Serve until ``name`` hears from the server: what it heard, signature checked."""
        deadline = time.monotonic() + 30
        while not peers[name].poll(10):
            assert time.monotonic() < deadline, f"{name} heard nothing"
            server._recv_clients(time.monotonic())
            server._flush()
        return signers[name].verify(peers[name].recv_multipart())

    try:
        for name in ("good", "bad"):
            sock = peers[name] = ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.identity = name.encode()
            sock.plain_username = wire.CONTROL_USER
            sock.plain_password = wire.control_password(key)
            sock.connect(server.endpoint)
            hello: dict[str, Any] = {"version": wire.PROTOCOL_VERSION, "name": name, "pid": 1, "host": "h"}
            hello |= {"window": 4, "resume": None, "channel": writer.handle.token}
            sock.send_multipart(signers[name].sign([wire.HELLO, wire.encode_json(hello)]))
            assert answer(name)[0] == wire.WELCOME
        proto = server.protocol
        real = proto.readers._on_frames

        def failing(ident: bytes, *args: Any) -> Any:
            if ident == b"bad":
                raise RuntimeError("a bug this frame trips")
            return real(ident, *args)

        monkeypatch.setattr(proto.readers, "_on_frames", failing)
        peers["bad"].send_multipart(signers["bad"].sign([wire.ACK, wire.U64.pack(0)]))
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


def test_a_message_published_after_a_readers_frame_woke_the_sleeping_server_still_wakes_it(tmp_path: Path) -> None:
    """A frame from a reader wakes a server asleep on the ring; it is taken and answered without
    ending the sleep (``TcpServer._frames_asleep``), and the sleep goes on. A message published
    after that must still wake the server: the sleep stays announced in the ring, so the writer
    sends its datagram. Heartbeats are a minute apart here, so nothing else could make the
    server take the message before the deadline. The server's loop runs in a thread of this
    process; the reader is two real sockets (control and data)."""
    with _ring_and_server(tmp_path, hb_interval=60.0) as (writer, server, stop_w):
        key = server.protocol._cfg.key
        assert key is not None
        went_on: list[bool] = []  # what each frame taken asleep returned: True, the sleep went on
        real = server._frames_asleep

        def frames_asleep() -> bool:
            went_on.append(real())
            return went_on[-1]

        server._frames_asleep = frames_asleep  # type: ignore[method-assign]
        ctx = zmq.Context()
        control, data = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        loop = threading.Thread(target=server.run, daemon=True)
        loop.start()
        deadline = time.monotonic() + 30

        def until(what: str, done: Any) -> None:
            while not done():
                assert time.monotonic() < deadline, what
                time.sleep(0.005)

        try:
            for sock in (control, data):
                sock.linger = 0
                sock.routing_id = b"peer"
                sock.plain_username = wire.PLAIN_USER
            control.plain_username = wire.CONTROL_USER
            control.plain_password = wire.control_password(key)
            data.plain_password = server.data_token.encode()
            control.connect(server.endpoint)
            data.connect(f"tcp://127.0.0.1:{server.data_port}")
            hello: dict[str, Any] = {"version": wire.PROTOCOL_VERSION, "name": "peer", "pid": 1, "host": "h"}
            hello |= {"window": 64, "resume": None, "channel": writer.handle.token}
            signer = wire.ReaderSigner(key)
            control.send_multipart(signer.sign([wire.HELLO, wire.encode_json(hello)]))
            assert control.poll(30_000), "no WELCOME"
            assert signer.verify(control.recv_multipart())[0] == wire.WELCOME
            # The WELCOME goes out from inside the call, before it returns: wait for its return.
            until("the HELLO taken asleep", lambda: len(went_on) == 1)
            assert went_on == [True]  # the HELLO was taken asleep, and answered from there
            src = server._src
            for i in range(5):
                # Once the sleep is announced, the ACK can only be taken by the poll that follows
                # (before that, the turn that sent message i - 1 may still be taking frames).
                until("the server asleep on the ring", lambda: src._words[src._wait_word] != 0)
                before = len(went_on)
                control.send_multipart(signer.sign([wire.ACK, wire.U64.pack(i)]))
                until("the ACK taken asleep", lambda: len(went_on) > before)  # noqa: B023
                assert went_on[-1] is True  # ... and the sleep went on
                writer.put(i)
                until(f"message {i} taken from the ring", lambda: server._src.next_msg == i + 1)  # noqa: B023
                assert data.poll(30_000), f"message {i} not sent"
                assert bytes(data.recv_multipart()[0]) == wire.BATCH
        finally:
            server.drain_timeout = 0.0  # stop at once, without waiting for the reader to drain
            os.close(stop_w)
            loop.join(30)
            control.close(linger=0)
            data.close(linger=0)
            ctx.term()
        assert not loop.is_alive()
