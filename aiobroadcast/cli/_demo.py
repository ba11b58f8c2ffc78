"""``aiobroadcast demo``: a writer, local reader processes over shared memory and a remote reader
over TCP (on loopback), with live progress and a summary table."""

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

from .._base.errors import BroadcastError, plural
from .._base.handle import Handle
from .._broadcast.open import Transport, open_reader, open_writer
from ._common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    HelpFormatter,
    children_ignore_sigint,
    error,
    loop_options,
    stop_on_signals,
)

#: Seconds a reader process may take to start and attach.
START_TIMEOUT_S = 30.0


# argparse, spelled out per command as in the other cli modules: a table or wrapper of
# add_parser/add_argument calls would only hide argparse's own API.
def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run a writer, local reader processes and a remote (TCP) reader; report throughput and latency",
        description=(
            "Start one writer, READERS local reader processes that read its shared-memory ring, and REMOTE "
            "reader processes that connect to the writer's TCP endpoint (CurveZMQ, on loopback: the same "
            "code path as a reader on another host). The writer publishes COUNT messages of SIZE payload "
            "bytes, each stamped with its send time; every reader checks it got every message in order and "
            "measures latency. A progress line shows messages sent, rate and the slowest reader's lag; a "
            "summary table follows. Ctrl-C (or SIGTERM) stops the writer, lets the readers finish, and "
            "removes the ring: no process or /dev/shm file is left behind."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--readers", type=int, default=3, help="local reader processes (shared memory)")
    p.add_argument("--remote", type=int, default=1, help="remote reader processes (TCP on loopback; 0: none)")
    p.add_argument("--count", type=int, default=20_000, help="messages to publish")
    p.add_argument("--size", type=int, default=64, help="payload bytes per message")
    p.add_argument("--rate", type=float, default=0.0, help="messages per second (0: as fast as readers allow)")
    p.add_argument("--capacity", type=int, default=256, help="slots in the ring")
    p.add_argument("--slot-bytes", type=int, default=1 << 16, help="bytes per slot")
    p.add_argument(
        "--tcp", default="tcp://127.0.0.1:0", help="endpoint the writer serves remote readers on (port 0: any free)"
    )
    p.set_defaults(func=run_demo)


def _send(conn: Connection, msg: Any) -> None:
    try:
        conn.send(msg)
    except OSError:
        pass  # the parent is gone: nobody is listening any more


def _reader_main(handle_json: str, name: str, transport: Transport, conn: Connection) -> None:
    # The parent decides when to stop: it closes the channel, and this reader then ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    async def main() -> None:
        lat: list[int] = []
        expected = 0
        try:
            async with open_reader(handle_json, name=name, transport=transport) as reader:
                _send(conn, "ready")
                async for seq, sent_ns, _payload in reader:
                    now = time.perf_counter_ns()
                    if seq != expected:
                        _send(conn, ("error", f"expected message {expected}, got {seq}"))
                        return
                    expected += 1
                    lat.append(now - sent_ns)
        except BroadcastError as exc:
            _send(conn, ("error", f"{type(exc).__name__}: {exc} (after {plural(expected, 'message')})"))
            return
        lat.sort()
        p50 = lat[len(lat) // 2] if lat else 0
        p99 = lat[int(len(lat) * 0.99)] if lat else 0
        _send(conn, ("done", expected, p50, p99))

    anyio.run(main, backend_options=loop_options())


def run_demo(args: argparse.Namespace) -> int:
    if args.readers < 0 or args.remote < 0 or args.readers + args.remote < 1:
        error("--readers and --remote must be 0 or more, and there must be at least one reader")
        return EXIT_USAGE
    if args.count < 1 or args.size < 0 or args.rate < 0:
        error("--count must be at least 1, --size and --rate at least 0")
        return EXIT_USAGE
    if not args.tcp.startswith("tcp://"):
        error(f"--tcp must be a tcp:// endpoint, e.g. tcp://127.0.0.1:0, not {args.tcp!r}")
        return EXIT_USAGE
    return anyio.run(_demo, args, backend_options=loop_options())


async def _demo(args: argparse.Namespace) -> int:
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    pipes: list[Connection] = []
    roles: list[tuple[str, Transport]] = [(f"reader-{i}", "shm") for i in range(args.readers)]
    roles += [(f"remote-{i}", "tcp") for i in range(args.remote)]
    out = sys.stdout
    interrupted: int | None = None
    t0 = time.perf_counter()
    elapsed_pub = 0.0
    try:
        with children_ignore_sigint():  # the writer's TCP server process: we stop it ourselves
            writer = await open_writer(
                capacity=args.capacity,
                slot_bytes=args.slot_bytes,
                max_readers=max(args.readers, args.remote, 1),
                tcp=args.tcp if args.remote else None,
            )
        async with writer:
            handle: Handle = writer.handle
            print(
                f"channel {handle.name}: ring of {handle.capacity} x {handle.slot_bytes} B in {handle.directory}, "
                f"{plural(args.count, 'message')} of {args.size} B",
                file=out,
            )
            local = [n for n, t in roles if t == "shm"]
            remote = [n for n, t in roles if t == "tcp"]
            if local:
                print(f"  local readers (shared memory): {', '.join(local)}", file=out)
            if remote:
                print(f"  remote readers (TCP {handle.tcp}, CurveZMQ): {', '.join(remote)}", file=out)
            out.flush()
            async with stop_on_signals() as stop:
                for name, transport in roles:
                    parent, child = ctx.Pipe()
                    p = ctx.Process(target=_reader_main, args=(handle.to_json(), name, transport, child), daemon=True)
                    p.start()
                    child.close()
                    procs.append(p)
                    pipes.append(parent)
                for (name, _t), conn in zip(roles, pipes, strict=True):
                    ok = await anyio.to_thread.run_sync(conn.poll, START_TIMEOUT_S, abandon_on_cancel=True)
                    first = _receive(conn) if ok else None
                    if first != "ready":
                        why = first[1] if isinstance(first, tuple) else f"no answer within {START_TIMEOUT_S:g} s"
                        error(f"reader process {name} did not start: {why}")
                        return EXIT_FAILED
                t0 = time.perf_counter()
                await _publish(writer, args, t0, out)
                _progress(out, writer.statistics(), t0)
            interrupted = stop.exit_code
            elapsed_pub = time.perf_counter() - t0
            if interrupted is not None:
                out.write(f"\ninterrupted after {plural(writer.statistics().sent, 'message')}: closing the channel\n")
                out.flush()
        # Closed: the readers drain what was published, then report.
        results = [await anyio.to_thread.run_sync(_result, conn) for conn in pipes]
        elapsed = time.perf_counter() - t0
        out.write("\n")
        _table(out, roles, results, args, elapsed, elapsed_pub)
        if interrupted is not None:
            return interrupted
        return EXIT_FAILED if any(r[0] != "done" for r in results) else EXIT_OK
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in pipes:
            conn.close()


async def _publish(writer: Any, args: argparse.Namespace, t0: float, out: Any) -> None:
    payload = b"x" * args.size
    interval = 1.0 / args.rate if args.rate > 0 else 0.0
    next_report = t0 + 0.5
    for seq in range(args.count):
        if interval:
            delay = t0 + seq * interval - time.perf_counter()
            if delay > 0:
                await anyio.sleep(delay)
        await writer.put((seq, time.perf_counter_ns(), payload))
        if (interval or seq & 1023 == 0) and time.perf_counter() >= next_report:
            next_report += 0.5
            _progress(out, writer.statistics(), t0)


def _receive(conn: Connection) -> Any:
    try:
        return conn.recv()
    except (EOFError, OSError):
        return ("error", "the reader process exited without reporting")


def _result(conn: Connection) -> tuple[Any, ...]:
    """A reader's report; a reader process that died says so instead."""
    try:
        while conn.poll(START_TIMEOUT_S):
            result: Any = conn.recv()
            if result != "ready":  # left unread when Ctrl-C came during the start
                return tuple(result)
    except (EOFError, OSError):
        pass
    return ("error", "the reader process exited without reporting")


def _table(
    out: Any,
    roles: list[tuple[str, Transport]],
    results: list[tuple[Any, ...]],
    args: argparse.Namespace,
    elapsed: float,
    elapsed_pub: float,
) -> None:
    print(f"{'reader':<10} {'transport':<14} {'messages':>10} {'p50 latency':>12} {'p99 latency':>12}", file=out)
    for (name, transport), r in zip(roles, results, strict=True):
        how = "shared memory" if transport == "shm" else "TCP"
        if r[0] == "done":
            print(f"{name:<10} {how:<14} {r[1]:>10} {r[2] / 1e3:>9.1f} us {r[3] / 1e3:>9.1f} us", file=out)
        else:
            print(f"{name:<10} {how:<14} FAILED: {r[1]}", file=out)
    total = max((r[1] for r in results if r[0] == "done"), default=0)
    elapsed = max(elapsed, 1e-9)
    print(
        f"{plural(total, 'message')} to each of {plural(len(roles), 'reader')} ({args.readers} local, "
        f"{args.remote} remote) in "
        f"{elapsed:.2f} s: {total / elapsed:,.0f} msg/s, {total * args.size / elapsed / 1e6:,.1f} MB/s of payload "
        f"per reader (publishing took {elapsed_pub:.2f} s)",
        file=out,
    )
    out.flush()


def _progress(out: Any, stats: Any, t0: float) -> None:
    elapsed = max(time.perf_counter() - t0, 1e-9)
    slowest = max((r.lag for r in stats.readers), default=0)
    out.write(f"\r  sent {stats.sent:>9,}  {stats.sent / elapsed:>10,.0f} msg/s  slowest reader lag {slowest:>5}")
    out.flush()
    if os.environ.get("AIOBROADCAST_DEMO_NEWLINES"):
        out.write("\n")
