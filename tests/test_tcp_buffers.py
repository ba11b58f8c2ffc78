"""The pool of buffers for large bodies (``_seal.Buffers``): the TCP server's, against real ZeroMQ
sockets (a buffer is written again only once ZeroMQ let go of it, never while a message made
from it is still queued or being sent), and a remote reader's (a body is opened again into a
buffer only once nothing refers to it: never under a view the user still holds)."""

from __future__ import annotations

import time

import zmq

from aiobroadcast._tcp import seal
from aiobroadcast._tcp.seal import Buffers

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
        pool = Buffers(64 * SIZE)
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
    pool = Buffers(3 * 100)
    held = [pool.take(100) for _ in range(5)]  # all in use: 5 new, only 3 pooled
    assert len(pool._bufs) == 3
    del held
    assert pool.take(100) is pool._bufs[-1]  # idle again: reused
    pool.take(50)  # another size: the idle ones of the old size go
    pool.clear()
    assert len(pool._bufs) == 0


def test_a_reader_opens_a_body_into_a_buffer_again_only_once_nothing_refers_to_it() -> None:
    """A large body that cannot be opened in place (a read-only frame, or a ``cryptography``
    that refuses) is opened into a pooled buffer; a view the user keeps (a zero-copy read, an
    out-of-band pickle buffer) keeps that buffer out of the pool, and its bytes stay intact."""
    channel = b"c" * 32
    sealer = seal.Sealer(channel)
    pool = Buffers(64 * SIZE)
    opener = seal.Opener(channel, buffer=pool.take)
    opener.install(sealer.keys_message())
    bodies = [bytes([k]) * (64 << 10) for k in range(4)]
    sealed = [bytes(sealer.seal(k, 0, body)) for k, body in enumerate(bodies)]  # read-only: not in place
    first = opener.open(0, 0, sealed[0])
    assert first == bodies[0] and any(b is first for b in pool._bufs)
    first_id = id(first)
    kept = memoryview(first)[:16]  # what a user's object built on the body holds
    del first
    second = opener.open(1, 0, sealed[1])
    assert second is not kept.obj and second == bodies[1]
    assert bytes(kept) == bodies[0][:16]  # not written over
    second_id = id(second)
    del kept, second  # the user let go; the second was decoded (copied out) and dropped
    third = opener.open(2, 0, sealed[2])
    assert id(third) == first_id and third == bodies[2]  # used again, not a new allocation
    fourth = opener.open(3, 0, sealed[3])
    assert id(fourth) == second_id and fourth == bodies[3]
    del third, fourth
    pool.clear()
    assert len(pool._bufs) == 0
