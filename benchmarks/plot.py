"""Plot ``benchmarks/side_by_side.py --peers --json`` results: throughput against readers and against size.

    python benchmarks/plot.py docs/performance.jsonl docs/performance.png   # also prints a markdown table

Needs matplotlib (not a dependency of aiobroadcast; ``pip install matplotlib``). The input is the
JSON lines that ``side_by_side.py --json`` prints (one object per cell and system, medians).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

STYLE = {"aiobroadcast": ("tab:blue", "o"), "vllm": ("tab:orange", "s"), "pyzmq": ("tab:green", "^")}
LABEL = {"aiobroadcast": "aiobroadcast (shm)", "vllm": "vLLM MessageQueue", "pyzmq": "pyzmq asyncio PUB/SUB"}


def load(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip().startswith("{")]


def pick(rows: Iterable[dict[str, Any]], **want: Any) -> list[dict[str, Any]]:
    return [r for r in rows if all(r.get(k) == v for k, v in want.items())]


def size_label(n: int) -> str:
    return {64: "64 B", 65536: "64 KiB", 4194304: "4 MiB"}.get(n, f"{n} B")


def main(src: str, dst: str) -> None:
    rows = load(src)
    systems = [s for s in STYLE if pick(rows, system=s)]
    fig, (ax_r, ax_s, ax_l) = plt.subplots(1, 3, figsize=(15, 4.6))

    # 1. 64 B throughput against readers.
    for s in systems:
        pts = sorted((r["readers"], r["msgs_per_s"]) for r in pick(rows, system=s, mode="tput", size=64))
        if pts:
            color, marker = STYLE[s]
            ax_r.plot(*zip(*pts, strict=True), color=color, marker=marker, label=LABEL[s])
    ax_r.set(title="64 B messages: throughput vs readers", xlabel="reader processes", ylabel="messages / s")
    ax_r.set_xticks([1, 2, 4])
    ax_r.set_ylim(bottom=0)

    # 2. Throughput (MB/s of payload) against message size, 1 and 2 readers.
    for s in systems:
        color, marker = STYLE[s]
        for readers, ls in ((1, "-"), (2, "--")):
            pts = sorted((r["size"], r["MB_per_s"]) for r in pick(rows, system=s, mode="tput", readers=readers))
            if pts:
                ax_s.plot(
                    *zip(*pts, strict=True),
                    color=color,
                    marker=marker,
                    linestyle=ls,
                    label=f"{s}, {readers} reader{'s' if readers > 1 else ''}",
                )
    ax_s.set(
        title="throughput vs message size",
        xlabel="payload bytes (log)",
        ylabel="MB/s of payload (log)",
        xscale="log",
        yscale="log",
    )
    ax_s.set_xticks([64, 65536, 4194304], [size_label(n) for n in (64, 65536, 4194304)])
    ax_s.legend(fontsize=7)

    # 3. Paced latency against readers.
    for s in systems:
        color, marker = STYLE[s]
        lat = sorted((r["readers"], r["p50_us"], r["p99_us"]) for r in pick(rows, system=s, mode="lat"))
        if lat:
            xs = [x[0] for x in lat]
            ax_l.plot(xs, [x[1] for x in lat], color=color, marker=marker, label=f"{s} p50")
            ax_l.plot(xs, [x[2] for x in lat], color=color, marker=marker, linestyle=":", label=f"{s} p99")
    ax_l.set(
        title="latency, one 64 B message per ms (lower is better)",
        xlabel="reader processes",
        ylabel="one-way latency (us, log)",
        yscale="log",
    )
    ax_l.set_xticks([1, 2, 4])
    ax_l.legend(fontsize=7)

    ax_r.legend(fontsize=8)
    for ax in (ax_r, ax_s, ax_l):
        ax.grid(alpha=0.3)
    fig.suptitle("aiobroadcast vs vLLM MessageQueue vs pyzmq — medians, same sitting, 2-core host", fontsize=11)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


def markdown(src: str) -> str:
    """The results as a markdown table with the ratios aiobroadcast / peer."""
    rows = load(src)
    out = [
        "| cell | figure | aiobroadcast | vLLM | pyzmq | aiobroadcast / vLLM | aiobroadcast / pyzmq |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    cells = list(dict.fromkeys((r["mode"], r["readers"], r["size"]) for r in rows))
    for mode, readers, size in cells:
        by = {r["system"]: r for r in pick(rows, mode=mode, readers=readers, size=size)}
        if mode == "tput":
            figs = [("msgs/s", "msgs_per_s"), ("MB/s", "MB_per_s")]
        elif mode == "lat":
            figs = [("p50 us", "p50_us"), ("p99 us", "p99_us")]
        else:
            figs = [
                ("CPU s per reader while idle (worst reader's median)", "reader_cpu_s_while_idle_max"),
                ("wake-up latency us (p50)", "wake_latency_us_p50"),
            ]
        for k, (name, key) in enumerate(figs):
            vals = {s: by[s][key] for s in by}
            ours = vals.get("aiobroadcast")

            def cell_val(s: str, vals: dict[str, Any] = vals) -> str:
                v = vals.get(s)
                return "-" if v is None else f"{v:,.0f}" if isinstance(v, int) or v >= 1000 else f"{v:g}"

            def ratio(s: str, vals: dict[str, Any] = vals, ours: Any = ours) -> str:
                v = vals.get(s)
                return "-" if ours is None or not v else f"{ours / v:.2f}x"

            label = f"{mode} {readers} reader{'s' if readers > 1 else ''}, {size_label(size)}" if k == 0 else ""
            out.append(
                f"| {label} | {name} | {cell_val('aiobroadcast')} | {cell_val('vllm')} | {cell_val('pyzmq')} "
                f"| {ratio('vllm')} | {ratio('pyzmq')} |"
            )
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
    print(markdown(sys.argv[1]))
