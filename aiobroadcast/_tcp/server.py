"""The writer's TCP server: serves remote readers from the ring, with credit flow control,
heartbeats, resend on loss and CurveZMQ (docs/design.md, "Remote readers").

It runs as its own process (``python -m aiobroadcast._tcp.server``, started by ``open_writer``),
so it neither competes with the writer for the GIL nor depends on the writer's event loop: heartbeats
go on while the writer is busy, and it notices the writer's death like any reader. It reads the
ring as one more local reader (its place is reserved), so under policy "block" a slow remote
reader holds the writer back exactly like a local one. Closing its stdin asks it to stop once
remote readers have drained; it publishes who is connected in a small JSON file beside the ring.

Clients hold the keys but are not trusted: every frame is checked before it is acted on, a bad
one costs only its sender, and what one client can make the server hold is bounded (docs/design.md,
"Clients that hold the keys"). If the process dies anyway, the writer starts another
(``supervisor.py``), which takes this one's ring place over.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import resource
import select
import signal
import sys
import time
from typing import Any

import zmq
import zmq.auth.thread
from pydantic import ValidationError

from .._base import tuning as _tuning
from .._base.constants import TCP_SERVER_READER_NAME
from .._base.errors import BroadcastError, EndOfStream, ReaderLagged, WouldBlock, WriterGone
from .._shm import segment as _segment
from .._shm.arena import arena_path
from .._shm.layout import W_NEXT_MSG, name_key
from .._shm.place import local_holder
from .._shm.segment import Segment, attach_segment
from .._shm.subscriber import ShmSource
from . import seal, wire
from .allow import AllowGate
from .listener import Listener
from .notices import Notices
from .report import remove_report
from .serving import (
    BUFFER_BYTES,
    ClientInfo,
    ReaderFault,
    ServerConfig,
    ServerProtocol,
)
from .settings import ServerSettings

log = logging.getLogger("aiobroadcast")

#: how soon the server tries again to send to a reader whose queue was full
RETRY_S = 0.005


def _view(body: Any, oob: bool) -> tuple[Any, int]:
    """A body as the ring hands it: a view of its slot (policy "block"; the slot is held until
    the next ``get_nowait``) or a checked copy (policy "lag"). The protocol seals it at once,
    its number known: sealing is the one copy out of the ring."""
    return body, 1 if oob else 0


#: sealed bodies at least this large become ZeroMQ messages without a copy (sharing the pool's
#: buffer); smaller ones are copied into one: pyzmq's zero-copy costs 10-15 us a message (its
#: garbage thread hears from ZeroMQ when the buffer is free), a copy of 64 KiB 4 us, and the
#: pool's buffer is then free again at once (the next body is sealed into it, warm in cache)
ZERO_COPY_BYTES = 256 * 1024


def _frame(sealed: bytes | bytearray) -> zmq.Frame:
    """A large sealed body as a ZeroMQ message, which every send then shares (refcounted, never
    copied again)."""
    return zmq.Frame(sealed, copy=len(sealed) < ZERO_COPY_BYTES)


#: a turn of the server's loop stops taking from the ring once it took this many bytes of bodies
#: (or 4096 messages): the sealed ones go out, then it takes more. Taking the whole ring first (up
#: to 64 messages of 64 KiB, about 6 ms of sealing) left the readers idle while it sealed, then
#: sent them a burst (docs/performance.md: 64 KiB with 1 reader from 4,887 to 6,333 msgs/s, medians
#: of 5 alternated runs). Small messages still go many to a turn (64 KiB of them).
TURN_BYTES = 64 * 1024


class RingFeed:
    """The server's reading of the ring, as one more local reader (its place is reserved, so
    under policy "block" a slow remote reader holds the writer back as a local one would): a
    turn's take handed to the protocol (``pull``), and leaving the ring (``leave``)."""

    def __init__(self, seg: Segment, settings: ServerSettings) -> None:
        handle = settings.handle
        # hold: under policy "block" a body is a view of its slot until the next get_nowait,
        # so the protocol seals it straight out of the ring.
        # Its name is reserved for it, not claimed: the remote readers' names are (``RemoteNames``).
        self.src = ShmSource(
            seg, handle, TCP_SERVER_READER_NAME, _view, hold=True, take_over=settings.take_over, unique=False
        )
        if handle.arena_bytes:  # arena bodies go out whole: their buffers copied in (one copy)
            self.src.attach_arena(arena_path(handle.path), False)
        #: bytes of bodies the last turn took from the ring
        self.pulled_bytes = 0
        #: it left the ring (``leave``)
        self.left = False

    def pull(self, proto: ServerProtocol) -> int:
        """Hand what the ring holds to the protocol (under "block", while it has room), up to
        ``TURN_BYTES`` of bodies: then it is sent before more is taken."""
        n = 0
        budget = TURN_BYTES
        src = self.src
        while n < 4096 and budget > 0 and proto.wants_ring():
            try:
                item = src.get_nowait()
            except WouldBlock:
                break
            except ReaderLagged:
                proto.lost(src.next_msg)
                continue
            except EndOfStream:
                proto.stream_ended("closed")
                break
            except WriterGone:
                proto.stream_ended("gone")
                break
            proto.add(src.next_msg - 1, item)
            budget -= len(item[0])
            n += 1
        self.pulled_bytes = TURN_BYTES - budget
        return n

    def leave(self) -> bool:
        """A fan-in sender's collector left for good (``ServerProtocol.abandoned``): leave the
        ring, so the sender sees its collector's place inactive and its ``put`` raises
        ``CollectorGone`` (a put waiting for room is woken), instead of publishing to nobody.
        The process goes on (the writer restarts a server that exits) and refuses readers. True
        if it left now (not before)."""
        if self.left:
            return False
        self.left = True
        self.src.leave_place()  # the mapping stays (the loop still reads the ring's words)
        return True


