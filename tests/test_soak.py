"""A soak: a writer serving shared-memory and TCP readers in processes of their own, while
readers are SIGKILLed and new ones started at random, and the TCP server process is SIGKILLed
once. The writer never stops publishing for good; every reader alive at the end received, from
its first message on, every message in order or was told exactly what it missed (ReaderLagged),
and got the end of the stream (never WriterGone). Bounded: about 30 s. The schedule comes from a
seeded generator; the seed is in the failure message.
"""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any, Literal

import _tcp_workers as tw
import anyio
import pytest
from _peers import the_server
from _tcp_workers import ASYNCIO, TRIO, UVLOOP, Child, ReaderOpts, message, reader_proc

import aiobroadcast as ab

pytestmark = pytest.mark.anyio

CHAOS_S = 18.0  #: how long readers are killed and started
STEP_S = (0.8, 2.0)  #: between two kills
INTERVAL_S = 0.003  #: between two messages
HB = 0.5  #: a killed remote reader is dropped after 3 s; a reader hears nothing for 9 s before WriterGone
BACKENDS = (ASYNCIO, UVLOOP, TRIO)
BIG_EVERY = 97  #: every 97th message spans several slots


class Readers:
    """The reader processes, started and killed at random; the ones alive at the end report."""

    def __init__(self, writer: ab.Writer[Any], rng: random.Random) -> None:
        self._writer = writer
        self._rng = rng
        #: name, process, and the messages published before it started and once it was attached:
        #: its first message is one in between
        self.alive: list[tuple[str, Child, int, int]] = []
        self.killed = 0
        self._made = 0

    async def start(self, transport: Literal["shm", "tcp"]) -> None:
        self._made += 1
        name = f"{transport}-{self._made}"
        backend = BACKENDS[self._made % len(BACKENDS)]
        opts = ReaderOpts(name=name, transport=transport, big_every=BIG_EVERY)
        before = self._writer.statistics().sent
        child = Child(reader_proc, backend, None, self._writer.handle.to_json(), opts)
        self.alive.append((name, child, before, before))
        await child.recv("attached")
        self.alive[-1] = (name, child, before, self._writer.statistics().sent)

    async def kill_one(self) -> None:
        name, child, _, _ = self.alive.pop(self._rng.randrange(len(self.alive)))
        child.signal(signal.SIGKILL)
        child.cleanup()
        self.killed += 1
        await self.start("tcp" if name.startswith("tcp") else "shm")

    def cleanup(self) -> None:
        for _name, child, _, _ in self.alive:
            child.cleanup()


@pytest.mark.parametrize("anyio_backend", [pytest.param(ASYNCIO, id="asyncio")])
async def test_readers_and_the_tcp_server_killed_at_random_never_cost_a_silent_gap() -> None:
    seed = int(os.environ.get("SOAK_SEED", time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    where = f"(seed {seed}: SOAK_SEED={seed} replays the schedule)"
    async with ab.open_writer(
        tcp="tcp://127.0.0.1:0", heartbeat_s=HB, capacity=16, slot_bytes=512, tcp_window=32, max_readers=8
    ) as writer:
        readers = Readers(writer, rng)
        published = 0
        try:
            for transport in ("shm", "shm", "shm", "tcp", "tcp"):
                await readers.start(transport)

            async def publish() -> None:
                nonlocal published
                while True:
                    await writer.put(message(published, big_every=BIG_EVERY))
                    published += 1
                    await anyio.sleep(INTERVAL_S)

            async with anyio.create_task_group() as tg:
                tg.start_soon(publish)
                server_killed_at = rng.uniform(0.3, 0.7) * CHAOS_S
                server_killed = False
                end = time.monotonic() + CHAOS_S
                t0 = time.monotonic()
                while time.monotonic() < end:
                    await anyio.sleep(rng.uniform(*STEP_S))
                    if not server_killed and time.monotonic() - t0 >= server_killed_at:
                        the_server().kill()
                        server_killed = True
                    else:
                        await readers.kill_one()
                with anyio.fail_after(30):
                    while True:
                        if writer.statistics().tcp_server == "running":
                            break
                        await anyio.sleep(0.1)
                await anyio.sleep(1.0)  # the last readers started get messages too
                tg.cancel_scope.cancel()
            stats = writer.statistics()
            assert stats.tcp_server_restarts == 1, where
            await writer.aclose()
            reports: list[tuple[str, Any, int, int]] = []
            for name, child, before, attached in readers.alive:
                reports.append((name, await child.recv("events", within_s=60), before, attached))
        finally:
            readers.cleanup()
    assert readers.killed >= 5, where
    for name, report, before, attached in reports:
        events = report["events"]
        what = f"{name}: {tw.summary(events)} {where}"
        assert events[-1] == ("end",), what
        start = first_expected(events, published)
        assert before <= start <= attached, f"started at {start}, attached between {before} and {attached}: {what}"
        tw.account(events[:-1], published, start=start)


def first_expected(events: list[tw.Event], published: int) -> int:
    """The number of the first message a reader expected: its first message (or the end, if it
    got none), less what it was told it lost before that."""
    lost = 0
    for e in events:
        if e[0] == "msg":
            return int(e[1]) - lost
        if e[0] == "lagged":
            lost += e[1]
    return published - lost
