"""A paced stream over TCP: the server polls the ring briefly after each message (while messages
come within ``_tuning.TCP_SERVER_SPIN_NS`` of each other) and sleeps once they stop; a remote
reader's ``get`` sleeps on a future the I/O thread resolves. Neither may lose a wake-up, and
neither may keep spinning once the stream stops.

Real writer, real server process, real remote reader over loopback. The heartbeat is long
(``SLOW_HB``), and so is the limit of a reader's sleep: a lost wake-up would then show as a
message that comes only with the next heartbeat (the server's poll ends there), seconds late,
instead of being hidden by a short one. Bounds on time are liveness bounds, never latency.
"""

from __future__ import annotations

import random
from typing import Any

import anyio
import psutil
import pytest
from _peers import the_server

import aiobroadcast as ab
import aiobroadcast.blocking as abb
from aiobroadcast._base import tuning as _tuning
from aiobroadcast._tcp import client, inbox

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def no_safety_net(monkeypatch: pytest.MonkeyPatch) -> None:
    """A remote reader's sleep ends on its own after ``_tuning.REMOTE_SLEEP_S`` (a safety net):
    made long here, so that a lost wake-up shows as a message seconds late, not hidden by it."""
    monkeypatch.setattr(_tuning, "REMOTE_SLEEP_S", 60.0)


#: heartbeat_s of these writers: a lost wake-up costs a message up to this long (or twice)
SLOW_HB = 5.0
#: what "at once" means for one message here, on a loaded 2-core machine (a lost wake-up: SLOW_HB)
PROMPT_S = 2.0
#: pauses between a get and the next put: around the end of the server's spin (2 ms), inside
#: it, and well after it (asleep); 0: the put comes while the reader is still returning
PAUSES_S = (0.0, 0.0002, 0.001, 0.0018, 0.002, 0.0022, 0.003, 0.006, 0.02)
ROUNDS = 300


async def test_paced_messages_reach_a_remote_reader_without_a_lost_wake_up(anyio_backend: Any) -> None:
    """Message by message, each put at a random point of the server's spin or sleep and of the
    reader's: every one arrives promptly, in order, none only with a heartbeat."""
    rng = random.Random(27)
    async with ab.open_writer(tcp="tcp://127.0.0.1:0", heartbeat_s=SLOW_HB, capacity=64, slot_bytes=256) as w:
        async with ab.open_reader(w.handle, transport="tcp", name="paced") as r:
            for i in range(ROUNDS):
                await anyio.sleep(rng.choice(PAUSES_S))
                with anyio.fail_after(PROMPT_S):  # a lost wake-up: the message comes with a heartbeat
                    await w.put(i)
                    assert await r.get() == i


async def test_a_get_parked_before_the_put_is_woken(anyio_backend: Any) -> None:
    """The reader parks first (its sleep announced to the I/O thread), the put comes later, at
    pauses around the server's spin: the parked get returns promptly every time."""
    rng = random.Random(2027)
    async with ab.open_writer(tcp="tcp://127.0.0.1:0", heartbeat_s=SLOW_HB, capacity=64, slot_bytes=256) as w:
        async with ab.open_reader(w.handle, transport="tcp", name="parked") as r:
            send, receive = anyio.create_memory_object_stream[int](ROUNDS)

            async def read(n: int) -> None:
                for _ in range(n):
                    await send.send(await r.get())

            n = ROUNDS // 2
            with anyio.fail_after(60), send, receive:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(read, n)
                    for i in range(n):
                        await anyio.sleep(rng.choice(PAUSES_S[1:]))
                        with anyio.fail_after(PROMPT_S):  # a lost wake-up: it comes with a heartbeat
                            await w.put(i)
                            assert await receive.receive() == i


@pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")])
async def test_the_server_and_the_reader_sleep_once_a_dense_stream_stops(anyio_backend: Any) -> None:
    """A burst and a paced run keep the server polling the ring; once they stop, it sleeps: over
    the next 2 s the server process and this process (the writer, the remote reader and its I/O
    thread) use almost no CPU. A server that kept spinning would use most of a CPU."""
    async with ab.open_writer(tcp="tcp://127.0.0.1:0", capacity=256, slot_bytes=256) as w:
        async with ab.open_reader(w.handle, transport="tcp", name="burst") as r:
            server = the_server()

            async def read(n: int) -> None:
                for i in range(n):
                    assert await r.get() == i

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(read, 2000)
                    for i in range(2000):  # dense
                        await w.put(i)
            for i in range(200):  # paced at 1 ms: the server spins between messages
                await w.put(i)
                assert await r.get() == i
                await anyio.sleep(0.001)
            await anyio.sleep(0.2)  # the spin ends 2 ms after the last message
            me = psutil.Process()
            before = server.cpu_times(), me.cpu_times()
            await anyio.sleep(2.0)
            after = server.cpu_times(), me.cpu_times()
            server_s = (after[0].user + after[0].system) - (before[0].user + before[0].system)
            mine_s = (after[1].user + after[1].system) - (before[1].user + before[1].system)
            # Idle, both wake for heartbeats only (0.5 s): a few milliseconds of CPU in 2 s.
            assert server_s < 0.05, f"the idle server used {server_s:.3f} CPU-s in 2 s"
            assert mine_s < 0.05, f"the idle writer and reader used {mine_s:.3f} CPU-s in 2 s"
            await w.put(-1)
            with anyio.fail_after(PROMPT_S * 5):
                assert await r.get() == -1


async def test_an_idle_remote_readers_sleep_ends_on_its_own_after_the_safety_net(
    anyio_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get parked on an idle remote stream sleeps ``_tuning.REMOTE_SLEEP_S`` at a time (its
    I/O thread wakes it for whatever comes; the limit only bounds a lost wake-up), then parks
    again, and still takes the message that comes at last."""
    monkeypatch.setattr(_tuning, "REMOTE_SLEEP_S", 0.25)
    ends: list[bool] = []
    sleep = client.TcpSource.sleep

    async def counted(self: client.TcpSource, limit_s: float) -> bool:
        woken = await sleep(self, limit_s)
        ends.append(woken)
        return woken

    monkeypatch.setattr(client.TcpSource, "sleep", counted)
    async with ab.open_writer(tcp="tcp://127.0.0.1:0", heartbeat_s=SLOW_HB) as w:
        async with ab.open_reader(w.handle, transport="tcp", name="idle") as r:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    got: list[int] = []

                    async def read() -> None:
                        got.append(await r.get())

                    tg.start_soon(read)
                    # 6.5 limits of the sleep (a heartbeat is 5 s): the put lands in the middle
                    # of a sleep, not where one ends on its own (at 6 limits it raced that end).
                    await anyio.sleep(1.625)
                    await w.put(7)
            assert got == [7]
    assert ends.count(False) >= 3  # the sleep's own ends (1.625 s / 0.25 s, on a loaded machine)
    assert ends[-1] is True  # the message woke the last one


def test_a_lost_wake_up_costs_a_remote_message_two_heartbeats_at_most(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sleep's own limit is a last resort: when the wake-up that announces a message is lost
    (here every first one of a message's), the I/O thread's next turn (its idle heartbeat, two
    intervals on, at the latest) wakes the sleeper for what is queued. Blocking reader: it waits on the inbox's
    descriptor, so every wake-up goes through ``Inbox.wake``."""
    monkeypatch.setattr(_tuning, "REMOTE_SLEEP_S", 60.0)
    calls = lost = 0
    wake = inbox.Inbox.wake

    def lossy(self: inbox.Inbox) -> None:
        nonlocal calls, lost
        calls += 1
        if calls % 2 == 0:
            wake(self)
        else:
            lost += 1

    monkeypatch.setattr(inbox.Inbox, "wake", lossy)
    with abb.open_writer(tcp="tcp://127.0.0.1:0", heartbeat_s=0.2) as w:
        with abb.open_reader(w.handle, transport="tcp", name="lossy") as r:
            for i in range(5):
                w.put(i)
                # Long before the sleep's own limit (60 s), not within the first wake-up.
                assert r.get(timeout=PROMPT_S * 5) == i
    # Wake-ups were lost: every odd one. How many a message needed depends on whether the reader
    # was asleep yet when it came (none if not), so only the loss itself is certain.
    assert lost >= 1
