"""The floor under a small message's cost in Python on this host, beside aiobroadcast's own.

    python benchmarks/put_floor.py [--count N] [--repeat K] [--size BYTES]

One process, no readers waiting, the benchmark's message ``(perf_counter_ns(), b"x" * SIZE)``.

The floor is the least a Python writer can do to publish a message into a shared ring: pickle it
(``pickle.dumps``), copy it into a slot, pack the slot header, store the commit word and the head.
No checks of any kind (role, thread, fork, closed), no lock, no room check, no wake-up check, no
recovery from an interrupt mid-copy, a fresh pickler per message. Then the same as an ``async def``
awaited per message, which is what ``await writer.put`` adds at the least. The reader's floor is
the mirror: read the commit word and the header, ``pickle.loads`` the slot, store the cursor.

Beside them, in the same process, on a real channel: the writer's calls as
``benchmarks/put_many.py`` measures them (``put``, ``put_nowait``, ``put_many`` in batches of 8,
16, 32 and 64; the best of its 5 rounds), and ``Reader.get_nowait`` (a ring of 256 slots refilled between
rounds; only the reads are timed).

Prints a table and one JSON object (medians of K runs, microseconds per message). The difference
between a floor and our figure is what the guarantees and the layers cost per message; a peer
written in C or Rust pays neither.
"""

from __future__ import annotations

import argparse
import json
import mmap
import pickle
import statistics
import struct
import time

import anyio
from put_many import main as writer_costs  # benchmarks/put_many.py, beside this script

import aiobroadcast as ab

REST = struct.Struct("<QIIQ")
CAPACITY = 256
SLOT = 4160
BASE = 4096


def floor_writer(count: int, payload: bytes) -> float:
    buf = mmap.mmap(-1, BASE + CAPACITY * SLOT)
    words = memoryview(buf).cast("Q")
    dumps = pickle.dumps
    now = time.perf_counter_ns
    start = time.perf_counter()
    for seq in range(count):
        body = dumps((now(), payload), 5)
        n = len(body)
        off = BASE + (seq % CAPACITY) * SLOT
        buf[off + 32 : off + 32 + n] = body
        REST.pack_into(buf, off + 8, seq, n, 3, n)
        words[off >> 3] = seq
        words[1] = seq + 1
    elapsed = time.perf_counter() - start
    words.release()
    buf.close()
    return elapsed / count * 1e6


class _FloorWriter:
    def __init__(self) -> None:
        self.buf = mmap.mmap(-1, BASE + CAPACITY * SLOT)
        self.words = memoryview(self.buf).cast("Q")
        self.seq = 0

    async def put(self, obj: object) -> None:
        body = pickle.dumps(obj, 5)
        n = len(body)
        seq = self.seq
        off = BASE + (seq % CAPACITY) * SLOT
        self.buf[off + 32 : off + 32 + n] = body
        REST.pack_into(self.buf, off + 8, seq, n, 3, n)
        self.words[off >> 3] = seq
        self.seq = seq = seq + 1
        self.words[1] = seq

    def close(self) -> None:
        self.words.release()
        self.buf.close()


async def floor_writer_async(count: int, payload: bytes) -> float:
    fw = _FloorWriter()
    put = fw.put
    now = time.perf_counter_ns
    start = time.perf_counter()
    for _ in range(count):
        await put((now(), payload))
    elapsed = time.perf_counter() - start
    fw.close()
    return elapsed / count * 1e6


def floor_reader(count: int, payload: bytes) -> float:
    buf = mmap.mmap(-1, BASE + CAPACITY * SLOT)
    words = memoryview(buf).cast("Q")
    view = memoryview(buf)
    body = pickle.dumps((time.perf_counter_ns(), payload), 5)
    n = len(body)
    for i in range(CAPACITY):
        off = BASE + i * SLOT
        buf[off + 32 : off + 32 + n] = body
        REST.pack_into(buf, off + 8, i, n, 3, n)
        words[off >> 3] = i
    loads = pickle.loads
    start = time.perf_counter()
    for seq in range(count):
        off = BASE + (seq % CAPACITY) * SLOT
        if words[off >> 3] != seq % CAPACITY:
            raise AssertionError("the floor reader lost its place")
        _msg, flen, _flags, _total = REST.unpack_from(buf, off + 8)
        loads(view[off + 32 : off + 32 + flen])
        words[2] = seq + 1
    elapsed = time.perf_counter() - start
    view.release()
    words.release()
    buf.close()
    return elapsed / count * 1e6


async def reader_cost(count: int, payload: bytes) -> float:
    """``Reader.get_nowait`` per message, on a real channel refilled by ``put_many``."""
    now = time.perf_counter_ns
    async with ab.open_writer(capacity=CAPACITY, slot_bytes=SLOT) as writer:
        async with ab.open_reader(writer.handle) as reader:
            get_nowait = reader.get_nowait
            timed = 0.0
            taken = 0
            while taken < count:
                await writer.put_many([(now(), payload) for _ in range(200)])
                start = time.perf_counter()
                for _ in range(200):
                    get_nowait()
                timed += time.perf_counter() - start
                taken += 200
    return timed / taken * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--count", type=int, default=200_000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--size", type=int, default=64)
    args = p.parse_args()
    if args.count < 200:
        p.error("--count must be at least 200 (the reader's rounds take 200 messages)")
    if not 0 <= args.size <= SLOT - 128:
        p.error(f"--size must be 0..{SLOT - 128}: every message fits in one {SLOT}-byte slot here")
    payload = b"x" * args.size
    runs: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        runs.setdefault(name, []).append(value)

    async def one_round() -> None:
        add("floor writer", floor_writer(args.count, payload))
        add("floor writer, async def", await floor_writer_async(args.count, payload))
        add("floor reader", floor_reader(args.count, payload))
        for name, ns in (await writer_costs(args.size, args.count)).items():
            add(name, ns / 1000)
        add("get_nowait", await reader_cost(args.count, payload))

    for _ in range(args.repeat):  # interleaved: each round measures every row once
        anyio.run(one_round, backend_options={"use_uvloop": True})
    medians = {name: round(statistics.median(values), 3) for name, values in runs.items()}
    for name, values in runs.items():
        print(f"{name:26} median {statistics.median(values):6.2f} us   range {min(values):.2f}-{max(values):.2f}")
    print(json.dumps({"size": args.size, "count": args.count, "repeat": args.repeat, "us_per_msg": medians}))


if __name__ == "__main__":
    main()
