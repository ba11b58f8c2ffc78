"""The floor under any sleeping reader's wake-up latency on this host, without aiobroadcast.

    python benchmarks/wake_floor.py [--pause S] [--count N] [--readers R] [--loop blocking|uvloop]

R reader processes block on a Unix datagram socket (``recv`` in C, or an event loop's
``add_reader``); a sender sleeps PAUSE seconds, stamps ``perf_counter_ns()`` and sends the stamp
to each reader. Each reader reports now - stamp. Prints one JSON object: the medians per reader.
This is what a kernel wake-up costs here (on a virtual machine, an idle vCPU must be woken by the
hypervisor); a library that sleeps instead of spinning cannot wake faster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from typing import Any


def _reader(path: str, count: int, loop: str, q: Any) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    lat: list[float] = []
    if loop == "blocking":
        q.put("ready")
        for _ in range(count):
            stamp = int(s.recv(64))
            lat.append((time.perf_counter_ns() - stamp) / 1000)
    else:
        import uvloop

        async def main() -> None:
            s.setblocking(False)
            ev_loop = asyncio.get_running_loop()
            q.put("ready")
            for _ in range(count):
                fut = ev_loop.create_future()
                ev_loop.add_reader(s.fileno(), fut.set_result, None)
                await fut
                ev_loop.remove_reader(s.fileno())
                stamp = int(s.recv(64))
                lat.append((time.perf_counter_ns() - stamp) / 1000)

        uvloop.run(main())
    q.put(lat)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--pause", type=float, default=1.0, help="seconds between messages (default 1)")
    p.add_argument("--count", type=int, default=5)
    p.add_argument("--readers", type=int, default=2)
    p.add_argument("--loop", choices=("blocking", "uvloop"), default="blocking")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        paths = [os.path.join(d, f"r{i}.sock") for i in range(args.readers)]
        procs = [ctx.Process(target=_reader, args=(path, args.count, args.loop, q)) for path in paths]
        for proc in procs:
            proc.start()
        for _ in procs:
            assert q.get(timeout=30) == "ready"
        out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        for _ in range(args.count):
            time.sleep(args.pause)
            stamp = str(time.perf_counter_ns()).encode()
            for path in paths:
                out.sendto(stamp, path)
        results = [q.get(timeout=30) for _ in procs]
        for proc in procs:
            proc.join()
        out.close()
    print(json.dumps({
        "pause_s": args.pause, "loop": args.loop, "readers": args.readers, "count": args.count,
        "wake_latency_us_median_per_reader": [round(statistics.median(r), 1) for r in results],
    }))


if __name__ == "__main__":
    main()
