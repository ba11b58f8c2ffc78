"""Real hosts, real links: a writer, a relay host and a plain remote reader, each in its own
network namespace with its own address (10.231.0.1, .2, .3), joined by a bridge (_netns.py).

Needs root on Linux (CI runs as root); skipped with the precise reason otherwise. Every process
here is a spawned child that enters its namespace before opening any socket; the writer's TCP
server process inherits the writer's namespace. /dev/shm is shared by all namespaces (same mount
namespace), so readers on the "reader host" ask for ``transport="tcp"`` explicitly; the relay's
local readers use its shared-memory ring. The same scenarios run over loopback in test_tcp.py.

Cutting a link (``ip link set px down``, the reader's port on the bridge) is a cable pull: no
packet passes, nobody is told. Shorter than the drop bound, TCP retransmits and the reader
resumes without a gap; longer, the writer drops the reader and goes on (policy "block"), and
the reader later gets ``ReaderLagged`` (it came back and was told exactly what it missed) or
``WriterGone`` (it heard nothing for 18 heartbeats).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import _netns
import anyio
import pytest
from _tcp_workers import (
    ASYNCIO,
    TRIO,
    UVLOOP,
    Child,
    Event,
    ReaderOpts,
    WriterSpec,
    account,
    reader_proc,
    relay_proc,
    spawn,
    summary,
    terminal,
    writer_proc,
)

import aiobroadcast as ab

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.parametrize("anyio_backend", [pytest.param(ASYNCIO, id="asyncio")]),
]

MARGIN_S = 5.0  #: slack for a loaded CI machine in every liveness bound


@pytest.fixture(scope="module")
def hosts() -> Iterator[_netns.Topology]:
    """Three namespaces and a bridge, deleted at the end (also when a test fails)."""
    try:
        topo = _netns.create()
    except _netns.Unavailable as exc:
        pytest.skip(f"no network namespaces: {exc}")
    try:
        yield topo
    finally:
        _netns.destroy(topo)
        assert not any(_netns.exists(ns) for ns in (topo.writer_ns, topo.relay_ns, topo.reader_ns, topo.bridge_ns))


def accounted(events: list[Event]) -> int:
    """How many messages the events account for (received, or reported missed)."""
    return sum(1 if e[0] == "msg" else e[1] if e[0] == "lagged" else 0 for e in events)


async def test_writer_relay_and_remote_reader_on_three_hosts(hosts: _netns.Topology) -> None:
    """Ordered delivery across hosts: a plain remote reader on host X and two local readers behind
    a relay on host R all receive every message (mixed sizes) in order, then EndOfStream."""
    n, big_every = 300, 7
    spec = WriterSpec(tcp=f"tcp://{_netns.WRITER_IP}:0", count=n, big_every=big_every, heartbeat_s=0.5)
    with spawn(writer_proc, UVLOOP, hosts.writer_ns, spec) as writer:
        upstream = await writer.recv("handle")
        tcp = ab.Handle.parse(upstream).tcp
        assert tcp is not None and tcp.startswith(f"tcp://{_netns.WRITER_IP}:") and not tcp.endswith(":0")
        with spawn(relay_proc, TRIO, hosts.relay_ns, upstream, "relay-r", 8) as relay:
            local = await relay.recv("handle")
            with (
                spawn(
                    reader_proc,
                    ASYNCIO,
                    hosts.relay_ns,
                    local,
                    ReaderOpts(name="r1", transport="shm", big_every=big_every),
                ) as r1,
                spawn(
                    reader_proc,
                    UVLOOP,
                    hosts.relay_ns,
                    local,
                    ReaderOpts(name="r2", transport="shm", big_every=big_every),
                ) as r2,
                spawn(
                    reader_proc,
                    TRIO,
                    hosts.reader_ns,
                    upstream,
                    ReaderOpts(name="x", transport="tcp", big_every=big_every),
                ) as x,
            ):
                for child in (r1, r2, x):
                    await child.recv("attached")
                writer.send("go")
                sent = await writer.recv("sent", within_s=60)
                assert sorted(name for name, transport in sent["readers"] if transport == "tcp") == ["relay-r", "x"]
                assert sent["dropped"] == 0
                await writer.recv("closed")
                for child in (r1, r2, x):
                    result = await child.recv("events", within_s=60)
                    assert result["events"] == [("msg", i) for i in range(n)] + [("end",)], summary(result["events"])
                    assert await child.join() == 0
            await relay.recv("done")
            assert await relay.join() == 0
        assert await writer.join() == 0


async def _cut_and_restore(hosts: _netns.Topology, writer: Child, reader: Child, *, down_s: float, n: int) -> Any:
    """Start the stream, cut the reader's link once it has 50 messages, restore it after
    ``down_s`` seconds, and let the writer close once the reader has accounted for every
    message. Returns the writer's "sent" report."""
    await reader.recv("attached")
    writer.send("go")
    await reader.until(lambda ev: len(ev) >= 50)
    async with anyio.create_task_group() as tg:
        tg.start_soon(reader.collect)  # it reports every message: keep its pipe flowing
        hosts.set_reader_link(up=False)
        try:
            await anyio.sleep(down_s)
        finally:
            hosts.set_reader_link(up=True)
        sent = await writer.recv("sent", within_s=60)
        tg.cancel_scope.cancel()
    await reader.until(lambda ev: accounted(ev) >= n, within_s=60)
    writer.send("close")
    await writer.recv("closed", within_s=60)
    return sent


