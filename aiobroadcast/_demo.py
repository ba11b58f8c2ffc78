"""``aiobroadcast demo``: a writer and reader processes on this host, with live progress."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import anyio
import anyio.to_thread

from ._handle import Handle
from ._open import open_reader, open_writer


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run a writer and reader processes on this host and report throughput and latency",
        description=(
            "Start one writer and READERS reader processes on this host. The writer publishes "
            "COUNT messages of SIZE payload bytes (each stamped with its send time) through a "
            "shared-memory ring; every reader checks it got every message in order and measures "
            "latency. A progress line shows messages sent, rate and the slowest reader's lag; a "
            "summary table follows. Ctrl-C stops everything and removes the ring."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--readers", type=int, default=3, help="reader processes")
    p.add_argument("--count", type=int, default=200_000, help="messages to publish")
    p.add_argument("--size", type=int, default=64, help="payload bytes per message")
    p.add_argument("--rate", type=float, default=0.0, help="messages per second (0: as fast as readers allow)")
    p.add_argument("--capacity", type=int, default=256, help="slots in the ring")
    p.add_argument("--slot-bytes", type=int, default=1 << 16, help="bytes per slot")
    p.set_defaults(func=run_demo)


def _reader_main(handle_json: str, name: str, conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop

    async def main() -> None:
        lat: list[int] = []
        expected = 0
        async with open_reader(handle_json, name=name) as reader:
            conn.send("ready")
            async for seq, sent_ns, _payload in reader:
                now = time.perf_counter_ns()
                if seq != expected:
                    conn.send(("error", f"{name}: expected message {expected}, got {seq}"))
                    return
                expected += 1
                lat.append(now - sent_ns)
        lat.sort()
        conn.send(("done", expected, lat[len(lat) // 2] if lat else 0, lat[int(len(lat) * 0.99)] if lat else 0))

    anyio.run(main, backend_options=_loop_options())


def _loop_options() -> dict[str, Any]:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}


def run_demo(args: argparse.Namespace) -> int:
    if args.readers < 1 or args.count < 1 or args.size < 0:
        print("aiobroadcast: error: --readers and --count must be at least 1, --size at least 0", file=sys.stderr)
        return 2
    return anyio.run(_demo, args, backend_options=_loop_options())


async def _demo(args: argparse.Namespace) -> int:
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    pipes: list[Connection] = []
    out = sys.stdout
    try:
        async with open_writer(capacity=args.capacity, slot_bytes=args.slot_bytes, max_readers=args.readers) as writer:
            handle: Handle = writer.handle
            print(
                f"channel {handle.name}: ring of {handle.capacity} x {handle.slot_bytes} B in {handle.directory}, "
                f"{args.readers} reader processes, {args.count} messages of {args.size} B",
                file=out,
            )
            for i in range(args.readers):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_reader_main, args=(handle.to_json(), f"reader-{i}", child), daemon=True)
                p.start()
                child.close()
                procs.append(p)
                pipes.append(parent)
            for conn in pipes:
                if await anyio.to_thread.run_sync(conn.poll, 30) is False or conn.recv() != "ready":
                    print("aiobroadcast: error: a reader process did not start", file=sys.stderr)
                    return 1
            payload = b"x" * args.size
            interval = 1.0 / args.rate if args.rate > 0 else 0.0
            t0 = time.perf_counter()
            next_report = t0 + 0.5
            for seq in range(args.count):
                if interval:
                    delay = t0 + seq * interval - time.perf_counter()
                    if delay > 0:
                        await anyio.sleep(delay)
                await writer.put((seq, time.perf_counter_ns(), payload))
                if seq & 1023 == 0 and time.perf_counter() >= next_report:
                    next_report += 0.5
                    _progress(out, writer.statistics(), t0)
            _progress(out, writer.statistics(), t0)
        elapsed_pub = time.perf_counter() - t0
        results = [await anyio.to_thread.run_sync(conn.recv) for conn in pipes]
        elapsed = time.perf_counter() - t0
        out.write("\n")
        failed = [r for r in results if r[0] != "done"]
        print(f"{'reader':<10} {'messages':>10} {'p50 latency':>12} {'p99 latency':>12}", file=out)
        for i, r in enumerate(results):
            if r[0] == "done":
                print(f"reader-{i:<3} {r[1]:>10} {r[2] / 1e3:>9.1f} us {r[3] / 1e3:>9.1f} us", file=out)
            else:
                print(f"reader-{i:<3} FAILED: {r[1]}", file=out)
        total = args.count
        print(
            f"{total} messages to each of {args.readers} readers in {elapsed:.2f} s: "
            f"{total / elapsed:,.0f} msg/s, {total * args.size / elapsed / 1e6:,.1f} MB/s of payload per reader "
            f"(publishing took {elapsed_pub:.2f} s)",
            file=out,
        )
        return 1 if failed else 0
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in pipes:
            conn.close()


def _progress(out: Any, stats: Any, t0: float) -> None:
    elapsed = max(time.perf_counter() - t0, 1e-9)
    slowest = max((r.lag for r in stats.readers), default=0)
    out.write(f"\r  sent {stats.sent:>9,}  {stats.sent / elapsed:>10,.0f} msg/s  slowest reader lag {slowest:>5}")
    out.flush()
    if os.environ.get("AIOBROADCAST_DEMO_NEWLINES"):
        out.write("\n")
