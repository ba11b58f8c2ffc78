"""A fan-in collector hears of a sender's death from the sender's pidfd, at once: with the
liveness period made a minute long, only that notice can report the killed sender within the
test's bound (docs/fan-in.md, "Liveness")."""

from __future__ import annotations

import os
import time

import anyio
import pytest
from _blocking_workers import recv
from _fanin_workers import sender_proc
from _workers import spawn

import aiobroadcast as ab
from aiobroadcast import blocking
from aiobroadcast._base import tuning as _tuning

#: Generous bound for "it happens" (never a performance claim): a loaded 2-core machine; far
#: below the minute-long liveness period these tests set.
WITHIN_S = 15.0

needs_pidfd = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfd_open here")


@pytest.mark.parametrize(
    "anyio_backend",
    [("asyncio", {"use_uvloop": False}), ("asyncio", {"use_uvloop": True}), ("trio", {})],
    ids=["asyncio", "uvloop", "trio"],
)
@pytest.mark.anyio
@needs_pidfd
async def test_a_parked_collector_reports_a_killed_sender_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    async with ab.open_collector(capacity=8, slot_bytes=256) as collector:
        with spawn(sender_proc, collector.handle.to_json(), "k", 3, "hang") as doomed:
            await doomed.recv("attached")
            await doomed.recv("sent")
            with anyio.fail_after(WITHIN_S):
                got = [await collector.get() for _ in range(3)]  # attached by now
            assert got == [ab.Item("k", ("k", i)) for i in range(3)]
            monkeypatch.setattr(_tuning, "LIVENESS_S", 60.0)
            collector._g._last_check = time.monotonic()  # no periodic look is due before a minute

            async def kill_soon() -> None:
                await anyio.sleep(0.3)  # the collector is parked by then
                doomed.sigkill()

            async with anyio.create_task_group() as tg:
                tg.start_soon(kill_soon)
                with anyio.fail_after(WITHIN_S):
                    assert await collector.get() == ab.SourceGone("k", doomed.pid)


@needs_pidfd
def test_a_blocking_collector_reports_a_killed_sender_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    with blocking.open_collector(capacity=8, slot_bytes=256) as collector:
        with spawn(sender_proc, collector.handle.to_json(), "k", 1, "hang") as doomed:
            recv(doomed, "attached")
            recv(doomed, "sent")
            assert collector.get(timeout=WITHIN_S) == ab.Item("k", ("k", 0))
            monkeypatch.setattr(_tuning, "LIVENESS_S", 60.0)
            collector._g._last_check = time.monotonic()
            doomed.sigkill()
            assert collector.get(timeout=WITHIN_S) == ab.SourceGone("k", doomed.pid)


def test_without_a_pidfd_the_liveness_period_still_finds_the_dead_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ``pidfd_open`` is missing (or refused) the lock is looked at every ``LIVENESS_S``."""
    monkeypatch.delattr(os, "pidfd_open", raising=False)
    with blocking.open_collector(capacity=8, slot_bytes=256) as collector:
        with spawn(sender_proc, collector.handle.to_json(), "k", 1, "hang") as doomed:
            recv(doomed, "attached")
            recv(doomed, "sent")
            assert collector.get(timeout=WITHIN_S) == ab.Item("k", ("k", 0))
            doomed.sigkill()
            t0 = time.monotonic()
            assert collector.get(timeout=WITHIN_S) == ab.SourceGone("k", doomed.pid)
            assert time.monotonic() - t0 < WITHIN_S
