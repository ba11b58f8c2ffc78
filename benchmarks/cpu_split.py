"""Where a run's CPU goes: per process and per thread, for any benchmark command.

    python benchmarks/cpu_split.py [--messages N] [--every-ms MS] -- COMMAND [ARGS...]

Runs COMMAND and, every MS milliseconds until it exits, reads the CPU time (user and system) of
every thread of COMMAND's process and of all its descendants from /proc. Prints one JSON object:
a row per thread (pid, tid, thread name, the process's command line, user and system seconds),
the total, and with ``--messages`` the CPU per message in microseconds, per row and in all; then
COMMAND's own last line of output, unchanged.

A thread's figure is its last sample, so a thread that ends between two samples loses up to MS
milliseconds (keep runs long against MS: seconds, not milliseconds). The tree is walked at every
sample for the first ``EARLY_S``, then every ``RESCAN`` samples (new processes are found that late
at most); in between only the known processes are read. The sampler's own CPU is reported
(``sampler_cpu_s``): it runs beside the command, on the same CPUs. Linux only.

Used to put aiobroadcast's processes beside a peer's on one cell, e.g. over TCP at 64 KiB:

    python benchmarks/cpu_split.py --messages 30000 -- \\
        python -m aiobroadcast bench --transport tcp --mode tput --readers 1 --size 65536 \\
        --count 30000 --repeat 1 --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
#: samples between two walks of the whole process table (a walk reads every process's stat)
RESCAN = 10
#: for this long after the start every sample walks it: the command's processes are born then, and a
#: short run on a loaded machine could otherwise end before the first walk that would find them
EARLY_S = 2.0


def _stat_fields(path: str) -> tuple[str, list[str]]:
    """The name and the fields after it of a /proc ``stat`` file (the name may hold spaces)."""
    with open(path) as f:
        text = f.read()
    return text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()


def descendants(root: int) -> list[int]:
    """``root`` and every process below it, now."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                _name, fields = _stat_fields(f"/proc/{entry}/stat")
            except (OSError, ValueError):
                continue  # gone meanwhile
            children[int(fields[1])].append(int(entry))
    found = [root]
    for pid in found:
        found.extend(children.get(pid, ()))
    return found


def sample(pids: list[int], rows: dict[tuple[int, int], dict[str, Any]], commands: dict[int, str]) -> None:
    """Record the CPU time of every thread of ``pids`` into ``rows`` (the latest wins), and each
    process's command line into ``commands`` (the latest seen: a process caught between its
    ``fork`` and its ``exec`` shows its parent's; an exited process has none)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            if cmdline:
                commands[pid] = cmdline
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        command = commands.get(pid, "")
        for tid in tids:
            try:
                name, fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
            except (OSError, ValueError):
                continue
            rows[(pid, int(tid))] = {
                "pid": pid,
                "tid": int(tid),
                "thread": name,
                "command": command[:120],
                "user_s": int(fields[11]) * TICK_S,
                "sys_s": int(fields[12]) * TICK_S,
            }


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--messages", type=int, default=None, help="messages the run moves: adds CPU per message")
    p.add_argument("--every-ms", type=float, default=20.0, help="sampling period (default 20 ms)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    if args.messages is not None and args.messages <= 0:
        p.error("--messages must be positive")
    if args.every_ms <= 0:
        p.error("--every-ms must be positive")
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    commands: dict[int, str] = {}
    # The command's output goes to a file, read once it exits (a pipe nobody reads could fill).
    with tempfile.TemporaryFile("w+") as output:
        proc = subprocess.Popen(command, stdout=output, text=True)
        cpu0 = time.process_time()
        pids: list[int] = []
        n = 0
        started = time.monotonic()
        while proc.poll() is None:
            if n % RESCAN == 0 or time.monotonic() - started < EARLY_S:
                pids = descendants(proc.pid)
            sample(pids, rows, commands)
            n += 1
            time.sleep(args.every_ms / 1000)
        sampler_cpu = time.process_time() - cpu0
        output.seek(0)
        out = output.read()
    if proc.returncode != 0:
        print(out, end="")
        print(f"cpu_split: the command exited with {proc.returncode}", file=sys.stderr)
        return proc.returncode
    threads = sorted((r for r in rows.values() if r["user_s"] + r["sys_s"] > 0), key=lambda r: (r["pid"], r["tid"]))
    total = sum(r["user_s"] + r["sys_s"] for r in threads)
    result: dict[str, Any] = {
        "threads": threads,
        "total_cpu_s": round(total, 3),
        "sampler_cpu_s": round(sampler_cpu, 3),
    }
    if args.messages is not None:
        for r in threads:
            r["us_per_msg"] = round((r["user_s"] + r["sys_s"]) / args.messages * 1e6, 1)
        result["us_per_msg"] = round(total / args.messages * 1e6, 1)
    for r in threads:
        r["user_s"] = round(r["user_s"], 3)
        r["sys_s"] = round(r["sys_s"], 3)
    print(json.dumps(result))
    lines = out.strip().splitlines()
    if lines:
        print(lines[-1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
