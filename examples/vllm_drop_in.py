"""vLLM's worker loop on aiobroadcast: only the import of ``MessageQueue`` changes.

A scheduler rank broadcasts each step (what vLLM's ``SchedulerOutput`` is to its workers) to N
worker ranks through one ``MessageQueue``; each worker runs the step and answers on a
``MessageQueue`` of its own, which the scheduler reads. Every loop is synchronous, as vLLM's:
``enqueue``/``dequeue`` block their thread, and a waiting worker sleeps on a socket instead of
spinning a core. The writer's queue has no ``dequeue`` (the scheduler's mistake is caught at
once, with the fix in the message); a worker that dies is dropped instead of hanging the
scheduler.

    python examples/vllm_drop_in.py --workers 2 --steps 200
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from typing import Any

from aiobroadcast.vllm import Handle, MessageQueue


@dataclass
class Step:
    """One scheduling step, as the workers receive it."""

    step: int
    token_ids: list[int]


def run_step(rank: int, step: Step) -> dict[str, Any]:
    """What a worker computes for a step (a stand-in for the model)."""
    return {"rank": rank, "step": step.step, "result": sum(step.token_ids) * (rank + 1)}


# --- a worker rank ------------------------------------------------------------------------------
def worker_main(rank: int, steps_handle: Handle, answers_out: Any) -> None:
    steps = MessageQueue.create_from_handle(steps_handle, rank)
    answers = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1 << 16, max_chunks=8)
    answers_out.put((rank, answers.export_handle()))
    steps.wait_until_ready()
    answers.wait_until_ready()
    print(f"worker {rank} (pid {os.getpid()}) ready", flush=True)
    while True:
        step = steps.dequeue()
        if step is None:  # the scheduler is done
            break
        answers.enqueue(run_step(rank, step))
    answers.close()


# --- the scheduler rank -------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    steps = MessageQueue(n_reader=args.workers, n_local_reader=args.workers, max_chunk_bytes=1 << 20, max_chunks=8)
    answers_out = ctx.Queue()
    procs = [
        ctx.Process(target=worker_main, args=(rank, steps.export_handle(), answers_out)) for rank in range(args.workers)
    ]
    for proc in procs:
        proc.start()
    # Each worker's answer queue is read here, as rank 0 of its readers.
    answers = {rank: MessageQueue.create_from_handle(h, 0) for rank, h in (answers_out.get() for _ in procs)}
    steps.wait_until_ready()

    try:
        steps.dequeue()  # type: ignore[attr-defined]
    except AttributeError as exc:
        print(f"the scheduler cannot dequeue from its own queue: {exc}")

    start = time.perf_counter()
    for i in range(args.steps):
        step = Step(i, list(range(i, i + 16)))
        steps.enqueue(step)
        for rank in sorted(answers):
            got = answers[rank].dequeue(timeout=30)
            if got != run_step(rank, step):
                print(f"step {i}: worker {rank} answered {got!r}")
                return 1
    elapsed = time.perf_counter() - start
    steps.enqueue(None)
    for proc in procs:
        proc.join(30)
    for queue in answers.values():
        queue.close()
    steps.close()
    failed = [proc.exitcode for proc in procs if proc.exitcode != 0]
    if failed:
        print(f"workers failed: exit codes {failed}")
        return 1
    print(
        f"{args.steps} steps: each of {args.workers} workers answered every step, in order "
        f"({elapsed / args.steps * 1e6:.0f} us per step round trip)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
