"""Cancellation at every await of every call, by every means a user has.

asyncio's own (``task.cancel()`` after k rounds of the loop, ``asyncio.timeout``,
``asyncio.wait_for``, a ``TaskGroup`` whose other task fails) on asyncio and uvloop, which no anyio
shield stops; and cancel scopes on every backend (trio's own under trio). A cancelled ``get``,
``put`` or ``put_many`` takes or publishes nothing, so what the calls that completed returned (or
published) is the whole stream, in order, with no gap and no duplicate.

Each run drives a few hundred calls through real shared-memory channels (and one reader over TCP),
with ``YIELD_EVERY`` lowered so that the periodic yield to the loop comes every few calls: a call
is cancelled there, and in the waits for a message or for room, and everywhere in between.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import random
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Literal, TypeVar

import anyio
import anyio.lowlevel
import pytest

import aiobroadcast as ab
from aiobroadcast._base import tuning as _tuning

pytestmark = pytest.mark.anyio

T = TypeVar("T")
Call = Callable[[], Coroutine[Any, Any, T]]
#: Runs one call under one way of cancelling it, the k-th variant of that way: (completed, result).
Attempt = Callable[[Call[T], str, int], Awaitable[tuple[bool, T | None]]]

ASYNCIO = [
    pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
]
ASYNCIO_WAYS = ["task.cancel", "timeout", "wait_for", "TaskGroup"]
SCOPE_WAYS = ["scope.cancel", "move_on_after", "task group"]
#: k: how many rounds of the loop a call runs before it is cancelled (0: before it starts), or
#: which of DELAYS_S a timeout gets. Past the first few, a call is asleep (or done) when cancelled.
ROUNDS = 8
DELAYS_S = [0.0, 1e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 0.0]
N = 300
END: Any = object()  # what a get returns for EndOfStream


class Boom(Exception):
    """The failure of a task group's other task, which cancels the call."""


@pytest.fixture(autouse=True)
def _yield_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """The periodic yield every few calls instead of every 64: many cancellations land on it."""
    monkeypatch.setattr(_tuning, "YIELD_EVERY", 3)


async def attempt_asyncio(call: Call[T], way: str, k: int) -> tuple[bool, T | None]:
    """Run ``call`` cancelled by asyncio's own means."""
    if way == "task.cancel":
        task = asyncio.ensure_future(call())
        for _ in range(k):
            await asyncio.sleep(0)
        task.cancel()
        try:
            return True, await task
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
            return False, None
    if way == "timeout":
        try:
            async with asyncio.timeout(DELAYS_S[k]):
                return True, await call()
        except TimeoutError:
            return False, None
    if way == "wait_for":
        try:
            return True, await asyncio.wait_for(call(), DELAYS_S[k] or 1e-6)
        except TimeoutError:
            return False, None
    assert way == "TaskGroup"

    async def sibling() -> None:
        for _ in range(k):
            await asyncio.sleep(0)
        raise Boom

    try:
        async with asyncio.TaskGroup() as tg:
            # The failing task first: its failure cancels the call after the call's first step
            # (k = 0), or after k more rounds.
            tg.create_task(sibling())
            task = tg.create_task(call())
    except* Boom:
        pass
    if task.cancelled():
        return False, None
    return True, task.result()


async def attempt_scope(call: Call[T], way: str, k: int) -> tuple[bool, T | None]:
    """Run ``call`` cancelled by a cancel scope (trio's own under trio)."""
    if way == "move_on_after":
        with anyio.move_on_after(DELAYS_S[k]):
            return True, await call()
        return False, None
    result: list[T] = []
    scope = anyio.CancelScope()

    async def run() -> None:
        with scope:
            result.append(await call())

    async def sibling() -> None:
        for _ in range(k):
            await anyio.lowlevel.checkpoint()
        raise Boom

    try:
        async with anyio.create_task_group() as tg:
            if way == "task group":
                tg.start_soon(sibling)  # first, as in attempt_asyncio
                tg.start_soon(run)
            else:
                tg.start_soon(run)
                assert way == "scope.cancel"
                for _ in range(k):
                    await anyio.lowlevel.checkpoint()
                scope.cancel()
    except BaseExceptionGroup as group:
        _, rest = group.split(Boom)
        if rest is not None:
            raise
    return (True, result[0]) if result else (False, None)


