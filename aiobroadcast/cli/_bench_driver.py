"""aiobroadcast's benchmark driver: one writer process (this one), READERS reader processes.

    python -m aiobroadcast.cli._bench_driver MODE READERS SIZE COUNT [--capacity N] [--slot-bytes N]
        [--transport shm|tcp] [--insecure] [--loop uvloop|asyncio|trio] [--spin-us US] [--zero-copy]
        [--blocking] [--batch N]

``aiobroadcast bench`` runs it once per run. The protocol is docs/performance.md's; the figures
come from ``_bench_figures`` (the peers' too, in the source tree's ``benchmarks/side_by_side.py``).
Prints one JSON object on its last line. ``IDLE_S`` (environment, default 5) is the pause
of mode ``idle``. Writer and readers use the public async API (``await writer.put``,
``await reader.get``) on their own event loops, or with ``--blocking`` the blocking API
(``aiobroadcast.blocking``: ``writer.put``, ``reader.get``, no event loop anywhere). Over TCP
the channel is sealed (AES-256-GCM, keys delivered over CurveZMQ) unless ``--insecure``
(authenticated, not encrypted). With ``--batch N`` (mode tput) the writer publishes with
``put_many``, N messages at a time, each stamped as it is built. The JSON field ``security``
keeps its values: "curve" for the default, "hmac" for ``--insecure``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import anyio

from ._bench_figures import (
    MODES,
    PACE_S,
    collect,
    expected,
    figures,
    reader_result,
    reap,
    server_cpu_ns,
    wait_attached,
)
from ._common import EXIT_FAILED, EXIT_OK, error

#: Ring sizes by message size: (largest payload, capacity). Above the last: ``LARGE_CAPACITY``
#: (what vLLM uses: 10 chunks).
CAPACITIES = ((64 * 1024, 64),)
LARGE_CAPACITY = 10
#: Room for the pickle framing around the payload and the 32-byte slot header.
SLOT_HEADROOM = 4096
#: Messages up to ``SMALL_BYTES``: slots sized to the message (``SMALL_HEADROOM`` of framing and
#: header), as many as fit in ``SMALL_RING_BYTES``, at most ``SMALL_CAPACITY``.
SMALL_BYTES = 4096
SMALL_HEADROOM = 192
SMALL_RING_BYTES = 1 << 20
SMALL_CAPACITY = 4096


def ring_for(size: int) -> tuple[int, int]:
    """The default ring for messages of ``size`` payload bytes: ``(capacity, slot_bytes)``.

    One message fits in one slot (as in vLLM's driver, where a chunk holds a whole message). Up to
    4 KiB: slots of ``size + 192`` bytes rounded up to 64, as many as fit in 1 MiB (at most 4096:
    64 B messages get 4096 slots of 256 B). Above: ``slot_bytes = size + 4 KiB`` rounded up to 64,
    64 slots up to 64 KiB and 10 above (vLLM's ``max_chunks``). The ring never takes more shared
    memory than vLLM's ``MessageQueue`` does in the same cell (64 B: 1 MiB vs 10 MiB; 64 KiB:
    4.3 MiB vs 10 MiB; 4 MiB: 40 MiB vs 80 MiB).

    Why many small slots: with more processes than CPUs (4 readers and a writer on 2 here), a
    reader is now and then off its CPU for a scheduler's time slice (milliseconds), and the writer
    runs on until the ring is full. 256 slots of 64 B messages last it under a millisecond; 4096
    last it about ten. Alternated on this project's 2-CPU machines, 4 readers: 149-180k msgs/s
    with 4096 slots of 256 B against 118-148k with 256 of 4160 B (6 runs each); 1 and 2 readers
    within the noise.
    """
    if size <= SMALL_BYTES:
        slot_bytes = (size + SMALL_HEADROOM + 63) // 64 * 64
        return min(SMALL_CAPACITY, SMALL_RING_BYTES // slot_bytes), slot_bytes
    slot_bytes = (size + SLOT_HEADROOM + 63) // 64 * 64
    capacity = next((cap for limit, cap in CAPACITIES if size <= limit), LARGE_CAPACITY)
    return capacity, slot_bytes


def default_loop() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


#: The ``loop`` of a driver that uses the blocking API: no event loop at all.
BLOCKING = "blocking"


def add_cell_args(p: argparse.ArgumentParser, peers: str) -> None:
    """The arguments every benchmark driver takes: PEERS (readers, senders or workers), SIZE,
    COUNT, and the ring's --capacity and --slot-bytes (defaults: see ``ring_args``)."""
    p.add_argument(peers, type=int)
    p.add_argument("size", type=int)
    p.add_argument("count", type=int)
    p.add_argument("--capacity", type=int)
    p.add_argument("--slot-bytes", type=int)


def peer_parser(module: str, doc: str | None, peers: str) -> argparse.ArgumentParser:
    """The parser of a many-process driver (``_bench_call``, ``_bench_gather``): prog
    ``python -m MODULE``, the first line of ``doc`` as description, the cell's arguments
    (``add_cell_args``) and --loop."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=(doc or "").split("\n")[0])
    add_cell_args(p, peers)
    p.add_argument("--loop", choices=("uvloop", "asyncio", "trio"), default=default_loop())
    return p


def ring_args(args: argparse.Namespace, default: tuple[int, int]) -> tuple[int, int]:
    """``(capacity, slot_bytes)``: --capacity and --slot-bytes where given, else ``default``'s."""
    return args.capacity or default[0], args.slot_bytes or default[1]


def report(out: dict[str, Any], problems: list[str]) -> int:
    """Print the cell's figures as one JSON line (with ``FAILED`` naming the problems); the exit code."""
    if problems:
        out["FAILED"] = "; ".join(problems)
    print(json.dumps(out), flush=True)
    return EXIT_FAILED if problems else EXIT_OK


def _run_loop(loop: str, func: Any, *args: Any) -> Any:
    if loop == BLOCKING:
        return func(*args)
    if loop == "trio":
        return anyio.run(func, *args, backend="trio")
    return anyio.run(func, *args, backend="asyncio", backend_options={"use_uvloop": loop == "uvloop"})


# --- readers --------------------------------------------------------------------------------------
def _reader_process(
    handle: str,
    rank: int,
    mode: str,
    count: int,
    transport: str,
    loop: str,
    opts: dict[str, Any],
    results: Any,
    ready: Any,
) -> None:
    try:
        main = _reader_blocking if loop == BLOCKING else _reader_main
        res = _run_loop(loop, main, handle, rank, mode, count, transport, opts, ready)
    except BaseException as exc:
        results.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        raise
    results.put(res)


# The async and the blocking roles below are twins, line for line: the same loop, with and
# without ``await``. That loop is what the benchmark measures, so it is not shared through a
# callback or a generator, which would add a call per message to one API and not to the other;
# what is around it (options, results) is shared.
def _reader_opts(transport: str) -> dict[str, Any]:
    return {"transport": "tcp"} if transport == "tcp" else {}


async def _reader_main(
    handle: str, rank: int, mode: str, count: int, transport: str, opts: dict[str, Any], ready: Any
) -> dict[str, Any]:
    from .. import open_reader

    async with open_reader(handle, name=f"bench-reader-{rank}", **opts, **_reader_opts(transport)) as reader:
        ready.set()
        lats: list[int] = []
        last = 0
        in_order = True
        lat = mode == "lat"
        get = reader.get
        payload: object = None
        for _ in range(count):
            ts, payload = await get()
            if lat:
                lats.append(time.perf_counter_ns() - ts)
            if ts < last:
                in_order = False
            last = ts
        t_end = time.perf_counter_ns()
        idle = None
        if mode == "idle":
            c0 = time.process_time()
            ts, payload = await get()
            idle = (time.process_time() - c0, time.perf_counter_ns() - ts)
    return _reader_result(rank, t_end, lats, count, in_order, idle, payload)


def _reader_blocking(
    handle: str, rank: int, mode: str, count: int, transport: str, opts: dict[str, Any], ready: Any
) -> dict[str, Any]:
    """``_reader_main`` with the blocking API: ``reader.get()`` blocks this thread."""
    from ..blocking import open_reader

    with open_reader(handle, name=f"bench-reader-{rank}", **opts, **_reader_opts(transport)) as reader:
        ready.set()
        lats: list[int] = []
        last = 0
        in_order = True
        lat = mode == "lat"
        get = reader.get
        payload: object = None
        for _ in range(count):
            ts, payload = get()
            if lat:
                lats.append(time.perf_counter_ns() - ts)
            if ts < last:
                in_order = False
            last = ts
        t_end = time.perf_counter_ns()
        idle = None
        if mode == "idle":
            c0 = time.process_time()
            ts, payload = get()
            idle = (time.process_time() - c0, time.perf_counter_ns() - ts)
    return _reader_result(rank, t_end, lats, count, in_order, idle, payload)


def _reader_result(
    rank: int, t_end: int, lats: list[int], count: int, in_order: bool, idle: tuple[float, int] | None, payload: object
) -> dict[str, Any]:
    """``idle``: the CPU seconds the reader used while it waited through the pause, and the
    latency of the message after it."""
    res = reader_result(rank, t_end, lats, count + (idle is not None), in_order, *(idle or (None, None)))
    res["payload_type"] = type(payload).__name__  # memoryview with zero_copy (64 KiB and up)
    return res


# --- the writer -----------------------------------------------------------------------------------
def _writer_opts(transport: str, insecure: bool) -> dict[str, Any]:
    return {"tcp": "tcp://127.0.0.1:0", "insecure": insecure} if transport == "tcp" else {}


async def _writer_main(
    mode: str,
    readers: int,
    size: int,
    count: int,
    capacity: int,
    slot_bytes: int,
    transport: str,
    loop: str,
    idle_s: float,
    spin_us: float | None = None,
    insecure: bool = False,
    zero_copy: bool = False,
    batch: int = 1,
) -> dict[str, Any]:
    from .. import open_writer

    extra = _writer_opts(transport, insecure)
    async with open_writer(capacity=capacity, slot_bytes=slot_bytes, max_readers=readers, **extra) as writer:
        run = _Readers(writer.handle.to_json(), readers, mode, count, transport, loop, spin_us, zero_copy)
        try:
            payload = b"x" * size
            put = writer.put
            t0 = time.perf_counter_ns()
            if mode == "lat":
                for _ in range(count):
                    await anyio.sleep(PACE_S)
                    await put((time.perf_counter_ns(), payload))
            elif batch > 1:
                put_many = writer.put_many
                for i in range(0, count, batch):
                    await put_many([(time.perf_counter_ns(), payload) for _ in range(min(batch, count - i))])
            else:
                for _ in range(count):
                    await put((time.perf_counter_ns(), payload))
            server_idle_ns = None
            if mode == "idle":
                s0 = server_cpu_ns()
                await anyio.sleep(idle_s)
                s1 = server_cpu_ns()
                server_idle_ns = None if s0 is None or s1 is None else s1 - s0
                await put((time.perf_counter_ns(), payload))
            # Collected in this thread, blocking the loop, as the peer drivers do: starting a worker
            # thread here would compete for the CPU with readers that are still waking up.
            results = run.collect()
        finally:
            run.join()
    return run.figures(size, t0, results, idle_s, server_idle_ns)


def _writer_blocking(
    mode: str,
    readers: int,
    size: int,
    count: int,
    capacity: int,
    slot_bytes: int,
    transport: str,
    loop: str,
    idle_s: float,
    spin_us: float | None = None,
    insecure: bool = False,
    zero_copy: bool = False,
    batch: int = 1,
) -> dict[str, Any]:
    """``_writer_main`` with the blocking API: ``writer.put()`` blocks this thread."""
    from ..blocking import open_writer

    extra = _writer_opts(transport, insecure)
    with open_writer(capacity=capacity, slot_bytes=slot_bytes, max_readers=readers, **extra) as writer:
        run = _Readers(writer.handle.to_json(), readers, mode, count, transport, loop, spin_us, zero_copy)
        try:
            payload = b"x" * size
            put = writer.put
            t0 = time.perf_counter_ns()
            if mode == "lat":
                for _ in range(count):
                    time.sleep(PACE_S)
                    put((time.perf_counter_ns(), payload))
            elif batch > 1:
                put_many = writer.put_many
                for i in range(0, count, batch):
                    put_many([(time.perf_counter_ns(), payload) for _ in range(min(batch, count - i))])
            else:
                for _ in range(count):
                    put((time.perf_counter_ns(), payload))
            server_idle_ns = None
            if mode == "idle":
                s0 = server_cpu_ns()
                time.sleep(idle_s)
                s1 = server_cpu_ns()
                server_idle_ns = None if s0 is None or s1 is None else s1 - s0
                put((time.perf_counter_ns(), payload))
            # Collected in this thread, as the async writer does.
            results = run.collect()
        finally:
            run.join()
    return run.figures(size, t0, results, idle_s, server_idle_ns)


class _Readers:
    """The reader processes of one run: started, attached (``__init__`` waits), collected."""

    def __init__(
        self,
        handle: str,
        readers: int,
        mode: str,
        count: int,
        transport: str,
        loop: str,
        spin_us: float | None,
        zero_copy: bool,
    ) -> None:
        self.mode = mode
        self.count = count
        ctx = mp.get_context("spawn")
        self.results_q = ctx.Queue()
        readies = [ctx.Event() for _ in range(readers)]
        opts: dict[str, Any] = {"spin_us": spin_us}
        if zero_copy:
            opts["zero_copy"] = True  # payloads arrive as views of the ring (the reader never touches them)
        self.procs = [
            ctx.Process(
                target=_reader_process,
                args=(handle, r, mode, count, transport, loop, opts, self.results_q, readies[r]),
                daemon=True,
            )
            for r in range(readers)
        ]
        wait_attached(self.procs, readies, "reader")

    def collect(self) -> list[dict[str, Any]]:
        return collect(self.results_q, self.procs)

    def join(self) -> None:
        reap(self.procs)

    def figures(
        self, size: int, t0: int, results: list[dict[str, Any]], idle_s: float, server_idle_ns: int | None
    ) -> dict[str, Any]:
        out = figures(self.mode, self.count, size, t0, results, idle_s, server_idle_ns)
        out["payload_type"] = sorted({r["payload_type"] for r in results})
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m aiobroadcast.cli._bench_driver", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("mode", choices=MODES)
    add_cell_args(p, "readers")
    p.add_argument("--transport", choices=("shm", "tcp"), default="shm")
    p.add_argument("--insecure", action="store_true", help="over TCP: authenticated (GMAC, HMAC-SHA256), not encrypted")
    p.add_argument("--loop", choices=("uvloop", "asyncio", "trio"), default=default_loop())
    p.add_argument("--spin-us", type=float, default=None)
    p.add_argument("--zero-copy", action="store_true", help="readers opened with open_reader(zero_copy=True)")
    p.add_argument(
        "--blocking",
        action="store_true",
        help="writer and readers use aiobroadcast.blocking (no event loop; --loop is ignored)",
    )
    p.add_argument("--batch", type=int, default=1, help="mode tput: the writer's put_many takes this many at a time")
    args = p.parse_args(argv)
    if args.batch < 1 or (args.batch > 1 and args.mode != "tput"):
        p.error("--batch must be at least 1, and more than 1 only in mode tput")
    if args.blocking:
        args.loop = BLOCKING
    capacity, slot_bytes = ring_args(args, ring_for(args.size))
    idle_s = float(os.environ.get("IDLE_S", "5"))
    out: dict[str, Any] = {
        "system": "aiobroadcast",
        "mode": args.mode,
        "readers": args.readers,
        "size": args.size,
        "count": args.count,
        "transport": args.transport,
        "loop": args.loop,
        "capacity": capacity,
        "slot_bytes": slot_bytes,
        "spin_us": args.spin_us,
        "zero_copy": args.zero_copy,
        "api": "blocking" if args.blocking else "async",
        "batch": args.batch,
    }
    if args.transport == "tcp":
        out["security"] = "hmac" if args.insecure else "curve"
    out.update(
        _run_loop(
            args.loop,
            _writer_blocking if args.blocking else _writer_main,
            args.mode,
            args.readers,
            args.size,
            args.count,
            capacity,
            slot_bytes,
            args.transport,
            args.loop,
            idle_s,
            args.spin_us,
            args.insecure,
            args.zero_copy,
            args.batch,
        )
    )
    print(json.dumps(out), flush=True)
    each = expected(args.mode, args.count)
    if out["received"] != [each] * args.readers or not out["in_order"]:
        error(f"readers received {out['received']} (expected {each} each, in order)")
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
