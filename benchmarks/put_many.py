"""Writer CPU per message: ``put``, ``put_nowait`` and ``put_many`` (batches of 8 to 64).

    python benchmarks/put_many.py [--size 64] [--count 200000]

One process, one writer and one reader that drains between batches (its cost is not counted):
what each call costs the writer per message, without the other processes of the benchmark.
Prints one JSON object: ns per message (best of 5 rounds) for each way of publishing.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvloop

import aiobroadcast as ab


async def main(size: int, count: int) -> dict[str, float]:
    payload = b"x" * size
    async with ab.open_writer(capacity=256, slot_bytes=size + 4096) as writer:
        async with ab.open_reader(writer.handle) as reader:

            def drain() -> None:
                while True:
                    try:
                        reader.get_nowait()
                    except ab.WouldBlock:
                        return

            async def put(n: int) -> None:
                for i in range(n):
                    await writer.put((i, payload))

            async def put_nowait(n: int) -> None:
                for i in range(n):
                    writer.put_nowait((i, payload))

            def batches(k: int) -> Callable[[int], Awaitable[None]]:
                async def run(n: int) -> None:
                    for _ in range(n // k):
                        await writer.put_many([(i, payload) for i in range(k)])

                return run

            ways: dict[str, Callable[[int], Awaitable[None]]] = {
                "put": put,
                "put_nowait": put_nowait,
                "put_many_8": batches(8),
                "put_many_16": batches(16),
                "put_many_32": batches(32),
                "put_many_64": batches(64),
            }
            best = {name: float("inf") for name in ways}
            for _ in range(5):
                for name, way in ways.items():
                    spent = 0
                    for _ in range(count // 128):
                        t0 = time.perf_counter_ns()
                        await way(128)
                        spent += time.perf_counter_ns() - t0
                        drain()
                    best[name] = min(best[name], spent / (count // 128 * 128))
            return {name: round(ns) for name, ns in best.items()}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--count", type=int, default=200_000)
    args = p.parse_args()
    out: Any = uvloop.run(main(args.size, args.count))
    print(json.dumps({"size": args.size, "ns_per_message": out}))
