"""How fast a call could be on this design, with the roles' layers taken out of the worker.

    python benchmarks/call_floor.py WORKERS SIZE COUNT [--blocking] [--worker full|bare] [--caller full|bare]

The ``call`` cell of ``aiobroadcast bench`` (``aiobroadcast.cli._bench_call``: one caller, WORKERS
worker processes, COUNT calls paced 1 ms apart, p50/p99 from the call to the last answer), with
the same rings and wake-ups, but the worker's loop (and, with ``--caller bare``, the caller's)
written straight on the shared-memory source and publisher underneath the roles:

- ``--worker bare``: take with the source's ``get_nowait``, sleep with ``begin_sleep``, one wait on
  the inbox and ``end_sleep``; answer with the channel's ``encode`` and the publisher's
  ``try_publish``. No ``Worker``/``Request``, no ``Reader.get``/``Sender.put``/``Writer.put``: what
  is left is the ring, the codec and the wake-ups, about 20 Python calls per request.
- ``--caller bare`` (with ``--blocking``): publish the request and take the answers from the
  workers' rings directly, sleeping on the collector's inbox (announce on every ring, fence,
  re-check, wait, retract) as the collector does.

Not a way to use the library: it reaches into private attributes, skips every check (closed,
thread, dead peers, full rings) and stops on the first surprise. It measures what the roles' layers
cost (``full`` against ``bare``) and what the design costs without them (``bare`` against the
peers' ``call`` cell): docs/performance.md, "Calls: what the layers cost, and the floor under them".
Prints the bench's JSON line.
"""

from __future__ import annotations

import os
import select
import sys
import time
from typing import Any

import aiobroadcast.cli._bench_call as bc
from aiobroadcast._base.errors import EndOfStream, WouldBlock
from aiobroadcast._shm.layout import fence
from aiobroadcast.cli._bench_figures import STEP_TIMEOUT_S, reap


def _answer(encode: Any, publish: Any, cid: int, value: Any, rank: int) -> None:
    """The bench's answer to call ``cid``, published straight into the reply ring."""
    parts, total, oob = encode((cid, True, (value[1], rank, bc.REPLY)))
    if not publish(parts, total, oob, 1):
        raise RuntimeError("the reply ring is full")


def _bare_blocking(handle: str, rank: int) -> float:
    from aiobroadcast.blocking import open_worker

    cpu0: float | None = None
    with open_worker(handle, name=f"w{rank}") as worker:
        src: Any = worker._r._src
        ch: Any = worker._s._w._ch
        poll = select.poll()
        poll.register(src.inbox_fd, select.POLLIN)
        get, begin, end, drain = src.get_nowait, src.begin_sleep, src.end_sleep, src.drain_inbox
        encode, publish = ch.publishing.encode, ch.pub.try_publish
        while True:
            try:
                cid, value = get()
            except WouldBlock:
                if not begin():
                    poll.poll(1000)
                    end(drain())
                continue
            except EndOfStream:
                break
            if cpu0 is None:
                cpu0 = time.process_time()
            _answer(encode, publish, cid, value, rank)
    return time.process_time() - (cpu0 or 0.0)


async def _bare_async(handle: str, rank: int) -> float:
    from aiobroadcast import open_worker

    cpu0: float | None = None
    async with open_worker(handle, name=f"w{rank}") as worker:
        src: Any = worker._r._src
        ch: Any = worker._s._w._ch
        get, begin, end, sleep = src.get_nowait, src.begin_sleep, src.end_sleep, src.sleep
        encode, publish = ch.publishing.encode, ch.pub.try_publish
        while True:
            try:
                cid, value = get()
            except WouldBlock:
                if not begin():
                    woken = False
                    try:
                        woken = await sleep(1.0)
                    finally:
                        end(woken)
                continue
            except EndOfStream:
                break
            if cpu0 is None:
                cpu0 = time.process_time()
            _answer(encode, publish, cid, value, rank)
    return time.process_time() - (cpu0 or 0.0)


def _bare_caller(workers: int, size: int, count: int, capacity: int, slot_bytes: int, loop: str) -> Any:
    from aiobroadcast.blocking import open_caller

    check = bc._Check(workers)
    payload = b"x" * size
    now = time.perf_counter_ns
    with open_caller(workers=check.names, capacity=capacity, slot_bytes=slot_bytes) as caller:
        run = bc._Workers(caller.handle.to_json(), workers, loop)
        try:
            caller.call((now(), 0, b""), timeout=STEP_TIMEOUT_S)  # every worker attached
            c: Any = caller
            ch, gather = c._w._ch, c._c._g
            srcs = [f.src for f in gather.feeds]
            inbox = gather.inbox
            poll = select.poll()
            poll.register(inbox.fileno(), select.POLLIN)
            encode, publish = ch.publishing.encode, ch.pub.try_publish
            first = c._core.book.next_id  # ids the workers' late-reply check accepts
            for cid in range(first, first + count):
                t0 = now()
                parts, total, oob = encode((cid, (t0, cid, payload)))
                if not publish(parts, total, oob, 1):
                    raise RuntimeError("the request ring is full")
                got = 0
                while True:
                    for s in srcs:
                        if s.ready():
                            answer = s.get_nowait()
                            if answer[0] != cid:
                                raise RuntimeError(f"call {cid}: answer {answer!r}")
                            got += 1
                    if got >= workers:
                        break
                    for s in srcs:
                        s.announce_sleep()
                    fence()
                    if not any(s.ready() for s in srcs):
                        poll.poll(1000)
                        inbox.drain()
                    for s in srcs:
                        s.retract_sleep()
                check.lat_ns.append(now() - t0)
                time.sleep(bc.PACE_S)
            c._core.book.next_id = first + count
            caller.close()
            cpu, errors = run.results()
        finally:
            reap(run.procs)
    return check, cpu, errors


# Set in the worker processes too: spawn runs this module again there, as __mp_main__.
if os.environ.get("CALL_FLOOR_WORKER") == "bare":
    bc._work_blocking = _bare_blocking
    bc._work_async = _bare_async
if os.environ.get("CALL_FLOOR_CALLER") == "bare":
    bc._call_blocking = _bare_caller


def main() -> int:
    args = sys.argv[1:]
    for knob in ("--worker", "--caller"):
        if knob in args:
            i = args.index(knob)
            os.environ[f"CALL_FLOOR_{knob[2:].upper()}"] = args[i + 1]
            del args[i : i + 2]
    if os.environ.get("CALL_FLOOR_CALLER") == "bare" and "--blocking" not in args:
        raise SystemExit("--caller bare needs --blocking")
    if not os.environ.get("CALL_FLOOR_REEXEC"):
        # The module-level switches must be set as this file is first run: run again with them.
        env = dict(os.environ, CALL_FLOOR_REEXEC="1")
        os.execve(sys.executable, [sys.executable, __file__, *args], env)
    return bc.main(args)


if __name__ == "__main__":
    sys.exit(main())
