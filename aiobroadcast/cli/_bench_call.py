"""aiobroadcast's call driver: one caller (this process), N worker processes.

    python -m aiobroadcast.cli._bench_call WORKERS SIZE COUNT [--capacity N] [--slot-bytes N]
        [--loop uvloop|asyncio|trio] [--blocking]

The protocol's mode ``call`` (the peers' PROTOCOL.md): COUNT calls, one every millisecond, each
``(time.perf_counter_ns(), call_id, payload)`` of SIZE bytes broadcast to every worker through
``open_caller``/``open_worker``; each worker answers ``(call_id, rank, 64-byte payload)``, and the
call completes when every worker's answer for that id is in (checked, else ``FAILED``).
``p50_us``/``p99_us`` of (before the call -> last answer taken); ``reader_cpu_s``: CPU seconds
each worker used over the calls (from the first call it answered to the caller's close).
``--blocking``: caller and workers use ``aiobroadcast.blocking``. Prints one JSON object on its
last line.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from typing import Any

import anyio

from ._bench_driver import BLOCKING, _run_loop, peer_parser, report, ring_args, ring_for
from ._bench_figures import STEP_TIMEOUT_S, reap

#: The pause between calls (PROTOCOL.md: as ``lat``).
PACE_S = 0.001
REPLY = b"r" * 64


def _worker_process(handle: str, rank: int, loop: str, done: Any) -> None:
    try:
        cpu = _run_loop(loop, _work_blocking if loop == BLOCKING else _work_async, handle, rank)
    except BaseException as exc:
        done.put((rank, f"worker {rank}: {type(exc).__name__}: {exc}"))
        raise
    done.put((rank, cpu))


# The async and blocking twins here (_work_*, _call_*) are written out line for line, as in
# _bench_driver: their loops are what is measured, and sharing one through a callback would add
# a call per message to one API and not to the other.
async def _work_async(handle: str, rank: int) -> float:
    from .. import open_worker

    cpu0: float | None = None
    async with open_worker(handle, name=f"w{rank}") as worker:
        async for request in worker:
            if cpu0 is None:
                cpu0 = time.process_time()
            await request.reply((request.value[1], rank, REPLY))
    return time.process_time() - (cpu0 or 0.0)


def _work_blocking(handle: str, rank: int) -> float:
    from ..blocking import open_worker

    cpu0: float | None = None
    with open_worker(handle, name=f"w{rank}") as worker:
        for request in worker:
            if cpu0 is None:
                cpu0 = time.process_time()
            request.reply((request.value[1], rank, REPLY))
    return time.process_time() - (cpu0 or 0.0)


class _Workers:
    def __init__(self, handle: str, workers: int, loop: str) -> None:
        ctx = mp.get_context("spawn")
        self.done = ctx.Queue()
        self.procs = [
            ctx.Process(target=_worker_process, args=(handle, r, loop, self.done), daemon=True) for r in range(workers)
        ]
        for p in self.procs:
            p.start()

    def results(self) -> tuple[list[float], list[str]]:
        cpu = [0.0] * len(self.procs)
        errors = []
        for _ in self.procs:
            try:
                rank, res = self.done.get(timeout=STEP_TIMEOUT_S)
            except Exception:
                return cpu, ["a worker reported nothing"]
            if isinstance(res, str):
                errors.append(res)
            else:
                cpu[rank] = round(res, 3)
        return cpu, errors


class _Check:
    def __init__(self, workers: int) -> None:
        self.names = [f"w{r}" for r in range(workers)]
        self.lat_ns: list[int] = []
        self.problem: str | None = None

    def call(self, cid: int, answers: dict[str, Any], t0: int, t1: int) -> None:
        from .. import Reply

        want = {w: Reply(w, (cid, r, REPLY)) for r, w in enumerate(self.names)}
        if answers != want and self.problem is None:
            self.problem = f"call {cid}: {[a for a in answers.values() if a not in want.values()][:2]}"
        self.lat_ns.append(t1 - t0)


async def _call_async(workers: int, size: int, count: int, capacity: int, slot_bytes: int, loop: str) -> Any:
    from .. import open_caller

    check = _Check(workers)
    payload = b"x" * size
    now = time.perf_counter_ns
    async with open_caller(workers=check.names, capacity=capacity, slot_bytes=slot_bytes) as caller:
        run = _Workers(caller.handle.to_json(), workers, loop)
        try:
            await caller.call((now(), 0, b""), timeout=STEP_TIMEOUT_S)  # every worker attached
            call = caller.call
            for cid in range(1, count + 1):
                t0 = now()
                answers = await call((t0, cid, payload), timeout=STEP_TIMEOUT_S)
                check.call(cid, answers, t0, now())
                await anyio.sleep(PACE_S)
            await caller.aclose()
            cpu, errors = run.results()
        finally:
            run_procs = run.procs
            reap(run_procs)
    return check, cpu, errors


def _call_blocking(workers: int, size: int, count: int, capacity: int, slot_bytes: int, loop: str) -> Any:
    from ..blocking import open_caller

    check = _Check(workers)
    payload = b"x" * size
    now = time.perf_counter_ns
    with open_caller(workers=check.names, capacity=capacity, slot_bytes=slot_bytes) as caller:
        run = _Workers(caller.handle.to_json(), workers, loop)
        try:
            caller.call((now(), 0, b""), timeout=STEP_TIMEOUT_S)
            call = caller.call
            for cid in range(1, count + 1):
                t0 = now()
                answers = call((t0, cid, payload), timeout=STEP_TIMEOUT_S)
                check.call(cid, answers, t0, now())
                time.sleep(PACE_S)
            caller.close()
            cpu, errors = run.results()
        finally:
            reap(run.procs)
    return check, cpu, errors


def _pct(sorted_ns: list[int], q: float) -> float:
    return round(sorted_ns[min(len(sorted_ns) - 1, int(q * len(sorted_ns)))] / 1000, 1)


def main(argv: list[str] | None = None) -> int:
    p = peer_parser("aiobroadcast.cli._bench_call", __doc__, "workers")
    p.add_argument("--blocking", action="store_true", help="caller and workers use aiobroadcast.blocking")
    args = p.parse_args(argv)
    loop = BLOCKING if args.blocking else args.loop
    capacity, slot_bytes = ring_args(args, ring_for(args.size))
    # The cell's JSON line, key by key as _bench_gather's (which adds "senders" after "readers"):
    # a shared builder would change the keys' order in the printed line.
    out: dict[str, Any] = {
        "system": "aiobroadcast",
        "mode": "call",
        "readers": args.workers,
        "size": args.size,
        "count": args.count,
        "transport": "shm",
        "loop": loop,
        "capacity": capacity,
        "slot_bytes": slot_bytes,
        "api": "blocking" if args.blocking else "async",
    }
    run = _call_blocking if args.blocking else _call_async
    check, cpu, errors = _run_loop(loop, run, args.workers, args.size, args.count, capacity, slot_bytes, loop)
    lat = sorted(check.lat_ns)
    out["received"] = [len(lat)]
    out["in_order"] = check.problem is None
    if lat:
        out["p50_us"] = _pct(lat, 0.50)
        out["p99_us"] = _pct(lat, 0.99)
    out["reader_cpu_s"] = cpu
    problems = [*errors, *([check.problem] if check.problem else [])]
    if len(lat) != args.count:
        problems.append(f"{len(lat)} of {args.count} calls completed")
    return report(out, problems)


if __name__ == "__main__":
    sys.exit(main())
