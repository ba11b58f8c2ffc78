"""A worker pool: one parent broadcasts configuration and jobs to N worker processes.

Each worker process runs its own event loop with several tasks that ``await`` the same reader:
every worker receives every message, and within a worker each message goes to exactly one task.
Workers report results back on a channel of their own (one writer each, the parent reads them
all). Kill a worker (``kill -9 PID``) and the others and the parent go on: the parent's writer
drops the dead reader within about a second, and the parent's reader of that worker's results
gets ``WriterGone``.

    python examples/worker_pool.py --workers 3 --tasks 4 --jobs 500 --rate 100
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread

import aiobroadcast as ab


# --- the worker process ---------------------------------------------------------------------
def worker_main(work_handle: str, index: int, tasks: int, conn: Connection) -> None:
    anyio.run(worker, work_handle, index, tasks, conn, backend_options={"use_uvloop": True})


async def worker(work_handle: str, index: int, tasks: int, conn: Connection) -> None:
    name = f"worker-{index}"
    config: dict[str, Any] = {}
    async with ab.open_writer(capacity=256, slot_bytes=1024, max_readers=1, codec="json") as results:
        async with ab.open_reader(work_handle, name=name) as work:
            conn.send((os.getpid(), results.handle.to_json()))  # attached: the parent may start
            conn.close()

            async def task(t: int) -> None:
                async for msg in work:  # ends when the parent closes the channel
                    # Each message goes to one task; there is no await between taking a config
                    # message and applying it, so the next job (in any task) sees the new config.
                    if msg["kind"] == "config":
                        config.update(msg["config"])
                        continue
                    await anyio.sleep(config["cost"])  # the job's I/O
                    result = msg["x"] * config["scale"]
                    await results.put({"job": msg["job"], "task": t, "result": result})

            async with anyio.create_task_group() as tg:
                for t in range(tasks):
                    tg.start_soon(task, t)
    # Leaving: the results channel closes, and the parent's reader of it ends cleanly.


# --- the parent -----------------------------------------------------------------------------
@dataclass
class Tally:
    pid: int = 0
    jobs: Counter[int] = field(default_factory=Counter)
    tasks: Counter[int] = field(default_factory=Counter)
    wrong: int = 0
    died: bool = False


async def collect(
    index: int, handle: str, tally: Tally, scale: int, *, task_status: anyio.abc.TaskStatus[None]
) -> None:
    """Read one worker's results until it closes its channel, or dies."""
    async with ab.open_reader(handle, name="parent") as results:
        task_status.started()  # attached: a reader gets what is published from now on
        while True:
            try:
                r = await results.get()
            except ab.EndOfStream:
                return
            except ab.WriterGone:
                tally.died = True
                done = sum(tally.jobs.values())
                print(f"worker-{index} (pid {tally.pid}) died after {done} results; the others go on", flush=True)
                return
            tally.jobs[r["job"]] += 1
            tally.tasks[r["task"]] += 1
            tally.wrong += r["result"] != r["job"] * scale


async def parent(args: argparse.Namespace) -> int:
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    handles: list[str] = []
    tallies = [Tally() for _ in range(args.workers)]
    try:
        async with ab.open_writer(capacity=64, slot_bytes=1024, max_readers=args.workers) as work:
            for i in range(args.workers):
                here, there = ctx.Pipe()
                p = ctx.Process(target=worker_main, args=(work.handle.to_json(), i, args.tasks, there))
                p.start()
                there.close()
                procs.append(p)
                pid, results_handle = await anyio.to_thread.run_sync(here.recv)
                here.close()
                tallies[i].pid = pid
                handles.append(results_handle)
                print(f"worker-{i} pid {pid} ready ({args.tasks} tasks)", flush=True)
            async with anyio.create_task_group() as tg:
                for i, h in enumerate(handles):
                    await tg.start(collect, i, h, tallies[i], args.scale)
                await work.put({"kind": "config", "config": {"scale": args.scale, "cost": args.cost}})
                for job in range(args.jobs):
                    await work.put({"kind": "job", "job": job, "x": job})
                    if (job + 1) % 50 == 0:
                        print(f"published {job + 1} jobs", flush=True)
                    if args.rate:
                        await anyio.sleep(1 / args.rate)
                await work.aclose()  # workers finish what was published, then stop
                # The collectors end when every worker has closed its results channel (or died).
    finally:
        for p in procs:
            await anyio.to_thread.run_sync(p.join, 10)
            if p.is_alive():
                p.kill()
                p.join()
    # A killed worker could not remove its results channel: remove what dead writers left.
    dead = [ab.Handle.parse(handles[i]) for i, t in enumerate(tallies) if t.died]
    for _ in range(25):  # sweep_stale leaves files younger than 2 s alone: try for up to 5 s
        if not sweep(dead):
            break
        await anyio.sleep(0.2)
    return report(args, tallies)


def sweep(dead: list[ab.Handle]) -> bool:
    """Remove the channels of dead writers; True while some are still there."""
    for h in dead:
        ab.sweep_stale(h.directory)
    return any(os.path.exists(h.path) for h in dead)


def report(args: argparse.Namespace, tallies: list[Tally]) -> int:
    ok = True
    for i, t in enumerate(tallies):
        done = sum(t.jobs.values())
        per_task = ", ".join(f"task {k}: {v}" for k, v in sorted(t.tasks.items()))
        if t.died:
            print(f"worker-{i}: DIED after {done} results")
            continue
        exact = len(t.jobs) == args.jobs and all(n == 1 for n in t.jobs.values()) and not t.wrong
        ok = ok and exact
        missing = sorted(set(range(args.jobs)) - set(t.jobs))
        twice = sorted(j for j, n in t.jobs.items() if n > 1)
        verdict = (
            "every job exactly once, all correct"
            if exact
            else f"WRONG: missing {missing[:10]}, twice {twice[:10]}, {t.wrong} wrong results"
        )
        print(f"worker-{i}: {done} results for {args.jobs} jobs: {verdict} ({per_task})")
    alive = sum(not t.died for t in tallies)
    print(f"{'done' if ok else 'FAILED'}: {alive} of {args.workers} workers completed {args.jobs} jobs", flush=True)
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description="Broadcast jobs to a pool of async worker processes.")
    parser.add_argument("--workers", type=int, default=3, help="worker processes")
    parser.add_argument("--tasks", type=int, default=4, help="tasks per worker sharing its reader")
    parser.add_argument("--jobs", type=int, default=200, help="jobs to broadcast")
    parser.add_argument("--rate", type=float, default=0.0, help="jobs per second (0: as fast as workers go)")
    parser.add_argument("--cost", type=float, default=0.002, help="seconds of simulated I/O per job")
    parser.add_argument("--scale", type=int, default=3, help="a configuration value the workers apply")
    args = parser.parse_args()
    sys.exit(anyio.run(parent, args, backend_options={"use_uvloop": True}))


if __name__ == "__main__":
    main()
