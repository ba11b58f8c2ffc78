"""The benchmark protocol's figures, computed by the same code for every system measured.

``aiobroadcast bench``'s driver computes its figures with ``figures``; the source tree's
``benchmarks/side_by_side.py`` imports it to compute the peers' figures from what their drivers
(``benchmarks/peers.py``, in the peers' own interpreter) measured.
"""

from __future__ import annotations

import glob
import os
import queue
import time
from typing import Any

MODES = ("tput", "lat", "idle")
#: Pacing of mode ``lat`` (seconds between messages).
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
    """What a reader process sends back to its writer."""
    return {
        "rank": rank,
        "t_end": t_end,
        "lats": lats,
        "received": received,
        "in_order": in_order,
        "idle_cpu_s": idle_cpu_s,
        "wake_ns": wake_ns,
    }


def server_cpu_ns() -> int | None:
    """CPU time so far, in nanoseconds, of this process's TCP server children (the processes it
    started that run ``aiobroadcast._tcp.server``), every thread counted (``/proc/PID/task/*/
    schedstat``: nanoseconds, where ``/proc/PID/stat`` counts 10 ms ticks); None where /proc
    cannot say (not Linux, or no server)."""
    me, total, found = os.getpid(), 0, False
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat, "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if int(fields[1]) != me:  # the parent's pid follows the state
                continue
            pid = stat.split("/")[2]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"aiobroadcast._tcp.server" not in f.read():
                    continue
            for task in glob.glob(f"/proc/{pid}/task/*/schedstat"):
                with open(task, "rb") as f:
                    total += int(f.read().split()[0])
            found = True
        except (OSError, IndexError, ValueError):  # it ended meanwhile, or not Linux's format
            continue
    return total if found else None


def figures(
    mode: str,
    count: int,
    size: int,
    t0: int,
    results: list[dict[str, Any]],
    idle_s: float,
    server_idle_ns: int | None = None,
) -> dict[str, Any]:
    """The protocol's figures from the readers' results (``t0``: first send, perf_counter ns).

    - ``tput``: ``msgs_per_s`` = COUNT / (first send -> last reader has its last message),
      ``MB_per_s`` of payload (10**6 bytes).
    - ``lat``: one-way latency over all readers' samples, ``p50_us`` and ``p99_us``.
    - ``idle``: ``reader_cpu_s_while_idle`` (CPU seconds each reader used during the pause) and
      ``wake_latency_us`` (latency of the message after the pause), one value per reader; over
      TCP also ``server_cpu_s_while_idle``, the writer's TCP server process's CPU seconds over
      the writer's pause (``server_idle_ns``).
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
        out["reader_cpu_s_while_idle"] = [round(float(r["idle_cpu_s"]), 4) for r in results]
        out["wake_latency_us"] = [round(int(r["wake_ns"]) / 1e3, 1) for r in results]
        if server_idle_ns is not None:
            out["server_cpu_s_while_idle"] = round(server_idle_ns / 1e9, 4)
    return out


def expected(mode: str, count: int) -> int:
    """Messages each reader must receive: COUNT, and one more after the pause of mode ``idle``."""
    return count + 1 if mode == "idle" else count


def collect(q: Any, procs: list[Any]) -> list[dict[str, Any]]:
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
    return results


def wait_attached(procs: list[Any], readies: list[Any], what: str) -> None:
    """Start ``procs`` and wait until each has set its event in ``readies``; if one exits first or
    STEP_TIMEOUT_S passes, reap them all and raise ``RuntimeError`` naming ``what``."""
    for p in procs:
        p.start()
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while not all(e.is_set() for e in readies):
        if time.monotonic() > deadline or any(p.exitcode is not None for p in procs):
            reap(procs)
            raise RuntimeError(f"{what} processes did not attach")
        time.sleep(0.005)  # before the run: blocking the event loop costs nothing


def reap(procs: list[Any]) -> None:
    """Join the reader processes; kill the ones that do not end within 10 s."""
    for p in procs:
        p.join(timeout=10)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
