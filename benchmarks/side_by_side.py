"""aiobroadcast side by side with its peers (vLLM's MessageQueue, pyzmq), in one sitting.

    python benchmarks/side_by_side.py [aiobroadcast bench options] [--peers] [--peer PEER ...]
        [--peer-python PYTHON] [--vllm-path DIR]

Runs ``aiobroadcast bench``'s cells (same options, same JSON objects) and, alternating with each
aiobroadcast run (A B A B ...), the peer drivers of ``benchmarks/peers.py`` in the peers' own
interpreter; prints the table with the ratios aiobroadcast / peer. docs/performance.md explains
the protocol and the figures. Needs a source checkout (it runs the peer drivers by path) and an
interpreter that imports aiobroadcast (this one).

The sitting is this script's: ``aiobroadcast bench`` measures aiobroadcast alone, and this script
runs its cells with the pieces of ``aiobroadcast.cli._bench`` that the command itself runs on
(the options, the cells, one run's driver command, the medians, the table's layout). The peer
drivers report what they measured; the figures of every system come from the same function,
``aiobroadcast.cli._bench_figures.figures``, run here for the peers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiobroadcast.cli import _bench as bench
from aiobroadcast.cli._bench_figures import figures

PEERS_SCRIPT = Path(__file__).resolve().with_name("peers.py")
#: The peers ``--peers`` runs; ``pyzmq-curve`` (pyzmq PUB/SUB with CurveZMQ) runs only when named.
PEERS = ("vllm", "pyzmq")
EXTRA_PEERS = ("pyzmq-curve",)
RATIO_NOTE = (
    "ratio = aiobroadcast / peer: for msgs/s and MB/s above 1 is better; for latency and CPU, below 1 is better."
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="benchmarks/side_by_side.py",
        description=bench.DESCRIPTION + " --peers runs vLLM's MessageQueue and pyzmq asyncio PUB/SUB in the same "
        "sitting, alternating with aiobroadcast, and prints the ratios aiobroadcast / peer.",
    )
    bench.add_options(p)
    p.add_argument("--peers", action="store_true", help="also run the peers (vllm, pyzmq), alternating")
    p.add_argument(
        "--peer",
        action="append",
        choices=(*PEERS, *EXTRA_PEERS),
        dest="only_peers",
        help="run this peer (repeatable; implies --peers); pyzmq-curve (pyzmq PUB/SUB with "
        "CurveZMQ) runs only when named",
    )
    p.add_argument(
        "--peer-python",
        default=sys.executable,
        help="interpreter for the peer drivers (needs pyzmq; vLLM also needs torch; default: this one)",
    )
    p.add_argument(
        "--vllm-path",
        default=None,
        help="folder that makes vllm.distributed.device_communicators.shm_broadcast importable "
        "(added to the peers' PYTHONPATH; default: $AIOBROADCAST_VLLM_PATH)",
    )
    return p


class Unavailable(Exception):
    """The system cannot run here (a peer its interpreter cannot import): it is skipped."""


#: Runs one cell of one system in fresh processes and returns the driver's JSON object.
Runner = Callable[[bench.Cell], dict[str, Any]]
#: Results of a sitting: the aggregate of each cell and system.
Results = dict[bench.Cell, dict[str, dict[str, Any]]]


def our_runner(args: argparse.Namespace) -> Runner:
    """aiobroadcast's runs: the driver ``aiobroadcast bench`` runs, with the same options."""
    return lambda cell: bench.run_driver(*bench.driver_command(cell, args), args.timeout)


def peer_runner(peer: str, args: argparse.Namespace) -> Runner:
    """How one peer runs a cell: its driver in ``--peer-python``, with the same transport and pause."""

    def run(cell: bench.Cell) -> dict[str, Any]:
        if cell.mode not in ("tput", "lat", "idle"):
            raise Unavailable(f"no peer driver for mode {cell.mode}")
        env = dict(os.environ)
        env["IDLE_S"] = repr(args.idle_s)
        if args.vllm_path:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (args.vllm_path, env.get("PYTHONPATH")) if p)
        cmd = [
            args.peer_python,
            str(PEERS_SCRIPT),
            peer,
            cell.mode,
            str(cell.readers),
            str(cell.size),
            str(cell.count),
            "--transport",
            args.transport,
        ]
        where = args.peer_python + (f" with PYTHONPATH={args.vllm_path}" if args.vllm_path else "")
        if shutil.which(args.peer_python) is None:
            raise Unavailable(f"cannot start {args.peer_python}")
        try:
            obj = bench.run_driver(cmd, env, args.timeout)
        except bench.RunFailed as exc:
            if exc.result is None or "unavailable" not in exc.result:
                raise
            hint = " (set --vllm-path or AIOBROADCAST_VLLM_PATH, and --peer-python)" if peer == "vllm" else ""
            reason = exc.result.get("reason")
            raise Unavailable(f"not importable by {where}: {reason}{hint}") from exc
        measured = obj.pop("t0"), obj.pop("reader_results"), obj.pop("idle_s")
        obj.update(figures(cell.mode, cell.count, cell.size, *measured))
        return obj

    return run


