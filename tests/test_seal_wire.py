"""The sealed data plane on the wire: real writers, servers and readers, with something on the
path between them (docs/security.md).

The server listens on 127.0.0.1; readers are given a handle that points at 127.0.0.2, where
the test sits in the middle: a byte relay that records what crosses (the control connection,
and the data connection when capturing), or, for the data connection, a relay that reads the
ZMTP stream and plays the on-path attacker (it changes or replays frames).
"""

from __future__ import annotations

import pickle
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import _forge
import _tcp_workers as tw
import anyio
import anyio.to_thread
import pytest
import zmq
from _peers import ON_ASYNCIO, ON_TRIO, ON_UVLOOP, remote_names, tcp_writer, the_server, until

import aiobroadcast as ab
from aiobroadcast._tcp import seal, wire

pytestmark = pytest.mark.anyio

MIDDLE = "127.0.0.2"  # where the relays listen, unless a port is taken there (see middle_for)
MARKER = b"PLAINTEXT-MARKER-"


def shut(*socks: socket.socket) -> None:
    """End both directions of a relayed connection (whichever side ended it first)."""
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class ByteRelay:
    """Forwards TCP connections from middle:port to 127.0.0.1:port, recording every byte."""

    def __init__(self, port: int, middle: str = MIDDLE) -> None:
        self.port = port
        self.lsock = socket.create_server((middle, port))
        self.captured = bytearray()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = [self.lsock]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.lsock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.port))
            self._socks += [client, upstream]
            self._connected(client, upstream)

    def _connected(self, client: socket.socket, upstream: socket.socket) -> None:
        """Forward a new connection both ways."""
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(1 << 16):
                with self._lock:
                    self.captured += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            shut(src, dst)

    def close(self) -> None:
        self._stop = True
        for s in self._socks:
            s.close()


#: what the attacker does with each frame group from the server: the groups to pass on instead
Tamper = Callable[[list[bytes]], list[list[bytes]]]


class ZmtpMitm(ByteRelay):
    """A byte relay that reads the ZMTP 3 stream from the server (a 64-byte greeting, then
    frames: a flags byte, a 1- or 8-byte size, the body) and passes every message (frame group)
    through ``tamper``, which returns the groups to send instead. Commands pass unchanged. This
    is an attacker on the TCP path: ZeroMQ on either side sees only what it sends."""

    def __init__(self, port: int, tamper: Tamper, middle: str = MIDDLE) -> None:
        self.tamper = tamper
        super().__init__(port, middle)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        if src.getpeername()[0] != "127.0.0.1" or src.getpeername()[1] != self.port:
            return super()._pump(src, dst)  # the reader's direction: as it is
        try:
            for group in zmtp_messages(src, dst):
                for out in self.tamper(group):
                    dst.sendall(_zmtp(out))
        except OSError:
            pass
        finally:
            shut(src, dst)


def zmtp_messages(src: socket.socket, dst: socket.socket) -> Iterator[list[bytes]]:
    """The messages (frame groups) of the ZMTP 3 stream ``src`` sends: a 64-byte greeting, then
    frames (a flags byte, a 1- or 8-byte size, the body). The greeting and the commands (READY,
    ...) pass on to ``dst`` as they come (each side waits for the other's); each message is the
    caller's to pass on, change or hold back."""
    buf = bytearray()
    greeting = 64  # greeting bytes still to pass on
    group: list[bytes] = []
    while chunk := src.recv(1 << 16):
        buf += chunk
        if greeting:
            n = min(greeting, len(buf))
            dst.sendall(buf[:n])
            del buf[:n]
            greeting -= n
            if greeting:
                continue
        while len(buf) >= 2:
            flags = buf[0]
            head = 9 if flags & 0x02 else 2
            if len(buf) < head:
                break
            size = int.from_bytes(buf[1:9], "big") if flags & 0x02 else buf[1]
            if len(buf) < head + size:
                break
            body, raw = bytes(buf[head : head + size]), bytes(buf[: head + size])
            del buf[: head + size]
            if flags & 0x04:  # a command
                dst.sendall(raw)
                continue
            group.append(body)
            if flags & 0x01:  # MORE
                continue
            yield group
            group = []


