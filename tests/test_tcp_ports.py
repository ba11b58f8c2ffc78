"""The TCP server's two listening ports against peers without the keys: junk, connections that say
nothing, senders that dribble a byte at a time, and well-formed ZeroMQ peers that have no
credentials. None of it may cost the server descriptors or memory beyond a bound for longer than
the handshake limit (``listener.HANDSHAKE_S``), stop an honest reader, or leave ``statistics()``
saying all is well when the server cannot accept (docs/security.md, "Peers without the keys").

Real writer, real server process, real sockets on 127.0.0.1; every attack is bounded in count
and time and stops by itself. The server's descriptors are counted in /proc (psutil).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import _tcp_workers as tw
import anyio
import anyio.to_thread
import psutil
import pytest
import zmq
from _peers import ON_ASYNCIO, hello, keyed_peer, tcp_writer, the_server, until

import aiobroadcast as ab
from aiobroadcast._tcp import listener, wire

pytestmark = pytest.mark.anyio

#: descriptors the server may hold above what it held before an attack, once it is over (the
#: attackers' ZeroMQ peers keep reconnecting and are refused at once: a few are always in flight)
SLACK_FDS = 12
#: how long the server may take to let go of everything an attack opened (the handshake limit,
#: and a machine shared with other tests)
RECOVER_S = 3 * listener.HANDSHAKE_S
MIB = 1 << 20
#: the ZMTP 3.0 greeting of a peer with the NULL mechanism (64 bytes)
GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def control_port(writer: ab.Writer[Any]) -> int:
    assert writer.handle.tcp is not None
    return int(writer.handle.tcp.rsplit(":", 1)[1])


def junk_flood(port: int, count: int) -> None:
    """Connections that each send about 2 KB of junk (a ZMTP 1.0 prefix, then noise) and close."""
    for _ in range(count):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(b"\x01\x00" + os.urandom(2000))
        except OSError:
            pass  # the server closed it first: that is its right


class Loiterers:
    """Connections held open from this side for as long as the test runs: ``silent`` ones that
    say nothing, ``slow`` ones that send the ZMTP greeting a byte every ``slow_every_s``, and
    ZeroMQ DEALER and SUB sockets without credentials (they reconnect whenever refused)."""

    def __init__(self, port: int, *, silent: int, slow: int, zmq_peers: int, slow_every_s: float = 0.25) -> None:
        self.port = port
        self.silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(silent)]
        self.slow = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(slow)]
        self.ctx = zmq.Context()
        self.peers: list[zmq.Socket[bytes]] = []
        for k in range(zmq_peers):
            sock = self.ctx.socket(zmq.DEALER if k % 2 == 0 else zmq.SUB)
            sock.linger = 0
            if sock.type == zmq.SUB:
                sock.subscribe(b"")
            sock.connect(f"tcp://127.0.0.1:{port}")
            self.peers.append(sock)
        self.slow_dropped = 0  #: slow connections the server closed
        self._stop = threading.Event()
        self._every = slow_every_s
        self._thread = threading.Thread(target=self._dribble, daemon=True)
        self._thread.start()

    def _dribble(self) -> None:
        sent = 0
        live = list(self.slow)
        while live and not self._stop.wait(self._every):
            for s in list(live):
                try:
                    s.send(GREETING[sent % len(GREETING) : sent % len(GREETING) + 1])
                except OSError:
                    live.remove(s)
                    self.slow_dropped += 1
            sent += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for s in self.silent + self.slow:
            s.close()
        for sock in self.peers:
            sock.close(linger=0)
        self.ctx.term()


@contextmanager
def loiterers(port: int, **kw: Any) -> Iterator[Loiterers]:
    attack = Loiterers(port, **kw)
    try:
        yield attack
    finally:
        attack.close()


class HonestStream:
    """A writer publishing a message every few milliseconds and a remote reader that must get
    every one, in order, whatever the attack does."""

    def __init__(self, writer: ab.Writer[Any], reader: ab.Reader[Any]) -> None:
        self.writer = writer
        self.reader = reader
        self.sent = 0
        self.got: list[int] = []
        self.stopping = False  #: set by the test: the publisher stops
        self._done = False  #: the publisher stopped; ``sent`` is final

    async def publish(self) -> None:
        while True:
            stopping = self.stopping
            await self.writer.put(tw.message(self.sent))  # the last one wakes a reader waiting in get
            self.sent += 1
            if stopping:
                self._done = True
                return
            await anyio.sleep(0.01)

    async def consume(self) -> None:
        while not (self._done and len(self.got) >= self.sent):
            with anyio.fail_after(20):  # a reader stopped by the attack fails here
                self.got.append(tw.check_message(await self.reader.get()))

    def check(self) -> None:
        assert self.got == list(range(self.sent))


async def fds_come_back(server: Any, bound: int) -> int:
    """Poll the server's descriptors until they are at most ``bound``; the last count."""
    seen = server.num_fds()
    deadline = time.monotonic() + RECOVER_S
    while seen > bound and time.monotonic() < deadline:
        await anyio.sleep(0.1)
        seen = server.num_fds()
    return int(seen)


