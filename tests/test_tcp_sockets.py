"""``send_parts`` and ``recv_parts`` (the per-message multipart calls of the TCP layer) against real
ZeroMQ sockets over TCP: whole messages in order, ``zmq.Again`` with nothing sent when the peer's
queue is full, nothing delivered to an unknown peer, ``zmq.Again`` when nothing is there."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from aiobroadcast._tcp.sockets import recv_parts, send_parts

IDENT = b"reader-1"


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    try:
        router.linger = dealer.linger = 0
        router.router_mandatory = True
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.routing_id = IDENT
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"hello")
        assert router.recv_multipart() == [IDENT, b"hello"]
        yield router, dealer
    finally:
        router.close()
        dealer.close()
        ctx.term()


def wait_for(sock: zmq.Socket[Any]) -> list[zmq.Frame]:
    assert sock.poll(5000, zmq.POLLIN), "nothing came"
    return recv_parts(sock)


def test_whole_messages_in_order_with_frames_and_buffers(pair: tuple[zmq.Socket[Any], zmq.Socket[Any]]) -> None:
    router, dealer = pair
    big = bytearray(range(256)) * 1024  # 256 KiB: sent without a copy
    sent: list[list[Any]] = [
        [b"one"],
        [b"head", zmq.Frame(b"body")],
        [b"", memoryview(b"view"), big, b"tail"],
    ]
    for parts in sent:
        send_parts(router, [IDENT, *parts])
    for parts in sent:
        got = wait_for(dealer)
        assert [f.bytes for f in got] == [bytes(p) for p in parts]
        assert not got[-1].more and all(f.more for f in got[:-1])
    with pytest.raises(zmq.Again):
        recv_parts(dealer)
    # And back the other way, as the server receives a reader's frames.
    send_parts(dealer, [b"ack", b"12"])
    assert [f.bytes for f in wait_for(router)] == [IDENT, b"ack", b"12"]


def test_a_full_queue_refuses_whole_messages_only(pair: tuple[zmq.Socket[Any], zmq.Socket[Any]]) -> None:
    router, dealer = pair
    router.sndhwm = 4
    dealer.rcvhwm = 4
    payload = b"x" * 100_000  # fills the socket buffers quickly
    accepted = refused = 0
    deadline = time.monotonic() + 10
    while refused < 3 and time.monotonic() < deadline:
        try:
            send_parts(router, [IDENT, b"h", payload, accepted.to_bytes(4, "big")])
            accepted += 1
        except zmq.Again:
            refused += 1
    assert refused == 3, "the queue never filled"
    for n in range(accepted):  # every accepted message arrives whole, none of the refused ones
        got = wait_for(dealer)
        assert [len(f) for f in got] == [1, len(payload), 4] and int.from_bytes(got[2].bytes, "big") == n
    time.sleep(0.2)
    with pytest.raises(zmq.Again):
        recv_parts(dealer)


def test_an_unknown_peer_gets_nothing(pair: tuple[zmq.Socket[Any], zmq.Socket[Any]]) -> None:
    router, dealer = pair
    with pytest.raises(zmq.ZMQError) as err:
        send_parts(router, [b"nobody", b"h", b"body"])
    assert err.value.errno == zmq.EHOSTUNREACH
    send_parts(router, [IDENT, b"after"])
    assert [f.bytes for f in wait_for(dealer)] == [b"after"]  # no stray frames before it
