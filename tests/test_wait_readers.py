"""``Writer.wait_readers`` and ``BlockingWriter.wait_readers``: wait until readers are attached,
by count or by names, local and remote alike; a timeout names who is missing; a cancelled or
interrupted wait changes nothing; a dead reader does not count."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import anyio
import pytest
from _interrupts import in_functions, interrupt_at_line
from test_reader_names import Holder

import aiobroadcast as ab
from aiobroadcast import blocking

ASYNCIO = pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio")
LOOPBACK = "tcp://127.0.0.1:0"


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for h in made:
        h.stop()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [ASYNCIO, pytest.param(("trio", {}), id="trio")])
async def test_waits_for_a_count_of_local_and_remote_readers(holders: list[Holder]) -> None:
    async with ab.open_writer(capacity=8, slot_bytes=256, tcp=LOOPBACK) as writer:
        got: list[tuple[ab.ReaderInfo, ...]] = []

        async def wait() -> None:
            got.append(await writer.wait_readers(2, timeout=60))

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await anyio.sleep(0.2)
            assert not got  # nobody yet: the TCP server's own place does not count
            holders.append(Holder(writer.handle, "local-1", "shm"))
            await anyio.to_thread.run_sync(holders[-1].ready)
            await anyio.sleep(0.2)
            assert not got  # one of two
            holders.append(Holder(writer.handle, "remote-1", "tcp"))
            await anyio.to_thread.run_sync(holders[-1].ready)
        (readers,) = got
        assert sorted((r.name, r.transport) for r in readers) == [("local-1", "shm"), ("remote-1", "tcp")]
        assert sorted(r.pid for r in readers) == sorted(h.pid for h in holders)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [ASYNCIO])
async def test_a_timeout_names_the_readers_missing() -> None:
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle, name="here"):
            assert [r.name for r in await writer.wait_readers(names=["here"], timeout=5)] == ["here"]
            with pytest.raises(ab.WaitTimeout, match=r"not attached: 'late', 'later' \(attached: here \(shm\)\)"):
                await writer.wait_readers(names=["here", "late", "later"], timeout=0.3)
            with pytest.raises(TimeoutError, match=r"1 of 3 readers attached"):
                await writer.wait_readers(3, timeout=0.2)
            with pytest.raises(ab.WaitTimeout, match=r"not attached: 'late'; 1 of 2 readers attached"):
                await writer.wait_readers(2, names=["late"], timeout=0)
            for bad in ({}, {"count": -1}, {"names": "here"}, {"count": 1, "timeout": -1.0}):
                with pytest.raises(ab.InvalidArgument):
                    await writer.wait_readers(**bad)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [ASYNCIO, pytest.param(("trio", {}), id="trio")])
async def test_a_cancelled_wait_changes_nothing() -> None:
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        with anyio.move_on_after(0.2) as scope:
            await writer.wait_readers(1)
        assert scope.cancelled_caught
        async with ab.open_reader(writer.handle, name="after") as reader:
            assert [r.name for r in await writer.wait_readers(1, timeout=5)] == ["after"]
            await writer.put("x")
            with anyio.fail_after(5):
                assert await reader.get() == "x"


def test_a_dead_reader_does_not_count(holders: list[Holder]) -> None:
    with blocking.open_writer(capacity=4, slot_bytes=256) as writer:
        h = Holder(writer.handle, "doomed")
        holders.append(h)
        h.ready()
        assert [r.name for r in writer.wait_readers(names=["doomed"], timeout=10)] == ["doomed"]
        os.kill(h.pid, signal.SIGKILL)
        h.proc.wait(10)
        assert [r.name for r in writer.statistics().readers] == ["doomed"]  # not dropped yet
        with pytest.raises(ab.WaitTimeout, match="not attached: 'doomed'"):
            writer.wait_readers(names=["doomed"], timeout=0.3)


def test_blocking_wait_by_names_from_another_thread_and_close_ends_it() -> None:
    with blocking.open_writer(capacity=4, slot_bytes=256) as writer:
        found: list[object] = []
        t = threading.Thread(target=lambda: found.append(writer.wait_readers(names=["a", "b"], timeout=30)))
        t.start()
        with blocking.open_reader(writer.handle, name="a"):
            time.sleep(0.2)
            assert not found
            with blocking.open_reader(writer.handle, name="b"):
                t.join(10)
                assert not t.is_alive()
                (readers,) = found
                assert sorted(r.name for r in readers) == ["a", "b"]  # type: ignore[attr-defined]
        errors: list[BaseException] = []

        def wait() -> None:
            try:
                writer.wait_readers(1)
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.2)
        writer.close()
        t.join(10)
        assert not t.is_alive()
        assert [type(e) for e in errors] == [ab.ClosedResourceError]


def test_a_ctrl_c_anywhere_in_a_blocking_wait_leaves_the_writer_usable() -> None:
    import aiobroadcast._broadcast.channel_server as channel_server

    # Every line of the wait's own code. Not the lines of ``attached``, a snapshot under the
    # writer's close lock as ``statistics()`` takes it (``with``): a real signal is handled after a
    # call returns or at a loop's jump back, and none comes between the lock's acquire and the
    # block, nor between the block and the release; a line-by-line interrupt there, which no
    # signal can make, would leave it held.
    where = in_functions(
        ["aiobroadcast.blocking", channel_server.__name__], ["wait_readers", "wait_readers_steps", "_sleep"]
    )
    with blocking.open_writer(capacity=4, slot_bytes=256) as writer:
        with blocking.open_reader(writer.handle, name="r") as reader:

            def wait() -> None:
                try:
                    writer.wait_readers(2, timeout=0.12)
                except ab.WaitTimeout:
                    pass  # not interrupted: every line was reached

            n = 1
            while interrupt_at_line(n, wait, where):
                writer.put(n)  # the writer is usable: nothing is held
                assert reader.get(timeout=5) == n
                assert [r.name for r in writer.wait_readers(1, timeout=5)] == ["r"]
                n += 1
            assert n > 10  # every line of the wait was interrupted once


def test_a_real_sigint_ends_a_blocking_wait() -> None:
    with blocking.open_writer(capacity=4, slot_bytes=256) as writer:
        timer = threading.Timer(0.3, lambda: signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            writer.wait_readers(1, timeout=30)  # a WaitTimeout if the Ctrl-C did not end it
        timer.join()
        with blocking.open_reader(writer.handle, name="then") as reader:
            assert [r.name for r in writer.wait_readers(1, timeout=5)] == ["then"]
            writer.put("ok")
            assert reader.get(timeout=5) == "ok"
