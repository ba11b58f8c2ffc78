"""The writer's TCP server: serves remote readers from the ring, with credit flow control,
heartbeats, resend on loss and CurveZMQ (docs/design.md, "Remote readers").

It runs as its own process (``python -m aiobroadcast._tcp_server``, started by ``open_writer``),
so it neither competes with the writer for the GIL nor depends on the writer's event loop: heartbeats
go on while the writer is busy, and it notices the writer's death like any reader. It reads the
ring as one more local reader (its place is reserved), so under policy "block" a slow remote
reader holds the writer back exactly like a local one. Closing its stdin asks it to stop once
remote readers have drained; it publishes who is connected in a small JSON file beside the ring.
"""

from __future__ import annotations

import bisect
import ctypes
import json
import logging
import os
import signal
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.auth.thread

from . import _wire as wire
from ._exceptions import BroadcastError, EndOfStream, ReaderLagged, WouldBlock, WriterGone
from ._handle import Handle
from ._ring import Segment, attach_segment
from ._shm_reader import ShmSource

log = logging.getLogger("aiobroadcast")

BRIDGE_NAME = "tcp-server"


def _raw(body: Any, oob: bool) -> tuple[bytes | zmq.Frame, int]:
    """A body out of the ring, copied once (it is a view of the slot, which the writer reuses
    as soon as we move on). A large body is copied straight into a ZeroMQ message, which every
    send then shares (refcounted, never copied again); a small one into bytes, to be joined."""
    if len(body) >= wire.FRAME_ALONE:
        return zmq.Frame(body, copy=True), 1 if oob else 0
    return bytes(body), 1 if oob else 0


@dataclass
class _Client:
    ident: bytes
    name: str
    pid: int
    window: int
    next_send: int
    acked: int
    last_heard: float
    ended: bool = False
    received_total: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    host: str = ""  #: where it lives, as it says in HELLO (optional)


