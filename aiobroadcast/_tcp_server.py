"""The writer's TCP server: serves remote readers from the ring, with credit flow control,
heartbeats, resend on loss and CurveZMQ (docs/design.md, "Remote readers").

It runs as its own process (``python -m aiobroadcast._tcp_server``, started by ``open_writer``),
so it neither competes with the writer for the GIL nor depends on the writer's event loop: heartbeats
go on while the writer is busy, and it notices the writer's death like any reader. It reads the
ring as one more local reader (its place is reserved), so under policy "block" a slow remote
reader holds the writer back exactly like a local one. Closing its stdin asks it to stop once
remote readers have drained; it publishes who is connected in a small JSON file beside the ring.

Clients hold the keys but are not trusted: every frame is checked before it is acted on, a bad
one costs only its sender, and what one client can make the server hold is bounded (docs/design.md,
"Clients that hold the keys"). If the process dies anyway, the writer starts another
(``_tcp_supervisor.py``), which takes this one's ring place over.
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
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.auth.thread

from . import _seal as seal
from . import _wire as wire
from ._exceptions import BroadcastError, EndOfStream, ReaderLagged, WouldBlock, WriterGone
from ._handle import Handle
from ._ring import NAME_BYTES, W_NEXT_MSG, Segment, attach_segment
from ._shm_reader import ShmSource
from ._tcp_supervisor import remove_quietly, stats_tmp_path

log = logging.getLogger("aiobroadcast")

BRIDGE_NAME = "tcp-server"

#: ZeroMQ's queue of frame groups for one remote reader (ZMQ_SNDHWM). The server never queues
#: more for a reader: a batch ZeroMQ refuses stays in the server's buffer and goes later. With
#: BATCH_BYTES this bounds what a reader that does not read (or asks for everything again and
#: again) costs the server: docs/design.md, "Remote readers".
SEND_HWM = 16
#: a batch takes no more bodies once it holds this many bytes
BATCH_BYTES = 128 * 1024
#: frame groups ZeroMQ takes in from one reader before it stops reading that connection
RECV_HWM = 64
#: how soon the server tries again to send to a reader whose queue was full
RETRY_S = 0.005
#: a remote peer's refused frames are logged at most once in this many seconds
COMPLAIN_EVERY_S = 60.0
#: peers remembered for that (a flood of new peers is not logged one by one)
COMPLAINTS_KEPT = 256


def _view(body: Any, oob: bool) -> tuple[Any, int]:
    """A body as the ring hands it: a view of its slot (policy "block"; the slot is held until
    the next ``get_nowait``) or a checked copy (policy "lag"). ``_pull_ring`` seals it at once,
    its number known: sealing is the one copy out of the ring."""
    return body, 1 if oob else 0


@dataclass
class _Client:
    ident: bytes
    name: str
    pid: int
    window: int
    next_send: int
    acked: int
    last_heard: float
    #: when it last had the server send again (HELLO, NACK): at most once a heartbeat
    resent_at: float = 0.0
    ended: bool = False
    host: str = ""  #: where it lives, as it says in HELLO (optional)
    #: ZeroMQ refused the last send (its queue is full, or it is not connected): try again soon
    choked: bool = False


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
        take_over: int | None = None,
        returning: int = 0,
        rekey_messages: int = seal.REKEY_MESSAGES,
        rekey_bytes: int = seal.REKEY_BYTES,
    ) -> None:
        """``take_over`` and ``returning``: this server replaces one that died (pid
        ``take_over``), which served ``returning`` remote readers; see ``_awaiting_return``."""
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
        self._ring_words = seg.words
        self._ctx = zmq.Context()
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None
        self._router = self._ctx.socket(zmq.ROUTER)
        # Sealed data frames (BATCH, LAGGED, END) go on a second socket without CurveZMQ: each
        # message is sealed once for every reader (_seal.py), instead of CurveZMQ encrypting it
        # again for each connection. Admission and key delivery stay on the CurveZMQ socket;
        # docs/security.md says why this split is safe.
        self._data = self._ctx.socket(zmq.ROUTER)
        # A body is sealed once, with the group key of this server process (a restarted server
        # draws another; readers get it in WELCOME). Insecure: authenticated, not encrypted.
        self._sealer = seal.Sealer(
            handle.token.encode(),
            secret=hmac_key if insecure else None,
            rekey_messages=rekey_messages,
            rekey_bytes=rekey_bytes,
        )
        self._keys_epoch = 0  # the sealer's epoch whose keys every reader was sent
        self.rekey_requested = False  # SIGUSR1: a new key now
        try:
            r = self._router
            r.linger = 0
            r.sndhwm = SEND_HWM
            r.rcvhwm = RECV_HWM
            r.maxmsgsize = wire.MAX_CONTROL_FRAME
            # A full queue raises Again, an unknown peer EHOSTUNREACH: nothing is dropped silently,
            # so the server knows what it has sent.
            r.router_mandatory = True
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
            d = self._data
            d.linger = 0
            d.sndhwm = SEND_HWM
            d.rcvhwm = 1
            # Readers send nothing here, and the server never reads it: what a peer sends stops
            # at one small message (the bound also applies to the handshake, hence not 0).
            d.maxmsgsize = 1024
            d.router_mandatory = True
            try:
                d.bind(_data_endpoint(self.endpoint))
            except zmq.ZMQError as exc:
                raise BroadcastError(f"cannot bind a data port beside {self.endpoint}: {exc}") from exc
            self.data_port = int(d.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
            # hold: under policy "block" a body is a view of its slot until the next get_nowait,
            # so _pull_ring seals it straight out of the ring.
            self._src = ShmSource(seg, handle, BRIDGE_NAME, _view, hold=True, take_over=take_over)
        except BaseException:
            self._close_sockets()
            raise
        self._ctrl_r = stop_fd
        os.set_blocking(self._ctrl_r, False)
        self._lock = threading.Lock()
        self._clients: dict[bytes, _Client] = {}
        self._buf: list[tuple[bytes | bytearray | zmq.Frame, int]] = []  # sealed bodies, flags
        # Message number of each entry of _buf, ascending: the ring's own numbers, so a server
        # started again (by the writer, after this one died) numbers the stream the same way.
        # Consecutive but for gaps (policy "lag": the ring overwrote messages before we took
        # them); a number in [_base, _end) that is not here was lost.
        self._seqs: list[int] = []
        self._base = self._src.next_msg  # nothing before it is held
        self._end = self._base  # next number the server will have
        self._ring_done: str | None = None  # "closed" or "gone"
        self._stopping = False
        self._stop_deadline = 0.0
        self.dropped = 0
        self.rejected_frames = 0
        self._complaints: dict[bytes, float] = {}
        self._report_failing = False
        self._returning = returning
        self._grace_until = time.monotonic() + 2 * hb_timeout

    def _write_stats(self) -> None:
        """Who is connected, for ``Writer.statistics()`` and ``aiobroadcast stats``. Only a
        report: if it cannot be written (a full /dev/shm), the last one stays and readers are
        served as before."""
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
        tmp = stats_tmp_path(self._stats_path)
        try:
            with open(tmp, "w") as f:
                json.dump(snapshot, f)
            os.replace(tmp, self._stats_path)
        except OSError as exc:
            remove_quietly(tmp)
            if not self._report_failing:
                self._report_failing = True
                log.warning(
                    "aiobroadcast: the TCP server cannot write its report %s (%s); remote readers are "
                    "served as before, statistics() shows the last report until there is room",
                    self._stats_path,
                    exc.strerror or exc,
                )
            return
        if self._report_failing:
            self._report_failing = False
            log.warning("aiobroadcast: the TCP server writes its report %s again", self._stats_path)

    def run(self) -> bool:
        """Serve until stopped; False if the server failed (a bug: the writer starts another)."""
        try:
            self._loop()
        except Exception:  # pragma: no cover - a bug
            log.exception("aiobroadcast: TCP server failed")
            return False
        finally:
            self._src.close()
            self._close_sockets()
            # Nobody is served from here on (a writer dropped without aclose leaves it to us).
            remove_quietly(self._stats_path)
            remove_quietly(stats_tmp_path(self._stats_path))
        return True

    def _close_sockets(self) -> None:
        self._router.close(linger=0)
        self._data.close(linger=0)
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
            if self.rekey_requested:
                self.rekey_requested = False
                self._sealer.rekey()
            pulled = self._pull_ring()
            self._send_keys()  # before anything sealed under the new key goes out
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
            wait_s = next_hb - time.monotonic()
            if any(c.choked for c in self._clients.values()):
                wait_s = min(wait_s, RETRY_S)
            try:
                poller.poll(int(max(0.0, wait_s) * 1000) + 1)
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

    def _pull_ring(self) -> int:
        """Take what the ring holds into the buffer (under "block", while the buffer has room)."""
        n = 0
        buf = self._buf
        src = self._src
        while self._ring_done is None and (not self._block or len(buf) < self._buffer_max) and n < 4096:
            try:
                item = src.get_nowait()
            except WouldBlock:
                break
            except ReaderLagged:
                # The ring overwrote messages before we took them (policy "lag"): a gap in the
                # buffer. Readers still get what we hold before it, then are told exactly what
                # the gap cost them (_send_clients).
                with self._lock:
                    self._end = src.next_msg
                continue
            except EndOfStream:
                self._ring_done = "closed"
                break
            except WriterGone:
                self._ring_done = "gone"
                break
            seq = src.next_msg - 1
            if seq < self._base and not self._seqs:
                # Only the first message after joining can be numbered below what the ring said
                # then (the writer was between its two stores; docs/design.md, "Joining"). It is
                # still ours to send: start there.
                self._base = seq
            body, flags = item
            # Sealed once here, in the ring's order (the sealer never seals a number twice under
            # one key), and these bytes go to every reader and again after a loss.
            sealed = self._sealer.seal(seq, flags, body)
            buf.append((zmq.Frame(sealed, copy=False) if len(sealed) >= wire.FRAME_ALONE else sealed, flags))
            self._seqs.append(seq)
            with self._lock:
                self._end = seq + 1
            n += 1
        return n

    def _horizon(self) -> int:
        """The number of the next message the writer will publish (and this server will have)."""
        return max(self._end, self._ring_words[W_NEXT_MSG])

    def _send(self, ident: bytes, frames: list[Any]) -> bool:
        return self._send_signed(ident, wire.sign(self._key, frames))

    def _send_data(self, ident: bytes, frames: list[Any]) -> bool:
        """``_send_signed`` on the data socket: frames sealed already (bodies by _seal.py; the
        batch header is checked by them: every body's seq and flags are bound into its seal)."""
        return self._send_signed(ident, frames, self._data)

    def _send_sealed(self, ident: bytes, kind: bytes, payload: bytes) -> bool:
        """A data-socket frame that is not a message (LAGGED, END), sealed for this send."""
        return self._send_data(ident, [kind, self._sealer.seal_control(kind, payload)])

    def _send_keys(self) -> None:
        """After a rekey: every reader gets the keys (the next one was announced already, so
        readers open the first frame under it even if this arrives later)."""
        if self._sealer.epoch == self._keys_epoch:
            return
        self._keys_epoch = self._sealer.epoch
        msg = [wire.KEYS, self._sealer.keys_message()]
        for ident in list(self._clients):
            self._send(ident, msg)  # lost if its queue is full: it asks again (UnknownKey)

    def _send_signed(self, ident: bytes, frames: list[Any], sock: zmq.Socket[Any] | None = None) -> bool:
        """Hand ``frames`` to ZeroMQ for ``ident``; False if it refused: the reader's queue is full
        (SEND_HWM: it is not reading) or it is not connected right now."""
        try:
            (sock or self._router).send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            return False
        return True

    def _recv_clients(self) -> None:
        router = self._router
        for _ in range(1024):
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ident, rest = frames[0], frames[1:]
            if len(rest) > wire.MAX_CONTROL_FRAMES:
                self._reject(ident, f"{len(rest)} frames in one message")
                continue
            try:
                rest = wire.verify(self._key, rest)
            except wire.FrameError as exc:
                # Not authentic (insecure mode): nothing says which reader it claims to be, so
                # nobody is dropped for it.
                self.rejected_frames += 1
                self._complain(ident, None, str(exc))
                continue
            try:
                self._handle_frames(ident, rest)
            except (wire.FrameError, struct.error) as exc:
                self._reject(ident, str(exc))
            except Exception as exc:  # a bug: it must not take the other readers down with it
                log.exception("aiobroadcast: the TCP server failed on a frame from a remote reader")
                self._reject(ident, f"internal error {type(exc).__name__}")

    def _reject(self, ident: bytes, reason: str) -> None:
        """A frame from ``ident`` that the server refuses: count it, drop that reader (only it),
        tell it why."""
        self.rejected_frames += 1
        with self._lock:
            client = self._clients.pop(ident, None)
        self._complain(ident, client, reason)
        self._send(ident, [wire.REFUSED, f"malformed frame: {reason}".encode()[:256]])
        if client is not None:
            self._write_stats()

    def _complain(self, ident: bytes, client: _Client | None, reason: str) -> None:
        """Log a refused frame: once per peer per COMPLAIN_EVERY_S, so a flood is a few lines."""
        now = time.monotonic()
        last = self._complaints.get(ident)
        if last is not None and now - last < COMPLAIN_EVERY_S:
            return
        if len(self._complaints) >= COMPLAINTS_KEPT:
            self._complaints = {k: t for k, t in self._complaints.items() if now - t < COMPLAIN_EVERY_S}
            if len(self._complaints) >= COMPLAINTS_KEPT:
                return
        self._complaints[ident] = now
        who = f"remote reader {client.name!r} (pid {client.pid})" if client else "a remote peer"
        log.warning(
            "aiobroadcast: the TCP server refused a frame from %s: %s%s (%d refused so far)",
            who,
            reason[:200],
            "; dropped it" if client else "",
            self.rejected_frames,
        )

    def _handle_frames(self, ident: bytes, frames: list[bytes]) -> None:
        """Act on one reader's frame group, each field checked first (raises ``FrameError``)."""
        if not frames:
            raise wire.FrameError("empty message")
        kind = frames[0]
        now = time.monotonic()
        client = self._clients.get(ident)
        if kind == wire.HELLO:
            _arity(frames, 1)
            self._hello(ident, client, wire.decode_hello(frames[1]), now)
            return
        if kind in (wire.ACK, wire.NACK):
            _arity(frames, 1)
            if len(frames[1]) != wire.U64.size:
                raise wire.FrameError(f"{kind!r} needs a u64, got {len(frames[1])} bytes")
            (n,) = wire.U64.unpack(frames[1])
        elif kind == wire.BYE:
            _arity(frames, 0)
        else:
            raise wire.FrameError(f"unknown frame kind {kind[:8]!r}")
        if client is None:
            if kind != wire.BYE:
                self._send(ident, [wire.UNKNOWN])
            return
        client.last_heard = now
        if kind == wire.ACK:
            if n > client.acked:
                client.acked = min(n, client.next_send)
        elif kind == wire.NACK:
            if now - client.resent_at < self._hb_interval:
                return  # what it asked for a moment ago is on its way; it asks again if not
            client.resent_at = now
            # Send again from n, within its window: what it acknowledged it has, and beyond its
            # credit it may not ask.
            client.next_send = max(client.acked, min(n, client.acked + client.window, self._horizon()))
            client.ended = False
        else:
            with self._lock:
                del self._clients[ident]
            self._write_stats()

    def _hello(self, ident: bytes, client: _Client | None, hello: wire.Hello, now: float) -> None:
        if hello.version != wire.PROTOCOL_VERSION:
            self._send(ident, [wire.REFUSED, b"protocol version mismatch"])
            return
        if hello.channel is not None and hello.channel != self._handle.token:
            # Same endpoint and keys (fixed CurveKeys), but the handle of another writer: its
            # frames would never open here (the channel id is in every seal).
            self._send(ident, [wire.REFUSED, b"this handle is of another channel (an earlier writer at this endpoint)"])
            return
        if client is not None and now - client.resent_at < self._hb_interval:
            return  # it said HELLO a moment ago; it says it again if the WELCOME is lost
        if client is None and len(self._clients) >= self._max_remote:
            self._send(ident, [wire.REFUSED, f"all {self._max_remote} remote reader places are taken".encode()])
            return
        horizon = self._horizon()
        if hello.resume is not None and self._returning:
            self._returning -= 1
        if hello.resume is not None and hello.resume > horizon:
            raise wire.FrameError(f"resume at {hello.resume}, beyond the stream's next message {horizon}")
        # A new reader starts with the next message published, as on shared memory: not with
        # what the server still holds, nor with what is in the ring and not yet taken (a slow
        # reader, policy "block"). A returning one resumes where it says; if that is before
        # what the server holds, _send_clients tells it exactly what it lost.
        start = horizon if hello.resume is None else hello.resume
        client = _Client(
            ident=ident,
            name=hello.name[:NAME_BYTES],
            pid=hello.pid,
            host=hello.host,
            window=min(hello.window, self._window),
            next_send=start,
            acked=start,
            last_heard=now,
            resent_at=now,
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
            # Where the sealed data frames come from, and the keys to open them (secret: this
            # goes over CurveZMQ only; insecure, it holds salts, not keys).
            "data_port": self.data_port,
            "keys": self._sealer.keys_message().hex(),
        }
        self._send(ident, [wire.WELCOME, wire.encode_json(welcome)])

    def _send_clients(self) -> int:
        sent = 0
        # Readers that keep pace get the same batch: build it once (its bodies are sealed
        # already), keyed by its first seq and count, which fix its content within this call.
        batches: dict[tuple[int, int], list[Any]] = {}
        for client in list(self._clients.values()):
            try:
                sent += self._send_client(client, batches)
            except Exception:  # a bug: it must not take the other readers down with it
                log.exception("aiobroadcast: the TCP server failed to send to %r; dropped it", client.name)
                with self._lock:
                    self._clients.pop(client.ident, None)
        return sent

    def _send_client(self, client: _Client, batches: dict[tuple[int, int], list[Any]]) -> int:
        """Send ``client`` what its credit allows; the number of messages ZeroMQ took."""
        if client.next_send < self._base:
            # It needs what the server no longer holds (policy "lag", a resume after a restart):
            # say exactly what is lost. Credit is not granted for the gap: the reader acknowledges
            # it once it has taken the report (it then holds at most `window` messages).
            if not self._send_sealed(
                client.ident, wire.LAGGED, wire.U64x2.pack(self._base, self._base - client.next_send)
            ):
                client.choked = True
                return 0
            client.next_send = self._base
        limit = min(self._end, client.acked + client.window)
        if client.next_send < limit:
            seqs = self._seqs
            lo = bisect.bisect_left(seqs, client.next_send)
            if lo == len(seqs) or seqs[lo] != client.next_send:
                # In a gap of the server's own: say what it holds next, and go on from there.
                after = seqs[lo] if lo < len(seqs) else self._end
                if not self._send_sealed(client.ident, wire.LAGGED, wire.U64x2.pack(after, after - client.next_send)):
                    client.choked = True
                    return 0
                client.next_send = after
                if after >= limit:
                    return 0  # no credit beyond the gap until the reader takes the report
            first = client.next_send
            hi = lo + min(limit - first, len(seqs) - lo)
            hi = _run_end(seqs, lo, hi)  # stop before a gap
            count = 0
            size = 0
            for body, _flags in self._buf[lo:hi]:
                count += 1
                size += len(body)
                if size >= BATCH_BYTES:
                    break
            key = (first, count)
            frames = batches.get(key)
            if frames is None:
                frames = batches[key] = wire.encode_batch(first, self._buf[lo : lo + count])
            if not self._send_data(client.ident, frames):
                client.choked = True
                return 0
            client.choked = False
            client.next_send += count
            return count
        if self._ring_done and not client.ended and client.next_send >= self._end:
            if self._send_sealed(client.ident, wire.END, wire.U64.pack(self._end) + self._ring_done.encode()):
                client.ended = True
            else:
                client.choked = True
        return 0

    def _awaiting_return(self) -> bool:
        """Whether readers of the server this one replaces may still come back (for at most
        two silence timeouts): under "block" it keeps what it takes from the ring for them."""
        if self._returning and time.monotonic() >= self._grace_until:
            self._returning = 0
        return self._returning > 0

    def _trim(self) -> None:
        buf = self._buf
        seqs = self._seqs
        if self._block and self._awaiting_return():
            return
        if self._block:
            # Held until every reader has it (a reader that joined later starts after it).
            keep_from = min(min((c.acked for c in self._clients.values()), default=self._end), self._end)
            drop = bisect.bisect_left(seqs, keep_from)
        else:  # the newest buffer_max entries (gaps do not count)
            drop = max(0, len(seqs) - self._buffer_max)
            keep_from = seqs[drop] if drop < len(seqs) else self._end
        if keep_from > self._base:
            del buf[:drop]
            del seqs[:drop]
            with self._lock:
                self._base = keep_from
            self._sealer.retire(seqs[0] if seqs else self._end)

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
            self._send(ident, [wire.HEARTBEAT, wire.U64x2.pack(self._end, done)])  # lost if its queue is full

    def _all_done(self) -> bool:
        # Every remote reader has everything (it says BYE when it has the end) or was dropped.
        return self._ring_done is not None and all(c.ended and c.acked >= self._end for c in self._clients.values())


def _arity(frames: list[bytes], args: int) -> None:
    if len(frames) != 1 + args:
        raise wire.FrameError(f"{frames[0][:8]!r} takes {args} argument frame(s), got {len(frames) - 1}")


def _run_end(seqs: list[int], lo: int, hi: int) -> int:
    """The end of the run of consecutive seqs that starts at ``seqs[lo]``, at most ``hi``.
    ``seqs`` ascends without repeats, so ``seqs[j] - j`` never falls: a binary search."""
    d = seqs[lo] - lo
    return lo + bisect.bisect_right(range(lo, hi), d, key=lambda j: seqs[j] - j)


def _data_endpoint(endpoint: str) -> str:
    """The data socket binds where the control socket did, on a port of its own."""
    return endpoint.rsplit(":", 1)[0] + ":*"


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
                take_over=cfg.get("take_over"),
                returning=cfg.get("returning", 0),
                rekey_messages=cfg.get("rekey_messages") or seal.REKEY_MESSAGES,
                rekey_bytes=cfg.get("rekey_bytes") or seal.REKEY_BYTES,
            )
        except BaseException:
            seg.close()
            raise
    except BroadcastError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1

    def rekey_now(signum: int, frame: Any) -> None:
        server.rekey_requested = True  # taken at the next turn of the loop

    signal.signal(signal.SIGUSR1, rekey_now)  # a new group key on demand
    print(json.dumps({"endpoint": server.endpoint}), flush=True)
    server._write_stats()
    return 0 if server.run() else 1


if __name__ == "__main__":
    sys.exit(main())
