"""Smoke test of ``aiobroadcast bench`` and of ``benchmarks/side_by_side.py`` (run by path, as in a
source checkout): they run and print valid JSON. No timing assertions."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from aiobroadcast._base.codec import PickleEncoder
from aiobroadcast._shm.layout import SLOT_HEADER_BYTES
from aiobroadcast.cli import _bench, _bench_driver

ROOT = Path(__file__).resolve().parent.parent
SIDE_BY_SIDE = ROOT / "benchmarks" / "side_by_side.py"


def bench(*args: str, timeout: float = 60, side_by_side: bool = False) -> subprocess.CompletedProcess[str]:
    command = [str(SIDE_BY_SIDE)] if side_by_side else ["-m", "aiobroadcast", "bench"]
    return subprocess.run(
        [sys.executable, *command, "--repeat", "1", "--gap-s", "0", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def script(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run this interpreter on ``argv`` (a script of benchmarks/, by path) and capture its output."""
    return subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


def objects(proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert all(isinstance(o, dict) for o in out)
    return out


def check_common(obj: dict[str, Any], system: str, mode: str, readers: int, count: int) -> None:
    assert obj["system"] == system
    assert (obj["mode"], obj["readers"], obj["size"], obj["count"], obj["runs"]) == (mode, readers, 64, count, 1)
    expected = count + 1 if mode == "idle" else count
    assert obj["received"] == [expected] * readers
    assert obj["in_order"] is True


def test_tput_cell_json() -> None:
    proc = bench("--mode", "tput", "--readers", "1", "--size", "64", "--count", "200", "--json")
    (obj,) = objects(proc)
    check_common(obj, "aiobroadcast", "tput", 1, 200)
    assert obj["msgs_per_s"] > 0 and obj["MB_per_s"] >= 0
    assert obj["transport"] == "shm"
    assert (obj["capacity"], obj["slot_bytes"]) == _bench_driver.ring_for(64)
    # The progress lines and the table go to stderr with --json.
    assert "[1/1] tput r=1 64 B" in proc.stderr
    assert "msgs/s" in proc.stderr and "MB/s" in proc.stderr


@pytest.mark.parametrize("size", [0, 1, 64, 1000, 4096, 4097, 65536, 65537, 4 << 20])
def test_the_default_ring_holds_a_protocol_message_in_one_slot_within_vllms_memory(size: int) -> None:
    """The benchmark's message ``(perf_counter_ns(), b"x" * size)``, encoded as the writer encodes
    it, fits in one slot; the ring takes at most 1 MiB up to 4 KiB messages, and never more than
    vLLM's ring in the same cell (10 chunks of max(1 MiB, 2 * size + 4 KiB))."""
    capacity, slot_bytes = _bench_driver.ring_for(size)
    _parts, total, _oob = PickleEncoder().encode((time.perf_counter_ns(), b"x" * size))
    assert total + SLOT_HEADER_BYTES <= slot_bytes and slot_bytes % 64 == 0
    memory = capacity * slot_bytes
    assert memory <= 10 * max(1 << 20, 2 * size + 4096)
    if size <= 4096:
        assert memory <= 1 << 20 and capacity >= 244


def test_lat_cell_json() -> None:
    (obj,) = objects(bench("--mode", "lat", "--readers", "2", "--size", "64", "--count", "50", "--json"))
    check_common(obj, "aiobroadcast", "lat", 2, 50)
    assert 0 < obj["p50_us"] <= obj["p99_us"]


def test_idle_cell_json() -> None:
    (obj,) = objects(
        bench("--mode", "idle", "--readers", "2", "--size", "64", "--count", "20", "--idle-s", "0.3", "--json")
    )
    check_common(obj, "aiobroadcast", "idle", 2, 20)
    assert obj["idle_s"] == 0.3
    assert len(obj["reader_cpu_s_while_idle"]) == len(obj["wake_latency_us"]) == 2
    assert all(x >= 0 for x in obj["reader_cpu_s_while_idle"])
    assert all(x > 0 for x in obj["wake_latency_us"])
    assert "server_cpu_s_while_idle" not in obj  # no TCP server on shared memory


def test_idle_cell_over_tcp_reports_the_servers_cpu() -> None:
    """Over TCP the idle cell also says what the writer's TCP server process used while the
    channel was idle (its heartbeats): the figure the idle target of the remote path is about."""
    args = "--mode idle --readers 1 --size 64 --count 20 --idle-s 0.6 --transport tcp --json"
    (obj,) = objects(bench(*args.split()))
    check_common(obj, "aiobroadcast", "idle", 1, 20)
    assert obj["transport"] == "tcp"
    assert obj["server_cpu_s_while_idle"] > 0  # it beats at least once in 0.6 s: never 0, never absent


def test_missing_peer_is_skipped(tmp_path: Path) -> None:
    """vLLM is not importable here (no torch, no vLLM on the path): skipped with a message; the
    pyzmq peer (pyzmq is a dependency) runs. Without --json the table goes to stdout."""
    proc = bench(
        "--mode",
        "tput",
        "--readers",
        "1",
        "--size",
        "64",
        "--count",
        "200",
        "--peers",
        "--peer-python",
        sys.executable,
        "--vllm-path",
        str(tmp_path / "no-vllm-here"),
        side_by_side=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "skipping vllm: not importable by" in proc.stderr
    head, _rule, *rows = proc.stdout.splitlines()
    assert head.split() == ["cell", "figure", "aiobroadcast", "pyzmq", "aiobroadcast/pyzmq"]
    assert rows[0].startswith("tput r=1 64 B") and "msgs/s" in rows[0] and rows[0].endswith("x")
    assert "skipped vllm: not importable by" in proc.stdout


def test_tcp_transport() -> None:
    (obj,) = objects(
        bench("--transport", "tcp", "--mode", "tput", "--readers", "1", "--size", "64", "--count", "200", "--json")
    )
    check_common(obj, "aiobroadcast", "tput", 1, 200)
    assert obj["transport"] == "tcp"


@pytest.mark.parametrize("argv", [["--repeat", "0"], ["--readers", "0"], ["--readers", "3"], ["--count", "0"]])
def test_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    _bench.register(parser.add_subparsers())
    args = parser.parse_args(["bench", *argv])
    assert args.func(args) == 2
    assert capsys.readouterr().err.startswith("aiobroadcast: error: ")


def test_tcp_insecure_and_the_pyzmq_curve_peer() -> None:
    """--insecure runs our TCP channel without CurveZMQ (the JSON says which); the pyzmq-curve
    peer runs only when named, beside the plain pyzmq peer, and is lossless too."""
    proc = bench(
        "--transport",
        "tcp",
        "--insecure",
        "--mode",
        "tput",
        "--readers",
        "1",
        "--size",
        "64",
        "--count",
        "200",
        "--peer",
        "pyzmq",
        "--peer",
        "pyzmq-curve",
        "--peer-python",
        sys.executable,
        "--json",
        timeout=120,
        side_by_side=True,
    )
    by_system = {o["system"]: o for o in objects(proc)}
    assert set(by_system) == {"aiobroadcast", "pyzmq", "pyzmq-curve"}
    for system, obj in by_system.items():
        check_common(obj, system, "tput", 1, 200)
        assert obj["transport"] == "tcp"
    assert by_system["aiobroadcast"]["security"] == "hmac"
    assert by_system["pyzmq-curve"]["security"] == "curve"
    assert "security" not in by_system["pyzmq"]
    assert "(insecure: GMAC)" in proc.stderr
    (secure,) = objects(
        bench("--transport", "tcp", "--mode", "tput", "--readers", "1", "--size", "64", "--count", "200", "--json")
    )
    assert secure["security"] == "curve"


def test_zero_copy_readers_cell_json() -> None:
    """``--zero-copy``: the readers open with ``zero_copy=True`` (large payloads as views)."""
    (obj,) = objects(
        bench("--mode", "tput", "--readers", "2", "--size", "65536", "--count", "300", "--zero-copy", "--json")
    )
    assert (obj["system"], obj["size"], obj["count"], obj["zero_copy"]) == ("aiobroadcast", 65536, 300, True)
    assert obj["received"] == [300, 300] and obj["in_order"] is True
    assert obj["payload_type"] == ["memoryview"]  # what the readers got: views, not copies
    (copying,) = objects(bench("--mode", "tput", "--readers", "1", "--size", "65536", "--count", "300", "--json"))
    assert copying["zero_copy"] is False and copying["payload_type"] == ["bytes"]


@pytest.mark.parametrize("api", [(), ("--blocking",)], ids=["async", "blocking"])
def test_batched_writer_cell_json(api: tuple[str, ...]) -> None:
    """``--batch``: the writer publishes with ``put_many``; a count that is not a multiple of
    the batch still sends every message (the last batch is short), in order, to every reader."""
    (obj,) = objects(
        bench("--mode", "tput", "--readers", "2", "--size", "64", "--count", "1000", "--batch", "64", "--json", *api)
    )
    check_common(obj, "aiobroadcast", "tput", 2, 1000)
    assert obj["batch"] == 64 and obj["api"] == ("blocking" if api else "async")


@pytest.mark.parametrize("mode", ["lat", "idle"])
def test_batch_is_refused_outside_mode_tput(mode: str) -> None:
    """A paced run publishes one message at a time; --batch there is a usage error, not ignored."""
    proc = bench("--mode", mode, "--readers", "1", "--size", "64", "--count", "10", "--batch", "4")
    assert proc.returncode == 2
    assert "--batch" in proc.stderr and "only with --mode tput" in proc.stderr


@pytest.mark.parametrize("mode", ["tput", "lat", "idle"])
def test_blocking_api_cells(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--blocking``: writer and readers use aiobroadcast.blocking, with the same figures."""
    monkeypatch.setenv("IDLE_S", "0.3")
    (obj,) = objects(bench("--mode", mode, "--readers", "2", "--size", "64", "--count", "100", "--blocking", "--json"))
    check_common(obj, "aiobroadcast", mode, 2, 100)
    assert (obj["api"], obj["loop"]) == ("blocking", "blocking")
    if mode == "idle":
        assert len(obj["reader_cpu_s_while_idle"]) == 2 and obj["idle_s"] == 0.3
    (tcp,) = objects(
        bench(
            "--mode",
            mode,
            "--readers",
            "1",
            "--size",
            "64",
            "--count",
            "50",
            "--blocking",
            "--transport",
            "tcp",
            "--json",
        )
    )
    check_common(tcp, "aiobroadcast", mode, 1, 50)
    assert (tcp["api"], tcp["transport"]) == ("blocking", "tcp")


def test_peer_drivers_run_in_an_interpreter_without_aiobroadcast() -> None:
    """benchmarks/peers.py runs in the peers' interpreter, which need not have aiobroadcast or its
    dependencies: without site-packages (``-S``) it still starts, and reports the peer as
    unavailable, in the JSON line side_by_side.py reads."""
    proc = script(
        "-S", str(ROOT / "benchmarks" / "peers.py"), "pyzmq", "tput", "1", "64", "10", cwd=ROOT / "benchmarks"
    )
    assert proc.returncode == 3, proc.stderr
    last = json.loads(proc.stdout.splitlines()[-1])
    assert last["unavailable"] == "pyzmq" and "zmq" in last["reason"]


def test_the_bench_command_has_no_peer_options() -> None:
    """Comparing with peers lives in benchmarks/side_by_side.py; the library's command does not
    know about them."""
    proc = bench("--peers", "--mode", "tput", "--readers", "1", "--size", "64", "--count", "10")
    assert proc.returncode == 2
    assert "unrecognized arguments: --peers" in proc.stderr


def test_put_floor_prints_every_row() -> None:
    """``benchmarks/put_floor.py`` (the Python floor beside our per-message cost) runs on a real
    channel and reports every row. No timing assertions: the figures belong in the docs."""
    proc = script(str(ROOT / "benchmarks" / "put_floor.py"), "--count", "2000", "--repeat", "1")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    rows = result["us_per_msg"]
    assert set(rows) == {
        "floor writer",
        "floor writer, async def",
        "floor reader",
        "put_nowait",
        "put",
        "put_many_8",
        "put_many_16",
        "put_many_32",
        "put_many_64",
        "get_nowait",
    }
    assert all(value > 0 for value in rows.values())


@pytest.mark.parametrize("pickled", [False, True], ids=["bare", "pickle"])
def test_wake_floor_paced_runs(pickled: bool) -> None:
    """``benchmarks/wake_floor.py --paced`` (the wake-up floor beside the ``lat`` cell), bare and
    carrying a pickled message, runs real reader processes and reports every reader. The reader
    checks that the message it unpickled is the one announced. No timing assertions."""
    proc = script(
        str(ROOT / "benchmarks" / "wake_floor.py"),
        "--paced",
        "--readers",
        "2",
        "--count",
        "50",
        *(["--pickle"] if pickled else []),
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["paced"] is True and result["pickle"] is pickled and result["count"] == 50
    assert len(result["wake_latency_us_median_per_reader"]) == 2
    assert 0 < result["p50_us"] <= result["p99_us"]


@pytest.mark.parametrize("loop", ["blocking", "futex"])
def test_wake_floor_blocking_readers_run(loop: str) -> None:
    """``benchmarks/wake_floor.py`` with blocking readers, woken through a datagram socket or a
    futex in a shared page, runs real reader processes and reports every reader. A futex reader
    that missed its wake-up would block for good (the script's timeout fails the test). No timing
    assertions."""
    proc = script(str(ROOT / "benchmarks" / "wake_floor.py"), "--loop", loop, "--pause", "0.01", "--count", "20")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["loop"] == loop and result["paced"] is False and result["count"] == 20
    medians = result["wake_latency_us_median_per_reader"]
    assert len(medians) == 2 and all(m > 0 for m in medians)


@pytest.mark.parametrize(
    "knobs",
    [["--worker", "bare"], ["--blocking", "--worker", "bare", "--caller", "bare"]],
    ids=["bare-async-worker", "bare-blocking-both"],
)
def test_call_floor_runs_real_workers_and_checks_every_answer(knobs: list[str]) -> None:
    """``benchmarks/call_floor.py`` (the call cell with the roles' layers taken out): real worker
    processes answer every call, each answer checked against its call id (a wrong or missing one
    fails the run). No timing assertions."""
    proc = script(str(ROOT / "benchmarks" / "call_floor.py"), "2", "64", "40", *knobs)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert "FAILED" not in result, result
    assert result["mode"] == "call" and result["readers"] == 2 and result["received"] == [40]
    assert 0 < result["p50_us"] <= result["p99_us"]
    assert len(result["reader_cpu_s"]) == 2


def test_cpu_split_names_every_process_of_a_tcp_run() -> None:
    """``benchmarks/cpu_split.py`` around a real run over TCP (writer, server, reader processes):
    it reports the server's process and the reader's I/O thread among its rows, CPU per message,
    and the run's own JSON line. No timing assertions."""
    run = [sys.executable, "-m", "aiobroadcast", "bench", "--transport", "tcp", "--mode", "tput"]
    run += ["--readers", "1", "--size", "65536", "--count", "2000", "--repeat", "1", "--json"]
    proc = script(str(ROOT / "benchmarks" / "cpu_split.py"), "--messages", "2000", "--every-ms", "5", "--", *run)
    assert proc.returncode == 0, proc.stderr
    split, bench_line = (json.loads(line) for line in proc.stdout.splitlines()[-2:])
    assert bench_line["received"] == [2000]
    threads = split["threads"]
    assert any("aiobroadcast._tcp.server" in t["command"] for t in threads)
    server = {t["pid"] for t in threads if "aiobroadcast._tcp.server" in t["command"]}
    assert any(t["pid"] in server and t["thread"].startswith("ZMQbg/IO") for t in threads)
    # The reader's process: its event loop's thread and its I/O thread (Python names neither).
    reader = [t for t in threads if "multiprocessing.spawn" in t["command"] and t["thread"] == "python"]
    assert len({t["tid"] for t in reader}) >= 2
    assert split["us_per_msg"] > 0
    assert split["sampler_cpu_s"] >= 0  # reported beside the run's figures, never inside them
    assert abs(sum(t["us_per_msg"] for t in threads) - split["us_per_msg"]) < 0.1 * len(threads)


def test_cpu_split_refuses_a_missing_command_and_passes_on_a_failure() -> None:
    proc = script(str(ROOT / "benchmarks" / "cpu_split.py"), "--messages", "10")
    assert proc.returncode == 2 and "give the command" in proc.stderr
    proc = script(str(ROOT / "benchmarks" / "cpu_split.py"), "--", sys.executable, "-c", "raise SystemExit(3)")
    assert proc.returncode == 3 and "exited with 3" in proc.stderr


@pytest.mark.parametrize("api", [(), ("--blocking",)], ids=["async", "blocking"])
def test_gather_cell_json(api: tuple[str, ...]) -> None:
    """``--mode gather``: N sender processes into one collector; the fields sitting.sh reads."""
    (obj,) = objects(bench("--mode", "gather", "--senders", "3", "--size", "64", "--count", "500", "--json", *api))
    assert (obj["mode"], obj["senders"], obj["readers"], obj["size"], obj["count"]) == ("gather", 3, 3, 64, 500)
    assert obj["received"] == [1500] and obj["in_order"] is True
    assert obj["msgs_per_s"] > 0 and "FAILED" not in obj
    assert obj["api"] == ("blocking" if api else "async")
    assert obj["take"] == "get_many"
    wrong = bench("--mode", "tput", "--senders", "2", "--size", "64", "--count", "10")
    assert wrong.returncode == 2 and "--senders" in wrong.stderr


@pytest.mark.parametrize("api", [(), ("--blocking",)], ids=["async", "blocking"])
def test_the_gather_driver_takes_one_delivery_per_get_when_asked(api: tuple[str, ...]) -> None:
    """``--get-one``: the collector takes with ``get`` (the figure before ``get_many``)."""
    proc = script("-m", "aiobroadcast.cli._bench_gather", "2", "64", "300", "--get-one", *api)
    (obj,) = objects(proc)[-1:]
    assert (obj["take"], obj["received"], obj["in_order"]) == ("get", [600], True)
    assert "FAILED" not in obj


def test_call_cell_json() -> None:
    """``--mode call``: one caller, N worker processes, a call every ms; the fields sitting.sh reads."""
    (obj,) = objects(bench("--mode", "call", "--readers", "2", "--size", "64", "--count", "200", "--json"))
    assert (obj["mode"], obj["readers"], obj["size"], obj["count"], obj["api"]) == ("call", 2, 64, 200, "async")
    assert obj["received"] == [200] and obj["in_order"] is True and "FAILED" not in obj
    assert 0 < obj["p50_us"] <= obj["p99_us"]
    assert len(obj["reader_cpu_s"]) == 2
    wrong = bench("--mode", "call", "--transport", "tcp", "--size", "64", "--count", "10")
    assert wrong.returncode == 2 and "--mode call runs over shared memory" in wrong.stderr


@pytest.mark.parametrize("mode", ["tput", "gather", "call"])
def test_the_drivers_start_from_the_installed_package(mode: str) -> None:
    """The drivers start as ``python -P -m aiobroadcast.cli._bench_...``: the package as installed
    finds itself, so nothing puts a path of the source tree (built from ``__file__``) on their
    PYTHONPATH; a wheel has no source tree to point at."""
    p = argparse.ArgumentParser()
    _bench.add_options(p)
    args = p.parse_args(["--mode", mode, "--readers", "1", "--size", "64"])
    assert _bench.check(args) is None
    (cell,) = _bench.select_cells(args)
    cmd, env = _bench.driver_command(cell, args)
    assert cmd[:3] == [sys.executable, "-P", "-m"] and cmd[3].startswith("aiobroadcast.cli._bench_")
    assert env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")
    for source in (ROOT / "aiobroadcast" / "cli").glob("_bench*.py"):
        assert "__file__" not in source.read_text(), source