def _zmtp(frames: list[bytes]) -> bytes:
    out = bytearray()
    for i, f in enumerate(frames):
        more = 0x01 if i < len(frames) - 1 else 0
        if len(f) > 255:
            out += bytes((more | 0x02,)) + len(f).to_bytes(8, "big")
        else:
            out += bytes((more, len(f)))
        out += f
    return bytes(out)


def listening_ports(writer: ab.Writer[Any]) -> tuple[int, int]:
    """The server's control port (the handle's) and its data port."""
    assert writer.handle.tcp is not None
    control = int(writer.handle.tcp.rsplit(":", 1)[1])
    ports = {c.laddr.port for c in the_server().net_connections("tcp") if c.status == "LISTEN"}
    (data,) = ports - {control}
    return control, data


def middle_for(*ports: int) -> str:
    """A loopback address where every one of ``ports`` is free to listen on. The relays listen on
    the server's own port numbers (a reader learns the data port from the server), and another
    socket may hold one of them on 127.0.0.2 (a connection's ephemeral port): try the next."""
    for n in range(2, 64):
        host = f"127.0.0.{n}"
        probes: list[socket.socket] = []
        try:
            probes.extend(socket.create_server((host, port)) for port in ports)  # kept as made: closed below
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
        return host
    raise AssertionError(f"no loopback address has ports {ports} free")


@contextmanager
def in_the_middle(writer: ab.Writer[Any], tamper: Tamper | None) -> Iterator[tuple[ab.Handle, list[ByteRelay]]]:
    """A handle whose reader goes through the middle: byte relays on both connections, or with
    ``tamper`` an attacker on the data connection."""
    control, data = listening_ports(writer)
    middle = middle_for(control, data)
    with ExitStack() as stack:
        relays = [ByteRelay(control, middle)]
        stack.callback(relays[0].close)
        if tamper is None:
            relays.append(ByteRelay(data, middle))
            stack.callback(relays[1].close)
        else:
            stack.callback(ZmtpMitm(data, tamper, middle).close)
        assert writer.handle.tcp is not None
        yield writer.handle.model_copy(update={"tcp": writer.handle.tcp.replace("127.0.0.1", middle)}), relays