async def attack_a_port(which: str, insecure: bool) -> None:
    data_port = free_port()
    async with tcp_writer(data_port=data_port, insecure=insecure) as writer:
        port = data_port if which == "data" else control_port(writer)
        async with ab.open_reader(writer.handle, transport="tcp", name="honest") as reader:
            server = the_server()
            stream = HonestStream(writer, reader)
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream.publish)
                tg.start_soon(stream.consume)
                await until(lambda: len(stream.got) >= 5)
                fds_before, rss_before = server.num_fds(), server.memory_info().rss
                with ExitStack() as stack:
                    attack = stack.enter_context(loiterers(port, silent=100, slow=20, zmq_peers=20))
                    await anyio.to_thread.run_sync(junk_flood, port, 300)
                    peak = server.num_fds()
                    # Everything the attackers hold stays open from their side: the server must
                    # let go of it by itself.
                    fds = await fds_come_back(server, fds_before + SLACK_FDS)
                    rss = server.memory_info().rss
                    # the server closed the dribblers (they did not give up)
                    await until(lambda: attack.slow_dropped == len(attack.slow), within_s=RECOVER_S)
                got_during = len(stream.got)
                stream.stopping = True
            stream.check()
        assert fds <= fds_before + SLACK_FDS, (
            f"the server holds {fds} descriptors {RECOVER_S:g} s after the attack (before: {fds_before}, peak {peak})"
        )
        assert rss - rss_before < 64 * MIB, (rss_before, rss)
        assert got_during > 5
        assert writer.statistics().tcp_server_health == "ok"


@ON_ASYNCIO
@pytest.mark.parametrize(
    ("which", "insecure"),
    [("data", False), ("control", False), ("control", True)],
    ids=["data", "control-curve", "control-insecure"],
)
async def test_peers_without_keys_cost_a_port_nothing_that_lasts(which: str, insecure: bool) -> None:
    """Junk, silent, dribbling and credential-less ZeroMQ peers on one port, all at once: the
    server's descriptors come back to what it held before while the attackers still hold their
    connections open, its memory does not grow with them, and the honest reader gets every
    message in order throughout."""
    await attack_a_port(which, insecure)


@ON_ASYNCIO
async def test_a_server_out_of_descriptors_says_so_in_statistics_and_recovers() -> None:
    """The server's descriptor limit lowered (prlimit) to a little above what it uses, then silent
    connections fill it: ``statistics().tcp_server_health`` says the server cannot serve; once
    they go, it says "ok" again, and the honest reader missed nothing."""
    data_port = free_port()
    async with tcp_writer(data_port=data_port) as writer:
        async with ab.open_reader(writer.handle, transport="tcp", name="honest") as reader:
            server = the_server()
            stream = HonestStream(writer, reader)
            limits = server.rlimit(psutil.RLIMIT_NOFILE)
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream.publish)
                tg.start_soon(stream.consume)
                await until(lambda: len(stream.got) >= 5)
                assert writer.statistics().tcp_server_health == "ok"
                server.rlimit(psutil.RLIMIT_NOFILE, (server.num_fds() + 24, limits[1]))
                try:
                    with loiterers(data_port, silent=60, slow=0, zmq_peers=0):
                        await until(lambda: writer.statistics().tcp_server_health != "ok", within_s=15)
                        health = writer.statistics().tcp_server_health
                        assert writer.statistics().tcp_server == "running"
                    await until(lambda: writer.statistics().tcp_server_health == "ok", within_s=RECOVER_S)
                finally:
                    server.rlimit(psutil.RLIMIT_NOFILE, limits)
                n = len(stream.got)
                await until(lambda: len(stream.got) >= n + 5)
                stream.stopping = True
            stream.check()
    assert "descriptor" in health, health


@ON_ASYNCIO
async def test_a_wrong_hmac_key_is_refused_at_the_handshake_of_an_insecure_control_port() -> None:
    """insecure=True: the control handshake is PLAIN with a password derived from the HMAC key,
    so a handle with another key fails ``open_reader`` at once, not after ``connect_timeout``."""
    async with tcp_writer(insecure=True) as writer:
        wrong = writer.handle.model_copy(update={"hmac_key": secrets.token_hex(32)})
        t0 = time.monotonic()
        with pytest.raises(ab.TransportError, match="refused this reader's keys at the handshake"):
            await ab.open_reader(wrong, transport="tcp", name="wrong-key", connect_timeout=60)
        assert time.monotonic() - t0 < 10
        assert writer.statistics().rejected_frames == 0


@ON_ASYNCIO
async def test_a_reader_that_sends_on_its_data_connection_does_not_stall_it() -> None:
    """A client with the keys (so with the data port's password, from WELCOME) sends messages
    on its data connection, where readers send nothing, then closes it: the server reads and
    drops them, so it sees the connection end and lets its descriptor go."""
    async with tcp_writer() as writer:
        server = the_server()
        with keyed_peer(writer.handle) as peer:
            peer.send(hello("chatty"))
            frames = await peer.answer()
            assert frames[0] == wire.WELCOME
            welcome = json.loads(frames[1])
            fds_before = server.num_fds()
            ctx = zmq.Context()
            try:
                data = ctx.socket(zmq.DEALER)
                data.linger = 0
                data.plain_username = wire.PLAIN_USER
                data.plain_password = welcome["data_token"].encode()
                data.connect(f"tcp://127.0.0.1:{welcome['data_port']}")
                for k in range(200):
                    data.send(b"chatter %d" % k)
                await until(lambda: server.num_fds() > fds_before)  # it got in
                await anyio.sleep(0.5)
                data.close(linger=0)
            finally:
                ctx.term()
            await until(lambda: server.num_fds() <= fds_before, within_s=RECOVER_S)
