"""Remote fan-in senders (docs/fan-in.md, "Remote senders (TCP)"): ``open_sender(..., tcp=...)``
on one host, the collector attaching its ``remote_handle`` from another (here: other processes,
real TCP on 127.0.0.1). Nothing put before the collector attaches is lost, and a collector that
closes or dies makes ``put`` raise ``CollectorGone`` instead of publishing to nobody."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from typing import Any

import _netns
import anyio
import anyio.from_thread
import anyio.to_thread
import pytest
from _blocking_workers import recv
from _fanin_workers import (
    netns_collector_proc,
    netns_remote_sender_proc,
    remote_collector_proc,
    remote_sender_proc,
)
from _peers import hello, keyed_peer, until
from _workers import spawn

import aiobroadcast as ab
from aiobroadcast import blocking
from aiobroadcast._tcp import wire

#: Generous bound for "it happens" (never a performance claim): a loaded 2-core machine.
WITHIN_S = 15.0
LOOPBACK = "tcp://127.0.0.1:0"


@pytest.fixture
def anyio_backend() -> Any:
    return ("asyncio", {"use_uvloop": False})


@pytest.mark.anyio
async def test_items_put_before_the_collector_attaches_all_arrive_in_order_and_memory_stays_bounded() -> None:
    """The sender puts 600 items at once; its ring (8) and its server's buffer (512) hold the first
    ones, then ``put`` waits for the collector. Once it attaches, every item arrives, in order,
    then ``SourceClosed``."""
    async with ab.open_collector(expect=["far"], capacity=8, slot_bytes=256) as collector:
        with spawn(remote_sender_proc, collector.handle.to_json(), 600) as far:
            h = await far.recv("handle")
            await anyio.sleep(1.0)  # it puts meanwhile, then waits
            assert not far.conn.poll(0), "600 puts were accepted with no collector: memory is not bounded"
            await collector.attach(h, name="far")
            with anyio.fail_after(WITHIN_S):
                got = [d async for d in collector]
            assert got == [ab.Item("far", i) for i in range(600)] + [ab.SourceClosed("far")]
            assert await far.recv("sent") == 600
            assert await far.recv("closed") == 600


@pytest.mark.parametrize("api", ["async", "blocking"])
def test_a_remote_senders_put_raises_collector_gone_once_its_collector_is_killed(api: str) -> None:
    with spawn(remote_collector_proc) as child:
        collector_handle = recv(child, "handle")
        try:

            def keep_putting(put: Any) -> float:
                """Put until CollectorGone (a put blocked on the full ring too); when it came."""
                deadline = time.monotonic() + 2 * WITHIN_S
                i = 0
                while time.monotonic() < deadline:
                    try:
                        put(i)
                    except ab.CollectorGone:
                        return time.monotonic()
                    i += 1
                    time.sleep(0.002)
                raise AssertionError(f"{i} puts accepted after the collector was killed, none raised")

            if api == "blocking":
                with blocking.open_sender(collector_handle, name="far", tcp=LOOPBACK, capacity=8) as bsender:
                    assert bsender.remote_handle is not None
                    child.send(bsender.remote_handle.to_json())
                    bsender.put("first")
                    assert recv(child, "took") == repr(ab.Item("far", "first"))
                    os.kill(child.pid, 9)
                    killed = time.monotonic()
                    gone_at = keep_putting(lambda i: bsender.put(i, timeout=2 * WITHIN_S))
            else:

                async def main() -> tuple[float, float]:
                    async with ab.open_sender(collector_handle, name="far", tcp=LOOPBACK, capacity=8) as sender:
                        assert sender.remote_handle is not None
                        child.send(sender.remote_handle.to_json())
                        await sender.put("first")
                        assert recv(child, "took") == repr(ab.Item("far", "first"))
                        os.kill(child.pid, 9)
                        killed = time.monotonic()
                        gone_at = await anyio.to_thread.run_sync(
                            keep_putting, lambda i: anyio.from_thread.run(sender.put, i)
                        )
                        return killed, gone_at

                killed, gone_at = anyio.run(main)
            # The server drops a silent reader after 6 heartbeats (3 s), then leaves the ring.
            assert gone_at - killed < 10.0
        finally:
            child.cleanup()
            shutil.rmtree(ab.CollectorHandle.parse(collector_handle).path, ignore_errors=True)


@pytest.mark.anyio
async def test_a_remote_senders_put_raises_collector_gone_once_its_collector_closes() -> None:
    async with ab.open_collector(capacity=8, slot_bytes=256) as collector:
        async with ab.open_sender(collector.handle, name="near") as near:
            assert near.remote_handle is None  # a sender of this host has none
        async with ab.open_sender(collector.handle, name="far", tcp=LOOPBACK) as sender:
            assert sender.remote_handle is not None
            await collector.attach(sender.remote_handle, name="far")
            await sender.put(1)
            with anyio.fail_after(WITHIN_S):
                got = [await collector.get(), await collector.get()]
            assert sorted(got, key=repr) == [ab.Item("far", 1), ab.SourceClosed("near")]
            await collector.aclose()
            closed = time.monotonic()
            with pytest.raises(ab.CollectorGone, match="closed or died"), anyio.fail_after(WITHIN_S):
                while True:
                    await sender.put(0)
                    await anyio.sleep(0.01)
            assert time.monotonic() - closed < 5.0  # BYE: the server leaves the ring at once
            with pytest.raises(ab.CollectorGone):
                sender.put_nowait(0)


def test_a_blocking_remote_sender_and_collector_round_trip_and_the_close_is_reported() -> None:
    with blocking.open_collector(expect=["far"], capacity=8, slot_bytes=256) as collector:
        with blocking.open_sender(collector.handle, name="far", tcp=LOOPBACK) as sender:
            for i in range(20):  # before the collector attaches
                sender.put(i)
            assert sender.remote_handle is not None
            collector.attach(sender.remote_handle.to_json(), name="far")
            sender.put_many([20, 21])
        got = list(collector)
        assert got == [ab.Item("far", i) for i in range(22)] + [ab.SourceClosed("far")]


@pytest.mark.anyio
async def test_forged_frames_from_a_keyed_peer_drop_only_that_peer_and_nothing_is_lost() -> None:
    """A peer holding the remote sender's keys sends malformed frames, and a HELLO of its own
    while the collector holds the one place: each is refused (the malformed ones counted), the
    collector's stream goes on whole and the sender's ``put`` never raises."""
    async with (
        ab.open_collector(capacity=8, slot_bytes=256) as collector,
        ab.open_sender(collector.handle, name="far", tcp=LOOPBACK) as sender,
    ):
        h = sender.remote_handle
        assert h is not None
        await sender.put(-1)  # before the collector attaches
        await collector.attach(h, name="far")
        forged = [[wire.ACK, b"\0" * 7], [b"Q", b"?"], [wire.HELLO, b"{not json"], hello("intruder")]
        for seq, frames in enumerate(forged):
            with keyed_peer(h) as hostile:
                hostile.send(frames)
                assert (await hostile.answer())[0] == wire.REFUSED, frames
            await sender.put(seq)
        with anyio.fail_after(WITHIN_S):
            got = [await collector.get() for _ in range(len(forged) + 1)]
        assert got == [ab.Item("far", i) for i in range(-1, len(forged))]
        await until(lambda: sender._w.statistics().rejected_frames >= 3)


@pytest.fixture(scope="module")
def hosts() -> Iterator[_netns.Topology]:
    """Network namespaces joined by a bridge (tests/_netns.py), deleted at the end."""
    try:
        topo = _netns.create()
    except _netns.Unavailable as exc:
        pytest.skip(f"no network namespaces: {exc}")
    try:
        yield topo
    finally:
        _netns.destroy(topo)


@pytest.mark.anyio
async def test_across_hosts_nothing_put_before_attach_is_lost_and_a_cut_link_ends_put(hosts: _netns.Topology) -> None:
    """The sender on one host (network namespace), the collector on another: what the sender put
    before the collector attached arrives in order; then the collector's cable is pulled (no
    packet, nobody told) and the sender's ``put`` raises ``CollectorGone`` once its server has
    dropped the silent collector (6 heartbeats: 3 s)."""
    with spawn(netns_collector_proc, hosts.reader_ns, 50) as collector:
        collector_handle = await collector.recv("handle")
        try:
            with spawn(netns_remote_sender_proc, hosts.writer_ns, collector_handle, 50) as sender:
                remote = await sender.recv("handle")
                assert ab.Handle.parse(remote).tcp.startswith(f"tcp://{_netns.WRITER_IP}:")  # type: ignore[union-attr]
                assert await sender.recv("sent") == 50
                collector.send(remote)
                assert await collector.recv("took") == list(range(50))
                hosts.set_reader_link(up=False)
                try:
                    t0 = time.monotonic()
                    sender.send("more")
                    await sender.recv("gone", within_s=WITHIN_S + 10)
                    assert time.monotonic() - t0 < WITHIN_S
                finally:
                    hosts.set_reader_link(up=True)
                await sender.recv("closed")  # its files removed
        finally:
            collector.cleanup()
            shutil.rmtree(ab.CollectorHandle.parse(collector_handle).path, ignore_errors=True)
