"""A 64 MiB torch CPU tensor to 2 local readers through a tensor arena: vLLM 0.33's
``MessageQueue(enable_shm_tensor_arena=True)``, aiobroadcast's drop-in with the same call, and
aiobroadcast's own blocking roles with ``arena_bytes`` and ``zero_copy=True`` readers; and, in
each run, one ``memcpy`` of 64 MiB (the physical limit of a copy-once writer).

    python benchmarks/arena_64mib.py --sitting 3       # alternates the three, 3 runs each
    python benchmarks/arena_64mib.py --impl native     # one run, JSON on stdout

vLLM's side runs under ``PEER_PYTHON`` (default ``/tmp/peers/bin/python``) with
``PYTHONPATH=VLLM_PEER`` (default ``/tmp/vllm-peer-arena``: the shim that
``../shared/peers/vllm/setup.sh`` builds, plus vLLM 0.33.0's ``shm_tensor_arena.py`` beside its
``shm_broadcast.py``).

Each run: the writer sends ``--messages`` tensors (the first ``--warmup`` not counted), one after
the other; each reader takes each, reads its first and last element, and drops it. Reported:
the writer's time per tensor (the ``enqueue``/``put`` call: pickling plus the one copy), the
time per tensor until both readers had all of them, the arena's fallbacks (a tensor copied
through the ring or pickled because the arena was full), and the median of 10 ``copy_`` calls
of 64 MiB between two tensors made in the same process.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from typing import Any

SIZE = 64 * 1024 * 1024


def _memcpy_s() -> float:
    import torch

    src = torch.ones(SIZE, dtype=torch.uint8)
    dst = torch.empty(SIZE, dtype=torch.uint8)
    dst.copy_(src)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _reader(impl: str, handle: Any, rank: int, n: int, done: Any) -> None:
    torch_threads()
    if impl == "native":
        from aiobroadcast import blocking

        with blocking.open_reader(handle, name=f"r{rank}", zero_copy=True) as r:
            done.put(("ready", rank))
            for _ in range(n):
                t = r.get(timeout=60)
                _ = float(t[0]) + float(t[-1])
                del t
            done.put(("done", time.perf_counter()))
        return
    mq = _mq(impl).create_from_handle(handle, rank)
    mq.wait_until_ready()
    for _ in range(n):
        t = mq.dequeue(timeout=60)
        _ = float(t[0]) + float(t[-1])
        del t
    done.put(("done", time.perf_counter()))


def torch_threads() -> None:
    import torch

    torch.set_num_threads(1)


def _mq(impl: str) -> Any:
    if impl == "vllm":
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    else:
        from aiobroadcast.vllm import MessageQueue
    return MessageQueue


def run(impl: str, messages: int, warmup: int) -> dict[str, Any]:
    import torch

    torch_threads()
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    tensor = torch.ones(SIZE // 4, dtype=torch.float32)
    if impl == "native":
        from aiobroadcast import blocking

        writer = blocking.open_writer(capacity=16, slot_bytes=1 << 16, max_readers=2, arena_bytes=4 * SIZE)
        handle = writer.handle
        procs = [ctx.Process(target=_reader, args=(impl, handle, i, messages, done)) for i in range(2)]
        for p in procs:
            p.start()
        for _ in procs:
            assert done.get(timeout=120)[0] == "ready"
        while len(writer.statistics().readers) < 2:
            time.sleep(0.01)
        put = writer.put
    else:
        mq = _mq(impl)(2, 2, enable_shm_tensor_arena=True)
        procs = [ctx.Process(target=_reader, args=(impl, mq.export_handle(), i, messages, done)) for i in range(2)]
        for p in procs:
            p.start()
        mq.wait_until_ready()
        put = mq.enqueue
    memcpy = _memcpy_s()
    costs = []
    start = 0.0
    for i in range(messages):
        if i == warmup:
            start = time.perf_counter()
        t0 = time.perf_counter()
        put(tensor)
        costs.append(time.perf_counter() - t0)
    ends = [done.get(timeout=300)[1] for _ in procs]
    for p in procs:
        p.join(60)
    if impl == "native":
        fallbacks = writer.statistics().arena_fallbacks
        writer.close()
    elif impl == "vllm":
        fallbacks = mq.tensor_arena._fallbacks if mq.tensor_arena is not None else -1
    else:
        fallbacks = mq._writer.statistics().arena_fallbacks
        mq.close()
    counted = costs[warmup:]
    return {
        "impl": impl,
        "messages": messages - warmup,
        "writer_ms": 1e3 * statistics.median(counted),
        "end_to_end_ms": 1e3 * (max(ends) - start) / (messages - warmup),
        "memcpy_ms": 1e3 * memcpy,
        "fallbacks": fallbacks,
    }


def sitting(runs: int, messages: int, warmup: int) -> None:
    peer_python = os.environ.get("PEER_PYTHON", "/tmp/peers/bin/python")
    peer_path = os.environ.get("VLLM_PEER", "/tmp/vllm-peer-arena")
    results: dict[str, list[dict[str, Any]]] = {"vllm": [], "dropin": [], "native": []}
    for k in range(runs):
        for impl in ("vllm", "dropin", "native") if k % 2 == 0 else ("native", "dropin", "vllm"):
            env = dict(os.environ)
            python = sys.executable
            if impl == "vllm":
                python = peer_python
                env["PYTHONPATH"] = peer_path
            cmd = [python, __file__, "--impl", impl, "--messages", str(messages), "--warmup", str(warmup)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if out.returncode:
                print(out.stderr, file=sys.stderr)
                raise SystemExit(f"{impl} failed")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            results[impl].append(res)
            print(json.dumps(res), flush=True)
    print("| implementation | writer ms/tensor | end-to-end ms/tensor | memcpy ms | writer / memcpy | fallbacks |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for impl, rs in results.items():
        w = statistics.median(r["writer_ms"] for r in rs)
        e = statistics.median(r["end_to_end_ms"] for r in rs)
        m = statistics.median(r["memcpy_ms"] for r in rs)
        ratio = statistics.median(r["writer_ms"] / r["memcpy_ms"] for r in rs)
        fb = sum(r["fallbacks"] for r in rs)
        print(f"| {impl} | {w:.1f} | {e:.1f} | {m:.1f} | {ratio:.2f}x | {fb} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=("vllm", "dropin", "native"))
    p.add_argument("--sitting", type=int, default=0, help="alternate the three, this many runs each")
    p.add_argument("--messages", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args()
    if a.sitting:
        sitting(a.sitting, a.messages, a.warmup)
    else:
        print(json.dumps(run(a.impl, a.messages, a.warmup)))


if __name__ == "__main__":
    main()
