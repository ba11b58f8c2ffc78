"""aiobroadcast side by side with its peers (vLLM's MessageQueue, pyzmq), in one sitting.

    python benchmarks/side_by_side.py [aiobroadcast bench options] [--peers] [--peer PEER ...]
        [--peer-python PYTHON] [--vllm-path DIR]

Runs ``aiobroadcast bench``'s cells (same options, same JSON objects) and, alternating with each
aiobroadcast run (A B A B ...), the peer drivers of ``benchmarks/peers.py`` in the peers' own
interpreter; prints the table with the ratios aiobroadcast / peer. docs/performance.md explains
the protocol and the figures. Needs a source checkout (it runs the peer drivers by path) and an
interpreter that imports aiobroadcast (this one).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from aiobroadcast.cli import _bench as bench

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


def peer_runner(peer: str, args: argparse.Namespace) -> bench.Runner:
    """How one peer runs a cell: its driver in ``--peer-python``, with the same transport and pause."""

    def run(cell: bench.Cell) -> dict[str, Any]:
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
            raise bench.Unavailable(f"cannot start {args.peer_python}")
        try:
            return bench.run_driver(cmd, env, args.timeout)
        except bench.Unavailable as exc:
            hint = " (set --vllm-path or AIOBROADCAST_VLLM_PATH, and --peer-python)" if peer == "vllm" else ""
            raise bench.Unavailable(f"not importable by {where}: {exc}{hint}") from exc

    return run


def ratio_table(cells: list[bench.Cell], results: bench.Results, systems: list[str]) -> str:
    """``aiobroadcast bench``'s table, with a column aiobroadcast / peer for each peer."""
    peers = [s for s in systems if s != bench.OURS]
    head = ["cell", "figure", *systems, *[f"{bench.OURS}/{p}" for p in peers]]
    rows = [
        [label, name, *bench.values(vals, systems), *[_ratio(vals, p) for p in peers]]
        for label, name, vals in bench.rows_of(cells, results)
    ]
    return bench.format_table(head, rows) + (f"\n{RATIO_NOTE}" if peers else "")


def _ratio(vals: dict[str, float], peer: str) -> str:
    if bench.OURS in vals and vals.get(peer, 0) > 0:
        return f"{vals[bench.OURS] / vals[peer]:.2f}x"
    return "-"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.vllm_path is None:
        args.vllm_path = os.environ.get("AIOBROADCAST_VLLM_PATH") or None
    peers = list(dict.fromkeys(args.only_peers or (PEERS if args.peers else ())))
    runners: dict[str, bench.Runner] = {
        bench.OURS: bench.our_runner(args),
        **{peer: peer_runner(peer, args) for peer in peers},
    }
    return bench.Sitting(args, runners).run(ratio_table)


if __name__ == "__main__":
    sys.exit(main())
