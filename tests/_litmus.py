"""Litmus programs for the ring's atomics (aiobroadcast/_shm/atomic.py), run by two spawned
processes on one shared-memory file, for tests/test_litmus.py (and, under emulation, on arm64).

Each program is the shape of one ordering step of docs/design.md, "Memory ordering", written with
the same calls the ring makes:

- ``mp`` (message passing, steps 1-2): a writer copies a body into shared memory with plain
  bytes (as ``Publisher.publish`` copies a message), then store-releases a flag (the seq word);
  a reader load-acquires the flag, then copies the body. Forbidden: a body older than the flag
  (``thermometer`` below says how that is told apart from a body torn between two newer ones).
- ``tear`` (single-copy atomicity): a writer stores two values that differ in every byte into one
  word, alternately; a reader loads it. Forbidden: any other value (a word read half old, half
  new). ``order="struct"`` stores with ``struct.pack_into("<Q")``, which CPython copies byte by
  byte: the reader then sees torn words, which is why every shared word goes through ``Words``.
- ``sb`` (store buffering, steps 3-4): each side store-releases its own word, ``fence()``, then
  load-acquires the other's (the reader's "announce I sleep, then look at the ring" against the
  writer's "publish, then look at the waiting words"). Forbidden: both loads see 0.

``order="broken"`` runs the same program with its two accesses in the wrong program order (the
flag stored before the body; the load before the store) and a ``sched_yield`` between them, so the
window shows from Python even when a busy machine runs both processes on one CPU: the forbidden
outcome then happens for real, which shows the checks can see it.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import struct
import time
from dataclasses import dataclass

from aiobroadcast._shm.atomic import Words, fence

CTX = multiprocessing.get_context("spawn")
# mp: a body of BODY_BYTES whose bytes all grow with the round (a "thermometer": byte k holds
# round - 255*k, clamped to 0..255, and the bytes add up to the round). A plain copy need not load
# a word whole (an SVE memcpy loads and stores byte elements), so a body read while it is being
# rewritten may mix bytes of two rounds; of two rounds at least the flag's, every byte is at least
# the flag's, and so is the sum. Only a body of an older round adds up to less.
BODY_BYTES = 256
MP_ROUNDS_MAX = 255 * BODY_BYTES
# Word offsets in the file: per-process "ready" words (their own cache lines), then the program's.
READY = (0, 8)
FLAG = 16
BODY = 24
START = BODY + BODY_BYTES // 8  # results; sb: x words from START, y words after them, results after both


def thermometer(i: int) -> bytes:
    full, rest = divmod(i, 255)
    return (b"\xff" * full + bytes([rest])).ljust(BODY_BYTES, b"\0")[:BODY_BYTES]


@dataclass
class Outcome:
    rounds: int  # rounds (sb) or reads (mp, tear) that were checked
    forbidden: int  # rounds (sb) or reads (mp, tear) with the forbidden outcome
    interleaved: int  # sb: rounds where both saw the other's store (the loads overlapped the stores);
    #                   mp: reads that saw a flag value between the first and the last


def _map(path: str, size: int) -> tuple[mmap.mmap, Words, memoryview]:
    fd = os.open(path, os.O_RDWR)
    try:
        m = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    buf = memoryview(m)
    return m, Words(buf), buf


def _unmap(m: mmap.mmap, w: Words, buf: memoryview) -> None:
    w.release()
    buf.release()
    m.close()


def _barrier(w: Words, me: int, value: int) -> None:
    """Store ``value`` in my ready word, then wait until the other side's reaches it."""
    w[READY[me]] = value
    other = READY[1 - me]
    spins = 0
    while w[other] < value:
        spins += 1
        if spins >= 200:  # a shared 2-CPU machine: let the other side run
            spins = 0
            os.sched_yield()


def _size(program: str, rounds: int) -> int:
    return 8 * (START + (4 * rounds if program == "sb" else 3))


# --- message passing ---------------------------------------------------------------------------
def mp_writer(path: str, rounds: int, order: str) -> None:
    assert rounds <= MP_ROUNDS_MAX
    m, w, buf = _map(path, _size("mp", rounds))
    at = BODY * 8
    _barrier(w, 0, 1)
    for i in range(1, rounds + 1):
        body = thermometer(i)
        if order == "broken":
            w[FLAG] = i
            os.sched_yield()  # a window wide enough to be seen, even with both on one CPU
            buf[at : at + BODY_BYTES] = body
        else:
            buf[at : at + BODY_BYTES] = body  # plain bytes, as a message is copied
            w[FLAG] = i  # store-release: the commit
    _unmap(m, w, buf)