def schedule(way: str) -> Callable[[], tuple[str, int]]:
    """The way, and k cycling over every round and delay, for each next call."""
    ks = itertools.cycle(range(ROUNDS))
    return lambda: (way, next(ks))


def big(i: int) -> object:
    """Message ``i``: now and then one larger than the ring (streamed), else small."""
    return ("big", i, bytes(5000)) if i % 17 == 5 else i


def index(msg: object) -> int:
    value = msg[1] if isinstance(msg, tuple) else msg
    assert isinstance(value, int)
    return value


async def paced_publisher(writer: ab.Writer[object], rng: random.Random) -> None:
    """Publish 0..N-1 in bursts, sometimes pausing (so a get sometimes waits), then close."""
    i = 0
    while i < N:
        for _ in range(rng.randrange(1, 12)):
            if i < N:
                await writer.put(i)
                i += 1
        if rng.random() < 0.5:
            await anyio.sleep(rng.choice([0, 0.0002, 0.001]))
    await writer.aclose()


async def cancelled_gets(
    reader: ab.Reader[object], attempt: Attempt[Any], next_way: Callable[[], tuple[str, int]]
) -> tuple[list[object], int]:
    """Get until EndOfStream, every get under a cancellation: what completed gets returned, and
    how many were cancelled."""

    async def get() -> object:
        try:
            return await reader.get()
        except ab.EndOfStream:
            return END

    got: list[object] = []
    cancelled = 0
    while True:
        way, k = next_way()
        done, value = await attempt(get, way, k)
        if not done:
            cancelled += 1
        elif value is END:
            return got, cancelled
        else:
            got.append(value)


async def check_gets(
    transport: Literal["shm", "tcp"], attempt: Attempt[Any], next_way: Callable[[], tuple[str, int]], seed: int
) -> None:
    kw: dict[str, Any] = {"tcp": "tcp://127.0.0.1:0", "heartbeat_s": 0.5} if transport == "tcp" else {}
    # A get is cancelled only if it waits (a ready message is taken before a timer can fire): a
    # run in which the writer stayed ahead all along cancelled nothing and proved nothing, so it
    # runs again with the next seed, a few times at most.
    for run in range(5):
        rng = random.Random(seed + 1000 * run)
        with anyio.fail_after(60):
            async with ab.open_writer(capacity=16, slot_bytes=256, **kw) as writer:
                async with ab.open_reader(writer.handle, transport=transport) as reader:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(paced_publisher, writer, rng)
                        got, cancelled = await cancelled_gets(reader, attempt, next_way)
        assert got == list(range(N))  # every message once, in order: none lost, none taken twice
        if cancelled > 0:
            return
    pytest.fail("no get was cancelled in 5 runs: the test proved nothing")


