"""A worker pool: the parent calls N worker processes, each call answered by every worker.

``open_caller`` makes the pool (a broadcast channel out, a fan-in back); each worker joins with
``open_worker`` and answers in a loop. Kill a worker (``kill -9 PID``) and the others and the
parent go on: the next call reports it ``NoReply("dead")`` within about a second.

    python examples/worker_pool.py --workers 3 --jobs 500 --rate 100
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
from collections import Counter
from typing import Any

import anyio

import aiobroadcast as ab


def worker_main(handle: str, name: str) -> None:
    anyio.run(worker, handle, name, backend_options={"use_uvloop": True})


async def worker(handle: str, name: str) -> None:
    config: dict[str, Any] = {}
    async with ab.open_worker(handle, name=name) as pool:
        async for request in pool:  # ends when the parent closes the pool
            kind, body = request.value
            if kind == "config":
                config.update(body)
                await request.reply(os.getpid())
            else:
                await anyio.sleep(config["cost"])  # the job's I/O
                await request.reply(body * config["scale"])


async def parent(args: argparse.Namespace) -> int:
    names = [f"worker-{i}" for i in range(args.workers)]
    ctx = mp.get_context("spawn")
    done: Counter[str] = Counter()
    dead: set[str] = set()
    async with ab.open_caller(workers=names) as pool:
        procs = [ctx.Process(target=worker_main, args=(pool.handle.to_json(), n)) for n in names]
        for p in procs:
            p.start()
        for name, hello in (await pool.call(("config", vars(args)), timeout=60)).items():
            print(f"{name} pid {hello.unwrap()} ready", flush=True)
        for job in range(args.jobs):
            for name, answer in (await pool.call(("job", job), timeout=10)).items():
                match answer:
                    case ab.Reply(_, result) if result == job * args.scale:
                        done[name] += 1
                    case ab.NoReply(_, "dead", why) if name not in dead:
                        dead.add(name)
                        print(f"{why} after {done[name]} results; the others go on", flush=True)
                    case ab.NoReply(_, "dead"):
                        pass
                    case _:
                        print(f"job {job}: {name}: {answer}", flush=True)
            if (job + 1) % 50 == 0:
                print(f"published {job + 1} jobs", flush=True)
            if args.rate:
                await anyio.sleep(1 / args.rate)
    for p in procs:
        p.join(10)
    for name in names:
        print(f"{name}: {'DIED after' if name in dead else 'completed'} {done[name]} of {args.jobs} jobs")
    ok = all(done[n] == args.jobs for n in names if n not in dead)
    print(
        f"{'done' if ok else 'FAILED'}: {len(names) - len(dead)} of {args.workers} workers completed {args.jobs} jobs"
    )
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description="Call a pool of async worker processes.")
    parser.add_argument("--workers", type=int, default=3, help="worker processes")
    parser.add_argument("--jobs", type=int, default=200, help="calls to make")
    parser.add_argument("--rate", type=float, default=0.0, help="calls per second (0: as fast as workers go)")
    parser.add_argument("--cost", type=float, default=0.002, help="seconds of simulated I/O per job")
    parser.add_argument("--scale", type=int, default=3, help="a configuration value the workers apply")
    sys.exit(anyio.run(parent, parser.parse_args(), backend_options={"use_uvloop": True}))


if __name__ == "__main__":
    main()