class _Allow:
    """ZAP credentials check: only the readers' public key gets in."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self._key


class TcpServer:
    def __init__(
        self,
        seg: Segment,
        handle: Handle,
        endpoint: str,
        *,
        insecure: bool,
        server_secret: bytes | None,
        client_public: bytes | None,
        hmac_key: bytes | None,
        window: int,
        buffer_max: int,
        hb_interval: float,
        hb_timeout: float,
        max_remote: int,
        stop_fd: int,
        stats_path: str,
    ) -> None:
        self._handle = handle
        self._stats_path = stats_path
        self._window = window
        self._buffer_max = buffer_max
        self._hb_interval = hb_interval
        self._hb_timeout = hb_timeout
        self.drain_timeout = 2 * hb_timeout
        self._max_remote = max_remote
        self._block = handle.policy == "block"
        self._key = hmac_key if insecure else None
        self._ctx = zmq.Context()
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None
        self._router = self._ctx.socket(zmq.ROUTER)
        try:
            r = self._router
            r.linger = 0
            r.sndhwm = 0  # bounded by the credit windows instead
            r.rcvhwm = 0
            r.maxmsgsize = wire.MAX_CONTROL_FRAME
            r.router_mandatory = False
            if not insecure:
                assert server_secret is not None and client_public is not None
                self._auth = zmq.auth.thread.ThreadAuthenticator(self._ctx, log=logging.getLogger("aiobroadcast.zap"))
                self._auth.start()
                self._auth.configure_curve_callback("aiobroadcast", credentials_provider=_Allow(client_public))
                r.zap_domain = b"aiobroadcast"
                r.curve_server = True
                r.curve_secretkey = server_secret
            try:
                r.bind(_port_star(endpoint))
            except zmq.ZMQError as exc:
                raise BroadcastError(f"cannot bind {endpoint}: {exc}") from exc
            self.endpoint = r.getsockopt_string(zmq.LAST_ENDPOINT)
            self._src = ShmSource(seg, handle, BRIDGE_NAME, _raw)
        except BaseException:
            self._close_sockets()
            raise
        self._ctrl_r = stop_fd
        os.set_blocking(self._ctrl_r, False)
        self._lock = threading.Lock()
        self._clients: dict[bytes, _Client] = {}
        self._buf: list[tuple[bytes | zmq.Frame, int]] = []
        # seq of each entry of _buf, ascending. Consecutive but for gaps (policy "lag": the ring
        # overwrote messages before we took them); a seq in [_base, _end) that is not here was lost.
        self._seqs: list[int] = []
        self._base = 0  # nothing before it is held
        self._end = 0  # next seq the server will have
        self._ring_done: str | None = None  # "closed" or "gone"
        self._stopping = False
        self._stop_deadline = 0.0
        self.dropped = 0
        self.rejected_frames = 0

    def _write_stats(self) -> None:
        """Who is connected, for ``Writer.statistics()`` and ``aiobroadcast stats``."""
        snapshot = {
            "pid": os.getpid(),
            "end": self._end,
            "dropped": self.dropped,
            "rejected_frames": self.rejected_frames,
            "readers": [
                {"name": c.name, "pid": c.pid, "host": c.host, "received": c.acked, "lag": max(0, self._end - c.acked)}
                for c in self._clients.values()
            ],
        }
        tmp = f"{self._stats_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(snapshot, f)
        os.replace(tmp, self._stats_path)

    def run(self) -> None:
        try:
            self._loop()
        except Exception:  # pragma: no cover - a bug; readers will see the writer as gone
            log.exception("aiobroadcast: TCP server failed")
        finally:
            self._src.close()
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._router.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._ctrl_r, zmq.POLLIN)
        inbox = self._src.inbox_fd
        next_hb = time.monotonic() + self._hb_interval
        while True:
            pulled = self._pull_ring()
            self._recv_clients()
            sent = self._send_clients()
            self._trim()
            now = time.monotonic()
            if now >= next_hb:
                self._heartbeat(now)
                self._write_stats()
                next_hb = now + self._hb_interval
            if self._stopping and (self._all_done() or now >= self._stop_deadline):
                return
            if pulled or sent:
                continue
            want_ring = self._ring_done is None and (not self._block or len(self._buf) < self._buffer_max)
            ring_sleep = want_ring and not self._src.begin_sleep()
            if want_ring and not ring_sleep:
                continue  # the ring changed while we announced the sleep
            if ring_sleep:
                poller.register(inbox, zmq.POLLIN)
            try:
                poller.poll(int(max(0.0, next_hb - time.monotonic()) * 1000) + 1)
            finally:
                if ring_sleep:
                    poller.unregister(inbox)
                    self._src.end_sleep(self._src.drain_inbox())
            if not self._stopping:
                try:
                    if os.read(self._ctrl_r, 64) == b"":  # the writer closed our stdin: drain, then stop
                        self._stopping = True
                        self._stop_deadline = time.monotonic() + self.drain_timeout
                        poller.unregister(self._ctrl_r)  # EOF stays readable: stop polling it
                except BlockingIOError:
                    pass

    def _pull_ring(self, *, catch_up: bool = False) -> int:
        """Take what the ring holds into the buffer (under "block", while the buffer has room).
        ``catch_up``: take what the ring holds now even if the buffer is full (at most
        ``capacity`` messages), so that a reader joining now starts after it."""
        n = 0
        buf = self._buf
        most = self._handle.capacity if catch_up else 4096
        while self._ring_done is None and (catch_up or not self._block or len(buf) < self._buffer_max) and n < most:
            try:
                item = self._src.get_nowait()
            except WouldBlock:
                break
            except ReaderLagged as exc:
                # The ring overwrote messages before we took them (policy "lag"): a gap in the
                # buffer. Readers still get what we hold before it, then are told exactly what
                # the gap cost them (_send_clients).
                with self._lock:
                    self._end += exc.missed
                continue
            except EndOfStream:
                self._ring_done = "closed"
                break
            except WriterGone:
                self._ring_done = "gone"
                break
            buf.append(item)
            self._seqs.append(self._end)
            with self._lock:
                self._end += 1
            n += 1
        return n

    def _send(self, ident: bytes, frames: list[Any]) -> None:
        self._send_signed(ident, wire.sign(self._key, frames))

    def _send_signed(self, ident: bytes, frames: list[Any]) -> None:
        try:
            self._router.send_multipart([ident, *frames], flags=zmq.NOBLOCK)
        except zmq.Again:  # pragma: no cover - sndhwm is unlimited
            pass

    def _recv_clients(self) -> None:
        router = self._router
        for _ in range(1024):
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ident, rest = frames[0], frames[1:]
            try:
                self._handle_frames(ident, wire.verify(self._key, rest))
            except (wire.FrameError, ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
                self.rejected_frames += 1
                log.warning("aiobroadcast: rejected a malformed frame from a remote reader: %s", exc)

    def _handle_frames(self, ident: bytes, frames: list[bytes]) -> None:
        if not frames:
            raise wire.FrameError("empty message")
        kind = frames[0]
        now = time.monotonic()
        client = self._clients.get(ident)
        if kind == wire.HELLO:
            hello = wire.decode_json(frames[1])
            if hello.get("version") != wire.PROTOCOL_VERSION:
                self._send(ident, [wire.REFUSED, b"protocol version mismatch"])
                return
            if client is None and len(self._clients) >= self._max_remote:
                self._send(ident, [wire.REFUSED, f"all {self._max_remote} remote reader places are taken".encode()])
                return
            resume = hello.get("resume")
            if resume is None:
                # A new reader starts with the next message published, as on shared memory: not
                # with what a full buffer (a slow reader, policy "block") left in the ring.
                self._pull_ring(catch_up=True)
            start = self._end if resume is None else int(resume)
            client = _Client(
                ident=ident,
                name=str(hello.get("name", "?"))[:64],
                pid=int(hello.get("pid", 0)),
                host=str(hello.get("host", ""))[:64],
                window=max(1, min(int(hello.get("window", self._window)), self._window)),
                next_send=start,
                acked=start,
                last_heard=now,
            )
            with self._lock:
                self._clients[ident] = client
            self._write_stats()  # statistics() lists it as soon as open_reader returns
            welcome = {
                "start": start,
                "policy": self._handle.policy,
                "hb_interval": self._hb_interval,
                "hb_timeout": self._hb_timeout,
                "window": client.window,  # the credit granted: the reader acknowledges every half of it
            }
            self._send(ident, [wire.WELCOME, wire.encode_json(welcome)])
            self._rewind(client, start)
            return
        if client is None:
            if kind != wire.BYE:
                self._send(ident, [wire.UNKNOWN])
            return
        client.last_heard = now
        if kind == wire.ACK:
            (n,) = wire.U64.unpack(frames[1])
            if n > client.acked:
                client.acked = min(n, client.next_send)
        elif kind == wire.NACK:
            (n,) = wire.U64.unpack(frames[1])
            self._rewind(client, n)
        elif kind == wire.BYE:
            with self._lock:
                del self._clients[ident]
            self._write_stats()
        else:
            raise wire.FrameError(f"unknown frame kind {kind[:8]!r}")

    def _rewind(self, client: _Client, n: int) -> None:
        """Send again from ``n``; if the server no longer has it, say exactly what is lost."""
        n = min(n, self._end)
        if n < self._base:
            self._send(client.ident, [wire.LAGGED, wire.U64x2.pack(self._base, self._base - n)])
            n = self._base
        client.next_send = n
        # Credit is not granted for the gap: the reader acknowledges it once it has taken the
        # LAGGED report (it then holds at most `window` messages, however long it stalls).
        client.acked = min(client.acked, n)
        client.ended = False

    def _send_clients(self) -> int:
        sent = 0
        # Readers that keep pace get the same batch: build and sign it once (the HMAC reads
        # every byte), keyed by its first seq and count, which fix its content within this call.
        batches: dict[tuple[int, int], list[Any]] = {}
        for client in list(self._clients.values()):
            if client.next_send < self._base:  # the server's own ring reader lagged: say so
                self._rewind(client, client.next_send)
            limit = min(self._end, client.acked + client.window)
            if client.next_send < limit:
                seqs = self._seqs
                lo = bisect.bisect_left(seqs, client.next_send)
                if lo == len(seqs) or seqs[lo] != client.next_send:
                    # In a gap of the server's own: say what it holds next, and go on from there.
                    after = seqs[lo] if lo < len(seqs) else self._end
                    self._send(client.ident, [wire.LAGGED, wire.U64x2.pack(after, after - client.next_send)])
                    client.next_send = after
                    if after >= limit:
                        continue  # no credit beyond the gap until the reader takes the report
                first = client.next_send
                hi = lo + min(limit - first, len(seqs) - lo)
                hi = _run_end(seqs, lo, hi)  # stop before a gap
                items = []
                size = 0
                for item in self._buf[lo:hi]:
                    items.append(item)
                    size += len(item[0])
                    if size >= 1 << 20:
                        break
                key = (first, len(items))
                frames = batches.get(key)
                if frames is None:
                    frames = batches[key] = wire.sign(self._key, wire.encode_batch(first, items))
                self._send_signed(client.ident, frames)
                client.next_send += len(items)
                sent += len(items)
            elif self._ring_done and not client.ended and client.next_send >= self._end:
                self._send(client.ident, [wire.END, wire.U64.pack(self._end), self._ring_done.encode()])
                client.ended = True
        return sent

    def _trim(self) -> None:
        buf = self._buf
        seqs = self._seqs
        if self._block:
            keep_from = min((c.acked for c in self._clients.values()), default=self._end)
            drop = bisect.bisect_left(seqs, keep_from)
        else:  # the newest buffer_max entries (gaps do not count)
            drop = max(0, len(seqs) - self._buffer_max)
            keep_from = seqs[drop] if drop < len(seqs) else self._end
        if keep_from > self._base:
            del buf[:drop]
            del seqs[:drop]
            with self._lock:
                self._base = keep_from
            for client in self._clients.values():
                if client.next_send < self._base:  # policy "lag": it fell behind the buffer
                    self._rewind(client, client.next_send)

    def _heartbeat(self, now: float) -> None:
        done = 1 if self._ring_done else 0
        for ident, client in list(self._clients.items()):
            if now - client.last_heard > self._hb_timeout:
                with self._lock:
                    del self._clients[ident]
                self.dropped += 1
                log.warning(
                    "aiobroadcast: remote reader %r (pid %d) silent for %.1f s; dropped it at message %d of %d",
                    client.name,
                    client.pid,
                    now - client.last_heard,
                    client.acked,
                    self._end,
                )
                continue
            self._send(ident, [wire.HEARTBEAT, wire.U64x2.pack(self._end, done)])

    def _all_done(self) -> bool:
        # Every remote reader has everything (it says BYE when it has the end) or was dropped.
        return self._ring_done is not None and all(c.ended and c.acked >= self._end for c in self._clients.values())


def _run_end(seqs: list[int], lo: int, hi: int) -> int:
    """The end of the run of consecutive seqs that starts at ``seqs[lo]``, at most ``hi``.
    ``seqs`` ascends without repeats, so ``seqs[j] - j`` never falls: a binary search."""
    d = seqs[lo] - lo
    return lo + bisect.bisect_right(range(lo, hi), d, key=lambda j: seqs[j] - j)


def _port_star(endpoint: str) -> str:
    """``tcp://host:0`` binds an ephemeral port; the real one is read back from the socket."""
    if endpoint.endswith(":0"):
        return endpoint[:-2] + ":*"
    return endpoint


