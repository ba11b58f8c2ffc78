"""The wake path under attack: a reader's inbox stays registered with an asyncio event loop
between sleeps, and the writer keeps a socket connected to each reader's inbox. What that must
not break: cancellation at any point of a sleep, a close while asleep, many tasks on one reader,
a loop that is closed and replaced, a fork child, and a reader place that changes hands.

Every test runs on asyncio, uvloop and trio (trio takes the generic path: one registration per
sleep). A lost wake-up would only cost a message the liveness re-check, so the tests that prove
a wake-up arrives stretch that re-check far beyond their deadline: a lost one fails the test.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

import aiobroadcast as ab
from aiobroadcast._base import tuning as _tuning
from aiobroadcast._broadcast.wakeup import LoopWaiter
from aiobroadcast._shm import wake as _wake

pytestmark = pytest.mark.anyio

#: Far beyond any deadline below: a sleep that is not woken by its datagram outlasts the test.
NEVER_S = 3600.0


@pytest.fixture
def no_liveness_rescue(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Readers opened from now on re-check the ring on their own only every hour."""
    monkeypatch.setattr(_tuning, "LIVENESS_S", NEVER_S)
    monkeypatch.setattr(_tuning, "WATCHED_LIVENESS_S", NEVER_S)
    yield


def inbox_of(reader: ab.Reader[Any]) -> _wake.Inbox:
    inbox = reader._src._inbox  # type: ignore[attr-defined]
    assert isinstance(inbox, _wake.Inbox)
    return inbox


def sleeping(writer: ab.Writer[Any]) -> bool:
    return any(r.sleeping for r in writer.statistics().readers)


async def until(condition: Any) -> None:
    """Wait (polling: the condition is another process's or task's state) until ``condition()``."""
    with anyio.fail_after(30):
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.001)


async def until_asleep(writer: ab.Writer[Any]) -> None:
    await until(lambda: sleeping(writer))


def fd_is_watched(fd: int) -> bool:
    """Whether the running asyncio loop watches ``fd`` for reading (the loop's own answer:
    ``remove_reader`` says whether there was one; put back at once)."""
    loop = asyncio.get_running_loop()
    if not loop.remove_reader(fd):
        return False
    loop.add_reader(fd, lambda: None)  # never called: the test removes it right after
    loop.remove_reader(fd)
    return True


def on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def test_a_reader_woken_many_times_is_registered_once_and_wakes_every_time(no_liveness_rescue: None) -> None:
    async with ab.open_writer(capacity=8, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle, spin_us=0) as reader:
            for i in range(50):
                await _wake_once(writer, reader, i)
            if on_asyncio():
                inbox = inbox_of(reader)
                assert isinstance(inbox.side, LoopWaiter)
                assert inbox.side._loop is asyncio.get_running_loop()  # stayed registered between sleeps
                fd = inbox.sock.fileno()
        if on_asyncio():
            assert not fd_is_watched(fd)  # aclose took it out of the loop before closing it


async def test_close_while_asleep_raises_closed_and_leaves_the_loop_clean() -> None:
    async with ab.open_writer(capacity=8, slot_bytes=256) as writer:
        reader = await ab.open_reader(writer.handle, spin_us=0)
        fd = inbox_of(reader).sock.fileno()
        outcome: list[BaseException] = []

        async def park() -> None:
            try:
                await reader.get()
            except ab.ClosedResourceError as exc:
                outcome.append(exc)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for _ in range(3):  # one sleeps in the source, two wait for it
                    tg.start_soon(park)
                await until_asleep(writer)
                await reader.aclose()
        assert len(outcome) == 3
        if on_asyncio():
            assert not fd_is_watched(fd)
            # The descriptor number is free for another file, which the loop may watch anew.
            a, b = socket.socketpair()
            try:
                loop = asyncio.get_running_loop()
                loop.add_reader(a.fileno(), lambda: None)
                loop.remove_reader(a.fileno())
            finally:
                a.close()
                b.close()


