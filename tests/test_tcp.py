"""Remote readers over ZeroMQ TCP on loopback: security, flow control, liveness, relays.

Real sockets and, where a peer must die or stall, real processes (``_tcp_workers``). Fake
servers and misbehaving clients are plain pyzmq sockets driven by hand. Each test runs on one
anyio backend (they rotate), because every TCP writer starts its own server process; the
backend-independent behaviour suite runs on all three in test_conformance.py.

Timing: the liveness tests use ``heartbeat_s=0.2``, so the server drops a silent reader after 6
heartbeats (1.2 s) and a reader that hears nothing gives up after 18 (3.6 s); the others keep
the default (0.5 s). Assertions on time are liveness bounds with generous margins, never
throughput.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import _tcp_workers as tw
import anyio
import psutil
import pytest
import zmq
from _peers import (
    ON_ASYNCIO,
    ON_TRIO,
    ON_UVLOOP,
    ended,
    hello,
    raw_peer,
    read_events,
    remote_names,
    server_processes,
    tcp_writer,
    until,
)
from _tcp_workers import (
    ASYNCIO,
    TRIO,
    UVLOOP,
    ReaderOpts,
    WriterSpec,
    account,
    fill_until_blocked,
    message,
    reader_proc,
    relay_proc,
    spawn,
    summary,
    writer_proc,
)
from zmq.auth.thread import ThreadAuthenticator

import aiobroadcast as ab
from aiobroadcast import blocking
from aiobroadcast._base import tuning as _tuning
from aiobroadcast._base.steps import run, run_blocking
from aiobroadcast._tcp import seal, wire
from aiobroadcast._tcp.client import TcpSource

pytestmark = pytest.mark.anyio

HB = 0.2  #: heartbeat_s of the writers of the liveness tests
DROP_S = 6 * HB  #: the documented bound: a silent remote reader is dropped after 6 heartbeats
GONE_S = 18 * HB  #: a reader that hears nothing for 18 heartbeats raises WriterGone
MARGIN_S = 5.0  #: slack for a loaded CI machine in every liveness bound
#: Ring capacity of the lag tests. RING_LAG: the TCP server is itself a reader of the ring; when
#: it falls more than ``capacity`` behind (policy "lag") it is told what it missed and passes it
#: on, but the shared-memory reader sometimes over-counts such a gap (see
#: test_conformance.py::test_lag_count_is_exact_while_the_reader_races_the_writer). So the lag
#: tests give the ring room and publish at a pace the server keeps up with: the gaps they
#: check are the remote reader's own.
RING = 64


def publish_without_yielding(writer: ab.Writer[Any], seqs: range) -> None:
    """Publish under policy "lag" without letting the event loop run (its tasks starve), at a
    pace the writer's TCP server process keeps up with (RING_LAG)."""
    for i in seqs:
        writer.put_nowait(message(i))
        time.sleep(0.0005)


# --- binding and handles ----------------------------------------------------------------------
@ON_ASYNCIO
async def test_binds_only_the_given_address_and_reads_the_port_back() -> None:
    async with tcp_writer() as writer:
        h = writer.handle
        assert h.tcp is not None
        m = re.fullmatch(r"tcp://127\.0\.0\.1:(\d+)", h.tcp)
        assert m, h.tcp
        port = int(m.group(1))
        assert 0 < port < 65536
        stream = await anyio.connect_tcp("127.0.0.1", port)
        await stream.aclose()
        with pytest.raises(OSError):  # same port, another local address: not bound
            await anyio.connect_tcp("127.0.0.2", port)
    with pytest.raises(ValueError, match="tcp://"):
        await ab.open_writer(tcp="udp://127.0.0.1:0")
    with pytest.raises(ab.BroadcastError, match=r"192\.0\.2\.1"):  # TEST-NET-1: no such address here
        await ab.open_writer(tcp="tcp://192.0.2.1:0")  # and nothing is left in /dev/shm


@ON_UVLOOP
async def test_handle_hides_its_keys_in_repr_and_saves_with_mode_0600(tmp_path: Path) -> None:
    async with tcp_writer() as writer:
        h = writer.handle
        assert h.server_key and h.client_public_key and h.client_secret_key
        for text in (repr(h), str(h)):
            assert h.client_secret_key not in text
            assert "client_secret_key" not in text
        path = tmp_path / "channel.json"
        h.save(path)
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert ab.Handle.load(path) == h


# --- who may read --------------------------------------------------------------------------------
@ON_TRIO
async def test_peers_without_the_right_keys_are_refused_and_never_counted() -> None:
    async with tcp_writer() as writer:
        h = writer.handle
        assert h.tcp is not None and h.server_key is not None
        async with ab.open_reader(h, transport="tcp", name="legit") as legit:
            # 1. A reader whose keys are not the channel's: the handshake fails.
            other_public, other_secret = zmq.curve_keypair()
            wrong = h.model_copy(
                update={"client_public_key": other_public.decode(), "client_secret_key": other_secret.decode()}
            )
            with pytest.raises(ab.TransportError):
                await ab.open_reader(wrong, transport="tcp", name="wrong-key", connect_timeout=1.0)
            # 2. A plain ZeroMQ peer (no CurveZMQ at all) saying HELLO: never answered.
            with raw_peer(h.tcp) as plain:
                plain.send(hello("no-curve"))
                assert not await plain.heard(1.0)
                # 3. CurveZMQ with a key pair of its own: refused at the handshake too.
                with raw_peer(h.tcp, curve=(h.server_key, other_public.decode(), other_secret.decode())) as stranger:
                    stranger.send(hello("stranger"))
                    assert not await stranger.heard(1.0)
                    assert remote_names(writer) == ["legit"]
            # 4. A handle that lost its secret key is refused before anything is sent.
            with pytest.raises(ab.InvalidHandle, match="CurveZMQ keys"):
                await ab.open_reader(h.model_copy(update={"client_secret_key": None}), transport="tcp")
            # The reader with the keys was never disturbed.
            await writer.put(message(0))
            with anyio.fail_after(10):
                assert tw.check_message(await legit.get()) == 0
            assert remote_names(writer) == ["legit"]
            assert writer.statistics().dropped_readers == 0


#: open_reader's connect_timeout in the handshake tests: a refused handshake must fail long before.
SLOW_CONNECT_S = 30.0
REFUSED_WITHIN_S = 10.0  #: liveness bound: measured at about 0.01 s (client key) and 0.2 s (server key)
REFUSED = "refused this reader's keys"