class RemoteNames:
    """The remote readers' names (``Readers.names``), claimed in the ring as a local reader claims
    its own: a lock on the name's byte (``ReaderPlace._claim_name``; docs/design.md, "Reader
    names"), held on this server's descriptor of the segment while the reader is admitted, and
    dropped with this process. So a remote reader's name is unique among the local readers, and
    theirs among the remote ones. Among the remote readers themselves the names are compared
    here: one descriptor's locks never conflict with each other."""

    def __init__(self, seg: Segment) -> None:
        self._seg = seg
        #: each admitted reader's name (as a record keeps it), lock byte and HELLO, by routing id
        self._held: dict[bytes, tuple[bytes, int, ClientInfo]] = {}

    def claim(self, ident: bytes, info: ClientInfo) -> str | None:
        key = name_key(info.name)
        if key == name_key(TCP_SERVER_READER_NAME):
            return "the writer's TCP server, whose name it is"
        for other_ident, (other_key, _byte, other) in self._held.items():
            if other_key == key and other_ident != ident:
                return f"remote reader pid {other.pid}" + (f" on {other.host}" if other.host else "") + ", over TCP"
        byte = _segment.name_lock_byte(info.name)
        # A byte another of our readers holds is ours already (two names of one digest).
        if any(b == byte for _k, b, _i in self._held.values()) or _segment.try_lock(self._seg.fd, byte):
            self._held[ident] = (key, byte, info)
            return None
        return local_holder(self._seg, info.name) or "a local reader attaching or leaving right now"

    def release(self, ident: bytes) -> None:
        held = self._held.pop(ident, None)
        if held is not None and all(b != held[1] for _k, b, _i in self._held.values()):
            _segment.unlock(self._seg.fd, held[1])


