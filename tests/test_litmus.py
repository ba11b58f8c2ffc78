"""Litmus tests of the ring's atomics (aiobroadcast/_shm/atomic.py), hammered by two real
processes on one shared-memory file: the orderings docs/design.md ("Memory ordering") relies on,
each in the shape the ring uses it (tests/_litmus.py has the programs).

On x86-64 only store buffering is a reordering the hardware really does, and only the fence
forbids it; on aarch64 message passing and torn reads are real too. Each program also runs in
the wrong order (or with ``struct.pack_into``), where the forbidden outcome happens: the checks
see it when it is there. Bounded: a few seconds each at most, most of it spawning.
"""

from __future__ import annotations

import mmap
import os
import platform
import uuid
from collections.abc import Iterator

import _litmus
import pytest

from aiobroadcast._base.errors import BroadcastError
from aiobroadcast._shm import layout
from aiobroadcast._shm.atomic import Words, fence, fence_acquire, fence_release


@pytest.fixture
def path() -> Iterator[str]:
    yield f"/dev/shm/litmus-{uuid.uuid4().hex}"  # not a channel's name: no test counts it as left over


def test_message_passing_never_shows_a_body_older_than_its_commit(path: str) -> None:
    out = _litmus.run("mp", path, rounds=_litmus.MP_ROUNDS_MAX)
    assert out.forbidden == 0, out
    assert out.interleaved > 0, f"the reader never read while the writer wrote: {out}"


def _seen_when_wrong(program: str, path: str, rounds: int, order: str) -> None:
    """The wrong order shows the forbidden outcome, in one of a few runs (on a busy machine the
    two processes may not overlap in one)."""
    outs = []
    for _ in range(4):
        outs.append(_litmus.run(program, path, rounds=rounds, order=order))
        if outs[-1].forbidden > 0:
            return
    raise AssertionError(f"the forbidden outcome never showed: {outs}")


def test_the_message_passing_check_sees_a_commit_stored_before_its_body(path: str) -> None:
    _seen_when_wrong("mp", path, 20_000, "broken")


def test_store_buffering_with_the_fence_never_misses_both_stores(path: str) -> None:
    out = _litmus.run("sb", path, rounds=100_000)
    assert out.forbidden == 0, out
    assert out.rounds > 1000, out


def test_the_store_buffering_check_sees_both_loads_miss_when_they_come_first(path: str) -> None:
    _seen_when_wrong("sb", path, 20_000, "broken")


def test_a_word_is_stored_and_loaded_whole(path: str) -> None:
    out = _litmus.run("tear", path, rounds=1_000_000)
    assert out.forbidden == 0, out
    assert out.rounds > 1000, out


def test_struct_pack_into_tears_a_word(path: str) -> None:
    """Why the shared words do not go through ``struct``: it stores a ``<Q`` byte by byte."""
    _seen_when_wrong("tear", path, 1_000_000, "struct")


# --- Words itself -----------------------------------------------------------------------------
def test_words_index_a_strided_view_and_refuse_what_is_out_of_range() -> None:
    m = mmap.mmap(-1, 4096)
    buf = memoryview(m)
    plain = buf.cast("Q")
    w = Words(buf)
    strided = Words(buf, 3, 16, 4)  # words 3, 19, 35, 51
    assert len(w) == 512 and len(strided) == 4
    strided[2] = 2**64 - 1
    w[51] = 7
    fence()
    fence_acquire()
    fence_release()
    assert plain[35] == 2**64 - 1 and strided.tolist() == [0, 0, 2**64 - 1, 7] and strided[-1] == 7
    assert strided.any() and not Words(buf, 4, 16, 4).any()
    with pytest.raises(IndexError):
        strided[4]
    with pytest.raises(OverflowError):
        w[0] = -1
    with pytest.raises(OverflowError):
        w[0] = 2**64
    with pytest.raises(ValueError):
        Words(buf, 500, 16, 2)  # the second item is past the end
    with pytest.raises(ValueError):
        Words(buf[1:])  # not 8-byte aligned
    # A Words holds the mapping until it is released; then it refuses every access.
    with pytest.raises(BufferError):
        m.close()
    for v in (w, strided):
        v.release()
    plain.release()
    buf.release()
    m.close()
    assert w.released
    with pytest.raises(ValueError):
        w[0]
    with pytest.raises(ValueError):
        w[0] = 1
    with pytest.raises(ValueError):
        w.tolist()


def test_words_of_a_read_only_mapping_load_and_refuse_stores() -> None:
    fd = os.memfd_create("litmus")
    try:
        os.ftruncate(fd, 4096)
        m = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    w = Words(m)
    assert w[0] == 0
    with pytest.raises(TypeError):
        w[0] = 1
    w.release()
    m.close()


@pytest.mark.parametrize("machine", ["x86_64", "aarch64", "riscv64", "ppc64le"])
def test_check_platform_accepts_the_machines_the_ordering_argument_covers(
    machine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(platform, "machine", lambda: machine)
    if machine in ("x86_64", "aarch64"):
        layout.check_platform()
    else:
        with pytest.raises(BroadcastError, match=machine):
            layout.check_platform()