async def refused_at_the_handshake(h: ab.Handle) -> ab.TransportError:
    """open_reader(h) fails with the handshake's reason, well within its connect_timeout."""
    t0 = time.monotonic()
    with pytest.raises(ab.TransportError, match=REFUSED) as info:
        await ab.open_reader(h, transport="tcp", name="wrong-keys", connect_timeout=SLOW_CONNECT_S)
    elapsed = time.monotonic() - t0
    assert elapsed < REFUSED_WITHIN_S, f"refused after {elapsed:.1f} s, not at the handshake"
    assert "\n" not in str(info.value)
    return info.value


def reader_threads() -> int:
    """Remote readers' I/O threads alive in this process."""
    return sum(t.name == "aiobroadcast-tcp-reader" for t in threading.enumerate())


def wrong_keys(h: ab.Handle, case: str) -> ab.Handle:
    other_public, other_secret = (k.decode() for k in zmq.curve_keypair())
    if case == "client-key":  # the server's ZAP handler refuses the key: it says so (ERROR 400)
        return h.model_copy(update={"client_public_key": other_public, "client_secret_key": other_secret})
    if case == "server-key":  # the server cannot decrypt HELLO: it closes the connection, silently
        return h.model_copy(update={"server_key": other_public})
    assert case == "insecure"  # plain TCP against CurveZMQ: the security mechanisms do not match
    return h.model_copy(update={"insecure": True, "hmac_key": secrets.token_hex(32)})


@ON_TRIO
@pytest.mark.parametrize("case", ["client-key", "server-key", "insecure"])
async def test_a_reader_with_wrong_keys_fails_at_the_handshake_not_at_the_timeout(case: str) -> None:
    async with tcp_writer() as writer:
        h = writer.handle
        async with ab.open_reader(h, transport="tcp", name="legit") as legit:
            await refused_at_the_handshake(wrong_keys(h, case))
            assert remote_names(writer) == ["legit"]
            # The refused reader left no thread behind it, and the one with the keys reads on.
            assert reader_threads() == 1
            await writer.put(message(0))
            with anyio.fail_after(10):
                assert tw.check_message(await legit.get()) == 0
            assert remote_names(writer) == ["legit"]
            assert writer.statistics().dropped_readers == 0
        # Refused alone (no reader with the keys around either): still never counted.
        await until(lambda: remote_names(writer) == [])
        await refused_at_the_handshake(wrong_keys(h, case))
        assert remote_names(writer) == []
        assert reader_threads() == 0


@ON_TRIO
async def test_a_connecting_reader_can_be_cancelled_and_leaves_nothing_behind() -> None:
    """An endpoint that accepts TCP but never speaks ZeroMQ: no handshake event ever comes, so
    only the caller's cancellation can end the wait early; it must, and close everything."""
    async with tcp_writer() as writer:
        pass
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        h = writer.handle.model_copy(update={"tcp": f"tcp://127.0.0.1:{port}"})
        t0 = time.monotonic()
        with anyio.move_on_after(0.3) as scope:
            async with ab.open_reader(h, transport="tcp", connect_timeout=30):
                raise AssertionError("connected to an endpoint that never answers")
        assert scope.cancelled_caught
        assert time.monotonic() - t0 < 10  # not the 30 s connect_timeout
        assert reader_threads() == 0


@asynccontextmanager
async def silent_endpoint() -> AsyncIterator[ab.Handle]:
    """A handle with a writer's keys whose endpoint accepts TCP and never speaks ZeroMQ: no
    WELCOME and no handshake event ever come."""
    async with tcp_writer() as writer:
        pass
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        yield writer.handle.model_copy(update={"tcp": f"tcp://127.0.0.1:{silent.getsockname()[1]}"})


class Interrupted(BaseException):
    """Ends a welcome's wait from outside, as a Ctrl-C would."""


@ON_ASYNCIO
async def test_a_welcome_wait_ended_from_outside_closes_the_source_on_both_drivers() -> None:
    """The welcome's steps (``TcpSource.welcome_steps``) are one generator for ``wait_welcome``
    and ``wait_welcome_blocking``: whichever driver runs them, a wait that ends neither welcomed
    nor timed out closes the source (its I/O thread stopped) and lets the error through."""

    def interrupted(limit_s: float) -> bool:
        raise Interrupted

    async def interrupted_async(limit_s: float) -> bool:
        return interrupted(limit_s)

    async with silent_endpoint() as h:
        before = reader_threads()
        for driver in ("async", "blocking"):
            source = TcpSource(h, f"interrupted-{driver}", lambda body, oob: body)
            assert reader_threads() == before + 1
            with pytest.raises(Interrupted):
                if driver == "async":
                    await run(source.welcome_steps(30), interrupted_async)
                else:
                    run_blocking(source.welcome_steps(30), interrupted)
            assert reader_threads() == before, driver


@ON_ASYNCIO
async def test_a_negative_connect_timeout_waits_no_time_and_never_passes_for_welcomed() -> None:
    async with silent_endpoint() as h:
        before = reader_threads()
        with anyio.fail_after(10):
            with pytest.raises(ab.TransportError, match="no answer from the writer"):
                await ab.open_reader(h, transport="tcp", connect_timeout=-1)
            with pytest.raises(ab.TransportError, match="no answer from the writer"):
                blocking.open_reader(h, transport="tcp", connect_timeout=-1)
        assert reader_threads() == before


class _AnyPassword(ThreadAuthenticator):
    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        return True, b"OK"