class TcpServer:
    """Moves frames between the sockets (``Listener``, listener.py), the ring (``RingFeed``) and
    a ``ServerProtocol``, which decides everything: what each reader gets, when, and what is
    refused. This class is the loop that drives them, when it spins and when it sleeps;
    what it reports and logs of the readers is ``Notices`` (notices.py)."""

    def __init__(
        self,
        seg: Segment,
        settings: ServerSettings,
        *,
        stop_fd: int,
        buffer_bytes: int = BUFFER_BYTES,
    ) -> None:
        """Serve ``settings.handle``'s ring, attached as ``seg``; ``stop_fd`` is readable when the
        server is to drain and stop. ``buffer_bytes``: the bytes of sealed bodies held for
        readers, at most (beside ``settings.buffer_max`` messages)."""
        self._report_path = settings.report_path
        self.drain_timeout = 2 * settings.hb_timeout
        self._ring_words = seg.words
        # A body is sealed once, with the group key of this server process (a restarted server
        # draws another; readers get it in WELCOME). Insecure: authenticated, not encrypted.
        # What is held, and what ZeroMQ still sends after the readers acknowledged it.
        self._buffers = seal.Buffers(2 * buffer_bytes)
        sealer = _sealer(settings, self._buffers)
        self.rekey_requested = False  # SIGUSR1: a new key now
        self.reload_requested = False  # SIGHUP: read the allow list again now
        # The allow list (allow.py): read now (a list that cannot be read stops the start: the
        # writer says why), then again when its file changes.
        self._allow = None if settings.allow_list is None else AllowGate(settings.allow_list)
        self._net = net = Listener(settings)
        if self._allow is not None:
            net.set_allowed(self._allow.allowed)
        self.endpoint, self.data_port, self.data_token = net.endpoint, net.data_port, net.data_token
        try:
            self._ring = RingFeed(seg, settings)
            self._src = self._ring.src
        except BaseException:
            net.close()
            raise
        self._ctrl_r = stop_fd
        os.set_blocking(self._ctrl_r, False)
        self.protocol = ServerProtocol(
            _config(settings, self.data_port, self.data_token, buffer_bytes),
            start=self._src.next_msg,
            now=time.monotonic(),
            returning=settings.returning,
            sealer=sealer,
            large=_frame,
        )
        self.protocol.readers.names = RemoteNames(seg)
        self._notices = Notices(self.protocol, settings.report_path)

    def write_stats(self) -> None:
        """Who is connected, for ``Writer.statistics()`` and ``aiobroadcast stats`` (``Notices``)."""
        self._notices.write()

    def run(self) -> bool:
        """Serve until stopped; False if the server failed (a bug: the writer starts another)."""
        try:
            self._loop()
        except Exception:  # pragma: no cover - a bug
            log.exception("aiobroadcast: TCP server failed")
            return False
        finally:
            self._src.close()
            self._net.close()
            # Nobody is served from here on (a writer dropped without aclose leaves it to us).
            remove_report(self._report_path)
        return True

    def _loop(self) -> None:
        proto = self.protocol
        poller = zmq.Poller()
        poller.register(self._net.router, zmq.POLLIN)
        poller.register(self._net.data, zmq.POLLIN)
        poller.register(self._ctrl_r, zmq.POLLIN)
        inbox = self._src.inbox_fd
        ctrl = self._ctrl_r
        stopping = False
        woken = False  # the ring's wake-up came and its datagram is still to be taken
        pulled_ns = 0  # when the spin began (a message taken in a dense stream; 0: no spin)
        last_pull_ns = 0  # when a message was last taken from the ring
        idle = True  # nothing taken from the ring since the last heartbeat
        router = self._net.router
        heard_asleep = False  # a reader's frame came while asleep on the ring (``_frames_asleep``)
        while True:
            if self.rekey_requested:
                self.rekey_requested = False
                proto.rekey()
            if self.reload_requested:
                self.reload_requested = False
                self.reload_allow_list()
            pulled = self._ring.pull(proto)
            if pulled:
                t = time.perf_counter_ns()
                # Spin after this turn only in a dense stream of small messages: this one came
                # within the spin's time of the one before (a sparser stream gains nothing from
                # it), and its bodies are small (a large one costs the server, and each reader,
                # far more than the wake-up a spin saves, and they need the CPU it would take).
                dense = (
                    t - last_pull_ns < _tuning.TCP_SERVER_SPIN_NS
                    and self._ring.pulled_bytes < wire.FRAME_ALONE * pulled
                )
                last_pull_ns = t
                pulled_ns = t if dense else 0
            idle = idle and not pulled
            proto.send_keys()
            self._flush()  # the keys, before anything sealed under the new key goes out
            # What was just taken goes out first: a reader waits for it, and what readers sent
            # (acknowledgements, mostly) can wait the few microseconds of a send. Sent again
            # below if what they sent gave credit.
            sent = self._transmit() if pulled else 0
            if woken:  # the wake-up's datagram, taken once what it announced is on its way
                woken = False
                self._src.drain_inbox()
            now = time.monotonic()
            received = self._recv_clients(now)
            self._flush()  # the answers (WELCOME, REFUSED, ...)
            if received or not pulled:
                sent += self._transmit()
            self._net.drain_data()
            proto.trim(now)
            if proto.heartbeat_due(now, heard=received > 0 or heard_asleep):
                for event in proto.heartbeat(now):
                    self._notices.on_event(event)
                self._flush()
                if self._allow is not None:
                    self.reload_allow_list()  # a stat of its file
                    self._allow.forget_others(proto.readers.clients)
                self.write_stats()
                if idle:
                    self._buffers.clear()
                idle = True
            if proto.abandoned:
                self._leave_ring()
            if proto.finished(now):
                return
            if pulled or sent:
                continue
            want_ring = proto.wants_ring()
            if pulled_ns and want_ring and _spin(self._src, self._net, ctrl, pulled_ns + _tuning.TCP_SERVER_SPIN_NS):
                continue  # a message (or a reader's frame) came while the stream was dense
            pulled_ns = 0  # spun to the end, or not spinning: sleep until woken
            ring_sleep = want_ring and not self._src.begin_sleep()
            if want_ring and not ring_sleep:
                continue  # the ring changed while we announced the sleep
            if ring_sleep:
                poller.register(inbox, zmq.POLLIN)
            wait_s = proto.next_heartbeat - time.monotonic()
            if proto.choked:
                wait_s = min(wait_s, RETRY_S)
            ready: list[Any] = []
            heard_asleep = False
            try:
                while True:
                    ready = [fd for fd, _ in poller.poll(int(max(0.0, wait_s) * 1000) + 1)]
                    # Only a reader's frame, while asleep on the ring: taken without a turn of
                    # the loop, and the sleep goes on (``_frames_asleep``).
                    if not ring_sleep or stopping or len(ready) != 1 or ready[0] is not router:
                        break
                    if not self._frames_asleep():
                        heard_asleep = True  # the turn's heartbeat answers it, if one is due
                        break
                    wait_s = proto.next_heartbeat - time.monotonic()
            finally:
                if ring_sleep:
                    poller.unregister(inbox)
                    # The datagram is taken after the message it announced is sent (above):
                    # two system calls and an exception less on that message's way. Until
                    # then the socket stays readable, so no sleep begins before it is taken.
                    woken = inbox in ready
                    self._src.end_sleep(woken)
            if not stopping and ctrl in ready:
                try:
                    if os.read(ctrl, 64) == b"":  # the writer closed our stdin: drain, then stop
                        stopping = True
                        proto.stop(time.monotonic() + self.drain_timeout)
                        poller.unregister(ctrl)  # EOF stays readable: stop polling it
                except BlockingIOError:
                    pass

    def reload_allow_list(self) -> None:
        """Read the allow list again if its file changed (``AllowGate.apply``): a reader whose
        key is no longer on it is revoked, and logged."""
        dropped = None if self._allow is None else self._allow.apply(self.protocol, self._net)
        if dropped is None:
            return
        for client in dropped:
            log.warning("aiobroadcast: remote reader %r (pid %d) revoked; dropped it", client.name, client.pid)
        self._flush()
        self.write_stats()

    def _frames_asleep(self) -> bool:
        """Take what readers sent while this server sleeps on the ring, and send what that calls
        for, the sleep still announced (docs/tcp.md, "A reader's frame while asleep"): True if
        it can go on, False if a whole turn of the loop is needed (something was sent, a
        heartbeat is due, a reader's queue is full, the stream abandoned, a new key asked for)."""
        proto = self.protocol
        now = time.monotonic()
        received = self._recv_clients(now)
        self._flush()  # the answers (WELCOME, REFUSED, ...)
        if self._transmit() or proto.choked or proto.abandoned or self.rekey_requested or self.reload_requested:
            return False
        return not proto.heartbeat_due(now, heard=received > 0)

    def _leave_ring(self) -> None:
        """A fan-in sender's collector left for good: leave the ring (``RingFeed.leave``)."""
        if self._ring.leave():
            self.write_stats()

    def _flush(self) -> None:
        """Send the control frames the protocol queued (WELCOME, REFUSED, KEYS, ...)."""
        self._net.send_control(self.protocol.data_to_send())

    def _transmit(self) -> int:
        """Send every reader what the protocol says its credit allows; the number of messages
        ZeroMQ took. A reader the protocol fails on (``ReaderFault``, a bug) is dropped, and
        the others are served."""
        while True:
            try:
                return self._net.send_data(self.protocol.transmit())
            except ReaderFault as fault:
                client = self.protocol.drop(fault.ident)
                log.error(
                    "aiobroadcast: the TCP server failed to send to remote reader %r; dropped it",
                    client.name if client else fault.ident,
                    exc_info=fault,
                )
                self.write_stats()

    def _recv_clients(self, now: float) -> int:
        """Hand what readers sent to the protocol; the number of frame groups taken."""
        receive = self._net.receive
        for n in range(1024):
            frames = receive()
            if frames is None:
                return n
            if self._allow is not None and not self._allow.admits(frames[0], self._net):
                continue
            published = self._ring_words[W_NEXT_MSG]
            try:
                event = self.protocol.receive(frames[0], frames[1:], now=now, published=published)
            except ReaderFault as fault:  # a bug: that reader is dropped (and told), not the others
                log.error("aiobroadcast: the TCP server failed on a frame from a remote reader", exc_info=fault)
                event = self.protocol.reject(fault.ident, fault.reason)
            if event is not None:
                self._notices.on_event(event)
        return 1024


