"""vLLM's executor pattern on aiobroadcast: ``collective_rpc`` broadcasts a method call to every
worker rank and returns one answer per rank, in rank order.

vLLM's ``MultiprocExecutor`` does this with one broadcast ``MessageQueue`` and one single-reader
``MessageQueue`` per worker, dequeued in rank order under one deadline; its answers carry no
call id, so after a timeout the next call can take a stale answer. Here each answer is matched
to its call (a late one is dropped and counted), a worker's exception comes back as its type
name and message, and a dead rank is reported as dead instead of timing out. Synchronous, as
vLLM's executor: the blocking API.

    python examples/vllm_executor.py --workers 2 --steps 100
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from typing import Any

from aiobroadcast import WorkerError, blocking


class GPUWorker:
    """A stand-in for vLLM's worker: the methods the executor calls by name."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.steps = 0

    def execute_model(self, token_ids: list[int]) -> int:
        self.steps += 1
        return sum(token_ids) * (self.rank + 1)

    def check_health(self) -> None:
        if self.rank == 1:
            raise RuntimeError(f"rank {self.rank}: device lost")


def worker_main(handle: str, rank: int) -> None:
    gpu = GPUWorker(rank)
    with blocking.open_worker(handle, name=f"rank-{rank}") as worker:
        worker.serve(lambda call: getattr(gpu, call[0])(*call[1]))  # vLLM's worker_busy_loop


class Executor:
    def __init__(self, workers: int) -> None:
        self.caller = blocking.open_caller(workers=[f"rank-{r}" for r in range(workers)])
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=worker_main, args=(self.caller.handle.to_json(), r)) for r in range(workers)]
        for p in self.procs:
            p.start()

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), timeout: float = 60) -> list[Any]:
        """Every rank's answer, in rank order; raises ``WorkerError`` (a rank's exception, as
        text) or ``NoReplyError`` (a rank died, closed, or missed the deadline)."""
        return [answer.unwrap() for answer in self.caller.call((method, args), timeout=timeout).values()]

    def shutdown(self) -> None:
        self.caller.close()  # the workers' loops end
        for p in self.procs:
            p.join(30)


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()
    executor = Executor(args.workers)
    try:
        executor.collective_rpc("execute_model", ([],))  # the first call waits for every rank to attach
        start = time.perf_counter()
        for step in range(args.steps):
            tokens = list(range(step, step + 16))
            outputs = executor.collective_rpc("execute_model", (tokens,))
            if outputs != [sum(tokens) * (r + 1) for r in range(args.workers)]:
                print(f"step {step}: wrong outputs {outputs}")
                return 1
        elapsed = time.perf_counter() - start
        print(f"{args.steps} steps: every rank answered every step ({elapsed / args.steps * 1e6:.0f} us per call)")
        try:
            executor.collective_rpc("check_health")
        except WorkerError as exc:
            print(f"check_health: {exc}")
        print(f"statistics: {executor.caller.statistics()}")
    finally:
        executor.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