def ratio_table(cells: list[bench.Cell], results: Results, systems: list[str]) -> str:
    """Each cell's figures by system, with a column aiobroadcast / peer for each peer."""
    peers = [s for s in systems if s != bench.OURS]
    head = ["cell", "figure", *systems, *[f"{bench.OURS}/{p}" for p in peers]]
    rows: list[list[str]] = []
    for cell in cells:
        by_sys = results.get(cell, {})
        if not by_sys:
            continue
        figs = {s: dict(bench.figures_of(a)) for s, a in by_sys.items()}
        for k, name in enumerate(dict(bench.figures_of(next(iter(by_sys.values()))))):
            vals = {s: f[name] for s, f in figs.items()}
            shown = [bench.fmt(vals[s]) if s in vals else "-" for s in systems]
            rows.append([cell.label if k == 0 else "", name, *shown, *[_ratio(vals, p) for p in peers]])
    return bench.format_table(head, rows) + (f"\n{RATIO_NOTE}" if peers else "")


def _ratio(vals: dict[str, float], peer: str) -> str:
    if bench.OURS in vals and vals.get(peer, 0) > 0:
        return f"{vals[bench.OURS] / vals[peer]:.2f}x"
    return "-"


@dataclass
class Sitting:
    """The cells of ``args``, each ``--repeat`` times, running every system in turn (A B A B ...),
    so that a drift of the machine falls on every system alike. ``runners`` maps a system's name
    to how it runs one cell; aiobroadcast's comes first."""

    args: argparse.Namespace
    runners: dict[str, Runner]
    progress: bench.Progress = field(default_factory=bench.Progress)
    skipped: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def run(self) -> int:
        """Run the sitting and print the ratio table; the exit code."""
        problem = bench.check(self.args)
        if problem is not None:
            print(f"side_by_side.py: {problem}", file=sys.stderr)
            return 2
        cells = bench.select_cells(self.args)
        bench.introduce(self.progress, self.args, cells, list(self.runners))
        results: Results = {
            cell: self._cell(cell, k * self.args.repeat * len(self.runners), len(cells)) for k, cell in enumerate(cells)
        }
        rendered = ratio_table(cells, results, [s for s in self.runners if s not in self.skipped])
        rendered += "".join(f"\nskipped {system}: {reason}" for system, reason in self.skipped.items())
        return bench.finish(self.args, rendered, self.failures)

    def _cell(self, cell: bench.Cell, step: int, n_cells: int) -> dict[str, dict[str, Any]]:
        """The runs of one cell; the aggregates by system (printed with ``--json``)."""
        args, total = self.args, n_cells * self.args.repeat * len(self.runners)
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in self.runners}
        for rep in range(args.repeat):
            for system, runner in self.runners.items():
                step += 1
                if system in self.skipped:
                    continue
                where = f"[{step}/{total}] {cell.label}"
                self.progress.show(
                    f"{where} count={cell.count} run {rep + 1}/{args.repeat}: {system} ...", transient=True
                )
                try:
                    res = runner(cell)
                except Unavailable as exc:
                    self.skipped[system] = str(exc)
                    self.progress.say(f"skipping {system}: {exc}")
                    continue
                except bench.RunFailed as exc:
                    self.failures.append(f"{cell.label} {system}: {exc}")
                    self.progress.say(f"{cell.label} run {rep + 1}: {system} FAILED: {exc}")
                    continue
                runs[system].append(res)
                self.progress.show(f"{where} run {rep + 1}/{args.repeat}: {system}: {bench.headline(cell, res)}")
                if args.gap_s > 0:
                    time.sleep(args.gap_s)
        aggregates = {system: bench.aggregate(cell, system, r) for system, r in runs.items() if r}
        if args.json:
            for agg in aggregates.values():
                print(json.dumps(agg), flush=True)
        self.progress.say(
            f"{cell.label}: "
            + "; ".join(f"{s} {bench.headline(cell, a)}" for s, a in aggregates.items())
            + f" (medians of {args.repeat})"
        )
        return aggregates


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.vllm_path is None:
        args.vllm_path = os.environ.get("AIOBROADCAST_VLLM_PATH") or None
    peers = list(dict.fromkeys(args.only_peers or (PEERS if args.peers else ())))
    runners: dict[str, Runner] = {bench.OURS: our_runner(args), **{peer: peer_runner(peer, args) for peer in peers}}
    return Sitting(args, runners).run()


if __name__ == "__main__":
    sys.exit(main())
