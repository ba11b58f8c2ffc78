"""``aiobroadcast bench``: the broadcast benchmark protocol, measured on this machine.

Every run is a fresh set of processes (``python -P -m aiobroadcast.cli._bench_driver``: the
package as installed), which prints one JSON object; this module runs them, takes medians and
prints the table. docs/performance.md explains the protocol and every figure. One system only:
comparing with peers (vLLM's MessageQueue, pyzmq) is not the library's business; the source
tree's ``benchmarks/side_by_side.py`` does it, with the pieces of this module that the command
itself runs on (``add_options``, ``check``, ``select_cells``, ``driver_command``, ``run_driver``,
``aggregate``, ``figures_of``, ``format_table``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._base.errors import plural
from ._bench_driver import default_loop, ring_for
from ._bench_figures import MODES
from ._bench_gather import ring_for_gather
from ._common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, error

OURS = "aiobroadcast"


@dataclass(frozen=True)
class Cell:
    mode: str
    readers: int
    size: int
    count: int

    @property
    def label(self) -> str:
        who = "s" if self.mode in MANY_TO_ONE else "r"
        return f"{self.mode} {who}={self.readers} {fmt_size(self.size)}"


#: The cells of the protocol, in the order they run.
PROTOCOL_CELLS = (
    Cell("tput", 1, 64, 20000),
    Cell("tput", 2, 64, 20000),
    Cell("tput", 4, 64, 20000),
    Cell("tput", 1, 65536, 5000),
    Cell("tput", 2, 65536, 5000),
    Cell("tput", 1, 4194304, 300),
    Cell("tput", 2, 4194304, 300),
    Cell("lat", 1, 64, 1000),
    Cell("lat", 2, 64, 1000),
    Cell("lat", 4, 64, 1000),
    Cell("idle", 2, 64, 100),
)


#: Modes of the other direction, many to one (``Cell.readers`` counts senders there).
MANY_TO_ONE = ("gather",)
#: Request/reply: one caller, ``Cell.readers`` worker processes (open_caller/open_worker).
CALL = "call"


def default_count(mode: str, size: int) -> int:
    if mode == CALL:
        return 2000
    if mode == "gather":
        return 50000 if size <= 1024 else 5000
    if mode == "lat":
        return 1000
    if mode == "idle":
        return 100
    return 20000 if size <= 1024 else 5000 if size <= 65536 else 300


def fmt_size(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


# --- the command line -----------------------------------------------------------------------------
DESCRIPTION = (
    "Run the benchmark protocol (docs/performance.md): one writer process and READERS reader processes; "
    "modes tput (as fast as possible), lat (one message per ms: one-way latency) and idle (CPU of waiting "
    "readers, wake-up latency after a pause). Without --mode/--readers/--size every protocol cell runs; they "
    "select cells, and all three together name one cell. Each cell runs --repeat times and medians are "
    "reported. Progress goes to stderr; the table to stdout (stderr with --json)."
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``bench`` subcommand."""
    p = subparsers.add_parser("bench", help="run the broadcast benchmark on this machine", description=DESCRIPTION)
    add_options(p)
    p.set_defaults(func=run)