#: glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: free memory glibc may keep at the top of a heap instead of giving it back to the kernel
KEEP_FREE_BYTES = 64 << 20


def _keep_freed_memory() -> None:
    """Stop glibc from handing freed message buffers back to the kernel at once.

    Large bodies make a ZeroMQ message per body: allocated here, freed by ZeroMQ's I/O thread
    once sent. With glibc's default (a 128 KiB trim threshold, raised only as large blocks are
    freed) the freed top of the heap goes back to the kernel, and the next body faults its pages
    in again: about 5 page faults per 64 KiB message. Keeping up to KEEP_FREE_BYTES free
    removes them. This process is ours, so the setting affects no one else; elsewhere than
    glibc it is skipped."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    mallopt(_M_TRIM_THRESHOLD, KEEP_FREE_BYTES)
    mallopt(_M_MMAP_THRESHOLD, 4 << 20)  # fixed (it was adaptive): bodies up to 4 MiB reuse the heap


def main() -> int:
    """Entry point of the server process. Reads its configuration (with the keys: never on the
    command line) as one JSON line on stdin, answers with one JSON line on stdout (the endpoint
    it bound, or the error), then serves until stdin closes and remote readers have drained."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    _keep_freed_memory()
    # A terminal's Ctrl-C is for the writer: it stops this server by closing our stdin, after
    # remote readers have drained.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cfg = json.loads(sys.stdin.readline())
    handle = Handle.model_validate(cfg["handle"])

    def key(name: str) -> bytes | None:
        value = cfg.get(name)
        return value.encode() if value else None

    try:
        seg = attach_segment(handle.path, handle.token, handle.capacity, handle.slot_bytes, handle.max_readers)
        try:
            server = TcpServer(
                seg,
                handle,
                cfg["endpoint"],
                insecure=cfg["insecure"],
                server_secret=key("server_secret"),
                client_public=key("client_public"),
                hmac_key=key("hmac_key"),
                window=cfg["window"],
                buffer_max=cfg["buffer_max"],
                hb_interval=cfg["hb_interval"],
                hb_timeout=cfg["hb_timeout"],
                max_remote=cfg["max_remote"],
                stop_fd=sys.stdin.fileno(),
                stats_path=cfg["stats_path"],
            )
        except BaseException:
            seg.close()
            raise
    except BroadcastError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1
    print(json.dumps({"endpoint": server.endpoint}), flush=True)
    server._write_stats()
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
