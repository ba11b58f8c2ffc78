"""Taking ahead (docs/design.md, "Taking ahead"): a shared-memory reader that finds several small
whole messages ready takes them out of the ring at once and hands them out one per get. These
tests attack what must not change: order, each message once, errors in their place, exact
statistics, bounded batches, and several threads sharing one reader."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import anyio
import pytest

import aiobroadcast as ab
from aiobroadcast import blocking
from aiobroadcast._base import tuning as _tuning

pytestmark = pytest.mark.anyio


class Counted:
    """Counts its decodings; the one numbered ``bad`` cannot be decoded."""

    decoded: ClassVar[list[int]] = []
    bad: ClassVar[int] = -1

    def __init__(self, n: int) -> None:
        self.n = n

    def __setstate__(self, state: dict[str, Any]) -> None:
        Counted.decoded.append(state["n"])
        if state["n"] == Counted.bad:
            raise ValueError(f"cannot decode {state['n']}")
        self.n = state["n"]


@contextlib.contextmanager
def undecodable(n: int) -> Iterator[None]:
    """``Counted(n)`` cannot be decoded inside the block; the decodings are counted afresh."""
    Counted.decoded, Counted.bad = [], n
    try:
        yield
    finally:
        Counted.bad = -1


async def test_mixed_sizes_come_in_order_with_exact_statistics(anyio_backend: Any) -> None:
    """Small messages, a message larger than a slot and one-slot messages larger than the batch's
    byte budget, in one ring: each get returns the next one, and the reader's statistics count
    exactly what was handed out, whatever was taken out of the ring ahead."""
    sent: list[Any] = []
    one = _tuning.AHEAD_BYTES * 2 // 5  # a one-slot message: three of them cross AHEAD_BYTES
    async with ab.open_writer(capacity=64, slot_bytes=one + 1024) as writer:
        async with ab.open_reader(writer.handle) as reader:
            for i in range(50):
                if i == 10:
                    sent.append(b"L" * (one * 5 // 2))  # three slots
                elif 20 <= i < 24:
                    sent.append(b"M" * one)  # one slot each, together above AHEAD_BYTES
                else:
                    sent.append(i)
                await writer.put(sent[-1])
            head = writer.statistics().head
            assert head == 52  # the large message takes three slots
            for k, expected in enumerate(sent):
                stats = reader.statistics()
                assert (stats.received, stats.lag) == (k, head - k - (2 if k > 10 else 0))
                assert await reader.get() == expected
            stats = reader.statistics()
            assert (stats.received, stats.lag) == (50, 0)
            with pytest.raises(ab.WouldBlock):
                reader.get_nowait()


async def test_a_batch_is_bounded_in_messages_and_bytes() -> None:
    """One get takes at most ``AHEAD_MESSAGES`` messages out of the ring, and stops after the
    message that crosses ``AHEAD_BYTES``: the writer's view of the reader shows it."""
    small = _tuning.AHEAD_MESSAGES + 8
    big = b"B" * (_tuning.AHEAD_BYTES // 3 + 1)  # one slot each; the third crosses AHEAD_BYTES
    async with ab.open_writer(capacity=64, slot_bytes=len(big) + 1024) as writer:
        async with ab.open_reader(writer.handle, name="r") as reader:
            for i in range(small):
                await writer.put(i)
            assert await reader.get() == 0
            (info,) = writer.statistics().readers
            assert info.received == _tuning.AHEAD_MESSAGES  # taken out of the ring
            assert info.lag == small - _tuning.AHEAD_MESSAGES
            assert reader.statistics().received == 1  # handed out
            assert [await reader.get() for _ in range(small - 1)] == list(range(1, small))

            for _ in range(6):
                await writer.put(big)
            assert await reader.get() == big
            (info,) = writer.statistics().readers
            assert info.received == small + 3
            assert [await reader.get() for _ in range(5)] == [big] * 5


@pytest.mark.parametrize(("bad", "count"), [(3, 6), (0, 4)], ids=["after-others", "first"])
async def test_an_undecodable_message_is_reported_in_its_place_and_the_rest_follow(bad: int, count: int) -> None:
    """Taken ahead with the messages around it, an undecodable message raises at its own turn,
    not before (the ones ahead of it come first) and not again; it counts as taken, and every
    message is decoded exactly once."""
    with undecodable(bad):
        async with ab.open_writer(capacity=16, slot_bytes=1024) as writer:
            async with ab.open_reader(writer.handle) as reader:
                for i in range(count):
                    await writer.put(Counted(i))
                assert [(await reader.get()).n for _ in range(bad)] == list(range(bad))
                with pytest.raises(ab.DeserializationError) as info:
                    await reader.get()
                assert info.value.msg_index == bad
                assert [(await reader.get()).n for _ in range(bad + 1, count)] == list(range(bad + 1, count))
                assert reader.statistics().received == count  # the undecodable one counts as taken
                assert sorted(Counted.decoded) == list(range(count))  # each decoded once


async def test_threads_and_the_loop_sharing_one_reader_take_each_message_once() -> None:
    """Threads calling ``get_nowait`` while the event loop's task calls ``get``: messages taken
    ahead are handed out without the reader's lock, while another taker may be filling the queue
    under it. The interpreter switches threads as often as it can, to interleave them finely."""
    total = 20_000
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        await _share(total)
    finally:
        sys.setswitchinterval(switch)


async def _share(total: int) -> None:
    async with ab.open_writer(capacity=256, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle) as reader:
            taken: list[list[int]] = [[], [], []]
            stop = threading.Event()
            failures: list[BaseException] = []

            def take(mine: list[int]) -> None:
                try:
                    while not stop.is_set():
                        try:
                            mine.append(reader.get_nowait())
                        except ab.WouldBlock:
                            pass
                except BaseException as exc:  # reported below: a taker must never fail
                    failures.append(exc)
                    raise

            threads = [threading.Thread(target=take, args=(taken[i],)) for i in (1, 2)]
            for t in threads:
                t.start()
            try:
                async with anyio.create_task_group() as tg:

                    async def produce() -> None:
                        for i in range(total):
                            await writer.put(i)

                    tg.start_soon(produce)
                    while sum(map(len, taken)) < total:
                        with anyio.move_on_after(0.01):
                            taken[0].append(await reader.get())
            finally:
                stop.set()
                for t in threads:
                    t.join()
            assert failures == []
            everything = [x for part in taken for x in part]
            assert sorted(everything) == list(range(total))  # none lost, none twice
            for part in taken:
                assert part == sorted(part)  # each taker saw its messages in order


FORK_SCRIPT = """
import json, os, anyio
import aiobroadcast as ab

async def main():
    async with ab.open_writer(capacity=16, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle) as reader:
            for i in range(6):
                await writer.put(i)
            first = await reader.get()
            waiting = reader.statistics().lag  # taken ahead, not handed out yet
            pid = os.fork()
            if pid == 0:  # the child: what the parent took ahead is not its to hand out
                seen = []
                for call in (reader.get_nowait, reader.statistics):
                    try:
                        seen.append(repr(call()))
                    except ab.ClosedResourceError as exc:
                        seen.append(type(exc).__name__)
                print(json.dumps({"child": seen}), flush=True)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            rest = [await reader.get() for _ in range(5)]
            print(json.dumps({"first": first, "waiting": waiting, "rest": rest, "status": status}), flush=True)

anyio.run(main, backend_options={"use_uvloop": True})
"""


def test_a_fork_child_hands_out_nothing_the_parent_took_ahead() -> None:
    """A reader that holds decoded messages taken ahead forks (as a pre-fork server or a
    DataLoader does): the child's use of the inherited reader is refused, and the parent still
    gets every message, once, in order."""
    proc = subprocess.run([sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines[0] == {"child": ["ClosedResourceError", "ClosedResourceError"]}
    assert lines[1] == {"first": 0, "waiting": 5, "rest": [1, 2, 3, 4, 5], "status": 0}


@pytest.mark.parametrize("how", ["lag", "zero_copy"])
async def test_lag_and_zero_copy_readers_take_one_message_at_a_time(how: str) -> None:
    """Under policy "lag" a body is copied out under the seqlock one at a time, and a zero-copy
    message keeps its slot until the next get: neither takes messages ahead."""
    writer_kw: dict[str, Any] = {"policy": "lag"} if how == "lag" else {}
    reader_kw: dict[str, Any] = {"zero_copy": True} if how == "zero_copy" else {}
    async with ab.open_writer(capacity=16, slot_bytes=256, **writer_kw) as writer:
        async with ab.open_reader(writer.handle, **reader_kw) as reader:
            for i in range(6):
                await writer.put(b"%d" % i)
            got = bytes(await reader.get())
            assert got == b"0"
            (info,) = writer.statistics().readers
            assert info.received == 1  # the writer sees the reader's cursor one past the first
            assert [bytes(await reader.get()) for _ in range(5)] == [b"%d" % i for i in range(1, 6)]


async def test_take_ahead_is_an_open_reader_option() -> None:
    """``open_reader(take_ahead=1)`` takes one message out of the ring per get (the writer's view
    of the reader shows it), a larger value bounds a batch, and a value that is not a positive
    integer is refused."""
    async with ab.open_writer(capacity=64, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle, name="one", take_ahead=1) as one:
            async with ab.open_reader(writer.handle, name="four", take_ahead=4) as four:
                for i in range(10):
                    await writer.put(i)
                assert await one.get() == 0
                assert await four.get() == 0
                received = {info.name: info.received for info in writer.statistics().readers}
                assert received == {"one": 1, "four": 4}
                assert [await one.get() for _ in range(9)] == list(range(1, 10))
        for bad in (0, -1, 1.5, True, "2"):
            with pytest.raises(ValueError, match="take_ahead"):
                await ab.open_reader(writer.handle, take_ahead=bad)  # type: ignore[arg-type]


def test_take_ahead_is_a_blocking_open_reader_option() -> None:
    with blocking.open_writer(capacity=64, slot_bytes=256) as writer:
        with blocking.open_reader(writer.handle, name="one", take_ahead=1) as one:
            for i in range(5):
                writer.put(i)
            assert one.get() == 0
            (info,) = writer.statistics().readers
            assert info.received == 1
            assert [one.get() for _ in range(4)] == list(range(1, 5))
        with pytest.raises(ValueError, match="take_ahead"):
            blocking.open_reader(writer.handle, take_ahead=0)
