"""The arena (docs/design.md, "The arena: zero-copy views with a lifetime"): a zero_copy
reader's views of large buffers stay valid while referenced, whatever the writer publishes
after; freeing them frees the space; a killed reader's pins are dropped; a fork child's
inherited views free nothing of its parent's; a full arena falls back to the ring."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

from aiobroadcast import InvalidArgument, MessageTooLarge, WouldBlock, WriterStatistics, blocking
from aiobroadcast.vllm import MessageQueue

torch: Any
try:
    import torch as _torch

    torch = _torch
except ImportError:  # the arm64 CI root has no torch: the messages carry a numpy array in its place
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed (pip install -e '.[vllm]')")

MIB = 1 << 20


def pinned(stats: WriterStatistics, name: str) -> int:
    return next(r.pinned_bytes for r in stats.readers if r.name == name)


def same(x: Any, y: Any) -> bool:
    return bool(torch.equal(x, y)) if torch is not None else np.array_equal(x, y)


def message(i: int) -> dict[str, Any]:
    """A message with a torch tensor, a numpy array and a large bytes (all out of band)."""
    return {
        "i": i,
        "t": (  # 1 MiB
            torch.full((MIB // 4,), float(i), dtype=torch.float32)
            if torch is not None
            else np.full(MIB // 4, float(i), dtype=np.float32)
        ),
        "a": np.full(MIB // 8, i, dtype=np.int64),  # 1 MiB
        "b": bytes([i % 251]) * (512 * 1024),
    }


def test_a_kept_view_stays_what_was_sent_across_1000_messages_and_frees_its_space_when_dropped() -> None:
    with blocking.open_writer(capacity=8, slot_bytes=4096, arena_bytes=8 * MIB) as writer:
        with (
            blocking.open_reader(writer.handle, name="views", zero_copy=True) as views,
            blocking.open_reader(writer.handle, name="copies") as copies,
        ):
            writer.put(message(7))
            kept = views.get(timeout=5)
            copied = copies.get(timeout=5)
            t, a, b = kept["t"], kept["a"][10:20], kept["b"]  # views of views keep it too
            del kept
            assert type(b) is memoryview and b.readonly and not a.flags.writeable
            assert type(copied["b"]) is bytes and copied["a"].flags.writeable  # a copying reader: as before
            sent = message(7)
            stats = writer.statistics()
            assert pinned(stats, "views") >= 2.5 * MIB and pinned(stats, "copies") == 0
            for i in range(1000):  # 2.5 MiB each through an 8 MiB arena: its space is reused over and over
                writer.put(message(i))
                got = views.get(timeout=5)
                assert got["i"] == i and float(got["t"][-1]) == float(i)
                copies.get(timeout=5)
            assert same(t, sent["t"]) and np.array_equal(a, sent["a"][10:20]) and b == sent["b"]
            stats = writer.statistics()
            assert stats.arena_placed == 1001 and stats.arena_fallbacks == 0
            del t, a, b, got
            gc.collect()
            stats = writer.statistics()
            assert pinned(stats, "views") == 0
            assert stats.arena_used_bytes == 0  # every reader passed every message, no view is alive
            assert stats.readers[0].lag == 0  # an arena message's ring slot is not held: its views are not of it


def test_a_full_arena_falls_back_to_the_ring_without_waiting_or_losing_anything() -> None:
    # A ring that holds a message whole: the reader reads after the put, in this thread.
    with blocking.open_writer(capacity=4, slot_bytes=4 * MIB, arena_bytes=3 * MIB) as writer:
        with blocking.open_reader(writer.handle, name="views", zero_copy=True) as reader:
            held = []
            for i in range(3):  # the first takes 2.5 MiB of the 3: the next two do not fit while it is held
                writer.put(message(i), timeout=5)
                held.append(reader.get(timeout=5))
            stats = writer.statistics()
            assert (stats.arena_placed, stats.arena_fallbacks) == (1, 2)
            # One lifetime per reader: views of the arena, copies of what fell back to the ring.
            assert type(held[0]["b"]) is memoryview and type(held[1]["b"]) is bytes
            for i in range(8):  # the ring's slots are all reused meanwhile
                writer.put(i, timeout=5)
                assert reader.get(timeout=5) == i
            for i, got in enumerate(held):
                want = message(i)
                assert same(got["t"], want["t"]) and np.array_equal(got["a"], want["a"])
                assert bytes(got["b"]) == want["b"]
            del held, got
            gc.collect()
            writer.put(message(3), timeout=5)
            reader.get(timeout=5)
            assert writer.statistics().arena_placed == 2  # room again once the views are gone


_HOLDER = """
import sys, time
from aiobroadcast import blocking
with blocking.open_reader(sys.argv[1], name="doomed", zero_copy=True) as r:
    kept = r.get(timeout=10)
    print("holding", flush=True)
    time.sleep(60)