async def test_cancelling_a_sleep_as_its_wake_up_arrives_loses_no_message(no_liveness_rescue: None) -> None:
    """The datagram and the cancellation land in the same loop round: the datagram may be taken
    by a sleep that is then cancelled. The message must still be there for the next get, and a
    later sleep must still be woken by its own datagram."""
    async with ab.open_writer(capacity=16, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle, spin_us=0) as reader:
            for i in range(40):
                scope = anyio.CancelScope()
                returned: list[int] = []

                async def park(scope: anyio.CancelScope = scope, returned: list[int] = returned) -> None:
                    with scope:
                        returned.append(await reader.get())

                async with anyio.create_task_group() as tg:
                    tg.start_soon(park)
                    await until_asleep(writer)
                    writer.put_nowait(i)  # the datagram goes out now...
                    if i % 2:
                        await anyio.lowlevel.checkpoint()  # ...and may be taken first
                    scope.cancel()  # ...the cancellation lands with it
                if returned:  # the get had returned before the cancellation came
                    assert returned == [i]
                    continue
                # Nothing was taken by the cancelled get, whatever the order.
                with anyio.fail_after(30):
                    assert await reader.get() == i
            # And the inbox still works: a fresh sleep is woken by its datagram.
            async with anyio.create_task_group() as tg:
                got: list[str] = []

                async def take() -> None:
                    got.append(await reader.get())

                tg.start_soon(take)
                await until_asleep(writer)
                with anyio.fail_after(30):
                    await writer.put("last")
            assert got == ["last"]


async def test_cancellation_at_random_points_of_many_parked_tasks_loses_and_duplicates_nothing() -> None:
    n = 400
    taken: list[int] = []
    async with ab.open_writer(capacity=8, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle, spin_us=0) as reader:

            async def publish() -> None:
                for i in range(n):
                    await writer.put(i)
                    if random.random() < 0.3:
                        await anyio.sleep(random.choice([0, 0.0002, 0.001]))

            async def take() -> None:
                while len(taken) < n:
                    with anyio.move_on_after(random.choice([0, 0.0001, 0.0005, 0.002, 0.01])):
                        taken.append(await reader.get())

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(publish)
                    for _ in range(4):
                        tg.start_soon(take)
    assert sorted(taken) == list(range(n))


async def test_cancelling_the_task_asleep_in_the_source_hands_the_sleep_to_another(no_liveness_rescue: None) -> None:
    async with ab.open_writer(capacity=8, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle, spin_us=0) as reader:
            got: list[int] = []
            scopes: list[anyio.CancelScope] = []

            async def park() -> None:
                with anyio.CancelScope() as scope:
                    scopes.append(scope)
                    got.append(await reader.get())

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    for _ in range(3):
                        tg.start_soon(park)
                    await until_asleep(writer)
                    await until(lambda: reader.statistics().tasks_waiting == 3)
                    scopes[0].cancel()  # the first one sleeps in the source; the others follow it
                    await until(lambda: reader.statistics().tasks_waiting == 2)
                    await until_asleep(writer)  # one of the other two sleeps in the source now
                    await writer.put(1)
                    await writer.put(2)
            assert sorted(got) == [1, 2]


async def test_a_reader_used_from_one_event_loop_after_another(no_liveness_rescue: None) -> None:
    """The loop the inbox is registered with closes, and the next one (asyncio, uvloop or trio)
    takes over: no stale registration, every sleep woken by its datagram."""
    writer = await ab.open_writer(capacity=8, slot_bytes=256)
    reader = await ab.open_reader(writer.handle, spin_us=0)
    handle = writer.handle
    try:
        await _wake_once(writer, reader, 0)
        for k, (backend, options) in enumerate(
            [
                ("asyncio", {"use_uvloop": False}),
                ("asyncio", {"use_uvloop": True}),
                ("trio", {}),
                ("asyncio", {"use_uvloop": True}),
            ],
            start=1,
        ):

            async def in_other_loop(k: int = k) -> None:
                await _wake_once(writer, reader, k)

            # anyio.run cannot nest: run the other loop in a worker thread that acts as this
            # one (the roles check the thread they were opened in).
            await anyio.to_thread.run_sync(_run_as_owner, reader, writer, backend, options, in_other_loop)
        await _wake_once(writer, reader, 99)
    finally:
        await reader.aclose()
        await writer.aclose()
    assert not await anyio.Path(handle.path).exists()


def _run_as_owner(
    reader: ab.Reader[Any], writer: ab.Writer[Any], backend: str, options: dict[str, Any], fn: Any
) -> None:
    saved = reader._thread, writer._publishing.thread
    reader._thread = writer._publishing.thread = threading.get_ident()
    try:
        anyio.run(fn, backend=backend, backend_options=options)
    finally:
        reader._thread, writer._publishing.thread = saved


