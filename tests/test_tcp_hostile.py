"""The TCP server against clients that hold the keys and misbehave, and against faults: every
remote reader host holds the handle's keys, so none of them may stop remote service for the
others, grow the server's memory without bound, or release the writer's backpressure; a full
/dev/shm or a killed server process must not end the channel either.

Real writer, real server process, real sockets; the hostile clients are ZeroMQ DEALERs with the
handle's keys (``_peers.KeyedPeer``). Time bounds are liveness bounds with generous margins.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import socket
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import _tcp_workers as tw
import anyio
import psutil
import pytest
from _peers import (
    ON_ASYNCIO,
    ON_TRIO,
    ON_UVLOOP,
    SAFE_HB,
    KeyedPeer,
    ended,
    hello,
    hello_body,
    keyed_peer,
    read_events,
    remote_names,
    server_processes,
    tcp_writer,
    the_server,
    until,
)
from _tcp_workers import ASYNCIO, fill_until_blocked, message, spawn

import aiobroadcast as ab
from aiobroadcast._tcp import wire

pytestmark = pytest.mark.anyio

HB = SAFE_HB  #: heartbeat_s: a reader hears nothing for 18 of them (9 s) before WriterGone
MIB = 1 << 20


BOTH_MODES = pytest.mark.parametrize("insecure", [False, True], ids=["curve", "insecure"])


async def round_trip(writer: ab.Writer[Any], reader: ab.Reader[Any], seq: int) -> None:
    """Publish ``message(seq)``; the honest reader must get exactly it next."""
    await writer.put(message(seq))
    with anyio.fail_after(20):
        assert tw.check_message(await reader.get()) == seq


def deep(depth: int) -> bytes:
    return b'{"version":%d,"window":4,"x":' % wire.PROTOCOL_VERSION + b"[" * depth + b"]" * depth + b"}"


def with_field(**fields: str) -> bytes:
    """A HELLO body with some fields replaced by raw JSON text."""
    base = {"version": str(wire.PROTOCOL_VERSION), "name": '"poison"', "pid": "1", "window": "4", "resume": "null"}
    base.update(fields)
    return ("{" + ",".join(f'"{k}":{v}' for k, v in base.items()) + "}").encode()


#: HELLO bodies that are authentic (sent with the keys) and each wrong in its own way
POISONED_HELLOS = {
    "window Infinity": with_field(window="Infinity"),
    "window NaN": with_field(window="NaN"),
    "window 1e400": with_field(window="1e400"),
    "window 2**64": with_field(window=str(2**64)),
    "window 0": with_field(window="0"),
    "window as a string": with_field(window='"4"'),
    "window true": with_field(window="true"),
    "pid -1": with_field(pid="-1"),
    "resume -2**70": with_field(resume=str(-(2**70))),
    "resume 2**64": with_field(resume=str(2**64)),
    "resume beyond the stream": with_field(resume=str(10**12)),
    "resume 1.5": with_field(resume="1.5"),
    "name too long": with_field(name='"' + "n" * 1000 + '"'),
    "name a number": with_field(name="7"),
    "version a string": with_field(version='"3"'),
    "nested 2,000 deep": deep(2000),
    "not an object": b"[1, 2]",
    "not JSON": b"{version: 3",
    "not UTF-8": b'{"version":3,"name":"\xff\xfe","window":4}',
    "empty": b"",
}


@BOTH_MODES
@ON_ASYNCIO
async def test_a_poisoned_hello_refuses_that_client_only_and_the_server_lives_on(insecure: bool) -> None:
    """Each HELLO is refused (REFUSED, counted in ``rejected_frames``) and the one server process
    goes on serving the honest reader; frames too large to be control frames (a 20,000-deep
    nesting, a 10 KiB name) are cut off by the socket before anyone parses them."""
    async with tcp_writer(insecure=insecure) as writer:
        h = writer.handle
        server = the_server()
        async with ab.open_reader(h, transport="tcp", name="honest") as honest:
            seq = 0
            for what, body in POISONED_HELLOS.items():
                with keyed_peer(h) as hostile:
                    hostile.send([wire.HELLO, body])
                    answer = await hostile.answer()
                    assert answer[0] == wire.REFUSED, (what, answer)
                await round_trip(writer, honest, seq)
                seq += 1
            await until(lambda: writer.statistics().rejected_frames >= len(POISONED_HELLOS))  # at a heartbeat
            for body in (deep(20_000), hello_body("n" * 10_000)):
                with keyed_peer(h) as hostile:
                    hostile.send([wire.HELLO, body])
                    assert not await hostile.heard(1.0)
                await round_trip(writer, honest, seq)
                seq += 1
            for frames in ([wire.HELLO], [wire.HELLO, hello_body("two"), b"extra"], [wire.HELLO, b"{}", b"", b""]):
                with keyed_peer(h) as hostile:
                    hostile.send(frames)
                    assert (await hostile.answer())[0] == wire.REFUSED, frames
                await round_trip(writer, honest, seq)
                seq += 1
            assert remote_names(writer) == ["honest"]
            stats = writer.statistics()
            assert stats.tcp_server == "running" and stats.tcp_server_restarts == 0
        assert the_server().pid == server.pid


@BOTH_MODES
@ON_TRIO
async def test_a_client_that_sends_a_malformed_frame_is_dropped_and_told_why(insecure: bool) -> None:
    """An admitted client (it had its WELCOME) that then sends a malformed ACK, NACK or BYE, or a
    kind that does not exist, is dropped (no longer listed) and told REFUSED; the others read on."""
    bad_frames = [
        [wire.ACK, b"\0" * 7],
        [wire.ACK, b"\0" * 9],
        [wire.ACK],
        [wire.NACK, b""],
        [wire.NACK, b"\0" * 8, b"\0" * 8],
        [wire.BYE, b"x"],
        [b"Q", b"?"],
        [b""],
    ]
    async with tcp_writer(insecure=insecure) as writer:
        h = writer.handle
        async with ab.open_reader(h, transport="tcp", name="honest") as honest:
            for seq, frames in enumerate(bad_frames):
                with keyed_peer(h) as hostile:
                    hostile.send(hello(f"hostile-{seq}"))
                    assert (await hostile.answer())[0] == wire.WELCOME
                    await until(lambda seq=seq: f"hostile-{seq}" in remote_names(writer))  # type: ignore[misc]
                    hostile.send(frames)
                    kinds = [(await hostile.answer())[0]]
                    while kinds[-1] != wire.REFUSED:
                        kinds.append((await hostile.answer())[0])
                    await until(lambda: remote_names(writer) == ["honest"])
                await round_trip(writer, honest, seq)
            await until(lambda: writer.statistics().rejected_frames >= len(bad_frames))


def rss(proc: Any) -> int:
    return int(proc.memory_info().rss)


@BOTH_MODES
@ON_ASYNCIO
async def test_a_nack_flood_from_a_client_that_never_reads_keeps_server_memory_bounded(insecure: bool) -> None:
    """A client that never reads asks for its whole window again every 2 ms for 3 s. Each NACK
    used to queue a full resend in ZeroMQ (+60-80 MiB in 3 s). Now the server resends at most
    once per heartbeat and never queues more than SEND_HWM frame groups for a reader (about
    2.3 MiB, docs/design.md): its memory grows by far less than the resends would take."""
    window, size = 256, 600  # small bodies: joined into new frames by every resend
    async with tcp_writer(insecure=insecure, tcp_window=window, capacity=64) as writer:
        h = writer.handle
        server = the_server()
        async with ab.open_reader(h, transport="tcp", name="honest") as honest:
            with keyed_peer(h) as hostile:
                hostile.send(hello("flood", window=window))
                welcome = await hostile.answer()
                assert welcome[0] == wire.WELCOME
                await until(lambda: "flood" in remote_names(writer))
                # The hostile client acknowledges nothing, so under "block" it holds the writer
                # once the server's buffer (2 * window) and the ring are full. The honest reader
                # gets all of it meanwhile.
                sent = 0
                with anyio.fail_after(30):
                    while sent < 2 * window:
                        await writer.put((sent, b"x" * size))
                        got = await honest.get()
                        assert got[0] == sent
                        sent += 1
                await anyio.sleep(2 * HB)
                before = rss(server)
                nack = [wire.NACK, wire.U64.pack(0)]
                resends_would_take = 0
                t_end = time.monotonic() + 3.0
                while time.monotonic() < t_end:
                    hostile.send(nack)
                    resends_would_take += window * size
                    await anyio.sleep(0.002)
                await anyio.sleep(2 * HB)
                grown = rss(server) - before
                assert resends_would_take > 64 * MIB  # the attack is real
                assert grown < 16 * MIB, f"server grew {grown / MIB:.1f} MiB under a NACK flood"
                # The hostile client is still a reader (NACK is allowed), the honest one reads on.
                assert "flood" in remote_names(writer)
            await round_trip(writer, honest, sent)


@ON_UVLOOP
async def test_repeated_hellos_never_release_the_writer_past_the_buffer_bound() -> None:
    """A live remote reader that acknowledges nothing holds the writer at the documented bound:
    the server's buffer (2 * max(tcp_window, capacity)) plus the ring. HELLOs meanwhile, from one
    identity again and again or from many, neither release it nor grow the buffer."""
    capacity, window = 8, 16
    bound = 2 * max(window, capacity) + capacity
    async with tcp_writer(tcp_window=window, capacity=capacity) as writer:
        h = writer.handle
        with keyed_peer(h) as slow:
            slow.send(hello("slow", window=window))
            assert (await slow.answer())[0] == wire.WELCOME

            async def stay_alive() -> None:
                while True:  # heard from, so never dropped; acknowledges nothing
                    slow.send([wire.ACK, wire.U64.pack(0)])
                    await anyio.sleep(HB / 2)

            async with anyio.create_task_group() as tg:
                tg.start_soon(stay_alive)
                sent = await fill_until_blocked(writer, 0, still_s=2 * HB)
                assert sent <= bound, f"published {sent}, the bound is {bound}"
                peers = [KeyedPeer(h) for _ in range(8)]  # one says HELLO again and again
                try:
                    for k in range(60):
                        peers[min(k, len(peers) - 1)].send(hello(f"hello-{k}", window=window))
                        await anyio.sleep(0.01)
                    sent = await fill_until_blocked(writer, sent, still_s=2 * HB)
                finally:
                    for p in peers:
                        p.close()
                assert sent <= bound, f"published {sent} after the HELLOs, the bound is {bound}"
                tg.cancel_scope.cancel()


@ON_ASYNCIO
async def test_a_killed_server_is_noticed_restarted_and_remote_readers_resume(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SIGKILL the TCP server: the writer notices at once, logs it, drops the dead server's
    readers from ``statistics()`` while it restarts the server on the same endpoint with the same
    keys. The remote reader never gets WriterGone: it reconnects, resumes, and is told exactly
    what it missed, if anything (here it had everything, so nothing)."""
    caplog.set_level(logging.WARNING, logger="aiobroadcast")
    n = 60
    async with tcp_writer() as writer:
        h = writer.handle
        old = the_server()
        events: list[tw.Event] = []
        async with ab.open_reader(h, transport="tcp", name="survivor") as reader:
            async with anyio.create_task_group() as tg:
                tg.start_soon(read_events, reader, ended, events)
                for i in range(n // 2):
                    await writer.put(message(i))
                await until(lambda: len(events) == n // 2)
                old.kill()
                seen: list[tuple[str, list[str]]] = []
                with anyio.fail_after(30):
                    while True:
                        s = writer.statistics()
                        seen.append((s.tcp_server, [r.name for r in s.readers if r.transport == "tcp"]))
                        if s.tcp_server_restarts == 1 and s.tcp_server == "running":
                            break
                        await anyio.sleep(0.005)
                assert all(not names for state, names in seen if state != "running"), seen
                new = the_server()
                assert new.pid != old.pid
                for i in range(n // 2, n):
                    await writer.put(message(i))
                await until(lambda: remote_names(writer) == ["survivor"], 20)
                await writer.aclose()
        _got, lags = tw.account(events[:-1], n)
        assert events[-1] == ("end",), tw.summary(events)
        assert not lags, tw.summary(events)
    assert any("TCP server" in r.getMessage() and r.levelno >= logging.WARNING for r in caplog.records)


@ON_TRIO
async def test_a_server_that_cannot_be_restarted_fails_loudly(caplog: pytest.LogCaptureFixture) -> None:
    """If the endpoint is taken before the new server binds it, the writer tries a few times,
    then says so: ``tcp_server == "failed"`` and an error in the log. Shared memory goes on."""
    caplog.set_level(logging.WARNING, logger="aiobroadcast")
    async with tcp_writer() as writer:
        h = writer.handle
        assert h.tcp is not None
        port = int(h.tcp.rsplit(":", 1)[1])
        async with ab.open_reader(h, transport="shm", name="local") as local:
            server = the_server()
            with socket.socket() as squatter:
                squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                server.kill()
                await anyio.to_thread.run_sync(psutil.wait_procs, [server], 10.0)
                squatter.bind(("127.0.0.1", port))
                squatter.listen()
                await until(lambda: writer.statistics().tcp_server == "failed", 60)
            assert any(r.levelno >= logging.ERROR and "TCP server" in r.getMessage() for r in caplog.records)
            assert remote_names(writer) == []
            await round_trip(writer, local, 0)


@ON_ASYNCIO
async def test_a_writer_dropped_without_aclose_lets_its_server_drain_and_stop() -> None:
    """Its server is not restarted, not left running, and leaves no file (the fixture checks)."""
    writer = await tcp_writer(heartbeat_s=0.2)
    server = the_server()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # "unclosed": it is the point here
        del writer
        gc.collect()
    gone, _alive = await anyio.to_thread.run_sync(psutil.wait_procs, [server], 20.0)
    assert gone == [server]
    assert server_processes(os.getpid()) == []


@ON_ASYNCIO
async def test_a_full_shm_degrades_the_servers_report_not_the_data_path() -> None:
    """A writer whose directory is a small tmpfs that fills up (Docker's /dev/shm is 64 MB): the
    server cannot write its report, logs it once, leaves no temporary file, and goes on serving
    the remote reader; once there is room again the report is written again. The writer runs in
    a mount namespace of its own (root only)."""
    top = tempfile.mkdtemp(prefix="ab-")  # short: socket paths in it must fit in 108 bytes
    spec = tw.FullShmSpec(directory=os.path.join(top, "shm"), count=40)
    with spawn(tw.full_shm_writer_proc, ASYNCIO, None, spec) as wproc, _removed(top):
        got = await wproc.next()
        if got[0] == "unavailable":
            pytest.skip(f"cannot mount a private tmpfs here: {got[1]}")
        assert got[0] == "handle"
        h = ab.Handle.parse(got[1])
        async with ab.open_reader(h, transport="tcp", name="remote") as reader:
            wproc.send("fill")
            full = await wproc.recv("full")
            assert full["listed"] == ["remote"]  # the last report the server could write
            for i in range(spec.count):
                with anyio.fail_after(20):
                    assert tw.check_message(await reader.get()) == i
            report = await wproc.recv("report")
            assert report["tcp_server"] == "running" and report["restarts"] == 0
            assert report["leftovers"] == [], report
            assert report["received_while_full"] == 0  # the last report written, before the fill
            assert report["received_again"] == spec.count  # written again once there is room
            assert report["complaints"] == 1, report  # logged once, not at every heartbeat
            assert "report was last written" in report["health_while_full"], report  # stale, and says so
            assert report["health_again"] == "ok", report
            wproc.send("close")
            with pytest.raises(ab.EndOfStream):
                with anyio.fail_after(20):
                    await reader.get()
        assert await wproc.join() == 0


@contextmanager
def _removed(path: str) -> Iterator[None]:
    try:
        yield
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_hello_bodies_are_validated_with_bounds() -> None:
    good = wire.decode_hello(hello_body("ok", window=7, resume=3))
    assert (good.name, good.window, good.resume) == ("ok", 7, 3)
    for what, body in POISONED_HELLOS.items():
        if what == "resume beyond the stream":
            continue  # well formed: the server refuses it for what it says
        with pytest.raises(wire.FrameError):
            wire.decode_hello(body)
    with pytest.raises(wire.FrameError):
        wire.decode_hello(deep(20_000))