async def test_link_cut_shorter_than_the_bound_resumes_without_a_gap(hosts: _netns.Topology) -> None:
    """The reader's link is down for 1 s; the drop bound is 6 heartbeats (3 s). TCP retransmits
    once it is back: the writer never dropped the reader, which receives every message, in
    order, with nothing missing (nothing was even reported missing)."""
    n = 400
    spec = WriterSpec(
        tcp=f"tcp://{_netns.WRITER_IP}:0", count=n, heartbeat_s=0.5, interval_s=0.005, then="wait", tcp_window=16
    )
    with spawn(writer_proc, ASYNCIO, hosts.writer_ns, spec) as writer:
        handle = await writer.recv("handle")
        with spawn(reader_proc, TRIO, hosts.reader_ns, handle, ReaderOpts(name="x", live=True)) as reader:
            sent = await _cut_and_restore(hosts, writer, reader, down_s=1.0, n=n)
            result = await reader.recv("events", within_s=30)
    events = result["events"]
    account(events, n)  # every message received or reported, in order: never a silent gap
    assert sent["dropped"] == 0, summary(events)
    assert events == [("msg", i) for i in range(n)] + [("end",)], summary(events)


@pytest.mark.parametrize("outcome", ["lagged", "gone"])
async def test_link_cut_longer_than_the_bound_the_writer_drops_the_reader_and_goes_on(
    hosts: _netns.Topology, outcome: str
) -> None:
    """The reader's link goes down while the writer (policy "block") publishes. The writer is
    held back only until the silent reader is dropped (6 heartbeats), then publishes the rest.

    - lagged: the link comes back as soon as the writer reports the drop, well within the
      reader's own bound (18 heartbeats): the reader resumes, is told exactly what it missed
      (ReaderLagged), and gets the rest, then EndOfStream.
    - gone: the link stays down until the reader gives up: WriterGone, after an in-order
      prefix with no silent gap."""
    n, hb = 300, (0.5 if outcome == "lagged" else 0.2)
    spec = WriterSpec(
        tcp=f"tcp://{_netns.WRITER_IP}:0",
        count=n,
        heartbeat_s=hb,
        interval_s=0.005,
        then="wait",
        tcp_window=16,
        report_drop=True,
    )
    with spawn(writer_proc, UVLOOP, hosts.writer_ns, spec) as writer:
        handle = await writer.recv("handle")
        with spawn(reader_proc, ASYNCIO, hosts.reader_ns, handle, ReaderOpts(name="x", live=True)) as reader:
            await reader.recv("attached")
            writer.send("go")
            await reader.until(lambda ev: len(ev) >= 50)
            async with anyio.create_task_group() as tg:
                tg.start_soon(reader.collect)  # it reports every message: keep its pipe flowing
                hosts.set_reader_link(up=False)
                try:
                    t0 = time.monotonic()
                    await writer.recv("dropped", within_s=6 * hb + MARGIN_S)
                    assert time.monotonic() - t0 < 6 * hb + MARGIN_S  # the documented bound
                    if outcome == "gone":
                        await reader.collected("events", within_s=18 * hb + MARGIN_S + 10)
                finally:
                    hosts.set_reader_link(up=True)
                sent = await writer.recv("sent", within_s=60)
                tg.cancel_scope.cancel()
            if outcome == "lagged":
                await reader.until(lambda ev: accounted(ev) >= n, within_s=60)
            writer.send("close")
            await writer.recv("closed", within_s=60)
            if outcome == "lagged":
                result = await reader.recv("events", within_s=30)
    assert sent["dropped"] == 1
    assert sent["longest_put_s"] < 6 * hb + MARGIN_S  # it never hung on the dead link
    events = reader.events
    if outcome == "lagged":
        events = result["events"]
        _, lags = account(events, n)
        assert lags, summary(events)  # it was dropped, so something was missed: exactly reported
        assert events[-1] == ("end",), summary(events)
    else:
        assert terminal(events) == ("gone",), summary(events)
        prefix = events[:-1]
        account(prefix, accounted(prefix))  # what it got is in order, with no silent gap
        assert accounted(prefix) < n