def mp_reader(path: str, rounds: int, seconds: float) -> None:
    """Reads until it sees the last flag (or for ``seconds``); writes its counts after the program."""
    m, w, buf = _map(path, _size("mp", rounds))
    at = BODY * 8
    checked = forbidden = between = 0
    _barrier(w, 1, 1)
    deadline = time.monotonic() + seconds  # from the start: spawning may take seconds (emulated)
    while True:
        flag = w[FLAG]  # load-acquire
        body = bytes(buf[at : at + BODY_BYTES])  # plain bytes, as a message is read
        checked += 1
        if 0 < flag < rounds:
            between += 1
        if sum(body) < flag:
            forbidden += 1
        if flag >= rounds or time.monotonic() > deadline:
            break
    w[START], w[START + 1], w[START + 2] = checked, forbidden, between
    _unmap(m, w, buf)


# --- single-copy atomicity -------------------------------------------------------------------
TEAR_VALUES = (0x0101010101010101, 0xFEFEFEFEFEFEFEFE)


def tear_writer(path: str, rounds: int, order: str) -> None:
    m, w, buf = _map(path, _size("tear", rounds))
    word = struct.Struct("<Q")
    at = FLAG
    a, b = TEAR_VALUES
    w[at] = a
    _barrier(w, 0, 1)
    for i in range(rounds):
        v = a if i & 1 else b
        if order == "struct":
            word.pack_into(buf, 8 * at, v)
        else:
            w[at] = v  # one 8-byte store
    w[READY[0]] = 2
    _unmap(m, w, buf)


def tear_reader(path: str, rounds: int, seconds: float) -> None:
    m, w, buf = _map(path, _size("tear", rounds))
    at = FLAG
    a, b = TEAR_VALUES
    checked = torn = 0
    _barrier(w, 1, 1)
    deadline = time.monotonic() + seconds
    while w[READY[0]] < 2 and time.monotonic() < deadline:
        v = w[at]  # one 8-byte load
        checked += 1
        if v != a and v != b:
            torn += 1
    w[START], w[START + 1], w[START + 2] = checked, torn, checked
    _unmap(m, w, buf)


# --- store buffering ---------------------------------------------------------------------------
def sb_side(path: str, me: int, rounds: int, order: str, seconds: float) -> None:
    """Round i: store 1 in my word i, fence, load the other side's word i into my result i."""
    m, w, buf = _map(path, _size("sb", rounds))
    mine = START + me * rounds
    other = START + (1 - me) * rounds
    result = START + 2 * rounds + me * (rounds // 2)
    done = 0
    deadline = 0.0
    for i in range(rounds // 2):
        _barrier(w, me, i + 1)
        if i == 0:
            deadline = time.monotonic() + seconds  # from the start: spawning may take seconds (emulated)
        for _ in range((i * 5 + me * 3) % 7):  # a skew that varies by round: the sides leave the
            pass  # barrier at different moments, so some rounds overlap whatever the load
        if order == "broken":
            seen = w[other + i]
            os.sched_yield()  # a window wide enough to be seen, even with both on one CPU
            w[mine + i] = 1
        else:
            w[mine + i] = 1  # store-release
            fence()
            seen = w[other + i]  # load-acquire
        w[result + i] = seen + 1  # 1: saw 0, 2: saw 1 (0: round not run)
        done = i + 1
        if time.monotonic() > deadline:
            break
    w[READY[me]] = 1 << 62  # never wait for me again
    w[START + 4 * rounds - 1 - me] = done
    _unmap(m, w, buf)


def run(program: str, path: str, rounds: int, order: str = "right", seconds: float = 5.0) -> Outcome:
    """Run ``program`` ("mp", "tear" or "sb") on a new file at ``path`` with two spawned processes."""
    size = _size(program, rounds)
    with open(path, "wb") as fh:
        fh.truncate(size)
    try:
        if program == "tear":
            procs = [
                CTX.Process(target=tear_writer, args=(path, rounds, order)),
                CTX.Process(target=tear_reader, args=(path, rounds, seconds)),
            ]
        elif program == "mp":
            procs = [
                CTX.Process(target=mp_writer, args=(path, rounds, order)),
                CTX.Process(target=mp_reader, args=(path, rounds, seconds)),
            ]
        else:
            procs = [CTX.Process(target=sb_side, args=(path, me, rounds, order, seconds)) for me in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(seconds + 60)
            if p.exitcode != 0:
                for q in procs:
                    q.kill()
                raise AssertionError(f"litmus process {p.name} ended with {p.exitcode}")
        m, w, buf = _map(path, size)
        try:
            if program in ("mp", "tear"):
                return Outcome(w[START], w[START + 1], w[START + 2])
            half = rounds // 2
            done = min(w[START + 4 * rounds - 1], w[START + 4 * rounds - 2])
            r0 = START + 2 * rounds
            seen0 = [w[r0 + i] for i in range(done)]
            seen1 = [w[r0 + half + i] for i in range(done)]
            forbidden = sum(1 for a, b in zip(seen0, seen1, strict=True) if a == 1 and b == 1)
            both = sum(1 for a, b in zip(seen0, seen1, strict=True) if a == 2 and b == 2)
            return Outcome(done, forbidden, both)
        finally:
            _unmap(m, w, buf)
    finally:
        os.unlink(path)