# argparse, spelled out per command as in the other cli modules: a table or wrapper of
# add_parser/add_argument calls would only hide argparse's own API.
def add_options(p: argparse.ArgumentParser) -> None:
    """The options of ``bench`` (``benchmarks/side_by_side.py`` takes them too)."""
    p.add_argument(
        "--mode",
        choices=(*MODES, *MANY_TO_ONE, CALL),
        help="only cells of this mode; gather: --senders processes send to one collector (open_sender, "
        "open_collector), as fast as they go; call: one caller calls --readers workers (open_caller, "
        "open_worker), a call every ms",
    )
    p.add_argument("--readers", type=int, help="only cells with this many reader processes")
    p.add_argument("--senders", type=int, help="with --mode gather: sender processes (default 4)")
    p.add_argument("--size", type=int, help="only cells with this payload size (bytes)")
    p.add_argument("--count", type=int, help="messages per run (default: the protocol's count for the cell)")
    p.add_argument("--repeat", type=int, default=3, help="runs per cell; medians are reported (default: 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object per cell on stdout")
    p.add_argument(
        "--transport",
        choices=("shm", "tcp"),
        default="shm",
        help="aiobroadcast over shared memory (default), or over TCP on 127.0.0.1",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="with --transport tcp: aiobroadcast's channel without encryption (frames authenticated "
        "with GMAC and HMAC-SHA256); default: sealed with AES-256-GCM, CurveZMQ admission",
    )
    p.add_argument("--idle-s", type=float, default=None, help="pause of mode idle in seconds (default: $IDLE_S or 5)")
    p.add_argument(
        "--capacity",
        type=int,
        help="aiobroadcast ring slots (default: up to 4 KiB messages as many as fit in 1 MiB, at most "
        "4096; 64 up to 64 KiB, else 10)",
    )
    p.add_argument(
        "--slot-bytes",
        type=int,
        help="aiobroadcast slot size (default: message size + 192 B up to 4 KiB messages, else + 4 KiB)",
    )
    p.add_argument(
        "--loop",
        choices=("uvloop", "asyncio", "trio"),
        default=default_loop(),
        help="event loop of aiobroadcast's writer and readers (default: uvloop if installed)",
    )
    p.add_argument(
        "--spin-us",
        type=float,
        default=None,
        help="aiobroadcast readers' open_reader(spin_us=...) (default: the library's adaptive poll)",
    )
    p.add_argument(
        "--zero-copy",
        action="store_true",
        help="aiobroadcast readers opened with open_reader(zero_copy=True): large payloads arrive "
        "as views of the ring, not copies (default: one copy out per reader)",
    )
    p.add_argument(
        "--blocking",
        action="store_true",
        help="aiobroadcast's writer and readers use the blocking API (aiobroadcast.blocking: no event "
        "loop, a waiting reader blocks in poll()); --loop is then ignored",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=1,
        help="with --mode tput: aiobroadcast's writer publishes with put_many, BATCH messages at a "
        "time (default 1: one put per message, as the protocol and the peers do)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a run is killed (default: 300)")
    p.add_argument("--gap-s", type=float, default=0.5, help="pause between runs in seconds (default: 0.5)")


def select_cells(args: argparse.Namespace) -> list[Cell]:
    if args.mode == CALL:
        size = 64 if args.size is None else args.size
        return [Cell(CALL, args.readers or 4, size, args.count or default_count(CALL, size))]
    if args.mode in MANY_TO_ONE:
        senders = args.senders or args.readers or 4
        size = 64 if args.size is None else args.size
        return [Cell(args.mode, senders, size, args.count or default_count(args.mode, size))]
    if args.mode is not None and args.readers is not None and args.size is not None:
        cells = [Cell(args.mode, args.readers, args.size, default_count(args.mode, args.size))]
    else:
        cells = [
            c
            for c in PROTOCOL_CELLS
            if (args.mode is None or c.mode == args.mode)
            and (args.readers is None or c.readers == args.readers)
            and (args.size is None or c.size == args.size)
        ]
        if not cells and args.mode is not None:
            readers = args.readers or 1
            size = 64 if args.size is None else args.size
            cells = [Cell(args.mode, readers, size, default_count(args.mode, size))]
    if args.count is not None:
        cells = [Cell(c.mode, c.readers, c.size, args.count) for c in cells]
    return cells


