"""Hand-driven ZeroMQ peers of a writer's TCP server, for tests that play a client which is not
aiobroadcast's: strangers without the keys, and hostile clients that hold them. And what the
TCP tests share on the test's side (children import ``_tcp_workers``, not this).

A ``KeyedPeer`` holds what every remote reader host holds, the handle's keys (CurveZMQ, or the
HMAC key under ``insecure=True``, with which it signs correctly), and sends whatever it likes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import anyio.to_thread
import psutil
import pytest
import zmq
from _tcp_workers import ASYNCIO, TRIO, UVLOOP, Backend, Event, check_message, terminal

import aiobroadcast as ab
from aiobroadcast._tcp import wire

LOOPBACK = "tcp://127.0.0.1:0"
#: heartbeat_s of most TCP tests (the default): a test machine starved for a second must not get
#: a reader dropped where the test expects every message
SAFE_HB = 0.5


def _on(backend: Backend) -> pytest.MarkDecorator:
    """Run a test on ``backend`` only: TCP tests start processes, so they do not run three times."""
    name = "uvloop" if backend[1].get("use_uvloop") else backend[0]
    return pytest.mark.parametrize("anyio_backend", [pytest.param(backend, id=name)])


ON_ASYNCIO, ON_UVLOOP, ON_TRIO = _on(ASYNCIO), _on(UVLOOP), _on(TRIO)


def tcp_writer(**kw: Any) -> Any:
    kw.setdefault("tcp", LOOPBACK)
    kw.setdefault("heartbeat_s", SAFE_HB)
    kw.setdefault("capacity", 8)
    kw.setdefault("slot_bytes", 256)
    return ab.open_writer(**kw)


def remote_names(writer: ab.Writer[Any]) -> list[str]:
    return sorted(r.name for r in writer.statistics().readers if r.transport == "tcp")


async def until(predicate: Callable[[], bool], within_s: float = 10.0) -> None:
    """Poll ``predicate`` until it holds (a liveness bound, not a latency measurement)."""
    with anyio.fail_after(within_s):
        while True:
            if predicate():
                return
            await anyio.sleep(0.02)


async def read_events(
    reader: ab.Reader[Any], stop: Callable[[list[Event]], bool], events: list[Event] | None = None
) -> list[Event]:
    """Events of an in-process reader, as ``reader_proc`` reports them, until ``stop(events)``
    (added to ``events`` as they come, if given)."""
    events = [] if events is None else events
    while not stop(events):
        try:
            events.append(("msg", check_message(await reader.get())))
        except ab.ReaderLagged as exc:
            events.append(("lagged", exc.missed))
        except ab.EndOfStream:
            events.append(("end",))
        except ab.WriterGone:
            events.append(("gone",))
    return events


def ended(events: list[Event]) -> bool:
    return terminal(events) is not None


class RawPeer:
    """A hand-driven ZeroMQ DEALER: a client that is not aiobroadcast's. ``send`` sends the frames
    as they are (sign them yourself to play a client with the key)."""

    def __init__(
        self, endpoint: str, *, curve: tuple[str, str, str] | None = None, password: bytes | None = None
    ) -> None:
        """``curve``: the CurveZMQ keys (server, public, secret); ``password``: the PLAIN
        password (an insecure server's control port wants ``wire.control_password(key)``)."""
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.routing_id = os.urandom(16)
        if curve is not None:
            server_key, public, secret = curve
            self.sock.curve_serverkey = server_key.encode()
            self.sock.curve_publickey = public.encode()
            self.sock.curve_secretkey = secret.encode()
        if password is not None:
            self.sock.plain_username = wire.CONTROL_USER
            self.sock.plain_password = password
        self.sock.connect(endpoint)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    async def heard(self, within_s: float) -> bool:
        """Whether anything at all arrives within ``within_s``."""
        return bool(await anyio.to_thread.run_sync(self.sock.poll, int(within_s * 1000)))

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@contextmanager
def raw_peer(
    endpoint: str, *, curve: tuple[str, str, str] | None = None, password: bytes | None = None
) -> Iterator[RawPeer]:
    peer = RawPeer(endpoint, curve=curve, password=password)
    try:
        yield peer
    finally:
        peer.close()


def hello_body(name: str, *, window: int = 4, resume: int | None = None) -> bytes:
    body = {"version": wire.PROTOCOL_VERSION, "name": name, "pid": 1, "window": window, "resume": resume}
    return wire.encode_json(body)


def hello(name: str, *, window: int = 4, resume: int | None = None) -> list[bytes]:
    return [wire.HELLO, hello_body(name, window=window, resume=resume)]


class KeyedPeer(RawPeer):
    """A client that holds the handle's keys: CurveZMQ admits it, or under ``insecure=True`` it
    signs every frame group in its session (keys derived from the handle's HMAC key), and
    checks what it is answered. It reads only when told to."""

    def __init__(self, h: ab.Handle) -> None:
        assert h.tcp is not None
        curve = password = None
        if not h.insecure:
            assert h.server_key and h.client_public_key and h.client_secret_key
            curve = (h.server_key, h.client_public_key, h.client_secret_key)
        else:
            assert h.hmac_key
            password = wire.control_password(h.hmac_key.encode())
        super().__init__(h.tcp, curve=curve, password=password)
        self.key = h.hmac_key.encode() if h.insecure and h.hmac_key else None
        self.signer = None if self.key is None else wire.ReaderSigner(self.key)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames if self.signer is None else self.signer.sign(frames))

    def kinds(self) -> list[bytes]:
        """The kinds of the frame groups that have arrived (taking them off the socket)."""
        out: list[bytes] = []
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            out.append(frames[0])

    async def answer(self, within_s: float = 10.0) -> list[bytes]:
        """The next frame group that arrives (verified under insecure=True), or fail."""
        if not await self.heard(within_s):
            raise AssertionError(f"the server said nothing within {within_s} s")
        frames = self.sock.recv_multipart()
        return frames if self.signer is None else self.signer.verify(frames)


@contextmanager
def keyed_peer(h: ab.Handle) -> Iterator[KeyedPeer]:
    peer = KeyedPeer(h)
    try:
        yield peer
    finally:
        peer.close()


def server_processes(pid: int) -> list[Any]:
    """The live TCP server processes that process ``pid`` started."""
    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "aiobroadcast._tcp.server" in p.cmdline() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def the_server(pid: int | None = None) -> Any:
    """The one live TCP server process of process ``pid`` (default: this one)."""
    servers = server_processes(os.getpid() if pid is None else pid)
    assert len(servers) == 1, servers
    return servers[0]
