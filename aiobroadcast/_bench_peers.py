"""Peer drivers for ``aiobroadcast bench --peers``, and the figures every driver reports.

    python .../aiobroadcast/_bench_peers.py PEER MODE READERS SIZE COUNT [--transport shm|tcp]

PEER is ``vllm`` (vLLM's own ``MessageQueue``, from
``vllm.distributed.device_communicators.shm_broadcast``: it needs torch, pyzmq and vLLM's module
on ``PYTHONPATH``), ``pyzmq`` (pyzmq asyncio PUB/SUB over ``ipc://`` with pickle, unbounded
high-water marks, i.e. lossless: what a user writes by hand) or ``pyzmq-curve`` (the same with
CurveZMQ encryption on the sockets: the counterpart of aiobroadcast's default TCP channel; not
part of ``--peers``, only run when named). The benchmark protocol is the one
in docs/performance.md: one writer process (this one) and READERS reader processes (spawn);
messages are ``(time.perf_counter_ns(), b"x" * SIZE)``; readers are ready before the clock
starts; ``IDLE_S`` (environment, default 5) is the pause of mode ``idle``. The last line printed
is one JSON object. If the peer cannot be imported the line is ``{"unavailable": PEER, "reason":
...}`` and the exit status is ``UNAVAILABLE_RC``.

This file runs as a script in the peer's interpreter, which need not have aiobroadcast's
dependencies installed: it imports only the standard library and the peer's own packages, and
never the ``aiobroadcast`` package. ``aiobroadcast.cli._bench_driver`` imports ``figures`` from it so
that every system's numbers are computed by the same code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time
from typing import Any

MODES = ("tput", "lat", "idle")
PEERS = ("vllm", "pyzmq")
#: Peers that run only when named (``--peer``).
EXTRA_PEERS = ("pyzmq-curve",)
#: Exit status of a driver whose peer is not importable here.
UNAVAILABLE_RC = 3
#: Pacing of mode ``lat`` (seconds between messages).
PACE_S = 0.001
#: How long a reader or the writer waits for anything before giving up (seconds).
STEP_TIMEOUT_S = 120.0
VLLM_MODULE = "vllm.distributed.device_communicators.shm_broadcast"


# --- the figures (shared by every driver) -------------------------------------------------------
def reader_result(
    rank: int, t_end: int, lats: list[int], received: int, in_order: bool,
    idle_cpu_s: float | None = None, wake_ns: int | None = None,
) -> dict[str, Any]:
    """What a reader process sends back to its writer."""
    return {
        "rank": rank, "t_end": t_end, "lats": lats, "received": received, "in_order": in_order,
        "idle_cpu_s": idle_cpu_s, "wake_ns": wake_ns,
    }


def figures(
    mode: str, count: int, size: int, t0: int, results: list[dict[str, Any]], idle_s: float
) -> dict[str, Any]:
    """The protocol's figures from the readers' results (``t0``: first send, perf_counter ns).

    - ``tput``: ``msgs_per_s`` = COUNT / (first send -> last reader has its last message),
      ``MB_per_s`` of payload (10**6 bytes).
    - ``lat``: one-way latency over all readers' samples, ``p50_us`` and ``p99_us``.
    - ``idle``: ``reader_cpu_s_while_idle`` (CPU seconds each reader used during the pause) and
      ``wake_latency_us`` (latency of the message after the pause), one value per reader.
    """
    results = sorted(results, key=lambda r: int(r["rank"]))
    out: dict[str, Any] = {
        "received": [r["received"] for r in results],
        "in_order": all(r["in_order"] for r in results),
    }
    if mode == "tput":
        el = (max(int(r["t_end"]) for r in results) - t0) / 1e9
        out["msgs_per_s"] = round(count / el)
        out["MB_per_s"] = round(count * size / el / 1e6, 1)
    elif mode == "lat":
        lats = sorted(x for r in results for x in r["lats"])
        out["p50_us"] = round(lats[len(lats) // 2] / 1e3, 1)
        out["p99_us"] = round(lats[int(len(lats) * 0.99)] / 1e3, 1)
    else:
        out["idle_s"] = idle_s
        out["reader_cpu_s_while_idle"] = [round(float(r["idle_cpu_s"]), 3) for r in results]
        out["wake_latency_us"] = [round(int(r["wake_ns"]) / 1e3, 1) for r in results]
    return out


def _expected(mode: str, count: int) -> int:
    return count + 1 if mode == "idle" else count


# --- vLLM MessageQueue ----------------------------------------------------------------------------
def _vllm_queue_class() -> Any:
    return importlib.import_module(VLLM_MODULE).MessageQueue


def _vllm_reader(handle: Any, rank: int, mode: str, count: int, q: Any) -> None:
    mq = _vllm_queue_class().create_from_handle(handle, rank)
    mq.wait_until_ready()
    lats: list[int] = []
    last = 0
    in_order = True
    lat = mode == "lat"
    dequeue = mq.dequeue
    for _ in range(count):
        ts, _payload = dequeue(timeout=STEP_TIMEOUT_S)
        if lat:
            lats.append(time.perf_counter_ns() - ts)
        if ts < last:
            in_order = False
        last = ts
    t_end = time.perf_counter_ns()
    received = count
    idle_cpu = wake = None
    if mode == "idle":
        c0 = time.process_time()
        ts, _payload = dequeue(timeout=STEP_TIMEOUT_S)
        wake = time.perf_counter_ns() - ts
        idle_cpu = time.process_time() - c0
        received += 1
    q.put(reader_result(rank, t_end, lats, received, in_order, idle_cpu, wake))


def run_vllm(mode: str, readers: int, size: int, count: int, idle_s: float, transport: str) -> dict[str, Any]:
    """vLLM's MessageQueue, configured as vLLM does for one message of SIZE bytes: chunks of
    max(1 MiB, 2*SIZE + 4096) bytes, 10 chunks. With ``tcp`` every reader is a "remote" reader
    (zmq XPUB/SUB over TCP on 127.0.0.1), which is what vLLM does across hosts."""
    queue_class = _vllm_queue_class()
    chunk = max(1 << 20, 2 * size + 4096)
    if transport == "tcp":
        mq = queue_class(readers, 0, max_chunk_bytes=chunk, max_chunks=10, connect_ip="127.0.0.1")
    else:
        mq = queue_class(readers, readers, max_chunk_bytes=chunk, max_chunks=10)
    handle = mq.export_handle()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_vllm_reader, args=(handle, r, mode, count, q), daemon=True) for r in range(readers)]
    for p in procs:
        p.start()
    try:
        mq.wait_until_ready()
        payload = b"x" * size
        enqueue = mq.enqueue
        t0 = time.perf_counter_ns()
        if mode == "lat":
            for _ in range(count):
                time.sleep(PACE_S)
                enqueue((time.perf_counter_ns(), payload))
        else:
            for _ in range(count):
                enqueue((time.perf_counter_ns(), payload))
        if mode == "idle":
            time.sleep(idle_s)
            enqueue((time.perf_counter_ns(), payload))
        results = _collect(q, procs)
    finally:
        _reap(procs)
        # vLLM leaves its ipc:// socket files behind; remove them.
        for addr in (getattr(handle, "local_subscribe_addr", None), getattr(handle, "local_notify_addr", None)):
            if isinstance(addr, str) and addr.startswith("ipc://"):
                with contextlib.suppress(OSError):
                    os.unlink(addr[len("ipc://"):])
    out: dict[str, Any] = {"system": "vllm", "peer": "vllm", "transport": transport, "max_chunk_bytes": chunk,
                           "max_chunks": 10}
    out.update(figures(mode, count, size, t0, results, idle_s))
    return out


# --- pyzmq asyncio PUB/SUB ------------------------------------------------------------------------
def _zmq_reader(
    addr: str, rank: int, mode: str, count: int, q: Any, ready: Any, curve: tuple[bytes, bytes, bytes] | None = None
) -> None:
    asyncio.run(_zmq_reader_main(addr, rank, mode, count, q, ready, curve))


async def _zmq_reader_main(
    addr: str, rank: int, mode: str, count: int, q: Any, ready: Any, curve: tuple[bytes, bytes, bytes] | None = None
) -> None:
    zmq = importlib.import_module("zmq")
    zmq_asyncio = importlib.import_module("zmq.asyncio")
    ctx = zmq_asyncio.Context()
    s = ctx.socket(zmq.SUB)
    try:
        s.setsockopt(zmq.RCVHWM, 0)
        if curve is not None:  # CurveZMQ client: the server's public key, our key pair
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = curve
        s.subscribe(b"")
        s.connect(addr)
        while await s.recv() != b"HELLO":  # the writer says HELLO until every reader is subscribed
            pass
        ready.set()
        while (m := await s.recv()) == b"HELLO":
            pass
        lats: list[int] = []
        last = 0
        in_order = True
        lat = mode == "lat"
        loads = pickle.loads
        recv = s.recv
        for i in range(count):
            ts, _payload = loads(m if i == 0 else await recv())
            if lat:
                lats.append(time.perf_counter_ns() - ts)
            if ts < last:
                in_order = False
            last = ts
        t_end = time.perf_counter_ns()
        received = count
        idle_cpu = wake = None
        if mode == "idle":
            c0 = time.process_time()
            ts, _payload = loads(await recv())
            wake = time.perf_counter_ns() - ts
            idle_cpu = time.process_time() - c0
            received += 1
        q.put(reader_result(rank, t_end, lats, received, in_order, idle_cpu, wake))
    finally:
        s.close(linger=0)
        ctx.term()


def run_pyzmq(
    mode: str, readers: int, size: int, count: int, idle_s: float, transport: str, curve: bool = False
) -> dict[str, Any]:
    """pyzmq PUB (sync writer) to asyncio SUB readers, pickle protocol 5, SNDHWM = RCVHWM = 0
    (unbounded queues: nothing is dropped). ``curve``: CurveZMQ on every socket (the PUB is the
    CURVE server, each SUB a client with its own key pair; no ZAP handler, so no client key
    check: the handshake and the per-frame encryption are what is measured)."""
    zmq = importlib.import_module("zmq")
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUB)
    path = ""
    keys: list[tuple[bytes, bytes, bytes] | None] = [None] * readers
    try:
        s.setsockopt(zmq.SNDHWM, 0)
        if curve:
            server_public, server_secret = zmq.curve_keypair()
            s.curve_server = True
            s.curve_secretkey = server_secret
            keys = [(server_public, *zmq.curve_keypair()) for _ in range(readers)]
        if transport == "tcp":
            s.bind("tcp://127.0.0.1:*")
            addr = s.getsockopt(zmq.LAST_ENDPOINT).decode()
        else:
            path = os.path.join(tempfile.gettempdir(), f"aiobroadcast-bench-zmq-{os.getpid()}.sock")
            addr = f"ipc://{path}"
            s.bind(addr)
        mpc = mp.get_context("spawn")
        q = mpc.Queue()
        evs = [mpc.Event() for _ in range(readers)]
        procs = [
            mpc.Process(target=_zmq_reader, args=(addr, r, mode, count, q, evs[r], keys[r]), daemon=True)
            for r in range(readers)
        ]
        for p in procs:
            p.start()
        try:
            deadline = time.monotonic() + STEP_TIMEOUT_S
            while not all(e.is_set() for e in evs):
                if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                    raise RuntimeError("pyzmq readers did not subscribe")
                s.send(b"HELLO")
                time.sleep(0.01)
            time.sleep(0.05)  # let the last HELLOs drain
            payload = b"x" * size
            send = s.send
            dumps = pickle.dumps
            t0 = time.perf_counter_ns()
            if mode == "lat":
                for _ in range(count):
                    time.sleep(PACE_S)
                    send(dumps((time.perf_counter_ns(), payload), protocol=5))
            else:
                for _ in range(count):
                    send(dumps((time.perf_counter_ns(), payload), protocol=5))
            if mode == "idle":
                time.sleep(idle_s)
                send(dumps((time.perf_counter_ns(), payload), protocol=5))
            results = _collect(q, procs)
        finally:
            _reap(procs)
    finally:
        s.close(linger=0)
        ctx.term()
        if path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    out: dict[str, Any] = {"system": "pyzmq-curve" if curve else "pyzmq", "peer": "pyzmq-asyncio",
                           "transport": transport, "hwm": 0, "lossless": True}
    if curve:
        out["security"] = "curve"
    out.update(figures(mode, count, size, t0, results, idle_s))
    return out


# --- plumbing -------------------------------------------------------------------------------------
def _collect(q: Any, procs: list[Any]) -> list[dict[str, Any]]:
    """One result per reader process; fails if a reader dies without one."""
    import queue

    results: list[dict[str, Any]] = []
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while len(results) < len(procs):
        try:
            results.append(q.get(timeout=0.5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"reader processes failed (exit codes {dead})") from None
    return results


def _reap(procs: list[Any]) -> None:
    for p in procs:
        p.join(timeout=10)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def check_available(peer: str) -> str | None:
    """None if the peer is importable here, else why not."""
    try:
        if peer == "vllm":
            importlib.import_module("torch")
            _vllm_queue_class()
        else:
            zmq = importlib.import_module("zmq")
            importlib.import_module("zmq.asyncio")
            if peer == "pyzmq-curve" and not zmq.has("curve"):
                return "this libzmq was built without CURVE"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="peer driver of aiobroadcast bench")
    p.add_argument("peer", choices=(*PEERS, *EXTRA_PEERS))
    p.add_argument("mode", choices=MODES)
    p.add_argument("readers", type=int)
    p.add_argument("size", type=int)
    p.add_argument("count", type=int)
    p.add_argument("--transport", choices=("shm", "tcp"), default="shm")
    args = p.parse_args(argv)
    reason = check_available(args.peer)
    if reason is not None:
        print(json.dumps({"unavailable": args.peer, "reason": reason, "python": sys.executable}), flush=True)
        return UNAVAILABLE_RC
    idle_s = float(os.environ.get("IDLE_S", "5"))
    out: dict[str, Any] = {"mode": args.mode, "readers": args.readers, "size": args.size, "count": args.count}
    if args.peer == "vllm":
        out.update(run_vllm(args.mode, args.readers, args.size, args.count, idle_s, args.transport))
    else:
        curve = args.peer == "pyzmq-curve"
        out.update(run_pyzmq(args.mode, args.readers, args.size, args.count, idle_s, args.transport, curve))
    expected = _expected(args.mode, args.count)
    print(json.dumps(out), flush=True)
    if out["received"] != [expected] * args.readers or not out["in_order"]:
        print(f"{args.peer}: readers received {out['received']} (expected {expected} each, in order)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    # Run as a script: its folder (the aiobroadcast package) must not shadow anything.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [x for x in sys.path if os.path.abspath(x or os.curdir) != _here]
    sys.exit(main())