# --- running one driver ---------------------------------------------------------------------------
class RunFailed(Exception):
    """A run that did not end with a JSON object and exit status 0; ``result`` is its last JSON
    object, if it printed one."""

    def __init__(self, message: str, result: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.result = result


def driver_command(cell: Cell, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The driver command of one aiobroadcast run, and its environment. ``-P``: the package as
    installed, never a checkout that happens to be the working directory (as the TCP server)."""
    env = dict(os.environ)
    if cell.mode in ("gather", CALL):
        driver = "aiobroadcast.cli._bench_gather" if cell.mode == "gather" else "aiobroadcast.cli._bench_call"
        cmd = [sys.executable, "-P", "-m", driver, str(cell.readers), str(cell.size)]
        cmd += [str(cell.count), "--loop", args.loop]
        if args.capacity:
            cmd += ["--capacity", str(args.capacity)]
        if args.slot_bytes:
            cmd += ["--slot-bytes", str(args.slot_bytes)]
        if args.blocking:
            cmd.append("--blocking")
        return cmd, env
    env["IDLE_S"] = repr(args.idle_s)
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "aiobroadcast.cli._bench_driver",
        cell.mode,
        str(cell.readers),
        str(cell.size),
        str(cell.count),
        "--transport",
        args.transport,
        "--loop",
        args.loop,
    ]
    if args.capacity:
        cmd += ["--capacity", str(args.capacity)]
    if args.slot_bytes:
        cmd += ["--slot-bytes", str(args.slot_bytes)]
    if args.spin_us is not None:
        cmd += ["--spin-us", repr(args.spin_us)]
    if args.zero_copy:
        cmd.append("--zero-copy")
    if args.blocking:
        cmd.append("--blocking")
    if args.batch > 1:
        cmd += ["--batch", str(args.batch)]
    if args.insecure and args.transport == "tcp":
        cmd.append("--insecure")
    return cmd, env


def run_driver(cmd: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run one driver in its own process group; return its JSON object (its last line)."""
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        raise RunFailed(f"cannot start {cmd[0]}: {exc}") from exc
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc, signal.SIGKILL)
        proc.communicate()
        raise RunFailed(f"timed out after {timeout:g} s") from None
    except BaseException:  # Ctrl-C: let the drivers close their channels, then make sure
        _kill_group(proc, signal.SIGINT)
        try:
            proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            _kill_group(proc, signal.SIGKILL)
            proc.communicate()
        raise
    lines = [ln for ln in out.splitlines() if ln.strip()]
    obj: dict[str, Any] | None = None
    if lines:
        try:
            obj = json.loads(lines[-1])
        except json.JSONDecodeError:
            obj = None
    if proc.returncode != 0 or obj is None:
        tail = " | ".join(err.strip().splitlines()[-3:])
        raise RunFailed(f"exit status {proc.returncode}: {tail or 'no output'}", obj)
    return obj


def _kill_group(proc: subprocess.Popen[str], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# --- medians and the table ------------------------------------------------------------------------
def _med(values: Sequence[float]) -> float:
    return float(statistics.median(values))


#: The keys of a driver's object that differ from run to run: the figures, and what each reader got.
PER_RUN = frozenset(
    {
        "received",
        "in_order",
        "msgs_per_s",
        "MB_per_s",
        "p50_us",
        "p99_us",
        "idle_s",
        "reader_cpu_s",
        "reader_cpu_s_while_idle",
        "server_cpu_s_while_idle",
        "wake_latency_us",
    }
)


def aggregate(cell: Cell, system: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One object for a cell and system: the protocol's figures as medians over the runs."""
    first = runs[0]
    out: dict[str, Any] = {
        "system": system,
        "mode": cell.mode,
        "readers": cell.readers,
        "size": cell.size,
        "count": cell.count,
    }
    # What the driver says about the run (transport, ring, loop, ...) passes on as it is.
    out.update((k, v) for k, v in first.items() if k not in out and k not in PER_RUN)
    out["runs"] = len(runs)
    out["received"] = first["received"]
    out["in_order"] = all(r["in_order"] for r in runs)
    if cell.mode in MANY_TO_ONE:
        out["senders"] = cell.readers
    if cell.mode in ("tput", "gather"):
        out["msgs_per_s"] = round(_med([r["msgs_per_s"] for r in runs]))
        out["MB_per_s"] = round(_med([r["MB_per_s"] for r in runs]), 1)
        out["samples_msgs_per_s"] = [r["msgs_per_s"] for r in runs]
    elif cell.mode in ("lat", CALL):
        if cell.mode == CALL:
            out["reader_cpu_s"] = [round(_med(col), 3) for col in zip(*[r["reader_cpu_s"] for r in runs], strict=True)]
        out["p50_us"] = round(_med([r["p50_us"] for r in runs]), 1)
        out["p99_us"] = round(_med([r["p99_us"] for r in runs]), 1)
        out["samples_p50_us"] = [r["p50_us"] for r in runs]
        out["samples_p99_us"] = [r["p99_us"] for r in runs]
    else:
        cpu = [r["reader_cpu_s_while_idle"] for r in runs]
        wake = [r["wake_latency_us"] for r in runs]
        out["idle_s"] = first["idle_s"]
        out["reader_cpu_s_while_idle"] = [round(_med(col), 4) for col in zip(*cpu, strict=True)]
        out["wake_latency_us"] = [round(_med(col), 1) for col in zip(*wake, strict=True)]
        out["reader_cpu_s_while_idle_max"] = max(out["reader_cpu_s_while_idle"])
        out["wake_latency_us_p50"] = round(_med([x for r in wake for x in r]), 1)
        out["samples_reader_cpu_s_while_idle"] = cpu
        out["samples_wake_latency_us"] = wake
        server = [r["server_cpu_s_while_idle"] for r in runs if "server_cpu_s_while_idle" in r]
        if server:  # over TCP: the writer's server process
            out["server_cpu_s_while_idle"] = round(_med(server), 4)
            out["samples_server_cpu_s_while_idle"] = server
    return out


def figures_of(agg: dict[str, Any]) -> list[tuple[str, float]]:
    """The headline figures of one aggregate: (name, value) rows of the table."""
    if agg["mode"] in ("tput", "gather"):
        return [("msgs/s", agg["msgs_per_s"]), ("MB/s", agg["MB_per_s"])]
    if agg["mode"] in ("lat", CALL):
        return [("p50 us", agg["p50_us"]), ("p99 us", agg["p99_us"])]
    rows = [
        ("idle CPU s (worst reader's median)", agg["reader_cpu_s_while_idle_max"]),
        ("wake us (p50 of readers x runs)", agg["wake_latency_us_p50"]),
    ]
    if "server_cpu_s_while_idle" in agg:
        rows.append(("TCP server's idle CPU s (median)", agg["server_cpu_s_while_idle"]))
    return rows


def fmt(v: float) -> str:
    if v >= 1000:
        return f"{v:,.0f}"
    if v >= 100:
        return f"{v:.1f}"
    return f"{v:.3g}" if v >= 0.01 else f"{v:.4f}"


def format_table(head: list[str], rows: list[list[str]]) -> str:
    """Columns aligned: the first two to the left (cell, figure), numbers to the right."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [
        "  ".join(h.ljust(w) if i < 2 else h.rjust(w) for i, (h, w) in enumerate(zip(r, widths, strict=True)))
        for r in [head, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def table(cells: list[Cell], results: dict[Cell, dict[str, Any]]) -> str:
    """The table of ``aiobroadcast bench``: each cell's figures, one row each."""
    rows = [
        [cell.label if k == 0 else "", name, fmt(value)]
        for cell in cells
        if cell in results
        for k, (name, value) in enumerate(figures_of(results[cell]))
    ]
    return format_table(["cell", "figure", OURS], rows)


# --- the command ----------------------------------------------------------------------------------
class Progress:
    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.width = 0

    def show(self, text: str, *, transient: bool = False) -> None:
        """A progress line: overwritten by the next one on a terminal; elsewhere one line per
        result (``transient`` lines only appear on a terminal)."""
        if self.tty:
            sys.stderr.write("\r" + text.ljust(self.width))
            self.width = len(text)
        elif not transient:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def say(self, text: str) -> None:
        """A line that stays."""
        if self.tty and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            self.width = 0
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


def headline(cell: Cell, res: dict[str, Any]) -> str:
    if cell.mode in ("tput", "gather"):
        return f"{res['msgs_per_s']:,} msgs/s {res['MB_per_s']} MB/s"
    if cell.mode in ("lat", CALL):
        return f"p50 {res['p50_us']} us p99 {res['p99_us']} us"
    return f"idle CPU {res['reader_cpu_s_while_idle']} s, wake {res['wake_latency_us']} us"


def check(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, if anything; fills in the defaults that come from the environment."""
    if args.repeat < 1:
        return "--repeat must be at least 1"
    if args.senders is not None and (args.senders < 1 or args.mode not in MANY_TO_ONE):
        return "--senders must be at least 1, and is for --mode gather only"
    if args.mode in (*MANY_TO_ONE, CALL) and (args.transport != "shm" or args.zero_copy or args.spin_us is not None):
        return f"--mode {args.mode} runs over shared memory, without --zero-copy or --spin-us"
    if (
        (args.readers is not None and args.readers < 1)
        or (args.size is not None and args.size < 0)
        or (args.count is not None and args.count < 1)
    ):
        return "--readers and --count must be at least 1, --size at least 0"
    if args.batch < 1 or (args.batch > 1 and args.mode != "tput"):
        return "--batch must be at least 1, and more than 1 only with --mode tput"
    if args.idle_s is None:
        args.idle_s = float(os.environ.get("IDLE_S", "5"))
    if not select_cells(args):
        return "no protocol cell matches; give --mode, --readers and --size for one cell"
    return None


def introduce(progress: Progress, args: argparse.Namespace, cells: list[Cell], systems: list[str]) -> None:
    """The first lines of a sitting: what runs, on what, and aiobroadcast's ring for each size."""
    security = ""
    if args.transport == "tcp":
        security = " (insecure: GMAC)" if args.insecure else " (AES-256-GCM sealed)"
    progress.say(
        f"aiobroadcast bench: {plural(len(cells), 'cell')} x {plural(args.repeat, 'run')} of {', '.join(systems)}; "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, aiobroadcast over {args.transport}"
        f"{security} on {'the blocking API' if args.blocking else args.loop}"
    )
    for size, senders in dict.fromkeys((c.size, c.readers if c.mode in MANY_TO_ONE else 0) for c in cells):
        cap, slot = ring_for_gather(size, senders) if senders else ring_for(size)
        cap, slot = args.capacity or cap, args.slot_bytes or slot
        each = f"each of {senders} senders' " if senders else ""
        progress.say(
            f"  {each}ring for {fmt_size(size)} messages: capacity {cap} x slot_bytes {slot} "
            f"({fmt_size(cap * slot) if cap * slot % 1024 == 0 else f'{cap * slot} B'})"
        )


def run(args: argparse.Namespace) -> int:
    """``aiobroadcast bench``: every selected cell ``--repeat`` times, one run after the other;
    the medians (one JSON object per cell with ``--json``) and the table."""
    problem = check(args)
    if problem is not None:
        error(problem)
        return EXIT_USAGE
    cells = select_cells(args)
    progress = Progress()
    introduce(progress, args, cells, [OURS])
    results: dict[Cell, dict[str, Any]] = {}
    failures: list[str] = []
    step, total = 0, len(cells) * args.repeat
    for cell in cells:
        runs: list[dict[str, Any]] = []
        for rep in range(args.repeat):
            step += 1
            where = f"[{step}/{total}] {cell.label}"
            progress.show(f"{where} count={cell.count} run {rep + 1}/{args.repeat} ...", transient=True)
            try:
                res = run_driver(*driver_command(cell, args), args.timeout)
            except RunFailed as exc:
                failures.append(f"{cell.label}: {exc}")
                progress.say(f"{cell.label} run {rep + 1}: FAILED: {exc}")
                continue
            runs.append(res)
            progress.show(f"{where} run {rep + 1}/{args.repeat}: {headline(cell, res)}")
            if args.gap_s > 0:
                time.sleep(args.gap_s)
        if not runs:
            continue
        results[cell] = agg = aggregate(cell, OURS, runs)
        if args.json:
            print(json.dumps(agg), flush=True)
        progress.say(f"{cell.label}: {headline(cell, agg)} (medians of {len(runs)})")
    return finish(args, table(cells, results), failures)


def finish(args: argparse.Namespace, rendered: str, failures: list[str]) -> int:
    """Print the table (stdout; stderr with ``--json``) and the failed runs; the exit code."""
    print(rendered, file=sys.stderr if args.json else sys.stdout, flush=True)
    if failures:
        error(f"{plural(len(failures), 'run')} failed:")
        for f in failures:
            print(f"  {f}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK
