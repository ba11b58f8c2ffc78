"""aiobroadcast's gather driver: N sender processes, one collector (this process).

    python -m aiobroadcast.cli._bench_gather SENDERS SIZE COUNT [--capacity N] [--slot-bytes N]
        [--loop uvloop|asyncio|trio] [--blocking]

The protocol's mode ``gather`` (the peers' PROTOCOL.md): each sender sends COUNT messages
``(time.perf_counter_ns(), sender, seq, payload)`` as fast as it can through ``open_sender``
(``put``); the collector (``open_collector``, ``get``) checks that it got exactly N*COUNT and
every sender's ``seq`` in order. ``msgs_per_s`` = N*COUNT / (the earliest first send, every
sender attached -> the collector has the last message); ``MB_per_s`` of payload. Prints one JSON
object on its last line; ``FAILED`` says what went wrong, if anything. ``--blocking``: both sides
use ``aiobroadcast.blocking`` (no event loop). The collector takes with ``get_many`` (a sender's
ring batch per call, as faster-fifo's driver takes with its ``get_many``); ``--get-one``: with
``get``, one delivery per call.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from typing import Any

import anyio
import anyio.lowlevel

from ._bench_driver import BLOCKING, _run_loop, peer_parser, report, ring_args, ring_for
from ._bench_figures import STEP_TIMEOUT_S, reap, wait_attached


def _sender_process(handle: str, rank: int, size: int, count: int, loop: str, ready: Any, go: Any, done: Any) -> None:
    try:
        main = _send_blocking if loop == BLOCKING else _send_async
        _run_loop(loop, main, handle, rank, size, count, ready, go)
    except BaseException as exc:
        done.put(f"sender {rank}: {type(exc).__name__}: {exc}")
        raise
    done.put(None)


# The async and blocking twins here (_send_*, _collect_*) are written out line for line, as in
# _bench_driver: their loops are what is measured, and sharing one through a callback would add
# a call per message to one API and not to the other.
async def _send_async(handle: str, rank: int, size: int, count: int, ready: Any, go: Any) -> None:
    from .. import open_sender

    async with open_sender(handle, name=f"s{rank}") as sender:
        ready.set()
        while not go.wait(0.001):  # before the clock: blocking the loop costs nothing
            await anyio.lowlevel.checkpoint()
        payload = b"x" * size
        put = sender.put
        now = time.perf_counter_ns
        name = f"s{rank}"
        for seq in range(count):
            await put((now(), name, seq, payload))


def _send_blocking(handle: str, rank: int, size: int, count: int, ready: Any, go: Any) -> None:
    from ..blocking import open_sender

    with open_sender(handle, name=f"s{rank}") as sender:
        ready.set()
        go.wait(STEP_TIMEOUT_S)
        payload = b"x" * size
        put = sender.put
        now = time.perf_counter_ns
        name = f"s{rank}"
        for seq in range(count):
            put((now(), name, seq, payload))


#: Shared memory all the senders' rings of a run take together at most: for messages up to 4 KiB
#: half of a CPU's L2 here (2 MiB), above it this machine's L3 (32 MiB).
GATHER_SMALL_RING_BYTES = 1 << 20
GATHER_RING_BYTES = 32 << 20


def ring_for_gather(size: int, senders: int) -> tuple[int, int]:
    """The senders' ring: the broadcast benchmark's slot (``ring_for``), with at most as many of
    its slots (but at least 256 of small ones, 8 of large ones) as keep every sender's ring
    together within ``GATHER_SMALL_RING_BYTES`` (messages up to 4 KiB) or ``GATHER_RING_BYTES``:
    4 senders get 1024 x 256 B at 64 B, and 64 x 68 KiB (the depth of iceoryx2's subscriber
    buffer in the same cell) at 64 KiB.

    Alternated on this project's 2-CPU machines, 4 senders, medians of 5-6 runs: at 64 B, 1024 slots
    367-380k msgs/s against 304-337k at 4096 (the broadcast ring's: the collector reads four rings
    in turn, and 4 MiB of them do not stay in its L2); at 64 KiB, 64 slots 62-96k msgs/s against
    49-59k at 15 (a sender whose ring is full sleeps until a quarter of it is free: a shallow ring
    puts it to sleep, and has the collector wake it, every few messages). Measured in one process,
    where no copy crosses CPUs, shallower rings of large slots had looked cheaper (8.5 us a put at
    16 slots against 12-14 us at 64, on a machine with an 8 MiB L3). In one interleaved sitting
    (docs/performance.md, "Fan-in and calls after tuning") the paired ratios to the old rings were
    1.08x at 64 B and 1.02x at 64 KiB: the latter within the noise of that sitting."""
    capacity, slot_bytes = ring_for(size)
    if size <= 4096:
        return max(256, min(capacity, GATHER_SMALL_RING_BYTES // (senders * slot_bytes))), slot_bytes
    return max(8, min(capacity, GATHER_RING_BYTES // (senders * slot_bytes))), slot_bytes


class _Senders:
    def __init__(self, handle: str, senders: int, size: int, count: int, loop: str) -> None:
        ctx = mp.get_context("spawn")
        self.done = ctx.Queue()
        self.go = ctx.Event()
        readies = [ctx.Event() for _ in range(senders)]
        self.procs = [
            ctx.Process(
                target=_sender_process,
                args=(handle, r, size, count, loop, readies[r], self.go, self.done),
                daemon=True,
            )
            for r in range(senders)
        ]
        wait_attached(self.procs, readies, "sender")

    def errors(self) -> list[str]:
        out = []
        for _ in self.procs:
            try:
                err = self.done.get(timeout=STEP_TIMEOUT_S)
            except Exception:
                return ["a sender reported nothing"]
            if err is not None:
                out.append(err)
        return out

    def join(self) -> None:
        reap(self.procs)


class _Check:
    """The collector's bookkeeping: per-sender order, the earliest first send."""

    def __init__(self, senders: int) -> None:
        self.next = {f"s{r}": 0 for r in range(senders)}
        self.first_ts: int | None = None
        self.problem: str | None = None
        from .. import Item

        self._item_type = Item

    def item(self, value: Any) -> None:
        ts, name, seq, _payload = value
        if seq != self.next.get(name, -1) and self.problem is None:
            self.problem = f"{name}: seq {seq} where {self.next.get(name)} was expected"
        self.next[name] = seq + 1
        if seq == 0 and (self.first_ts is None or ts < self.first_ts):
            self.first_ts = ts

    def batch(self, deliveries: list[Any], count: int) -> int:
        """Check what a ``get_many`` returned; the number of items among it."""
        n = 0
        item, item_type = self.item, self._item_type
        for d in deliveries:
            if type(d) is item_type:
                item(d.value)
                n += 1
            else:
                self.event(d, count)
        return n

    def event(self, d: Any, count: int) -> None:
        """A sender's close is expected once it sent everything; anything else is a failure."""
        from .. import SourceClosed

        if self.problem is None and not (isinstance(d, SourceClosed) and self.next.get(d.source) == count):
            self.problem = f"{d!r} before all of its items"