@pytest.mark.parametrize("insecure", [False, True], ids=["sealed", "insecure"])
@ON_ASYNCIO
async def test_no_plaintext_on_the_wire(insecure: bool) -> None:
    """Everything that crosses either connection is recorded: the messages are not in it. The
    same capture with insecure=True does show them (authenticated, not encrypted), which is
    what proves the capture sees the bodies."""
    small = [MARKER + b"%06d" % i for i in range(50)]
    large = MARKER * (100_000 // len(MARKER))
    async with tcp_writer(insecure=insecure, capacity=16, slot_bytes=1 << 17) as writer:
        with in_the_middle(writer, None) as (h, relays):
            async with ab.open_reader(h, transport="tcp", name="captured") as reader:
                for body in [*small, large]:
                    await writer.put(body)
                with anyio.fail_after(20):
                    got = [await reader.get() for _ in range(len(small) + 1)]
    assert got == [*small, large]
    wire_bytes = b"".join(bytes(r.captured) for r in relays)
    assert len(wire_bytes) > len(large)  # the large body crossed, in some form
    assert (MARKER in wire_bytes) is insecure


def flip_first_batch(where: str) -> Tamper:
    """Flip one bit in the first BATCH that carries a message, in ``where``: the batch header,
    the first body's key id, its ciphertext, or its tag. Everything else passes unchanged."""
    done = False

    def tamper(frames: list[bytes]) -> list[list[bytes]]:
        nonlocal done
        if done or frames[0] != wire.BATCH:
            return [frames]
        done = True
        mutable = [bytearray(f) for f in frames]
        (first_len, _flags) = wire.ENTRY.unpack_from(mutable[1], wire.BATCH_HEAD.size)
        target, offset = {
            "header": (1, 0),  # the low bit of the first seq
            "key-id": (2, 0),
            "body": (2, 4),
            "tag": (2, first_len - 1),
        }[where]
        mutable[target][offset] ^= 1
        return [[bytes(f) for f in mutable]]

    return tamper


@pytest.mark.parametrize("where", ["header", "key-id", "body", "tag"])
@ON_UVLOOP
async def test_a_flipped_bit_is_rejected_counted_and_the_stream_goes_on(where: str) -> None:
    """One bit changed on the path: that frame is refused and counted, nothing of it is
    delivered, the reader asks again and gets every message, in order, intact."""
    n = 20
    async with tcp_writer(heartbeat_s=0.2) as writer:
        with in_the_middle(writer, flip_first_batch(where)) as (h, _):
            async with ab.open_reader(h, transport="tcp", name="tampered") as reader:
                with anyio.fail_after(30):
                    got = []
                    for i in range(n):
                        await writer.put(b"message %d" % i)
                        got.append(await reader.get())
                assert got == [b"message %d" % i for i in range(n)]
                assert reader.statistics().rejected_frames >= 1
                assert reader.statistics().lagged == 0


def replay_batch(record_seq: int, replay_at: int) -> Tamper:
    """Record the BATCH that starts at ``record_seq``; send it again just before the one that
    starts at ``replay_at``."""
    recorded: list[bytes] | None = None

    def tamper(frames: list[bytes]) -> list[list[bytes]]:
        nonlocal recorded
        if frames[0] != wire.BATCH:
            return [frames]
        (first, _count) = wire.BATCH_HEAD.unpack_from(frames[1])
        if first == record_seq and recorded is None:
            recorded = frames
        if first == replay_at and recorded is not None:
            return [recorded, frames]
        return [frames]

    return tamper


@ON_TRIO
async def test_a_replayed_frame_is_rejected() -> None:
    n = 10
    async with tcp_writer() as writer:
        with in_the_middle(writer, replay_batch(2, 6)) as (h, _):
            async with ab.open_reader(h, transport="tcp", name="replayed") as reader:
                with anyio.fail_after(30):
                    got = []
                    for i in range(n):
                        await writer.put(i)
                        got.append(await reader.get())
                    await writer.put(n)
                    got.append(await reader.get())
                assert got == list(range(n + 1))  # nothing twice
                assert reader._src.rejected.get("replayed") == 1  # type: ignore[attr-defined]
                assert reader.statistics().rejected_frames == 1


def forge_before(at: int, forgery: str, group: seal.Opener, channel: bytes, payload: bytes) -> Tamper:
    """An admitted reader on the path (``group``: the keys it holds): before the BATCH that
    starts at ``at``, it sends a frame group of its own making, then the genuine one. ``body``:
    a batch of message ``at`` holding ``payload`` sealed under the group key; ``same-tag``: the
    genuine batch with a body of the same GCM tag that opens to ``payload``; ``lagged``: three
    messages lost; ``end``: the stream closed. Each carries the genuine group's last frame (the
    writer's MAC for this reader; before protocol 6, none: the frames are shaped as the genuine
    ones either way)."""
    done = False

    def tamper(frames: list[bytes]) -> list[list[bytes]]:
        nonlocal done
        if done or frames[0] != wire.BATCH or wire.BATCH_HEAD.unpack_from(frames[1]) != (at, 1):
            return [frames]
        done = True
        mac = frames[3:]
        key_id = seal.KEY_ID.unpack_from(frames[2])[0]
        if forgery == "body":
            body = _forge.seal_body(group, channel, at, 0, payload, key_id)
            forged = [*wire.encode_batch(at, [(body, 0)]), *mac]
        elif forgery == "same-tag":
            forged = [frames[0], frames[1], _forge.same_tag(group, at, 0, frames[2], payload), *mac]
        elif forgery == "lagged":
            forged = [wire.LAGGED, _forge.seal_control(group, channel, wire.LAGGED, wire.U64x2.pack(at + 3, 3)), *mac]
        else:
            forged = [wire.END, _forge.seal_control(group, channel, wire.END, wire.U64.pack(at) + b"closed"), *mac]
        return [forged, frames]

    return tamper


@pytest.mark.parametrize("forgery", ["body", "same-tag", "lagged", "end"])
@ON_UVLOOP
async def test_an_admitted_reader_on_the_path_cannot_write_to_another_reader(forgery: str, tmp_path: Path) -> None:
    """Reader "hostile" is admitted: it holds the group key. It sits on the path of reader
    "victim"'s data connection and sends it, before message 2, a body it sealed (a pickle whose
    unpickling would create a directory), the genuine batch with that pickle in a body of the
    same GCM tag, a LAGGED or an END: each would open under the group key. The victim refuses
    it (not from the writer's server, for this reader: counted), unpickles nothing, misses
    nothing, does not stop: it gets every message, in order."""
    marker = tmp_path / "pwned"
    payload = _forge.exploit(str(marker))
    pickle.loads(payload)  # the control: this payload does run code when unpickled
    assert marker.is_dir()
    marker.rmdir()
    n = 6
    sent = [b"message %d " % i + b"y" * 400 for i in range(n)]
    async with (
        tcp_writer(heartbeat_s=0.2, slot_bytes=1024) as writer,
        ab.open_reader(writer.handle, transport="tcp", name="hostile") as hostile,
    ):
        group = hostile._src._proto._opener  # type: ignore[attr-defined]
        tamper = forge_before(2, forgery, group, writer.handle.token.encode(), payload)
        with in_the_middle(writer, tamper) as (h, _):
            async with ab.open_reader(h, transport="tcp", name="victim") as victim:
                got = []
                with anyio.fail_after(30):
                    for body in sent:
                        await writer.put(body)
                        got.append(await victim.get())
                        assert await hostile.get() == body
                assert not marker.exists()  # nothing it sent was unpickled
                assert got == sent
                stats = victim.statistics()
                assert stats.lagged == 0
                assert victim._src.rejected.get("not_authentic", 0) >= 1  # type: ignore[attr-defined]
                assert stats.rejected_frames >= 1


@ON_ASYNCIO
async def test_a_reader_admitted_before_a_rekey_keeps_reading_after() -> None:
    """The server rekeys on SIGUSR1: three times, with messages between, so the reader needs
    the KEYS messages and not only the key announced at its WELCOME."""
    async with tcp_writer() as writer, ab.open_reader(writer.handle, transport="tcp", name="steady") as reader:
        opener = reader._src._proto._opener  # type: ignore[attr-defined]
        server = the_server()
        key_ids = []
        with anyio.fail_after(30):
            for i in range(8):
                if i % 2 == 0 and i:
                    # The next put must be sealed under the new key: wait until the reader has
                    # its keys message (a pause alone loses to a server not scheduled in time).
                    before = opener.current_key_id
                    server.send_signal(signal.SIGUSR1)
                    while opener.current_key_id == before:  # noqa: ASYNC110 - set by the pump thread
                        await anyio.sleep(0.01)
                await writer.put(i)
                assert await reader.get() == i
                key_ids.append(opener.current_key_id)
        assert len(set(key_ids)) == 4
        assert reader.statistics().rejected_frames == 0


@pytest.mark.parametrize("same_keys", [False, True], ids=["new-keys", "same-keys-other-name"])
@ON_ASYNCIO
async def test_the_old_handle_of_a_restarted_writer_is_refused(same_keys: bool) -> None:
    """A writer stops and another starts at the same endpoint. With new keys (the default) the
    old handle fails the CurveZMQ handshake; with the same keys (CurveKeys kept in a file) but
    another channel name it passes it, and the server refuses the handle of another channel by
    name (tests/test_restart.py: with the same name too, the old handle is accepted)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    keys = ab.CurveKeys.generate()
    async with tcp_writer(tcp=endpoint, keys=keys) as first:
        old = first.handle
    async with tcp_writer(tcp=endpoint, keys=keys if same_keys else None, channel="another") as second:
        assert second.handle.tcp == old.tcp
        match = "another channel" if same_keys else "refused this reader's keys"
        with pytest.raises(ab.TransportError, match=match):
            await ab.open_reader(old, transport="tcp", name="stale", connect_timeout=10)
        async with ab.open_reader(second.handle, transport="tcp", name="fresh") as fresh:
            await second.put(b"x")
            with anyio.fail_after(10):
                assert await fresh.get() == b"x"


class HeldRelay(ByteRelay):
    """A byte relay whose server-to-reader direction can be held: what the server sends waits
    (in the relay and the kernel) while ``flowing`` is clear, then goes on in order."""

    def __init__(self, port: int, middle: str = MIDDLE) -> None:
        self.flowing = threading.Event()
        self.flowing.set()
        super().__init__(port, middle)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        if src.getpeername() != ("127.0.0.1", self.port):
            return super()._pump(src, dst)  # the reader's direction: as it is
        try:
            while chunk := src.recv(1 << 16):
                while not self.flowing.wait(0.05):
                    if self._stop:
                        return
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            shut(src, dst)


@ON_ASYNCIO
async def test_a_reader_that_missed_two_rekeys_fetches_the_keys_again_and_reads_on() -> None:
    """rekey_messages=2: the server takes a new group key every two messages. The control
    connection to the reader is held in the middle (the KEYS of two rekeys wait there) while
    messages go out on the data connection: from message 4 on they are sealed under a key the
    reader was never given. It refuses them (counted: unknown key) and asks for the keys again;
    once the control connection flows, it gets every message, once and in order, nothing lost."""
    async with tcp_writer(rekey_messages=2) as writer:
        control, data = listening_ports(writer)
        middle = middle_for(control, data)
        with ExitStack() as stack:
            held = HeldRelay(control, middle)
            stack.callback(held.close)
            stack.callback(ByteRelay(data, middle).close)
            assert writer.handle.tcp is not None
            h = writer.handle.model_copy(update={"tcp": writer.handle.tcp.replace("127.0.0.1", middle)})
            async with ab.open_reader(h, transport="tcp", name="behind") as reader:
                proto = reader._src._proto  # type: ignore[attr-defined]
                with anyio.fail_after(30):
                    await writer.put(0)
                    assert await reader.get() == 0
                    first_key = proto._opener.current_key_id
                    held.flowing.clear()
                    for i in range(1, 8):
                        await writer.put(i)
                    await until(lambda: reader._src.rejected.get("unknown_key", 0) > 0, 20)  # type: ignore[attr-defined]
                    assert proto._keys_asked is not None  # it said HELLO again, for the keys
                    held.flowing.set()
                    got = [await reader.get() for _ in range(1, 8)]
                    await writer.put(8)
                    got.append(await reader.get())
                assert got == list(range(1, 9))  # every message, in order: nothing missed
                assert (proto._opener.current_key_id - first_key) % 2**32 >= 3
                stats = reader.statistics()
                assert stats.lagged == 0
                assert stats.rejected_frames == sum(reader._src.rejected.values())  # type: ignore[attr-defined]


@ON_ASYNCIO
async def test_the_rekey_policy_of_open_writer_reaches_the_server() -> None:
    """rekey_messages=3: the key changes every three messages, and readers follow it."""
    async with tcp_writer(rekey_messages=3) as writer, ab.open_reader(writer.handle, transport="tcp") as reader:
        opener = reader._src._proto._opener  # type: ignore[attr-defined]
        first = opener.current_key_id
        with anyio.fail_after(30):
            for i in range(9):
                await writer.put(i)
                assert await reader.get() == i
        # Messages 0-2 under the first key, 3-5 under the next, 6-8 under the one after. The
        # KEYS of a rekey may come after the first frame sealed under the new key (which the
        # reader opens with the key announced before), but it comes.
        await until(lambda: (opener.current_key_id - first) % 2**32 == 2)
        assert reader.statistics().rejected_frames == 0


@ON_ASYNCIO
async def test_the_data_port_of_open_writer_is_where_the_sealed_bodies_come_from() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with tcp_writer(data_port=port) as writer:
        assert listening_ports(writer)[1] == port
        async with ab.open_reader(writer.handle, transport="tcp") as reader:
            assert reader._src._proto.data_port == port  # type: ignore[attr-defined]
            await writer.put(b"x")
            with anyio.fail_after(10):
                assert await reader.get() == b"x"
        # the data port is taken: a second writer asking for it does not start
        with pytest.raises(ab.BroadcastError, match="data port"):
            await tcp_writer(data_port=port)


@pytest.mark.parametrize(
    "kw",
    [
        {"rekey_messages": 0},
        {"rekey_messages": 2**32 + 1},
        {"rekey_messages": 2.5},
        {"rekey_messages": True},
        {"rekey_bytes": 0},
        {"rekey_bytes": 2**48 + 1},
        {"data_port": -1},
        {"data_port": 65536},
        {"data_port": "5555"},
    ],
)
def test_bad_rekey_policies_and_data_ports_are_refused_by_both_factories(kw: dict[str, Any]) -> None:
    from aiobroadcast import blocking

    with pytest.raises(ab.InvalidArgument, match=next(iter(kw))):
        blocking.open_writer(tcp="tcp://127.0.0.1:0", **kw)

    async def main() -> None:
        await ab.open_writer(tcp="tcp://127.0.0.1:0", **kw)

    with pytest.raises(ab.InvalidArgument, match=next(iter(kw))):
        anyio.run(main)


def test_the_blocking_writer_takes_the_rekey_policy_and_the_data_port() -> None:
    from aiobroadcast import blocking

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with blocking.open_writer(tcp="tcp://127.0.0.1:0", rekey_messages=2, rekey_bytes=1 << 20, data_port=port) as w:
        with blocking.open_reader(w.handle, transport="tcp") as r:
            assert r._src._proto.data_port == port  # type: ignore[attr-defined]
            for i in range(5):
                w.put(i)
                assert r.get(timeout=10) == i


@pytest.mark.parametrize("insecure", [False, True], ids=["sealed", "insecure"])
@ON_ASYNCIO
async def test_a_slow_reader_under_a_rekey_per_message_reads_everything_it_was_sent(insecure: bool) -> None:
    """rekey_messages=1: a key per message. A reader that takes nothing for 60 messages holds
    them all unacknowledged, so the server holds them, each under a key of its own: more keys
    than a keys message carries (16). The server waits with its rekeys while that many old keys
    are held, so every keys message fits and the reader, once it reads, opens every message
    (before: a keys message of 61 keys was refused, the bodies under keys it lacked did not open,
    and the reader asked for the keys again forever)."""
    async with (
        tcp_writer(rekey_messages=1, insecure=insecure) as writer,
        ab.open_reader(writer.handle, transport="tcp", name="slow") as reader,
    ):
        with anyio.fail_after(30):
            await writer.put(0)
            assert await reader.get() == 0
            for i in range(1, 61):
                await writer.put(i)

            # the server took all of them from the ring, and holds them for the reader
            def taken() -> list[int]:
                return [r.received for r in writer.statistics().readers if r.transport == "tcp-server"]

            await until(lambda: taken() == [61])
            got = [await reader.get() for _ in range(60)]
            await writer.put(61)
            got.append(await reader.get())
        assert got == list(range(1, 62))
        assert reader.statistics().lagged == 0
        # A batch can overtake the KEYS message that names its key (they travel on two
        # connections): the reader then asks for the keys again. Before, every batch after the
        # refused keys message was unknown_key, and the reader never read on (fail_after).
        assert reader._src.rejected.get("unknown_key", 0) <= 2  # type: ignore[attr-defined]


@ON_ASYNCIO
async def test_a_sigstopped_reader_under_a_rekey_per_message_reads_on_once_resumed() -> None:
    """rekey_messages=1, and a remote reader process stopped (SIGSTOP) while 60 messages go out:
    it holds them unacknowledged, and the KEYS of 60 rekeys pile up for it (or are lost: its
    control queue is full). Once resumed it reads every message, or is told exactly what it
    missed (ReaderLagged, had the server dropped it meanwhile), and reads on to the end (before:
    the keys it asked for again came in a WELCOME of more than 16 keys, which it refused, and it
    asked again forever)."""
    n = 62
    async with tcp_writer(rekey_messages=1, heartbeat_s=2.0) as writer:
        opts = tw.ReaderOpts(name="stopped", live=True)
        with tw.spawn(tw.reader_proc, tw.ASYNCIO, None, writer.handle.to_json(), opts) as reader:
            await reader.recv("attached")
            await writer.put(tw.message(0))
            await reader.until(lambda ev: len(ev) >= 1)
            reader.signal(signal.SIGSTOP)
            try:
                with anyio.fail_after(30):
                    for i in range(1, n - 1):
                        await writer.put(tw.message(i))
            finally:
                reader.signal(signal.SIGCONT)
            await writer.put(tw.message(n - 1))
            await reader.until(
                lambda ev: sum(1 if e[0] == "msg" else e[1] if e[0] == "lagged" else 0 for e in ev) >= n, 60
            )
            with anyio.fail_after(20):
                await writer.aclose()
            events = (await reader.recv("events"))["events"]
    tw.account(events, n)
    assert events[-1] == ("end",), tw.summary(events)


# --- insecure mode: control frames recorded on one connection, played into another --------------


class _Conn:
    """One control connection through a ``ControlRelay``: what crossed it each way (frame
    groups, in order), and groups to slip in, each way, before the next one that crosses."""

    def __init__(self) -> None:
        self.crossed: dict[bool, list[list[bytes]]] = {True: [], False: []}  # to the reader?
        self.inject: dict[bool, list[list[bytes]]] = {True: [], False: []}
        self.injected = threading.Event()


class ControlRelay(ByteRelay):
    """Forwards control connections from middle:port to the server and reads their ZMTP stream
    both ways (the greeting, then frames; commands such as PLAIN's pass unchanged): it records
    every message of each connection, and slips in the messages it is given before the next one
    that crosses. ``next_inject``: what to slip into the next connection's first messages to the
    reader. The on-path attacker of insecure mode, who can read, record and inject, but holds no key."""

    def __init__(self, port: int, middle: str) -> None:
        self.conns: list[_Conn] = []
        self.next_inject: list[list[bytes]] = []
        super().__init__(port, middle)

    def _connected(self, client: socket.socket, upstream: socket.socket) -> None:
        conn = _Conn()
        conn.inject[True], self.next_inject = self.next_inject, []
        self.conns.append(conn)
        for a, b, to_reader in ((client, upstream, False), (upstream, client, True)):
            threading.Thread(target=self._relay, args=(a, b, conn, to_reader), daemon=True).start()

    def _relay(self, src: socket.socket, dst: socket.socket, conn: _Conn, to_reader: bool) -> None:
        try:
            for group in zmtp_messages(src, dst):
                while conn.inject[to_reader]:
                    dst.sendall(_zmtp(conn.inject[to_reader].pop(0)))
                    conn.injected.set()
                conn.crossed[to_reader].append(group)
                dst.sendall(_zmtp(group))
        except OSError:
            pass
        finally:
            shut(src, dst)

    def sent(self, index: int, kind: bytes, to_reader: bool = True) -> list[bytes]:
        """The first message of ``kind`` that crossed connection ``index``."""
        return next(g for g in self.conns[index].crossed[to_reader] if g and g[0] == kind)


@contextmanager
def control_in_the_middle(writer: ab.Writer[Any]) -> Iterator[tuple[ab.Handle, ControlRelay]]:
    """A handle whose readers go through a ``ControlRelay`` (control) and a byte relay (data)."""
    control, data = listening_ports(writer)
    middle = middle_for(control, data)
    with ExitStack() as stack:
        relay = ControlRelay(control, middle)
        stack.callback(relay.close)
        stack.callback(ByteRelay(data, middle).close)
        assert writer.handle.tcp is not None
        yield writer.handle.model_copy(update={"tcp": writer.handle.tcp.replace("127.0.0.1", middle)}), relay


@ON_ASYNCIO
async def test_another_readers_welcome_played_to_a_joining_reader_does_not_move_its_start() -> None:
    """insecure=True. Reader A joins at 0 and reads 0-4; reader B joins, and A's WELCOME (start 0)
    is slipped into B's control connection before B's own (start 5). Signed with the handle's
    key, it used to be taken: B waited at 0 for messages the server would never send it. Now it
    is signed for A's session: B refuses it, takes its own, and reads 5."""
    async with tcp_writer(insecure=True) as writer:
        with control_in_the_middle(writer) as (h, relay):
            async with ab.open_reader(h, transport="tcp", name="a") as a:
                with anyio.fail_after(30):
                    for i in range(5):
                        await writer.put(i)
                        assert await a.get() == i
                relay.next_inject = [relay.sent(0, wire.WELCOME)]
                async with ab.open_reader(h, transport="tcp", name="b") as b:
                    assert relay.conns[1].injected.is_set()
                    with anyio.fail_after(30):
                        await writer.put(5)
                        assert await b.get() == 5
                        assert await a.get() == 5
                    assert b._src._proto.next == 6  # type: ignore[attr-defined]


@ON_ASYNCIO
async def test_a_recorded_refused_played_to_a_reader_does_not_end_it() -> None:
    """insecure=True. A reader with the handle of another channel is refused (REFUSED, signed with
    the key they share); that REFUSED, slipped into another reader's control connection while it
    reads, used to end it (the server "refused" it). Now it is signed as the answer to the other
    reader's HELLO: refused, and the reader reads on."""
    async with tcp_writer(insecure=True) as writer:
        with control_in_the_middle(writer) as (h, relay):
            wrong = h.model_copy(update={"name": "aiobroadcast-" + "f" * 32})
            with pytest.raises(ab.BroadcastError, match="another channel"):
                await ab.open_reader(wrong, transport="tcp", name="elsewhere", connect_timeout=10)
            refused = relay.sent(0, wire.REFUSED)
            async with ab.open_reader(h, transport="tcp", name="victim") as victim:
                with anyio.fail_after(30):
                    await writer.put(0)
                    assert await victim.get() == 0
                    relay.conns[1].inject[True].append(refused)
                    await until(relay.conns[1].injected.is_set, 20)  # with the next heartbeat
                    for i in range(1, 4):
                        await writer.put(i)
                        assert await victim.get() == i


@ON_ASYNCIO
async def test_a_recorded_bye_played_to_the_server_drops_nobody() -> None:
    """insecure=True. Reader A leaves (BYE); its BYE, slipped into reader B's control connection
    toward the server, used to make the server drop B. Now it is of A's session, not B's: the
    server refuses it (counted) and B stays, reading."""
    async with tcp_writer(insecure=True) as writer:
        with control_in_the_middle(writer) as (h, relay):
            async with ab.open_reader(h, transport="tcp", name="a") as a:
                with anyio.fail_after(30):
                    await writer.put(0)
                    assert await a.get() == 0
            await until(lambda: any(g[0] == wire.BYE for g in relay.conns[0].crossed[False]))
            bye = relay.sent(0, wire.BYE, to_reader=False)
            await until(lambda: remote_names(writer) == [])
            async with ab.open_reader(h, transport="tcp", name="b") as b:
                with anyio.fail_after(30):
                    await writer.put(1)
                    assert await b.get() == 1
                    assert writer.statistics().rejected_frames == 0
                    relay.conns[1].inject[False].append(bye)
                    await until(relay.conns[1].injected.is_set, 20)  # with B's next ACK
                    await until(lambda: writer.statistics().rejected_frames == 1, 20)
                    assert remote_names(writer) == ["b"]
                    for i in range(2, 5):
                        await writer.put(i)
                        assert await b.get() == i


@ON_ASYNCIO
async def test_old_keys_played_to_a_reader_are_refused() -> None:
    """insecure=True, a new key every two messages. The first KEYS the reader was sent, played
    to it again once those keys are long retired, used to replace its keys: it could open
    nothing, and asked for the keys again. Now it is a replay in the reader's session (its
    counter is not above the last one taken): refused, and the reader reads on, every frame
    opening (no unknown key)."""
    async with tcp_writer(insecure=True, rekey_messages=2) as writer:
        with control_in_the_middle(writer) as (h, relay):
            async with ab.open_reader(h, transport="tcp", name="keyed") as reader:
                with anyio.fail_after(30):
                    for i in range(9):
                        await writer.put(i)
                        assert await reader.get() == i
                    await until(lambda: sum(g[0] == wire.KEYS for g in relay.conns[0].crossed[True]) >= 3)
                    relay.conns[0].inject[True].append(relay.sent(0, wire.KEYS))
                    await until(relay.conns[0].injected.is_set, 20)  # before the next heartbeat
                    await anyio.sleep(0.5)  # (taken, or refused, by then)
                    # 9 is sealed under the key of 8: no KEYS comes before it
                    for i in range(9, 13):
                        await writer.put(i)
                        assert await reader.get() == i
                assert reader._src.rejected.get("unknown_key", 0) == 0  # type: ignore[attr-defined]


@ON_ASYNCIO
async def test_a_reader_of_protocol_5_is_refused_by_name() -> None:
    """insecure=True. A reader of protocol 5 (its PLAIN user name and password, its HELLO signed
    with the handle's key itself) is admitted at the handshake only to be told, in terms it
    checks, that the server speaks another protocol."""
    async with tcp_writer(insecure=True) as writer:
        h = writer.handle
        assert h.tcp is not None and h.hmac_key is not None
        secret = h.hmac_key.encode()
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.linger = 0
            sock.plain_username = wire.PLAIN_USER
            sock.plain_password = wire.legacy_password(secret)
            sock.connect(h.tcp)
            body = {"version": 5, "name": "old", "pid": 1, "window": 4, "resume": None, "channel": h.token}
            sock.send_multipart(wire.legacy_sign(secret, [wire.HELLO, wire.encode_json(body)]))
            assert await anyio.to_thread.run_sync(sock.poll, 10_000), "no answer"
            answer = sock.recv_multipart()
        finally:
            sock.close(linger=0)
            ctx.term()
        assert answer[0] == wire.REFUSED and wire.legacy_sign(secret, answer[:-1]) == answer
        assert answer[1].startswith(b"protocol version mismatch: this server speaks protocol 6, the reader 5")