async def _wake_once(writer: ab.Writer[Any], reader: ab.Reader[Any], value: int) -> None:
    got: list[int] = []

    async def take() -> None:
        got.append(await reader.get())

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(take)
            await until_asleep(writer)
            await writer.put(value)
    assert got == [value]


async def test_a_place_that_changes_hands_is_woken_at_its_new_socket(no_liveness_rescue: None) -> None:
    """The writer's socket connected to place 0 must follow the place to its next reader, even
    when the old reader's socket is still open (a copy of its descriptor lives on elsewhere), so
    that sending to it would not fail."""
    async with ab.open_writer(capacity=8, slot_bytes=256, max_readers=1) as writer:
        first = await ab.open_reader(writer.handle, spin_us=0)
        await _wake_once(writer, first, 1)  # the writer is now connected to first's socket
        kept = os.dup(inbox_of(first).sock.fileno())  # first's socket outlives first
        try:
            await first.aclose()
            async with ab.open_reader(writer.handle, spin_us=0) as second:
                assert second.statistics().place == 0
                for i in range(3):
                    await _wake_once(writer, second, 10 + i)
        finally:
            os.close(kept)


async def test_a_fork_child_leaves_the_parents_loop_registration_alone(no_liveness_rescue: None) -> None:
    """A fork child shares the parent's epoll instance (the loop's descriptor): had it taken
    the inherited inbox out of the inherited loop, the parent would no longer be woken."""
    async with ab.open_writer(capacity=8, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle, spin_us=0) as reader:
            await _wake_once(writer, reader, 1)  # registered with this loop from now on
            got: list[int] = []

            async def take() -> None:
                got.append(await reader.get())

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(take)
                    await until_asleep(writer)
                    pid = os.fork()  # the reader is asleep, registered, in the parent
                    if pid == 0:  # pragma: no cover (the child)
                        code = 1
                        try:
                            try:
                                reader.get_nowait()
                            except ab.ClosedResourceError:
                                code = 0
                        finally:
                            os._exit(code)
                    status = await anyio.to_thread.run_sync(os.waitpid, pid, 0)
                    assert os.waitstatus_to_exitcode(status[1]) == 0
                    await writer.put(2)
            assert got == [2]
            await _wake_once(writer, reader, 3)


async def test_a_writer_waiting_for_room_is_woken_and_can_be_closed_while_waiting() -> None:
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle, spin_us=0) as reader:
            for i in range(4):
                writer.put_nowait(i)
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(writer.put, 4)  # waits for room on its inbox
                    for i in range(5):
                        assert await reader.get() == i
            # Blocked again, then cancelled: nothing published, the inbox still works.
            for i in range(4):
                writer.put_nowait(10 + i)
            with anyio.move_on_after(0.05) as scope:
                await writer.put("never")
            assert scope.cancelled_caught
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(writer.put, 14)
                    for i in range(5):
                        assert await reader.get() == 10 + i


def test_outbox_sends_nothing_and_raises_nothing_to_a_missing_or_full_inbox(tmp_path: Any) -> None:
    path = str(tmp_path / "x.sock")
    out = _wake.Outbox()
    try:
        out.wake(path)  # nobody bound: nothing to wake
        inbox = _wake.Inbox(path)
        try:
            for _ in range(10_000):  # far beyond what the socket holds
                out.wake(path)
            assert inbox.drain()
            assert not inbox.drain()
        finally:
            inbox.close()
        out.wake(path)  # closed and unlinked: nothing to wake
        again = _wake.Inbox(path)  # a new socket at the same path, same generation
        try:
            out.wake(path)  # the connection to the closed one fails: connect to this one
            assert again.drain()
        finally:
            again.close()
    finally:
        out.close()


async def test_a_put_that_fails_wakes_nobody_and_the_next_put_wakes_the_sleepers(no_liveness_rescue: None) -> None:
    """Readers are woken only once a message is in the ring: a put whose encoding fails publishes
    nothing and leaves the sleepers asleep (the same sleep episode), and the next put wakes them."""
    async with ab.open_writer(capacity=8, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle, spin_us=0) as reader:
            got: list[int] = []

            async def take() -> None:
                got.append(await reader.get())

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(take)
                    await until_asleep(writer)
                    episode = list(writer._ch.seg.waiting.tolist())
                    for _ in range(5):
                        with pytest.raises(ab.SerializationError):
                            await writer.put(lambda: None)  # unpicklable
                        with pytest.raises(ab.SerializationError):
                            writer.put_nowait(lambda: None)
                    await anyio.sleep(0.05)  # a wake-up, had one been sent, lands within this
                    assert writer._ch.seg.waiting.tolist() == episode  # still the same sleep
                    assert got == []
                    await writer.put(7)
            assert got == [7]