async def _collect_async(
    senders: int, size: int, count: int, capacity: int, slot_bytes: int, loop: str, one: bool
) -> Any:
    from .. import Item, open_collector

    async with open_collector(capacity=capacity, slot_bytes=slot_bytes) as collector:
        run = _Senders(collector.handle.to_json(), senders, size, count, loop)
        try:
            _attach_all(collector, senders)
            check = _Check(senders)
            item = check.item
            get = collector.get
            total = senders * count
            run.go.set()
            got = 0
            if one:
                while got < total:
                    d = await get()
                    if type(d) is Item:
                        item(d.value)
                        got += 1
                    else:
                        check.event(d, count)
            else:
                get_many, batch = collector.get_many, check.batch
                while got < total:
                    got += batch(await get_many(), count)
            t_end = time.perf_counter_ns()
            errors = run.errors()
        finally:
            run.join()
    return got, t_end, check, errors


def _collect_blocking(senders: int, size: int, count: int, capacity: int, slot_bytes: int, loop: str, one: bool) -> Any:
    from .. import Item
    from ..blocking import open_collector

    with open_collector(capacity=capacity, slot_bytes=slot_bytes) as collector:
        run = _Senders(collector.handle.to_json(), senders, size, count, loop)
        try:
            _attach_all(collector, senders)
            check = _Check(senders)
            item = check.item
            get = collector.get
            total = senders * count
            run.go.set()
            got = 0
            if one:
                while got < total:
                    d = get()
                    if type(d) is Item:
                        item(d.value)
                        got += 1
                    else:
                        check.event(d, count)
            else:
                get_many, batch = collector.get_many, check.batch
                while got < total:
                    got += batch(get_many(), count)
            t_end = time.perf_counter_ns()
            errors = run.errors()
        finally:
            run.join()
    return got, t_end, check, errors


def _attach_all(collector: Any, senders: int) -> None:
    """Before the clock: the collector attaches every sender's ring (taking nothing: none sent)."""
    from .. import WouldBlock

    deadline = time.monotonic() + STEP_TIMEOUT_S
    while len(collector.statistics().senders) < senders:
        if time.monotonic() > deadline:
            raise RuntimeError("the collector did not find every sender")
        try:
            collector.get_nowait()
        except WouldBlock:
            time.sleep(0.002)


def main(argv: list[str] | None = None) -> int:
    p = peer_parser("aiobroadcast.cli._bench_gather", __doc__, "senders")
    p.add_argument("--blocking", action="store_true", help="senders and collector use aiobroadcast.blocking")
    p.add_argument("--get-one", action="store_true", help="the collector takes with get(), not get_many()")
    args = p.parse_args(argv)
    loop = BLOCKING if args.blocking else args.loop
    capacity, slot_bytes = ring_args(args, ring_for_gather(args.size, args.senders))
    out: dict[str, Any] = {
        "system": "aiobroadcast",
        "mode": "gather",
        "readers": args.senders,
        "senders": args.senders,
        "size": args.size,
        "count": args.count,
        "transport": "shm",
        "loop": loop,
        "capacity": capacity,
        "slot_bytes": slot_bytes,
        "api": "blocking" if args.blocking else "async",
        "take": "get" if args.get_one else "get_many",
    }
    collect = _collect_blocking if args.blocking else _collect_async
    got, t_end, check, errors = _run_loop(
        loop, collect, args.senders, args.size, args.count, capacity, slot_bytes, loop, args.get_one
    )
    total = args.senders * args.count
    out["received"] = [got]
    out["in_order"] = check.problem is None
    if check.first_ts is not None:
        el = (t_end - check.first_ts) / 1e9
        out["msgs_per_s"] = round(total / el)
        out["MB_per_s"] = round(total * args.size / el / 1e6, 1)
    problems = [*errors, *([check.problem] if check.problem else [])]
    if got != total:
        problems.append(f"received {got} of {total}")
    return report(out, problems)


if __name__ == "__main__":
    sys.exit(main())