"""


def test_a_reader_killed_while_holding_views_frees_them() -> None:
    with blocking.open_writer(capacity=8, slot_bytes=4096, arena_bytes=4 * MIB) as writer:
        proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, writer.handle.to_json()], stdout=subprocess.PIPE, text=True
        )
        try:
            deadline = time.monotonic() + 20
            while not writer.statistics().readers and time.monotonic() < deadline:
                time.sleep(0.01)
            writer.put(message(1), timeout=5)
            assert proc.stdout is not None and proc.stdout.readline() == "holding\n"
            assert pinned(writer.statistics(), "doomed") >= 2.5 * MIB
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        finally:
            proc.kill()
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
        # The arena is full of the dead reader's pins (and the ring has room): the next put finds
        # no room in the arena, probes the readers' locks (at most once per liveness period),
        # drops the dead one, and places its buffers after all.
        writer.put(message(2), timeout=5)
        stats = writer.statistics()
        assert (stats.arena_placed, stats.arena_fallbacks) == (2, 0)
        assert stats.dropped_readers == 1 and not stats.readers


def test_a_fork_childs_inherited_views_free_nothing_of_its_parents() -> None:
    with blocking.open_writer(capacity=8, slot_bytes=4096, arena_bytes=3 * MIB) as writer:
        with blocking.open_reader(writer.handle, name="parent", zero_copy=True) as reader:
            writer.put({"a": np.arange(MIB // 8, dtype=np.int64)})
            kept = reader.get(timeout=5)["a"]
            before = pinned(writer.statistics(), "parent")
            assert before >= MIB
            pid = os.fork()
            if pid == 0:  # the child: reads its inherited view, drops it, collects, exits
                code = 0 if kept[12345] == 12345 else 1
                del kept
                gc.collect()
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
            assert pinned(writer.statistics(), "parent") == before  # still pinned: the child's free was not ours
            for i in range(20):  # the writer may not reuse the parent's record
                writer.put({"a": np.full(MIB // 8, -i, dtype=np.int64)})
                reader.get(timeout=5)
            assert np.array_equal(kept, np.arange(MIB // 8, dtype=np.int64))
            del kept
            gc.collect()
            assert pinned(writer.statistics(), "parent") == 0


@needs_torch
def test_vllm_with_the_tensor_arena_passes_tensors_that_stay_valid_while_referenced() -> None:
    writer = MessageQueue(1, 1, enable_shm_tensor_arena=True)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        writer.wait_until_ready()
        sent = torch.randn(2 * MIB // 4)
        writer.enqueue(("pixel_values", sent))
        _, kept = reader.dequeue(timeout=5)
        for i in range(200):
            writer.enqueue(("step", torch.full((2 * MIB // 4,), float(i))))
            _, t = reader.dequeue(timeout=5)
            assert float(t[0]) == float(i)
        assert torch.equal(kept, sent)
        kept.add_(1)  # writable, as vLLM's arena tensors are
        assert torch.equal(kept, sent + 1)
        stats = writer._writer.statistics()
        assert stats.arena_placed == 201 and stats.arena_fallbacks == 0
        assert stats.readers[0].pinned_bytes >= 2 * MIB
        del kept, t
        gc.collect()
        assert writer._writer.statistics().readers[0].pinned_bytes == 0
    finally:
        reader.close()
        writer.close()


def test_remote_readers_get_the_arenas_buffers_copied_in() -> None:
    with blocking.open_writer(capacity=8, slot_bytes=4096, arena_bytes=8 * MIB, tcp="tcp://127.0.0.1:0") as writer:
        with blocking.open_reader(writer.handle, transport="tcp", connect_timeout=20) as remote:
            writer.put(message(3), timeout=10)
            got = remote.get(timeout=10)
            want = message(3)
            assert same(got["t"], want["t"]) and np.array_equal(got["a"], want["a"]) and got["b"] == want["b"]
            assert writer.statistics().arena_placed == 1


def test_a_large_bytes_alone_goes_through_the_arena_and_lives_while_referenced() -> None:
    with blocking.open_writer(capacity=4, slot_bytes=4096, arena_bytes=4 * MIB) as writer:
        with blocking.open_reader(writer.handle, name="views", zero_copy=True) as reader:
            writer.put(b"k" * MIB)
            kept = reader.get(timeout=5)
            assert type(kept) is memoryview and kept.readonly
            for i in range(20):
                writer.put(bytes([i]) * MIB)
                assert reader.get(timeout=5)[0] == i
            assert kept == b"k" * MIB
            assert writer.statistics().arena_placed == 21


def test_stats_shows_the_bytes_each_readers_views_pin(tmp_path: Any) -> None:
    with blocking.open_writer(capacity=8, slot_bytes=4096, arena_bytes=4 * MIB) as writer:
        with blocking.open_reader(writer.handle, name="holder", zero_copy=True) as reader:
            writer.put(np.ones(MIB // 8))
            kept = reader.get(timeout=5)
            path = tmp_path / "h.json"
            writer.handle.save(path)
            cmd = [sys.executable, "-m", "aiobroadcast", "stats", str(path), "--once", "--interval", "0"]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
            assert "arena 4,194,304 B, 1,048,576 B held" in out
            assert "its views pin 1,048,576 B of the arena" in out
            del kept


def test_a_message_that_is_not_published_gives_its_record_back() -> None:
    with blocking.open_writer(capacity=2, slot_bytes=4096, arena_bytes=4 * MIB) as writer:
        with blocking.open_reader(writer.handle, name="slow") as reader:
            writer.put("a")
            writer.put("b")  # the ring is full until the reader reads
            with pytest.raises(WouldBlock):
                writer.put_nowait(np.ones(MIB // 8))  # encoded into the arena, then refused
            assert writer.statistics().arena_placed == 1
            assert (reader.get(timeout=5), reader.get(timeout=5)) == ("a", "b")
            assert writer.statistics().arena_used_bytes == 0
            writer.put(np.zeros(MIB // 8))
            assert not reader.get(timeout=5).any()


def test_max_message_bytes_counts_the_whole_message_whether_or_not_the_arena_has_room() -> None:
    with blocking.open_writer(capacity=4, slot_bytes=4 * MIB, arena_bytes=8 * MIB, max_message_bytes=MIB) as writer:
        with blocking.open_reader(writer.handle, name="r", zero_copy=True) as reader:
            with pytest.raises(MessageTooLarge):
                writer.put(np.ones(MIB // 4))  # 2 MiB: the arena has room, the limit says no
            stats = writer.statistics()
            assert (stats.arena_placed, stats.arena_used_bytes, stats.sent) == (0, 0, 0)
            writer.put(np.ones(MIB // 16))  # 512 KiB: in the arena
            assert reader.get(timeout=5).sum() == MIB // 16
            assert writer.statistics().arena_placed == 1


@pytest.mark.parametrize(
    "options",
    [{"policy": "lag"}, {"codec": "json"}, {"arena_bytes": -1}],
    ids=["lag", "json", "negative"],
)
def test_an_arena_needs_policy_block_and_pickle(options: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        blocking.open_writer(**{"arena_bytes": MIB, **options})