def _sealer(settings: ServerSettings, buffers: seal.Buffers) -> seal.Sealer:
    """A body is sealed once, with the group key of this server process (a restarted server
    draws another; readers get it in WELCOME). Insecure: authenticated, not encrypted, under
    keys derived from the handle's key (wire.data_secret)."""
    hmac_key = settings.key("hmac_key")
    return seal.Sealer(
        settings.handle.token.encode(),
        secret=wire.data_secret(hmac_key) if settings.insecure and hmac_key is not None else None,
        rekey_messages=settings.rekey_messages,
        rekey_bytes=settings.rekey_bytes,
        buffer=buffers.take,
    )


def _config(settings: ServerSettings, data_port: int, data_token: str | None, buffer_bytes: int) -> ServerConfig:
    """What the protocol grants and how long it waits, from the writer's settings and the
    listener's data socket."""
    return ServerConfig(
        policy=settings.handle.policy,
        key=settings.key("hmac_key") if settings.insecure else None,
        window=settings.window,
        buffer_max=settings.buffer_max,
        hb_interval=settings.hb_interval,
        hb_timeout=settings.hb_timeout,
        max_remote=settings.max_remote,
        channel=settings.handle.token,
        run=settings.run,
        data_port=data_port,
        data_token=data_token,
        buffer_bytes=buffer_bytes,
        sole_reader=settings.sole_reader,
    )