async def check_puts(attempt: Attempt[Any], way: str, many: bool, seed: int) -> None:
    """Put 0..N-1 (or batches of them), every call under a cancellation, a cancelled one never
    retried, while a reader that is sometimes slow (so puts wait for room) takes everything: it
    receives exactly the messages whose put returned."""
    rng = random.Random(seed)
    next_way = schedule(way)
    published: list[int] = []
    received: list[int] = []
    cancelled = 0
    with anyio.fail_after(60):
        async with ab.open_writer(capacity=16, slot_bytes=256) as writer:
            async with ab.open_reader(writer.handle) as reader:

                async def take() -> None:
                    while True:
                        try:
                            received.append(index(await reader.get()))
                        except ab.EndOfStream:
                            return
                        if rng.random() < 0.05:
                            await anyio.sleep(rng.choice([0, 0.0005]))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(take)
                    i = 0
                    while i < N:
                        way, k = next_way()
                        if many:
                            batch = list(range(i, min(N, i + rng.randrange(1, 6))))
                            msgs = [("big", j, bytes(600)) if j % 13 == 4 else j for j in batch]
                            call: Call[None] = functools.partial(writer.put_many, msgs)
                        else:
                            batch = [i]
                            call = functools.partial(writer.put, big(i))
                        done, _ = await attempt(call, way, k)
                        if done:
                            published.extend(batch)
                        else:
                            cancelled += 1
                        i += len(batch)
                    await writer.aclose()
    assert received == published  # exactly what was reported published, in order
    assert cancelled > 0 and published  # the run did cancel some calls and complete others


@pytest.mark.parametrize("anyio_backend", ASYNCIO)
@pytest.mark.parametrize("way", ASYNCIO_WAYS)
async def test_get_cancelled_by_asyncio_takes_nothing(way: str) -> None:
    await check_gets("shm", attempt_asyncio, schedule(way), seed=1)


@pytest.mark.parametrize("anyio_backend", ASYNCIO)
@pytest.mark.parametrize("way", ASYNCIO_WAYS)
async def test_put_cancelled_by_asyncio_publishes_nothing(way: str) -> None:
    await check_puts(attempt_asyncio, way, many=False, seed=2)


@pytest.mark.parametrize("anyio_backend", ASYNCIO)
@pytest.mark.parametrize("way", ASYNCIO_WAYS)
async def test_put_many_cancelled_by_asyncio_publishes_nothing(way: str) -> None:
    await check_puts(attempt_asyncio, way, many=True, seed=3)


@pytest.mark.parametrize("way", SCOPE_WAYS)
async def test_get_cancelled_by_a_scope_takes_nothing(way: str) -> None:
    await check_gets("shm", attempt_scope, schedule(way), seed=4)


@pytest.mark.parametrize("way", SCOPE_WAYS)
async def test_put_cancelled_by_a_scope_publishes_nothing(way: str) -> None:
    await check_puts(attempt_scope, way, many=False, seed=5)


@pytest.mark.parametrize("way", SCOPE_WAYS)
async def test_put_many_cancelled_by_a_scope_publishes_nothing(way: str) -> None:
    await check_puts(attempt_scope, way, many=True, seed=6)


@pytest.mark.parametrize("anyio_backend", ASYNCIO)
async def test_tcp_get_cancelled_by_asyncio_takes_nothing() -> None:
    """Reader.get is the same over TCP: every asyncio way and k in turn, on one remote reader."""
    ways = itertools.cycle(itertools.product(ASYNCIO_WAYS, range(ROUNDS)))
    await check_gets("tcp", attempt_asyncio, lambda: next(ways), seed=7)


@pytest.mark.parametrize("anyio_backend", [pytest.param(("trio", {}), id="trio")])
async def test_tcp_get_cancelled_by_a_trio_scope_takes_nothing() -> None:
    ways = itertools.cycle(itertools.product(SCOPE_WAYS, range(ROUNDS)))
    await check_gets("tcp", attempt_scope, lambda: next(ways), seed=8)


async def test_a_relay_cancelled_by_a_scope_hands_on_a_prefix() -> None:
    await check_relay("scope.cancel")


@pytest.mark.parametrize("anyio_backend", ASYNCIO)
async def test_a_relay_cancelled_by_asyncio_hands_on_a_prefix() -> None:
    await check_relay("task.cancel")


