"""Peer drivers for ``benchmarks/side_by_side.py``: vLLM's MessageQueue and pyzmq, measured by
aiobroadcast's benchmark protocol.

    PEER_PYTHON benchmarks/peers.py PEER MODE READERS SIZE COUNT [--transport shm|tcp]

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

This file runs as a script in the peer's interpreter, which need not have aiobroadcast or its
dependencies installed: it imports the standard library and the peer's own packages, nothing
else. It measures and does not compute figures: its JSON line carries what the readers reported
(``reader_results``, as ``aiobroadcast.cli._bench_figures.reader_result`` shapes them), the
first send (``t0``) and the pause (``idle_s``), and ``side_by_side.py``, in aiobroadcast's
interpreter, computes every system's figures with the same function
(``aiobroadcast.cli._bench_figures.figures``).
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
import queue
import sys
import tempfile
import time
from typing import Any

PEERS = ("vllm", "pyzmq")
#: Peers that run only when named (``--peer``).
EXTRA_PEERS = ("pyzmq-curve",)
#: Exit status of a driver whose peer is not importable here.
UNAVAILABLE_RC = 3
VLLM_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
MODES = ("tput", "lat", "idle")
#: Pacing of mode ``lat`` (seconds between messages), as aiobroadcast's driver.
PACE_S = 0.001
#: How long a reader or the writer waits for anything before giving up (seconds).
STEP_TIMEOUT_S = 120.0


def reader_result(
    rank: int,
    t_end: int,
    lats: list[int],
    received: int,
    in_order: bool,
    idle_cpu_s: float | None = None,
    wake_ns: int | None = None,
) -> dict[str, Any]:
    """What a reader process sends back to its writer (the fields ``figures`` reads)."""
    return {
        "rank": rank,
        "t_end": t_end,
        "lats": lats,
        "received": received,
        "in_order": in_order,
        "idle_cpu_s": idle_cpu_s,
        "wake_ns": wake_ns,
    }


def _collect(q: Any, procs: list[Any]) -> list[dict[str, Any]]:
    """One result per reader process; fails if a reader dies without one, or reports an error."""
    results: list[dict[str, Any]] = []
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while len(results) < len(procs):
        try:
            res = q.get(timeout=0.5)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"reader processes failed (exit codes {dead})") from None
            continue
        if "error" in res:
            raise RuntimeError(f"reader {res['rank']} failed: {res['error']}")
        results.append(res)
    return sorted(results, key=lambda r: int(r["rank"]))


def _reap(procs: list[Any]) -> None:
    """Join the reader processes; kill the ones that do not end within 10 s."""
    for p in procs:
        p.join(timeout=10)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def _measured(t0: int, results: list[dict[str, Any]], idle_s: float) -> dict[str, Any]:
    """What side_by_side.py computes the figures from."""
    return {"t0": t0, "idle_s": idle_s, "reader_results": results}


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
                    os.unlink(addr[len("ipc://") :])
    out: dict[str, Any] = {
        "system": "vllm",
        "peer": "vllm",
        "transport": transport,
        "max_chunk_bytes": chunk,
        "max_chunks": 10,
    }
    out.update(_measured(t0, results, idle_s))
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
    out: dict[str, Any] = {
        "system": "pyzmq-curve" if curve else "pyzmq",
        "peer": "pyzmq-asyncio",
        "transport": transport,
        "hwm": 0,
        "lossless": True,
    }
    if curve:
        out["security"] = "curve"
    out.update(_measured(t0, results, idle_s))
    return out


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
    p = argparse.ArgumentParser(description="peer driver of benchmarks/side_by_side.py")
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
    expected = args.count + 1 if args.mode == "idle" else args.count  # one more after the pause
    print(json.dumps(out), flush=True)
    received = [r["received"] for r in out["reader_results"]]
    if received != [expected] * args.readers or not all(r["in_order"] for r in out["reader_results"]):
        print(f"{args.peer}: readers received {received} (expected {expected} each, in order)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