def _spin(src: ShmSource, net: Listener, stdin_fd: int, until_ns: int) -> bool:
    """Poll the ring until ``until_ns`` (``perf_counter_ns``): True as soon as it holds a
    message, or a reader's frame or the writer's stdin needs the server's loop.

    A stream whose messages come within ``_tuning.TCP_SERVER_SPIN_NS`` of each other keeps
    the server awake: the next message is taken without a wake-up (a datagram from the
    writer, this process scheduled again: 30-50 us here) and by a process whose code and
    data are still in cache (a cold pass through take, seal and send runs several times its
    warm cost). Each round gives the CPU up (``sched_yield``) to whoever else is runnable
    on it, the writer and readers of this host included. Once messages stop, the spin ends
    and the server sleeps as before: an idle channel costs nothing."""
    ready = src.ready
    readable = net.readable
    now = time.perf_counter_ns
    yield_ = os.sched_yield
    n = 0
    while now() < until_ns:
        if ready():
            return True
        n += 1
        if not n & 15 and (readable() or select.select([stdin_fd], [], [], 0)[0]):
            return True  # a reader's frame, or the writer wrote to or closed our stdin
        yield_()
    return False


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


def _raise_descriptor_limit() -> None:
    """Raise this process's soft limit of descriptors to its hard limit: room for readers, and
    for peers between their connection and the end of their handshake (HANDSHAKE_S). The bound
    on what those cost is HANDSHAKE_S, not this; it only moves the point where the server
    runs out (``statistics().tcp_server_health`` says when it does)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY or soft >= hard:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):  # pragma: no cover - refused by the system
        pass


def main() -> int:
    """Entry point of the server process. Reads its settings (with the keys: never on the command
    line) as one JSON line on stdin, answers with one JSON line on stdout (the endpoint it bound,
    or the error), then serves until stdin closes and remote readers have drained."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    _keep_freed_memory()
    _raise_descriptor_limit()
    # A terminal's Ctrl-C is for the writer: it stops this server by closing our stdin, after
    # remote readers have drained.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        settings = ServerSettings.model_validate_json(sys.stdin.buffer.readline())
    except ValidationError as exc:  # another version of the package, or not the writer
        print(json.dumps({"error": f"bad settings on stdin: {_first_line(exc)}"}), flush=True)
        return 2
    handle = settings.handle
    try:
        seg = attach_segment(handle.path, handle.token, handle.capacity, handle.slot_bytes, handle.max_readers)
        try:
            server = TcpServer(seg, settings, stop_fd=sys.stdin.fileno())
        except BaseException:
            seg.close()
            raise
    except BroadcastError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1

    def rekey_now(signum: int, frame: Any) -> None:
        server.rekey_requested = True  # taken at the next turn of the loop

    def reload_now(signum: int, frame: Any) -> None:
        server.reload_requested = True  # taken at the next turn of the loop

    signal.signal(signal.SIGUSR1, rekey_now)  # a new group key on demand
    signal.signal(signal.SIGHUP, reload_now)  # read the allow list again now
    print(json.dumps({"endpoint": server.endpoint}), flush=True)
    server.write_stats()
    return 0 if server.run() else 1


def _first_line(exc: ValidationError) -> str:
    """What is wrong, in a line: the first error's field and message, and how many there are."""
    first = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(part) for part in first["loc"]) or "the line"
    more = exc.error_count() - 1
    return f"{where}: {first['msg']}" + (f" (and {more} more)" if more else "")


if __name__ == "__main__":
    sys.exit(main())
