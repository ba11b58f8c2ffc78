"""A writer's waits are one step generator each (``publish_steps``, ``batch_steps``) that the
async put and the blocking put both drive: cut short midway, by a deadline or a cancellation,
they publish nothing of the message (a stream already under way is dropped whole by readers)
and leave no wait announced in the ring."""

from __future__ import annotations

import threading

import anyio
import pytest

import aiobroadcast as ab
from aiobroadcast import blocking
from aiobroadcast._base.steps import run_blocking
from aiobroadcast._shm.layout import W_WAIT_TARGET

#: Generous bound for "it happens" (never a performance claim): a loaded 2-core CI machine.
WITHIN_S = 15.0

BIG = b"x" * 5000  # larger than the whole ring below (2 slots of 256 bytes): streamed


def test_a_blocking_stream_cut_short_by_its_timeout_is_dropped_whole() -> None:
    with blocking.open_writer(capacity=2, slot_bytes=256) as writer, blocking.open_reader(writer.handle) as reader:
        with pytest.raises(ab.WaitTimeout):
            writer.put(BIG, timeout=0.2)  # the first slots go out, then no room: the time is up
        ch = writer._ch
        assert ch.pub.aborted == 1
        assert ch.seg.words[W_WAIT_TARGET] == 0
        got: list[object] = []
        taker = threading.Thread(target=lambda: got.append(reader.get(timeout=WITHIN_S)), daemon=True)
        taker.start()
        writer.put("after", timeout=WITHIN_S)  # the reader drops the cut-short stream, making room
        taker.join(WITHIN_S)
        assert got == ["after"]
        assert writer.statistics().sent == 1


@pytest.mark.anyio
async def test_an_async_stream_cancelled_midway_is_dropped_whole() -> None:
    async with ab.open_writer(capacity=2, slot_bytes=256) as writer, ab.open_reader(writer.handle) as reader:
        with anyio.move_on_after(0.2) as scope:
            await writer.put(BIG)
        assert scope.cancelled_caught
        ch = writer._ch
        assert ch.pub.aborted == 1
        assert ch.seg.words[W_WAIT_TARGET] == 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(writer.put, "after")
            with anyio.fail_after(WITHIN_S):
                assert await reader.get() == "after"
        assert writer.statistics().sent == 1


def test_publish_steps_closed_while_waiting_publish_nothing_and_clear_the_wait() -> None:
    with blocking.open_writer(capacity=2, slot_bytes=256) as writer, blocking.open_reader(writer.handle):
        writer.put(0)
        writer.put(1)  # full: the next put waits
        ch = writer._ch
        announced: list[int] = []

        def sleep(limit_s: float) -> bool:
            announced.append(ch.seg.words[W_WAIT_TARGET])
            raise ab.WaitTimeout("stop here")

        with pytest.raises(ab.WaitTimeout):
            run_blocking(ch.publishing.publish_steps((b"2",), 1, False, 1), sleep)
        assert announced and announced[0] != 0  # it waited, announced
        assert ch.seg.words[W_WAIT_TARGET] == 0  # and the close cleared it
        with pytest.raises(ab.WaitTimeout):
            run_blocking(ch.publishing.batch_steps([((b"2",), 1, False, 1)], 1), sleep)
        assert ch.seg.words[W_WAIT_TARGET] == 0
        assert writer.statistics().sent == 2