class FakeServer:
    """A hand-driven ROUTER on loopback that plays a writer's TCP server (a forgery), with the
    data socket beside it. ``use(handle, secret)`` gives it a sealer and the key that signs
    control frames (``signed``, in the session of the reader's HELLO): those of the real server
    of ``handle`` if ``secret`` is the handle's (insecure mode), a forger's otherwise."""

    def __init__(self, *, curve_secret: bytes | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.auth: _AnyPassword | None = None
        if curve_secret is not None:
            self.sock.curve_server = True
            self.sock.curve_secretkey = curve_secret
        else:  # an insecure reader says PLAIN: let any password in (this server forges the rest)
            self.auth = _AnyPassword(self.ctx)
            self.auth.start()
            self.sock.zap_domain = b"fake"
            self.sock.plain_server = True
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.peer = b""
        self.data = self.ctx.socket(zmq.ROUTER)
        self.data.linger = 0
        self.data.router_mandatory = True
        self.data_port = self.data.bind_to_random_port("tcp://127.0.0.1")
        self.sealer: seal.Sealer | None = None
        #: the key that signs control frames (insecure mode), in the session of the last HELLO
        self.control_key: bytes | None = None
        self.session: wire.Session | None = None
        #: the writer's MAC of data frame groups for the one reader (its key in WELCOME)
        self.mac: seal.WriterMac | None = None

    def use(self, h: ab.Handle, secret: bytes) -> ab.Handle:
        self.sealer = seal.Sealer(h.token.encode(), secret=wire.data_secret(secret))
        self.control_key = wire.control_key(secret)
        self.mac = self.sealer.writer_mac()
        return h

    def signed(self, frames: list[bytes]) -> list[bytes]:
        """Control ``frames`` signed for the session of the last HELLO (its reader's nonce is in
        clear: a forger without the key reads it too)."""
        assert self.control_key is not None and self.session is not None
        return self.session.sign(self.control_key, frames)

    def with_mac(self, frames: list[Any]) -> list[Any]:
        """A data frame group with the writer's MAC for its reader (whose key WELCOME gives: in
        insecure mode in clear, so anyone on the path can make this MAC)."""
        assert self.mac is not None
        return self.mac.sign(frames)

    def welcome(self, hb_interval: float, hb_timeout: float, start: int = 0) -> list[bytes]:
        """A WELCOME that points the reader at the data socket, with the sealer's keys."""
        assert self.sealer is not None
        body = {
            "start": start,
            "policy": "block",
            "hb_interval": hb_interval,
            "hb_timeout": hb_timeout,
            "data_port": self.data_port,
            "keys": self.sealer.keys_message().hex(),
            "mac_key": self.mac.key.hex() if self.mac is not None else "",
        }
        return [wire.WELCOME, wire.encode_json(body)]

    def batch(self, first: int, bodies: list[bytes]) -> list[Any]:
        """A BATCH of ``bodies`` sealed as the real server seals them."""
        assert self.sealer is not None
        return self.with_mac(
            wire.encode_batch(first, [(self.sealer.seal(first + k, 0, b), 0) for k, b in enumerate(bodies)])
        )

    def send_data(self, frames: list[Any], within_s: float = 10.0) -> None:
        """Send on the data socket, once the reader (which connects after WELCOME) is there."""
        deadline = time.monotonic() + within_s
        while True:
            try:
                self.data.send_multipart([self.peer, *frames])
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    async def recv(self, within_s: float) -> list[bytes] | None:
        """The next frames a client sent (remembering the client), or None."""
        if not await anyio.to_thread.run_sync(self.sock.poll, int(within_s * 1000)):
            return None
        frames = self.sock.recv_multipart()
        self.peer = frames[0]
        return frames[1:]

    async def recv_hello(self, within_s: float = 10.0) -> None:
        with anyio.fail_after(within_s):
            while True:
                frames = await self.recv(within_s)
                if frames is not None and frames[0] == wire.HELLO:
                    if len(frames) > 2:  # signed: the session it opens
                        reader_nonce, _, counter = wire.TRAILER.unpack_from(frames[-1])
                        self.session = wire.Session(reader_nonce, os.urandom(wire.NONCE_BYTES), counter)
                    return

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart([self.peer, *frames])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.data.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


@asynccontextmanager
async def fake_server(*, curve_secret: bytes | None = None) -> AsyncIterator[FakeServer]:
    fake = FakeServer(curve_secret=curve_secret)
    try:
        yield fake
    finally:
        fake.close()


def fake_handle(endpoint: str, **update: Any) -> ab.Handle:
    """A handle for a channel served at ``endpoint`` (its ring is never touched: transport tcp)."""
    return ab.Handle(
        directory="/dev/shm",
        name=f"aiobroadcast-{secrets.token_hex(16)}",
        capacity=4,
        slot_bytes=256,
        max_readers=2,
        policy="block",
        codec="pickle",
        writer_pid=1,
        tcp=endpoint,
        **update,
    )


@ON_UVLOOP
async def test_a_forged_server_without_the_writers_key_is_refused() -> None:
    keys = ab.CurveKeys.generate()  # the writer's keys, as written in the handle
    _, forger_secret = zmq.curve_keypair()
    async with fake_server(curve_secret=forger_secret) as fake:
        h = fake_handle(
            fake.endpoint,
            server_key=keys.server_public,
            client_public_key=keys.client_public,
            client_secret_key=keys.client_secret,
        )
        # The forger cannot decrypt HELLO and closes every handshake: refused there, not after
        # connect_timeout.
        await refused_at_the_handshake(h)
        assert await fake.recv(0.2) is None  # not even the HELLO got through


class Exploit:
    """Pickles into a payload that, when unpickled anywhere, creates the directory ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Callable[[str], None], tuple[str]]:
        return (os.mkdir, (self.path,))


@ON_ASYNCIO
async def test_a_pickle_that_would_run_code_never_runs_unless_signed(tmp_path: Path) -> None:
    """insecure=True: every control frame group carries an HMAC under the handle's key, and every
    body on the data connection a GMAC under a key derived from it, checked before anything is
    parsed. A forged server (or a man in the middle) that lacks the key sends a pickle whose
    unpickling would create a directory: it never appears, the reader gets nothing, then
    WriterGone (the forger never said anything authentic)."""
    marker = tmp_path / "pwned"
    payload = pickle.dumps(Exploit(str(marker)))
    pickle.loads(payload)  # the control: this payload does run code when unpickled
    assert marker.is_dir()
    marker.rmdir()

    key = secrets.token_hex(32)
    wrong = secrets.token_bytes(32)

    def forgeries(h: ab.Handle, fake: FakeServer) -> list[list[Any]]:
        """Batches carrying the exploit, none sealed with the handle's key."""
        assert fake.sealer is not None
        forger = seal.Sealer(h.token.encode(), secret=wrong)
        exploit = forger.seal(0, 0, payload)
        benign = bytearray(fake.sealer.seal(0, 0, pickle.dumps("benign")))
        # a man in the middle swaps the body, keeps the key id and the tag
        swapped = benign[:4] + payload + benign[-seal.TAG_BYTES :]
        # Each with the writer's MAC for the reader: in insecure mode its key crosses in clear in
        # WELCOME, so the seal under the handle's key is what refuses these.
        return [
            fake.with_mac(wire.encode_batch(0, [(exploit, 0)])),  # sealed under the forger's key
            fake.with_mac(wire.encode_batch(0, [(payload, 0)])),  # not sealed at all
            fake.with_mac(wire.encode_batch(0, [(swapped, 0)])),
            fake.with_mac(wire.encode_batch(0, [(bytes(swapped[:-1]), 0)])),  # a truncated tag
            fake.with_mac(wire.encode_batch(0, [(bytes(benign[:4]) + payload + b"\0" * seal.TAG_BYTES, 0)])),
        ]

    async with fake_server() as fake:
        h = fake.use(fake_handle(fake.endpoint, insecure=True, hmac_key=key), wrong)
        # 1. The forger cannot even sign its WELCOME: open_reader fails.
        async with anyio.create_task_group() as tg:

            async def forge_welcome() -> None:
                await fake.recv_hello()
                fake.send(fake.signed(fake.welcome(0.1, 0.5)))
                fake.send(fake.welcome(0.1, 0.5))
                for frames in forgeries(h, fake):
                    fake.send(frames)

            tg.start_soon(forge_welcome)
            with pytest.raises(ab.TransportError):
                await ab.open_reader(h, transport="tcp", name="victim-1", connect_timeout=1.5)
        assert not marker.exists()

    # 2. Even after an authentic WELCOME, forged batches are dropped unread.
    async with fake_server() as fake:
        h = fake.use(fake_handle(fake.endpoint, insecure=True, hmac_key=key), key.encode())
        async with anyio.create_task_group() as tg:

            async def authentic_welcome() -> None:
                await fake.recv_hello()
                fake.send(fake.signed(fake.welcome(0.1, 0.5)))

            tg.start_soon(authentic_welcome)
            reader = await ab.open_reader(h, transport="tcp", name="victim-2")
        async with reader:
            for frames in forgeries(h, fake):
                fake.send_data(frames)
            await anyio.sleep(0.5)
            with pytest.raises(ab.WouldBlock):
                reader.get_nowait()
            with anyio.fail_after(3 * 0.5 + MARGIN_S), pytest.raises(ab.WriterGone):
                await reader.get()  # nothing authentic for 3 x hb_timeout
            assert reader.statistics().received == 0
    assert not marker.exists()


@ON_UVLOOP
async def test_signed_but_malformed_frames_are_rejected_and_the_stream_goes_on() -> None:
    """A server frame that is authentic but not well formed (truncated or inconsistent batch,
    short heartbeat, unknown kind, ...) is dropped; the next good frame is delivered. A
    truncated *body* in a good batch (sealed as it is) is one undecodable message
    (DeserializationError)."""
    key = secrets.token_hex(32).encode()

    def signed(frames: list[bytes]) -> list[bytes]:
        return fake.signed(frames)

    head, entry = wire.BATCH_HEAD.pack, wire.ENTRY.pack
    malformed_control = [
        [wire.HEARTBEAT, b"\1\2\3"],  # short numbers
        [wire.KEYS, b"\1\0"],  # a truncated keys message
        [wire.WELCOME, b"{not json"],
        [b"Z", b"?"],  # unknown kind
        [],
    ]
    malformed_data = [
        [wire.BATCH, b"\0" * 5, b""],  # truncated header
        [wire.BATCH, head(0, 2) + entry(3, 0), b"abc"],  # count does not match the header
        [wire.BATCH, head(0, 1) + entry(10, 0), b"abc"],  # body shorter than announced
        [wire.BATCH, head(0, 1) + entry(1, 0), b"abc"],  # body longer than announced
        [wire.BATCH, head(0, 1) + entry(3, 0)],  # no body frame
        [wire.BATCH],
        [wire.LAGGED, b"x"],
        [wire.END],
        [b"Z", b"?"],  # unknown kind
        [b""],
    ]
    async with fake_server() as fake:
        h = fake.use(fake_handle(fake.endpoint, insecure=True, hmac_key=key.decode()), key)
        async with anyio.create_task_group() as tg:

            async def greet() -> None:
                await fake.recv_hello()
                fake.send(signed(fake.welcome(0.1, 5.0)))

            tg.start_soon(greet)
            reader = await ab.open_reader(h, transport="tcp", name="sturdy")
        async with reader:
            assert fake.sealer is not None
            for frames in malformed_control:
                fake.send(signed(frames))
            for frames in malformed_data:
                fake.send_data(fake.with_mac(frames))  # authentic, so the frame's own checks refuse it
            fake.send_data(fake.batch(0, [pickle.dumps("cut short")[:-3]]))
            fake.send_data(fake.batch(1, [pickle.dumps("hello"), pickle.dumps("world")]))
            fake.send_data(fake.with_mac([wire.END, fake.sealer.seal_control(wire.END, wire.U64.pack(3) + b"closed")]))
            with anyio.fail_after(10):
                with pytest.raises(ab.DeserializationError):
                    await reader.get()
                assert await reader.get() == "hello"
                assert await reader.get() == "world"
                with pytest.raises(ab.EndOfStream):
                    await reader.get()


@pytest.mark.parametrize("insecure", [False, True], ids=["curve", "insecure"])
@ON_TRIO
async def test_bad_frames_from_a_client_do_not_break_the_server(insecure: bool) -> None:
    """A client holding the keys sends malformed control frames and one larger than
    MAX_CONTROL_FRAME; strangers send unsigned or wrongly signed ones. Other readers go on
    receiving, a new reader can still join, and no stranger is ever counted."""
    n = 60
    async with tcp_writer(insecure=insecure) as writer:
        h = writer.handle
        assert h.tcp is not None
        key = h.hmac_key.encode() if h.hmac_key else None
        keys = None if insecure else (h.server_key or "", h.client_public_key or "", h.client_secret_key or "")
        async with ab.open_reader(h, transport="tcp", name="steady") as steady:
            got: list[int] = []

            async def read_all() -> None:
                while len(got) < n:
                    got.append(tw.check_message(await steady.get()))

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(read_all)
                    for i in range(n // 2):
                        await writer.put(message(i))
                    with raw_peer(h.tcp, curve=keys, password=wire.control_password(key) if key else None) as rogue:
                        signer = wire.ReaderSigner(key) if key else None

                        def sign(frames: list[bytes]) -> list[bytes]:
                            return frames if signer is None else signer.sign(frames)

                        rogue.send(sign(hello("rogue")))
                        assert await rogue.heard(5.0)  # WELCOME: it holds the keys
                        for frames in (
                            [wire.ACK],
                            [wire.ACK, b"abc"],
                            [wire.NACK, b""],
                            [b"Q", b"?"],
                            [wire.HELLO, b"{bad json"],
                            [wire.HELLO, wire.encode_json({"version": 1, "pid": "not a number"})],
                        ):
                            rogue.send(sign(frames))
                        rogue.send(sign([wire.ACK, b"\0" * (wire.MAX_CONTROL_FRAME + 1)]))
                        if insecure:
                            with raw_peer(h.tcp) as stranger:
                                stranger.send(hello("unsigned"))
                                stranger.send(wire.ReaderSigner(secrets.token_bytes(32)).sign(hello("badly-signed")))
                                stranger.send([wire.ACK, b"\0" * (wire.MAX_CONTROL_FRAME + 1)])
                                assert not await stranger.heard(0.5)
                        for i in range(n // 2, n):
                            await writer.put(message(i))
            assert got == list(range(n))
            assert not {"unsigned", "badly-signed"} & set(remote_names(writer))
            async with ab.open_reader(h, transport="tcp", name="newcomer") as newcomer:
                await writer.put(message(n))
                with anyio.fail_after(10):
                    assert tw.check_message(await newcomer.get()) == n
                    assert tw.check_message(await steady.get()) == n


@ON_ASYNCIO
async def test_trust_pickle_false_refuses_pickle_and_accepts_json() -> None:
    async with tcp_writer(codec="json") as writer:
        assert writer.handle.codec == "json"
        async with ab.open_reader(writer.handle, transport="tcp", trust_pickle=False) as reader:
            await writer.put({"a": [1, 2.5, None, "x"]})
            with anyio.fail_after(10):
                assert await reader.get() == {"a": [1, 2.5, None, "x"]}
        pickled = writer.handle.model_copy(update={"codec": "pickle"})
        with pytest.raises(ab.InvalidHandle, match="trust_pickle"):
            await ab.open_reader(pickled, transport="tcp", trust_pickle=False)
        await until(lambda: remote_names(writer) == [])  # the json reader said BYE


@ON_TRIO
async def test_insecure_mode_logs_a_warning_signs_and_hides_its_key(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="aiobroadcast"):
        writer = await tcp_writer(insecure=True)
    async with writer:
        assert any("WITHOUT encryption" in r.getMessage() for r in caplog.records)
        h = writer.handle
        assert h.insecure and h.hmac_key and h.server_key is None
        assert h.hmac_key not in repr(h) and h.hmac_key not in str(h)
        with pytest.raises(ab.InvalidHandle, match="hmac_key"):  # never unauthenticated
            await ab.open_reader(h.model_copy(update={"hmac_key": None}), transport="tcp")
        async with ab.open_reader(h, transport="tcp") as reader:
            await writer.put(message(0))
            with anyio.fail_after(10):
                assert tw.check_message(await reader.get()) == 0


# --- flow control and slow readers ----------------------------------------------------------------
@ON_UVLOOP
async def test_slow_remote_reader_under_block_holds_the_writer_back_and_loses_nothing() -> None:
    """Credit flow control: a remote reader that stops reading is not dropped and not buffered
    without bound; the writer's put_nowait raises WouldBlock once the ring, the server's buffer
    (2 * max(tcp_window, capacity)) and the reader's window are full. When it reads again it
    gets every message in order."""
    n, stop_after, capacity, window = 200, 5, 8, 16
    async with tcp_writer(capacity=capacity, tcp_window=window) as writer:
        opts = ReaderOpts(name="slow", stop_after=stop_after)
        with spawn(reader_proc, TRIO, None, writer.handle.to_json(), opts) as reader:
            await reader.recv("attached")
            for i in range(stop_after):
                await writer.put(message(i))
            await reader.recv("stalled")
            published = await fill_until_blocked(writer, stop_after)
            assert published <= stop_after + 2 * max(window, capacity) + capacity, published
            assert remote_names(writer) == ["slow"]  # slow is not dead: still a reader
            assert writer.statistics().dropped_readers == 0
            reader.send("go")
            with anyio.fail_after(30):
                for i in range(published, n):
                    await writer.put(message(i))
                await writer.aclose()
            result = await reader.recv("events")
    assert result["events"] == [("msg", i) for i in range(n)] + [("end",)]


@ON_TRIO
async def test_slow_remote_reader_under_lag_is_told_exactly_what_it_missed() -> None:
    """Policy "lag": the writer never waits; a remote reader that stopped reading resumes with
    ``ReaderLagged(n)``, n being exactly the number of messages missing where it is raised."""
    n, stop_after = 500, 5

    def seen(upto: int) -> Callable[[list[tw.Event]], bool]:
        """The reader has received (or been told it missed) messages 0 .. upto-1."""
        return lambda ev: sum(1 if e[0] == "msg" else e[1] if e[0] == "lagged" else 0 for e in ev) >= upto

    async with tcp_writer(policy="lag", capacity=RING, tcp_window=4) as writer:
        opts = ReaderOpts(name="lagger", stop_after=stop_after, live=True)
        with spawn(reader_proc, UVLOOP, None, writer.handle.to_json(), opts) as reader:
            await reader.recv("attached")
            for i in range(stop_after):  # one at a time: the server's own ring place never lags
                await writer.put(message(i))
                await reader.until(seen(i + 1))
            await reader.recv("stalled")
            for i in range(stop_after, n):
                writer.put_nowait(message(i))  # never WouldBlock under "lag"
                if i % 8 == 0:
                    await anyio.sleep(0.001)  # the server's own ring place keeps up (RING_LAG)
            reader.send("go")
            await reader.until(seen(n))
            for i in range(n, n + 10):  # one at a time again: nothing more is missed
                await writer.put(message(i))
                await reader.until(seen(i + 1))
            with anyio.fail_after(10):
                await writer.aclose()
            result = await reader.recv("events")
    events = result["events"]
    got, lags = account(events, n + 10)
    assert events[-1] == ("end",)
    assert lags, summary(events)
    assert got[:stop_after] == list(range(stop_after)), summary(events)
    assert got[-10:] == list(range(n, n + 10)), summary(events)
    assert result["lagged"] == sum(lags)


@ON_UVLOOP
async def test_credit_is_acknowledged_within_the_granted_window_not_per_heartbeat() -> None:
    """The reader acknowledges every half of the window the server granted (tcp_window=4 here,
    smaller than the reader's own default): a stream of 40 messages never waits for the 3 s
    heartbeat that carries periodic acknowledgements."""
    hb = 3.0
    async with tcp_writer(tcp_window=4, capacity=4, heartbeat_s=hb) as writer:
        async with ab.open_reader(writer.handle, transport="tcp", name="eager") as reader:
            got: list[int] = []
            with anyio.fail_after(hb - 0.5):
                async with anyio.create_task_group() as tg:

                    async def read() -> None:
                        while len(got) < 40:
                            got.append(tw.check_message(await reader.get()))

                    tg.start_soon(read)
                    for i in range(40):
                        await writer.put(message(i))
            assert got == list(range(40))


@ON_ASYNCIO
async def test_stalled_remote_reader_under_lag_holds_one_window_and_one_gap_report() -> None:
    """Policy "lag", a remote reader that does not read while 2,000 messages go by: it holds at
    most ``tcp_window`` messages plus one gap report however long it stalls (no credit for
    what it never acknowledged), and then reads like a local reader would: what it had, one
    ``ReaderLagged`` with the exact count, the newest messages in order."""
    n, window = 2000, 4
    async with tcp_writer(policy="lag", capacity=RING, tcp_window=window) as writer:
        async with ab.open_reader(writer.handle, transport="tcp", name="stalled") as reader:
            for i in range(n):
                writer.put_nowait(message(i))
                if i % 8 == 0:
                    await anyio.sleep(0.001)  # the server's own ring place keeps up (RING_LAG)
                    assert reader.statistics().lag <= window + 1
            # The server has taken everything from the ring (its place there has no lag) ...
            await until(lambda: all(r.lag == 0 for r in writer.statistics().readers if r.transport == "shm"))
            await anyio.sleep(0.3)  # ... and told the reader
            assert reader.statistics().lag <= window + 1
            with anyio.fail_after(10):
                events = await read_events(reader, lambda ev: bool(ev) and ev[-1] == ("msg", n - 1))
    _, lags = account(events, n)
    assert len(lags) == 1, summary(events)
    kinds = [e[0] for e in events]
    assert kinds.index("lagged") <= window, summary(events)
    assert len(events) - kinds.index("lagged") - 1 <= 2 * max(window, RING), summary(events)


@ON_TRIO
async def test_server_behind_its_own_ring_under_lag_tells_readers_and_goes_on() -> None:
    """A burst into a 4-slot ring under policy "lag" leaves the TCP server (itself a ring reader)
    behind: it is told what it missed and must say so to its remote readers and go on
    serving them, never leave them waiting. No silent gap: every missing message is reported
    (the count may be too high, RING_LAG, but never too low)."""
    n = 200
    async with tcp_writer(policy="lag", capacity=4, tcp_window=4) as writer:
        async with ab.open_reader(writer.handle, transport="tcp", name="behind") as reader:
            for i in range(n):
                writer.put_nowait(message(i))
            with anyio.fail_after(10):
                events = await read_events(reader, lambda ev: bool(ev) and ev[-1] == ("msg", n - 1))
            writer.put_nowait(message(n))
            with anyio.fail_after(10):
                assert tw.check_message(await reader.get()) == n
    assert any(e[0] == "lagged" for e in events), summary(events)
    expected, reported = 0, 0
    for e in events:
        if e[0] == "lagged":
            reported += e[1]
        else:
            assert expected <= e[1] <= expected + reported, summary(events)  # in order, no silent gap
            expected, reported = e[1] + 1, 0


@pytest.mark.parametrize("big", [wire.FRAME_ALONE + 100, seal.FUSED_BYTES + 100], ids=["alone", "fused"])
@pytest.mark.parametrize("insecure", [False, True], ids=["curve", "insecure"])
@ON_UVLOOP
async def test_large_bodies_reach_every_remote_reader_intact_and_in_order(insecure: bool, big: int) -> None:
    """Bodies of FRAME_ALONE bytes or more travel as frames of their own, one ZeroMQ message
    shared by every send (from FUSED_BYTES on, a reader checks the writer's MAC in the pass that
    opens the body); mixed with small ones (joined frames), two readers get them all intact, in
    order, with either security."""
    n = 60 if big < seal.FUSED_BYTES else 12
    sent = [(i, bytes([i % 251]) * (big if i % 3 else 5)) for i in range(n)]
    async with tcp_writer(capacity=8, slot_bytes=big + 4096, insecure=insecure) as writer:
        async with (
            ab.open_reader(writer.handle, transport="tcp", name="a") as a,
            ab.open_reader(writer.handle, transport="tcp", name="b") as b,
        ):
            got: dict[str, list[Any]] = {"a": [], "b": []}
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:

                    async def drain(name: str, reader: ab.Reader[Any]) -> None:
                        for _ in range(n):
                            got[name].append(await reader.get())

                    tg.start_soon(drain, "a", a)
                    tg.start_soon(drain, "b", b)
                    for m in sent:
                        await writer.put(m)
    assert got["a"] == sent
    assert got["b"] == sent


@ON_ASYNCIO
async def test_late_join_behind_a_full_server_buffer_starts_with_the_next_message() -> None:
    """Late join over TCP is as over shared memory even while a slow remote reader holds the
    writer back: the newcomer starts with the next message published, not with what the full
    server buffer left in the ring."""
    async with tcp_writer(capacity=4, tcp_window=4) as writer:
        async with ab.open_reader(writer.handle, transport="tcp", name="stalled") as stalled:
            published = await fill_until_blocked(writer, 0)
            async with ab.open_reader(writer.handle, transport="tcp", name="late") as late:
                late_got: list[int] = []
                with anyio.fail_after(30):
                    async with anyio.create_task_group() as tg:

                        async def drain_stalled() -> None:
                            for i in range(published + 10):
                                assert tw.check_message(await stalled.get()) == i

                        async def read_late() -> None:
                            while len(late_got) < 10:
                                late_got.append(tw.check_message(await late.get()))

                        tg.start_soon(drain_stalled)
                        tg.start_soon(read_late)
                        for i in range(published, published + 10):
                            await writer.put(message(i))
                assert late_got == list(range(published, published + 10))


# --- liveness -------------------------------------------------------------------------------------
@ON_ASYNCIO
async def test_sigkilled_remote_reader_is_dropped_within_the_bound_and_the_writer_goes_on() -> None:
    stop_after = 5
    async with tcp_writer(capacity=8, tcp_window=16, heartbeat_s=HB) as writer:
        opts = ReaderOpts(name="doomed", stop_after=stop_after)
        with spawn(reader_proc, UVLOOP, None, writer.handle.to_json(), opts) as reader:
            await reader.recv("attached")
            for i in range(stop_after):
                await writer.put(message(i))
            await reader.recv("stalled")
            published = await fill_until_blocked(writer, stop_after)  # held back by "doomed"
            reader.signal(signal.SIGKILL)
            t0 = time.monotonic()
            with anyio.fail_after(DROP_S + MARGIN_S):
                await writer.put(message(published))
            assert time.monotonic() - t0 < DROP_S + MARGIN_S
            await until(lambda: writer.statistics().dropped_readers == 1)
            assert remote_names(writer) == []
            with anyio.fail_after(10):
                for i in range(published + 1, published + 100):
                    await writer.put(message(i))  # nobody holds it back any more
            assert await reader.join() == -signal.SIGKILL


@ON_ASYNCIO
async def test_idle_remote_readers_and_their_server_keep_each_other_past_both_silence_bounds() -> None:
    """An idle channel carries only heartbeats (a reader's every second interval, the server's
    with at most every second of those): neither side may take the other for gone. Idle for
    longer than the server's drop bound and the readers' give-up bound, both readers are still
    there and get the next message, and nobody was dropped."""
    async with tcp_writer(heartbeat_s=HB) as writer:
        h = writer.handle
        async with (
            ab.open_reader(h, transport="tcp", name="a") as a,
            ab.open_reader(h, transport="tcp", name="b") as b,
        ):
            await until(lambda: remote_names(writer) == ["a", "b"])
            await writer.put(message(0))
            with anyio.fail_after(10):
                assert [tw.check_message(await r.get()) for r in (a, b)] == [0, 0]
            await anyio.sleep(GONE_S + 4 * HB)  # idle, past DROP_S and GONE_S
            assert remote_names(writer) == ["a", "b"]
            assert writer.statistics().dropped_readers == 0
            await writer.put(message(1))
            with anyio.fail_after(10):
                assert [tw.check_message(await r.get()) for r in (a, b)] == [1, 1]
            assert writer.statistics().dropped_readers == 0


@ON_UVLOOP
async def test_sigstopped_remote_reader_half_open_is_dropped_then_told_what_it_missed() -> None:
    """SIGSTOP leaves the connection open but silent (half-open). The writer, held back, goes on
    once the server drops the reader (6 heartbeats). After SIGCONT the reader resumes and is told
    exactly what it missed (ReaderLagged), then gets the rest and EndOfStream."""
    n = 400
    async with tcp_writer(capacity=8, tcp_window=16, heartbeat_s=HB) as writer:
        opts = ReaderOpts(name="frozen", live=True, delay_s=0.001)
        with spawn(reader_proc, TRIO, None, writer.handle.to_json(), opts) as reader:
            await reader.recv("attached")
            for i in range(20):
                await writer.put(message(i))
            await reader.until(lambda ev: len(ev) >= 20)
            reader.signal(signal.SIGSTOP)
            try:
                with anyio.fail_after(DROP_S + MARGIN_S + 10):
                    for i in range(20, n):  # cannot finish unless "frozen" is dropped
                        await writer.put(message(i))
                await until(lambda: writer.statistics().dropped_readers == 1)
                assert remote_names(writer) == []
            finally:
                reader.signal(signal.SIGCONT)

            def accounted(ev: list[tw.Event]) -> bool:
                return sum(1 if e[0] == "msg" else e[1] if e[0] == "lagged" else 0 for e in ev) >= n

            await reader.until(accounted, within_s=GONE_S + MARGIN_S + 10)
            assert remote_names(writer) == ["frozen"]  # it said HELLO again
            with anyio.fail_after(10):
                await writer.aclose()
            result = await reader.recv("events")
    events = result["events"]
    _, lags = account(events, n)
    assert lags, summary(events)
    assert events[-1] == ("end",), summary(events)


def _age(path: str) -> float:
    """Seconds since ``path`` was modified (infinite if it does not exist)."""
    try:
        return time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return float("inf")


@pytest.mark.parametrize("whole_host", [False, True], ids=["writer-killed", "host-gone"])
@ON_TRIO
async def test_killed_writer_remote_reader_drains_then_writer_gone(whole_host: bool) -> None:
    """writer-killed: the writer process is SIGKILLed; its server process sees it die (like any
    ring reader), sends what it has and says so: the reader gets every message, then WriterGone.
    host-gone: writer and server are both SIGKILLed: the reader gets what had arrived, then
    WriterGone once it has heard nothing for 18 heartbeats."""
    n = 20
    spec = WriterSpec(count=n, then="hang", heartbeat_s=HB, tcp_window=2 * n)
    servers: list[Any] = []
    handle: ab.Handle | None = None
    try:
        with spawn(writer_proc, ASYNCIO, None, spec) as wproc:
            handle = ab.Handle.parse(await wproc.recv("handle"))
            servers = server_processes(wproc.pid)
            assert len(servers) == 1
            async with ab.open_reader(handle, transport="tcp", name="survivor") as reader:
                wproc.send("go")
                assert (await wproc.recv("sent"))["count"] == n
                await until(lambda: reader.statistics().lag == n)  # all n have arrived here
                wproc.signal(signal.SIGKILL)
                if whole_host:
                    servers[0].kill()
                t0 = time.monotonic()
                with anyio.fail_after(GONE_S + MARGIN_S):
                    events = await read_events(reader, ended)
                assert events == [("msg", i) for i in range(n)] + [("gone",)]
                assert time.monotonic() - t0 < GONE_S + MARGIN_S
                with pytest.raises(ab.WriterGone):
                    reader.get_nowait()  # and it stays gone
            assert await wproc.join() == -signal.SIGKILL
        # The orphaned server process leaves once its reader has gone.
        await anyio.to_thread.run_sync(psutil.wait_procs, servers, 10.0)
        assert not [p for p in servers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        for p in servers:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        await anyio.to_thread.run_sync(psutil.wait_procs, servers, 10.0)
        if handle is not None:  # the killed writer's files: swept once stale, as design.md says
            await anyio.sleep(max(0.0, _tuning.STALE_MIN_AGE_S + 0.2 - _age(handle.path)))
            ab.sweep_stale(handle.directory)
    assert handle is not None and _age(handle.path) == float("inf")


@ON_ASYNCIO
async def test_writer_close_remote_readers_get_everything_then_end_of_stream() -> None:
    """Several remote reader processes, mixed sizes (some larger than the ring): each gets every
    message in order, then EndOfStream. aclose returns as soon as each reader has the end and
    said BYE, long before the drain timeout (12 heartbeats: 24 s here)."""
    n, big_every, hb = 300, 10, 2.0
    async with tcp_writer(capacity=8, tcp_window=16, heartbeat_s=hb) as writer:
        h = writer.handle.to_json()
        with (
            spawn(reader_proc, TRIO, None, h, ReaderOpts(name="r1", big_every=big_every)) as r1,
            spawn(reader_proc, UVLOOP, None, h, ReaderOpts(name="r2", big_every=big_every, delay_s=0.001)) as r2,
        ):
            await r1.recv("attached")
            await r2.recv("attached")
            assert remote_names(writer) == ["r1", "r2"]
            for i in range(n):
                await writer.put(message(i, big_every))
            with anyio.fail_after(12 * hb / 2):
                await writer.aclose()
            for child in (r1, r2):
                result = await child.recv("events")
                assert result["events"] == [("msg", i) for i in range(n)] + [("end",)]
                assert await child.join() == 0


# --- relays ---------------------------------------------------------------------------------------
@ON_UVLOOP
async def test_relay_with_two_readers_behind_it_delivers_everything_in_order() -> None:
    n, big_every = 300, 7
    async with tcp_writer(capacity=8, tcp_window=16) as writer:
        with spawn(relay_proc, TRIO, None, writer.handle.to_json(), "relay-b", 8) as relay:
            local = await relay.recv("handle")
            assert ab.Handle.parse(local).tcp is None
            with (
                spawn(
                    reader_proc, ASYNCIO, None, local, ReaderOpts(name="b1", transport="shm", big_every=big_every)
                ) as b1,
                spawn(
                    reader_proc, TRIO, None, local, ReaderOpts(name="b2", transport="shm", big_every=big_every)
                ) as b2,
            ):
                await b1.recv("attached")
                await b2.recv("attached")
                assert remote_names(writer) == ["relay-b"]  # two readers, one TCP stream
                with anyio.fail_after(30):
                    for i in range(n):
                        await writer.put(message(i, big_every))
                    await writer.aclose()
                for child in (b1, b2):
                    result = await child.recv("events")
                    assert result["events"] == [("msg", i) for i in range(n)] + [("end",)]
            await relay.recv("done")
            assert await relay.join() == 0


@ON_TRIO
async def test_relay_under_lag_passes_reader_lagged_with_the_exact_count() -> None:
    """The relay (a task here) falls behind upstream while the writer publishes without
    awaiting; what it missed reaches both readers behind it as ReaderLagged with the same
    count, at the same place, and the accounting is exact."""
    n = 500
    async with tcp_writer(policy="lag", capacity=RING, tcp_window=4) as writer:
        ready = anyio.Event()
        local: list[ab.Handle] = []

        def on_ready(h: ab.Handle) -> None:
            local.append(h)
            ready.set()

        results: dict[str, list[tw.Event]] = {}
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: ab.relay(writer.handle, name="relay-lag", capacity=1024, on_ready=on_ready))
                await ready.wait()
                async with ab.open_reader(local[0], name="c1") as c1, ab.open_reader(local[0], name="c2") as c2:

                    async def collect(r: ab.Reader[Any]) -> None:
                        results[r.name] = await read_events(r, ended)

                    await until(lambda: remote_names(writer) == ["relay-lag"])
                    publish_without_yielding(writer, range(n))  # the relay task cannot keep up
                    tg.start_soon(collect, c1)
                    tg.start_soon(collect, c2)
                    await anyio.sleep(0.3)
                    await writer.aclose()  # the relay ends, its readers get EndOfStream
                    await until(lambda: len(results) == 2)
    for name in ("c1", "c2"):
        events = results[name]
        _, lags = account(events, n)
        assert lags, summary(events)
        assert events[-1] == ("end",)
    assert results["c1"] == results["c2"]


def test_worker_messages_round_trip() -> None:
    """The helpers the process tests rely on: messages check themselves, accounting is strict."""
    assert tw.check_message(message(7, 7), 7) == 7
    with pytest.raises(AssertionError):
        tw.check_message((7, b"\0" * 3))
    events: list[tw.Event] = [("msg", 0), ("lagged", 3), ("msg", 4), ("end",)]
    assert account(events, 5) == ([0, 4], [3])
    with pytest.raises(AssertionError, match="expected message 1"):
        account([("msg", 0), ("msg", 2)], 3)  # a silent gap
    with pytest.raises(AssertionError, match="accounted for 2 of 3"):
        account([("msg", 0), ("msg", 1)], 3)
    assert summary(events) == "0 lagged(3) 4 end"
    assert json.loads(json.dumps(events)) == [list(e) for e in events]


# --- the wire format and the server's buffer, without sockets ----------------------------------
def test_batches_put_large_bodies_in_frames_of_their_own_and_decode_back() -> None:
    """Bodies of FRAME_ALONE bytes or more travel alone (passed through, not copied into a joined
    frame); runs of small ones share a frame; empty bodies anywhere decode back."""
    big, small = b"B" * wire.FRAME_ALONE, b"s" * 10
    cases: list[list[tuple[Any, int]]] = [
        [(small, 0)],
        [(big, 1)],
        [(small, 0), (small, 1), (big, 1), (b"", 0), (small, 0), (zmq.Frame(big), 1)],
        [(b"", 0), (big, 0), (b"", 0)],
        [(b"", 0), (b"", 0)],
    ]
    for items in cases:
        frames = wire.encode_batch(5, items)
        assert frames[0] == wire.BATCH
        bodies = frames[2:]
        alone = [b for b, _ in items if len(b) >= wire.FRAME_ALONE]
        assert [f for f in bodies if len(f) >= wire.FRAME_ALONE] == alone
        assert all(any(f is b for f in bodies) for b in alone)  # the same objects: not copied
        first, got = wire.decode_batch(frames[1], bodies)
        assert first == 5
        assert [(bytes(b), f) for b, f in got] == [(bytes(b), f) for b, f in items]
        key = secrets.token_bytes(32)
        nonces = {"reader_nonce": os.urandom(wire.NONCE_BYTES), "server_nonce": os.urandom(wire.NONCE_BYTES)}
        signed = wire.sign(key, frames, to_reader=True, counter=1, **nonces)
        assert wire.verify(key, signed, to_reader=True) == wire.Signed(frames, counter=1, **nonces)
    head = wire.BATCH_HEAD.pack(0, 2) + wire.ENTRY.pack(3, 0) + wire.ENTRY.pack(3, 0)
    for parts in ([b"abcd", b"ef"], [b"abc", b"def", b""], [b"abc"], []):  # a body across frames, too many, too few
        with pytest.raises(wire.FrameError):
            wire.decode_batch(head, parts)


def test_the_tcp_server_imports_this_package_not_a_checkout_in_the_working_directory(tmp_path: Path) -> None:
    """``pip install .`` then ``aiobroadcast demo`` from the checkout: the working directory holds
    a source tree without the compiled extension. The server process must import the package the
    writer imported, not whatever ``aiobroadcast`` the working directory has."""
    shadow = tmp_path / "aiobroadcast"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the shadow package in the working directory')\n")
    script = (
        "from aiobroadcast import blocking\n"
        "with blocking.open_writer(capacity=4, slot_bytes=256, tcp='tcp://127.0.0.1:0') as w:\n"
        "    with blocking.open_reader(w.handle, transport='tcp', connect_timeout=20) as r:\n"
        "        w.put('through the server', timeout=10)\n"
        "        print(r.get(timeout=10))\n"
    )
    # -P: the script itself imports the installed package; its server is started from tmp_path.
    proc = subprocess.run(
        [sys.executable, "-P", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=90
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "through the server"
