"""The TCP server's pool of buffers for large sealed bodies, against real ZeroMQ sockets: a buffer
is written again only once ZeroMQ let go of it, never while a message made from it is still
queued or being sent."""

from __future__ import annotations

import time

import zmq

from aiobroadcast._tcp.server import _Buffers

SIZE = 1 << 20
COUNT = 12


def test_a_buffer_zeromq_still_sends_is_never_handed_out_again() -> None:
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    pull = ctx.socket(zmq.PULL)
    try:
        push.linger = 0
        pull.linger = 0
        port = push.bind_to_random_port("tcp://127.0.0.1")
        pull.rcvhwm = 1  # the receiver takes little in: the messages wait in the sender's queue
        pull.connect(f"tcp://127.0.0.1:{port}")
        pool = _Buffers(64 * SIZE)
        for k in range(COUNT):
            buf = pool.take(SIZE)
            buf[:] = bytes([k]) * SIZE
            push.send(zmq.Frame(buf, copy=False), copy=False)
            del buf  # only ZeroMQ (and the pool) refer to it now
        # Whatever the pool hands out now must not be one ZeroMQ still holds: scribble on it.
        spare = [pool.take(SIZE) for _ in range(COUNT)]
        for buf in spare:
            buf[:] = b"\xff" * SIZE
        for k in range(COUNT):
            got = pull.recv(copy=False)
            assert got.bytes == bytes([k]) * SIZE, f"message {k} was overwritten while queued"
        del spare
        # Once sent, ZeroMQ lets go (asynchronously): then the pooled buffers are used again.
        pooled = {id(b) for b in pool._bufs}
        deadline = time.monotonic() + 30
        while id(pool.take(SIZE)) not in pooled:
            assert time.monotonic() < deadline, "ZeroMQ never released a sent buffer"
            time.sleep(0.01)
    finally:
        push.close()
        pull.close()
        ctx.term()


def test_the_pool_keeps_no_more_than_its_bound_and_gives_idle_buffers_back() -> None:
    pool = _Buffers(3 * 100)
    held = [pool.take(100) for _ in range(5)]  # all in use: 5 new, only 3 pooled
    assert len(pool._bufs) == 3
    del held
    assert pool.take(100) is pool._bufs[-1]  # idle again: reused
    pool.take(50)  # another size: the idle ones of the old size go
    pool.clear()
    assert len(pool._bufs) == 0