@pytest.mark.parametrize(
    "anyio_backend",
    [("asyncio", {"use_uvloop": False}), ("asyncio", {"use_uvloop": True})],
    ids=["asyncio", "uvloop"],
)
async def test_a_reader_in_trio_guest_mode_on_an_asyncio_loop_takes_the_generic_path(
    no_liveness_rescue: None,
) -> None:
    """Trio can run as a guest of a running asyncio loop (the host): asyncio.get_running_loop()
    then answers in trio's tasks too, but they cannot await an asyncio future. Their sleeps go
    through anyio."""
    import trio

    loop = asyncio.get_running_loop()
    async with ab.open_writer(capacity=8, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle, spin_us=0) as reader:
            done: asyncio.Future[Any] = loop.create_future()

            async def guest() -> list[int]:
                return [await reader.get(), await reader.get()]

            trio.lowlevel.start_guest_run(
                guest,
                run_sync_soon_threadsafe=loop.call_soon_threadsafe,
                run_sync_soon_not_threadsafe=loop.call_soon,
                done_callback=lambda outcome: done.set_result(outcome),
                host_uses_signal_set_wakeup_fd=True,
            )
            with anyio.fail_after(30):
                await until_asleep(writer)
                await writer.put(1)
                await until_asleep(writer)
                await writer.put(2)
                outcome = await done
            assert outcome.unwrap() == [1, 2]


@pytest.mark.parametrize(
    "anyio_backend",
    [("asyncio", {"use_uvloop": False}), ("asyncio", {"use_uvloop": True})],
    ids=["asyncio", "uvloop"],
)
async def test_one_timer_ends_each_sleep_at_its_own_limit(tmp_path: Any) -> None:
    """One timer serves every sleep of an inbox under asyncio. A sleep woken early leaves it armed
    for its own limit; the next sleep must still end at its limit, whether that comes later (the
    timer arms itself again) or sooner (a shorter limit: the timer is armed again for it)."""
    path = str(tmp_path / "t.sock")
    inbox = _wake.Inbox(path)
    out = _wake.Outbox()
    loop = asyncio.get_running_loop()
    try:
        # Each sleep must end at its own limit: not before it (the loop's timers never fire
        # early, so these bounds do not depend on load), and long before the 60 s timer of the
        # first sleep (the guard, not a measured figure).
        with anyio.fail_after(30):
            out.wake(path)
            assert await inbox.wait(60.0)  # woken at once: the timer stays armed for 60 s
            start = loop.time()
            assert not await inbox.wait(0.2)  # a shorter limit: the timer is armed again for it
            assert loop.time() - start >= 0.19
            out.wake(path)
            assert await inbox.wait(0.3)  # woken at once: the timer is armed ~0.3 s from now
            await anyio.sleep(0.35)  # it fires with nobody asleep: not armed again
            start = loop.time()
            assert not await inbox.wait(0.5)  # a new timer for this sleep
            assert loop.time() - start >= 0.49
            out.wake(path)
            assert await inbox.wait(0.3)
            start = loop.time()
            assert not await inbox.wait(0.6)  # the old timer fires first and arms itself again
            assert loop.time() - start >= 0.59
    finally:
        inbox.close()
        out.close()


def test_the_shared_memory_layer_knows_no_event_loop() -> None:
    """``_shm`` (the ring, its wake-up sockets) imports no event-loop module: a task's sleep on an
    inbox is the reader layer's (``aiobroadcast._broadcast.wakeup``), given to ``_shm`` from above."""
    import ast
    import pathlib

    loops = {"asyncio", "anyio", "sniffio", "trio", "uvloop"}
    found = {}
    for path in sorted((pathlib.Path(ab.__file__).parent / "_shm").rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.split(".")[0])
        if names & loops:
            found[path.name] = sorted(names & loops)
    assert found == {}
