"""The floor under any sleeping reader's wake-up latency on this host, without aiobroadcast.

    python benchmarks/wake_floor.py [--pause S] [--count N] [--readers R] [--loop blocking|uvloop|futex]
    python benchmarks/wake_floor.py --paced [--pickle] [--pause 0.001] [--count N] [--readers R]

Default (idle floor): R reader processes block on a Unix datagram socket (``recv`` in C, or an
event loop's ``add_reader``); a sender sleeps PAUSE seconds, stamps ``perf_counter_ns()`` and sends
the stamp to each reader. Each reader reports now - stamp. ``--loop futex``: each reader blocks
in ``futex(FUTEX_WAIT)`` on a word of its own in a shared page instead (the wake-up of a
process-shared condition variable, as faster-fifo's queues use); the sender writes the stamp,
bumps the word and calls ``FUTEX_WAKE``. Linux on x86-64 and aarch64 only.

``--paced`` (the paced floor, beside the ``lat`` cell of the benchmark, which sends one message
per ms): each reader is a bare uvloop reader parked on a FIFO with one persistent
``add_reader``; it announces in shared memory that it sleeps. The sender sleeps PAUSE seconds
(default 1 ms, as the ``lat`` cell), stamps the time into shared memory and writes one byte to
the FIFO of each reader that announced it sleeps. No serialisation, no ring: this is the least
an asyncio reader that sleeps (no spinning) can take to see a message here.

``--paced --pickle``: the same, with the message a library carries: the sender stamps the time,
pickles ``(stamp, 64 bytes)`` into the shared page and writes the byte; the reader unpickles it
and takes the stamp from it. The least a sleeping asyncio reader of pickled objects can take: what
the ``lat`` cell's readers (ours, and the peers that pickle: faster-fifo, vLLM) do on top of the
wake-up.

Prints one JSON object: the medians (and, paced, the p99) per reader. This is what a kernel
wake-up costs here (on a virtual machine, an idle vCPU must be woken by the hypervisor); a library
that sleeps instead of spinning cannot wake faster.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import pickle
import platform
import socket
import statistics
import struct
import tempfile
import time
from typing import Any

#: Per reader, in the shared page: the word it sets while it sleeps, the stamp of the message, and
#: the stamp it took last (the sender waits for it before the next message).
WORD = struct.Struct("=q")
FLAG, STAMP, TAKEN = 0, 8, 16
STRIDE = 24
#: Under ``--pickle``, where the message is (its length, then its bytes), after every reader's words.
MESSAGE = 1024
PAYLOAD = b"x" * 64


def _reader(path: str, count: int, loop: str, q: Any) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    lat: list[float] = []
    if loop == "blocking":
        q.put("ready")
        for _ in range(count):
            stamp = int(s.recv(64))
            lat.append((time.perf_counter_ns() - stamp) / 1000)
    else:
        import uvloop

        async def main() -> None:
            s.setblocking(False)
            ev_loop = asyncio.get_running_loop()
            q.put("ready")
            for _ in range(count):
                fut = ev_loop.create_future()
                ev_loop.add_reader(s.fileno(), fut.set_result, None)
                await fut
                ev_loop.remove_reader(s.fileno())
                stamp = int(s.recv(64))
                lat.append((time.perf_counter_ns() - stamp) / 1000)

        uvloop.run(main())
    q.put(lat)


#: ``futex(2)``'s system call number, and its operations on a word shared between processes.
SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
FUTEX_WAIT, FUTEX_WAKE = 0, 1
#: Under ``--loop futex``: reader ``i``'s word is at ``FUTEX_WORD * (i + 1)``, its stamp 8 bytes on.
FUTEX_WORD = 64
WORD32 = struct.Struct("=i")


def _futex(page: mmap.mmap, at: int) -> tuple[Any, int]:
    """The C ``syscall`` function, and the address of the 32-bit word at ``at`` in ``page`` (valid
    while ``page`` is mapped)."""
    if SYS_FUTEX is None:
        raise SystemExit(f"wake_floor: --loop futex knows no futex(2) number for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall, ctypes.addressof(ctypes.c_int32.from_buffer(page, at))


def _futex_reader(shm: str, rank: int, count: int, q: Any) -> None:
    with open(shm, "r+b") as f:
        page = mmap.mmap(f.fileno(), 0)
    at = FUTEX_WORD * (rank + 1)
    syscall, addr = _futex(page, at)
    lat: list[float] = []
    q.put("ready")
    seen = 0
    while seen < count:  # the word counts the sender's messages: one missed is not waited for
        while (now := WORD32.unpack_from(page, at)[0]) == seen:
            syscall(SYS_FUTEX, ctypes.c_void_p(addr), FUTEX_WAIT, seen, None, None, 0)
        stamp = WORD.unpack_from(page, at + 8)[0]
        lat.append((time.perf_counter_ns() - stamp) / 1000)
        seen = now
    q.put(lat)


def _paced_reader(fifo: str, shm: str, rank: int, count: int, q: Any, pickled: bool) -> None:
    import uvloop

    fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # read-write: never sees end of file
    with open(shm, "r+b") as f:
        page = mmap.mmap(f.fileno(), 0)
    flag_at, stamp_at = STRIDE * rank + FLAG, STRIDE * rank + STAMP
    lat: list[float] = []

    async def main() -> None:
        ev_loop = asyncio.get_running_loop()
        waiter: list[asyncio.Future[None]] = []

        def readable() -> None:
            os.read(fd, 64)
            if waiter and not waiter[0].done():
                waiter[0].set_result(None)

        ev_loop.add_reader(fd, readable)  # once: no registration per sleep
        q.put("ready")
        seen = 0
        for _ in range(count):
            waiter[:] = [ev_loop.create_future()]
            WORD.pack_into(page, flag_at, 1)
            if WORD.unpack_from(page, stamp_at)[0] == seen:  # else it came before we announced
                await waiter[0]
            WORD.pack_into(page, flag_at, 0)
            seen = WORD.unpack_from(page, stamp_at)[0]
            if pickled:
                n = WORD.unpack_from(page, MESSAGE)[0]
                stamp, payload = pickle.loads(page[MESSAGE + 8 : MESSAGE + 8 + n])
            else:
                stamp, payload = seen, PAYLOAD
            now = time.perf_counter_ns()  # the message is seen; what follows is bookkeeping
            if stamp != seen or payload != PAYLOAD:
                raise RuntimeError(f"reader {rank}: the message is not the one announced")
            WORD.pack_into(page, STRIDE * rank + TAKEN, seen)
            lat.append((now - stamp) / 1000)
        ev_loop.remove_reader(fd)

    uvloop.run(main())
    q.put(lat)


def _run(ctx: Any, procs: list[Any], q: Any, send: Any, count: int) -> list[list[float]]:
    for proc in procs:
        proc.start()
    for _ in procs:
        assert q.get(timeout=30) == "ready"
    for _ in range(count):
        send()
    results = [q.get(timeout=30) for _ in procs]
    for proc in procs:
        proc.join()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--pause", type=float, default=None, help="seconds between messages (default 1, paced 0.001)")
    p.add_argument("--count", type=int, default=None, help="messages (default 5, paced 2000)")
    p.add_argument("--readers", type=int, default=2)
    p.add_argument("--loop", choices=("blocking", "uvloop", "futex"), default="blocking")
    p.add_argument("--paced", action="store_true", help="the paced floor: uvloop readers on a FIFO, announced sleeps")
    p.add_argument("--pickle", action="store_true", help="paced: carry a pickled (stamp, 64 bytes) message")
    args = p.parse_args()
    if args.pickle and not args.paced:
        p.error("--pickle goes with --paced")
    if args.paced and args.loop != "blocking":
        p.error("--paced readers are uvloop readers on a FIFO: no --loop")
    pause = args.pause if args.pause is not None else (0.001 if args.paced else 1.0)
    count = args.count if args.count is not None else (2000 if args.paced else 5)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        if args.paced:
            shm = os.path.join(d, "page")
            with open(shm, "w+b") as f:
                f.write(b"\0" * mmap.PAGESIZE)
                f.flush()
                page = mmap.mmap(f.fileno(), 0)
            fifos = [os.path.join(d, f"r{i}.fifo") for i in range(args.readers)]
            for fifo in fifos:
                os.mkfifo(fifo, 0o600)
            procs = [
                ctx.Process(target=_paced_reader, args=(fifo, shm, i, count, q, args.pickle))
                for i, fifo in enumerate(fifos)
            ]
            fds: list[int] = []

            def send() -> None:
                time.sleep(pause)
                # Wait (sleeping) until every reader has taken the previous message and sleeps again.
                while not all(
                    WORD.unpack_from(page, STRIDE * i + FLAG)[0]
                    and WORD.unpack_from(page, STRIDE * i + TAKEN)[0] == WORD.unpack_from(page, STRIDE * i + STAMP)[0]
                    for i in range(args.readers)
                ):
                    if not all(proc.is_alive() for proc in procs):
                        raise SystemExit("wake_floor: a reader process died (its error is above)")
                    time.sleep(pause)
                now = time.perf_counter_ns()
                if args.pickle:
                    body = pickle.dumps((now, PAYLOAD), protocol=5)
                    WORD.pack_into(page, MESSAGE, len(body))
                    page[MESSAGE + 8 : MESSAGE + 8 + len(body)] = body
                for i in range(args.readers):
                    WORD.pack_into(page, STRIDE * i + STAMP, now)
                for i, fd in enumerate(fds):
                    if WORD.unpack_from(page, STRIDE * i + FLAG)[0]:
                        os.write(fd, b"\0")

            for proc in procs:
                proc.start()
            for _ in procs:
                assert q.get(timeout=30) == "ready"
            fds = [os.open(fifo, os.O_WRONLY | os.O_NONBLOCK) for fifo in fifos]
            for _ in range(count):
                send()
            results = [q.get(timeout=30) for _ in procs]
            for proc in procs:
                proc.join()
            for fd in fds:
                os.close(fd)
            page.close()
        elif args.loop == "futex":
            shm = os.path.join(d, "page")
            with open(shm, "w+b") as f:
                f.write(b"\0" * max(mmap.PAGESIZE, FUTEX_WORD * (args.readers + 1)))
                f.flush()
                page = mmap.mmap(f.fileno(), 0)
            words = [_futex(page, FUTEX_WORD * (i + 1)) for i in range(args.readers)]
            procs = [ctx.Process(target=_futex_reader, args=(shm, i, count, q)) for i in range(args.readers)]
            bumps = [0] * args.readers

            def send() -> None:
                time.sleep(pause)
                stamp = time.perf_counter_ns()
                for i, (syscall, addr) in enumerate(words):
                    at = FUTEX_WORD * (i + 1)
                    WORD.pack_into(page, at + 8, stamp)
                    bumps[i] += 1
                    WORD32.pack_into(page, at, bumps[i])
                    syscall(SYS_FUTEX, ctypes.c_void_p(addr), FUTEX_WAKE, 1, None, None, 0)

            results = _run(ctx, procs, q, send, count)
            page.close()
        else:
            paths = [os.path.join(d, f"r{i}.sock") for i in range(args.readers)]
            procs = [ctx.Process(target=_reader, args=(path, count, args.loop, q)) for path in paths]
            out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

            def send() -> None:
                time.sleep(pause)
                stamp = str(time.perf_counter_ns()).encode()
                for path in paths:
                    out.sendto(stamp, path)

            results = _run(ctx, procs, q, send, count)
            out.close()
    out_json: dict[str, Any] = {
        "pause_s": pause,
        "loop": "uvloop" if args.paced else args.loop,
        "paced": args.paced,
        "pickle": args.pickle,
        "readers": args.readers,
        "count": count,
        "wake_latency_us_median_per_reader": [round(statistics.median(r), 1) for r in results],
    }
    if args.paced:
        out_json["p50_us"] = round(statistics.median(x for r in results for x in r), 1)
        out_json["p99_us"] = round(statistics.quantiles([x for r in results for x in r], n=100)[98], 1)
    print(json.dumps(out_json))


if __name__ == "__main__":
    main()