async def check_relay(way: str) -> None:
    """A relay cancelled anywhere stops: its local readers receive what it republished, a prefix of
    the upstream stream with no gap and no duplicate, then EndOfStream."""
    rng = random.Random(9)
    for k in range(0, 60, 4):
        with anyio.fail_after(30):
            async with ab.open_writer(capacity=16, slot_bytes=256) as up:
                handles: list[ab.Handle] = []
                ready = anyio.Event()

                def on_ready(h: ab.Handle, handles: list[ab.Handle] = handles, ready: anyio.Event = ready) -> None:
                    handles.append(h)
                    ready.set()

                scope = anyio.CancelScope()

                async def run_relay(scope: anyio.CancelScope = scope) -> None:
                    with scope:
                        await ab.relay(up.handle, transport="shm", capacity=16, on_ready=on_ready)

                got: list[object] = []
                async with anyio.create_task_group() as tg:
                    if way == "task.cancel":
                        task = asyncio.ensure_future(run_relay())
                    else:
                        tg.start_soon(run_relay)
                    await ready.wait()
                    async with ab.open_reader(handles[0]) as down:
                        tg.start_soon(paced_publisher, up, rng)
                        while len(got) < k:  # the relay is well under way
                            got.append(await down.get())
                        for _ in range(k % 7):
                            await anyio.lowlevel.checkpoint()
                        if way == "task.cancel":
                            task.cancel()
                        else:
                            scope.cancel()
                        while True:
                            try:
                                got.append(await down.get())
                            except ab.EndOfStream:
                                break
                    if way == "task.cancel":
                        with pytest.raises(asyncio.CancelledError):
                            await task
        assert got == list(range(len(got)))


async def test_a_caller_that_never_waits_still_lets_other_tasks_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tight loop of put, get or put_many that never has to wait yields to the loop once in
    YIELD_EVERY messages (64), so the loop's other tasks still run."""
    monkeypatch.setattr(_tuning, "YIELD_EVERY", 64)
    n = 640
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async with ab.open_writer(capacity=1024, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle) as reader, anyio.create_task_group() as tg:
            tg.start_soon(tick)
            # From here the ticker runs only when a call yields.
            before = ticks
            for i in range(n):
                await writer.put(i)
            after_puts = ticks
            for i in range(n):
                assert await reader.get() == i
            after_gets = ticks
            for i in range(0, n, 10):
                await writer.put_many(range(i, i + 10))
            after_put_many = ticks
            tg.cancel_scope.cancel()
    lower = n // 64 // 2
    assert after_puts - before >= lower
    assert after_gets - after_puts >= lower
    assert after_put_many - after_gets >= lower


async def test_a_relay_whose_upstream_never_makes_it_wait_still_lets_other_tasks_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A relay is a loop of get and put that need not wait while its upstream is ahead: it
    yields to the loop by the reader's rule (``Reader.get``: once in YIELD_EVERY messages), so
    between two turns of another task it republishes no more than that, twice."""
    monkeypatch.setattr(_tuning, "YIELD_EVERY", 64)
    n = 640
    bursts: list[int] = []

    async with ab.open_writer(capacity=1024, slot_bytes=256) as up, anyio.create_task_group() as tg:
        ready: list[ab.Handle] = []
        started = anyio.Event()

        def on_ready(handle: ab.Handle) -> None:
            ready.append(handle)
            started.set()

        tg.start_soon(functools.partial(ab.relay, up.handle, transport="shm", capacity=1024, on_ready=on_ready))
        await started.wait()
        async with ab.open_reader(ready[0]) as down:
            relayed = anyio.Event()

            async def sample() -> None:
                # What the relay republished between two of this task's turns.
                last = 0
                while True:
                    lag = down.statistics().lag
                    bursts.append(lag - last)
                    last = lag
                    if lag == n:
                        relayed.set()
                    await anyio.lowlevel.checkpoint()

            tg.start_soon(sample)
            for i in range(n):  # all of it upstream at once: the relay never waits for a message
                up.put_nowait(i)
            with anyio.fail_after(30):
                await relayed.wait()
            tg.cancel_scope.cancel()
    # (Two of its turns at most: trio runs the tasks of a round in random order.)
    assert max(bursts) <= 2 * 64, bursts
