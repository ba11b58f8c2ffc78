"""The command line, run as a user runs it: real processes, real pipes and signals."""

from __future__ import annotations

import json
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import psutil
import pytest
import zmq

import aiobroadcast as ab
from aiobroadcast.__main__ import main

CLI = [sys.executable, "-m", "aiobroadcast"]
HERE = socket.gethostname().encode()[:16].decode("utf-8", "ignore")  # this host's name, as the ring keeps it


class Proc:
    """A command whose stdout and stderr lines are collected as they come."""

    def __init__(
        self,
        *args: str,
        stdin: int | None = subprocess.DEVNULL,
        new_session: bool = False,
        env: dict[str, str] | None = None,
        prefix: tuple[str, ...] = (),
    ) -> None:
        self.args = list(args)
        self.popen = subprocess.Popen(
            [*prefix, *CLI, *args],
            env={**os.environ, **(env or {})},
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=new_session,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._lines: queue.Queue[tuple[str, str]] = queue.Queue()
        for stream, into, tag in ((self.popen.stdout, self.out, "out"), (self.popen.stderr, self.err, "err")):
            threading.Thread(target=self._pump, args=(stream, into, tag), daemon=True).start()

    def _pump(self, stream: object, into: list[str], tag: str) -> None:
        assert hasattr(stream, "readline")
        for line in iter(stream.readline, ""):
            into.append(line.rstrip("\n"))
            self._lines.put((tag, line.rstrip("\n")))

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait_for(self, pattern: str, timeout: float = 15.0) -> str:
        """Wait for a line (stdout or stderr) matching ``pattern``; return it."""
        rx = re.compile(pattern)
        for line in self.out + self.err:
            if rx.search(line):
                return line
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{self.args}: no line matching {pattern!r}; out={self.out} err={self.err}")
            try:
                _tag, line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if rx.search(line):
                return line

    def wait(self, timeout: float = 20.0) -> int:
        code = self.popen.wait(timeout)
        time.sleep(0.05)  # let the pumps take the last lines
        return code

    def stop(self) -> None:
        if self.popen.poll() is None:
            try:
                os.kill(self.pid, signal.SIGCONT)
                self.popen.terminate()
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        for f in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if f is not None:
                f.close()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Processes a test starts; all stopped at the end, whatever happened."""
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop()


def run(*args: str, stdin: str = "", timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], input=stdin, capture_output=True, text=True, timeout=timeout, check=False)


def wait_file(path: Path, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def sweep_until_gone(path: str, timeout: float = 6.0) -> None:
    """Remove what a SIGKILLed writer left (sweep_stale skips files younger than 2 s)."""
    deadline = time.monotonic() + timeout
    while os.path.exists(path) and time.monotonic() < deadline:
        ab.sweep_stale(os.path.dirname(path))
        time.sleep(0.2)


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    res = run("--help")  # also as `python -m aiobroadcast`, in its own process
    assert res.returncode == 0
    for command in ("demo", "publish", "subscribe", "stats", "keygen", "relay"):
        assert command in res.stdout
    for command in ("demo", "publish", "subscribe", "stats", "keygen"):
        with pytest.raises(SystemExit) as info:
            main([command, "--help"])
        assert info.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "(default:" in text or command == "keygen"  # keygen's options are a file and flags
        assert "Exit codes" in text or command in ("demo", "keygen")
        if command == "demo":
            assert "local reader processes (shared memory) (default: 3)" in text
            assert "remote reader processes (TCP on loopback; 0: none) (default: 1)" in text


def test_version_comes_from_the_package_metadata_alone() -> None:
    import importlib.metadata
    import tomllib

    root = Path(__file__).resolve().parent.parent
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    assert ab.__version__ == importlib.metadata.version("aiobroadcast") == declared
    # pyproject.toml is the one place: no copy of the number in the package's source to drift
    for source in (root / "aiobroadcast").rglob("*.py"):
        assert not re.search(r"__version__\s*=\s*['\"]\d+\.\d", source.read_text()), source
    res = run("--version")  # as `python -m aiobroadcast`, in its own process
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"aiobroadcast {declared}"


def test_publish_stdin_lines_and_subscribe_count(tmp_path: Path, procs: list[Proc]) -> None:
    handle = tmp_path / "channel.json"
    pub = Proc("publish", str(handle), "--wait-readers", "2", stdin=subprocess.PIPE)
    procs.append(pub)
    wait_file(handle)
    assert stat.S_IMODE(handle.stat().st_mode) == 0o600
    two = Proc("subscribe", str(handle), "--name", "two", "--count", "2")
    every = Proc("subscribe", str(handle), "--name", "every")
    procs += [two, every]
    pub.wait_for("2 readers attached")
    assert pub.popen.stdin is not None
    pub.popen.stdin.write('first line\nsecond: ünïcode\n{"not": "parsed"}\n')
    pub.popen.stdin.close()
    assert pub.wait() == 0, pub.err
    assert two.wait() == 0, two.err
    assert two.out == ["first line", "second: ünïcode"]
    assert every.wait() == 0, every.err
    assert every.out == ["first line", "second: ünïcode", '{"not": "parsed"}']
    assert any("local, over shared memory" in line for line in every.err)
    assert every.err[-1] == "every: received 3 messages"
    assert not handle.exists()  # the writer removes its handle file when it closes the channel


def test_subscribe_names_are_unique_on_the_channel(tmp_path: Path, procs: list[Proc]) -> None:
    handle = tmp_path / "channel.json"
    pub = Proc("publish", str(handle), "--wait-readers", "3", stdin=subprocess.PIPE)
    procs.append(pub)
    wait_file(handle)
    first = Proc("subscribe", str(handle), "--name", "same", "--quiet")
    procs.append(first)
    first.wait_for("same: attached")
    second = Proc("subscribe", str(handle), "--name", "same", "--quiet")
    procs.append(second)
    assert second.wait() == 2
    (line,) = second.err
    assert line.startswith("aiobroadcast: error: a reader named 'same' is already attached"), line
    assert f"pid {first.pid}" in line
    # without --name, each takes a name of its own
    unnamed = [Proc("subscribe", str(handle), "--quiet") for _ in range(2)]
    procs.extend(unnamed)
    names = [u.wait_for(r"^reader-\d+-\d+: attached").split(":")[0] for u in unnamed]
    assert names[0] != names[1]
    assert names == [f"reader-{u.pid}-1" for u in unnamed]
    pub.wait_for("3 readers attached")


def test_publish_json_values(tmp_path: Path, procs: list[Proc]) -> None:
    handle = tmp_path / "h.json"
    pub = Proc("publish", str(handle), "--json", "--wait-readers", "1", stdin=subprocess.PIPE)
    procs.append(pub)
    wait_file(handle)
    sub = Proc("subscribe", str(handle), "--count", "3")
    procs.append(sub)
    pub.wait_for("1 reader attached")
    assert pub.popen.stdin is not None
    pub.popen.stdin.write('{"a": [1, 2]}\n\n"text"\n3.5\n')
    pub.popen.stdin.close()
    assert sub.wait() == 0, sub.err
    assert sub.out == ['{"a": [1, 2]}', "text", "3.5"]  # strings print as they are, other values as JSON
    assert pub.wait() == 0


def test_ticks_over_tcp_with_an_advertised_address(tmp_path: Path, procs: list[Proc]) -> None:
    handle = tmp_path / "h.json"
    pub = Proc("publish", str(handle), "--ticks", "100", "--tcp", "tcp://127.0.0.1:0", "--advertise", "localhost")
    procs.append(pub)
    wait_file(handle)
    h = ab.Handle.load(handle)
    assert h.tcp is not None and re.fullmatch(r"tcp://localhost:\d+", h.tcp)
    assert h.server_key and h.client_secret_key  # CurveZMQ keys travel in the handle
    sub = Proc("subscribe", str(handle), "--transport", "tcp", "--count", "5", "--name", "far")
    procs.append(sub)
    assert sub.wait() == 0, sub.err
    seqs = [json.loads(line)["seq"] for line in sub.out]
    assert seqs == list(range(seqs[0], seqs[0] + 5))  # in order, none missing
    assert any("remote, over TCP tcp://localhost:" in line for line in sub.err)
    # stats shows remote readers too (from the TCP server's report beside the segment).
    far = Proc("subscribe", str(handle), "--transport", "tcp", "--quiet", "--name", "far-away")
    procs.append(far)
    far.wait_for("attached")
    deadline = time.monotonic() + 10
    while True:
        res = run("stats", str(handle), "--once", "--interval", "0")
        if re.search(rf"^\s+tcp\s+far-away\s+{far.pid}\s+{HERE}\s+yes\s", res.stdout, re.M):
            break
        assert time.monotonic() < deadline, res.stdout
        time.sleep(0.2)
    assert re.search(r"^\s+0\s+tcp-server\s.*the TCP server", res.stdout, re.M), res.stdout
    pub.popen.send_signal(signal.SIGTERM)
    assert pub.wait() == 0  # SIGTERM: a clean, requested stop
    assert far.wait() == 0  # the remote reader got the end of the stream
    assert not handle.exists()


def test_stats_names_readers_and_who_the_writer_waits_for(tmp_path: Path, procs: list[Proc]) -> None:
    handle = tmp_path / "h.json"
    pub = Proc("publish", str(handle), "--ticks", "500", "--capacity", "4")
    procs.append(pub)
    wait_file(handle)
    fine = Proc("subscribe", str(handle), "--name", "fine-reader", "--quiet")
    stuck = Proc("subscribe", str(handle), "--name", "stuck-reader", "--quiet")
    procs += [fine, stuck]
    fine.wait_for("attached")
    stuck.wait_for("attached")
    os.kill(stuck.pid, signal.SIGSTOP)  # alive, holding its place, reading nothing
    deadline = time.monotonic() + 15
    while True:
        res = run("stats", str(handle), "--once", "--interval", "0")
        assert res.returncode == 0, res.stdout + res.stderr
        waiting = [line for line in res.stdout.splitlines() if line.startswith("writer is waiting for:")]
        if waiting or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert waiting, res.stdout
    assert re.fullmatch(
        rf"writer is waiting for: stuck-reader \(pid {stuck.pid} on {HERE}\) at entry \d+ of \d+ - .*", waiting[0]
    )
    assert len(waiting) == 1  # the other reader keeps up
    rows = {line.split()[1]: line for line in res.stdout.splitlines() if re.match(r"\s+\d+\s", line)}
    assert str(fine.pid) in rows["fine-reader"].split()
    assert "HOLDING THE WRITER" in rows["stuck-reader"]
    assert "writer BLOCKED" in res.stdout.splitlines()[0]
    os.kill(stuck.pid, signal.SIGCONT)
    # Released: the writer goes on, and a snapshot with rates no longer shows it waiting.
    deadline = time.monotonic() + 15
    while True:
        res = run("stats", str(handle), "--once", "--interval", "0.2")
        if "writer is waiting for" not in res.stdout or time.monotonic() > deadline:
            break
    assert res.returncode == 0 and "writer is waiting for" not in res.stdout, res.stdout
    assert re.search(r"published \d+ messages \(\d+ ring entries\), [\d,.]+ msg/s", res.stdout)


def _elsewhere(host: str) -> tuple[str, ...]:
    """A prefix that runs a command in a UTS namespace of its own, named ``host``: another host
    name, as in a container."""
    return ("unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$@"', "sh")


def test_stats_and_statistics_show_where_each_reader_lives(tmp_path: Path, procs: list[Proc]) -> None:
    """A pid means something only where it lives (a container, another host): stats and
    Writer.statistics() show each reader's host name beside its pid, and stats the writer's. The
    readers here have host names of their own, as in containers: one over shared memory, one over
    TCP whose name is longer than the 16 bytes the ring keeps (TCP carries all of it)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to give readers host names of their own (UTS namespaces)")
    box = f"box-{secrets.token_hex(4)}"  # like a container's short id
    far = f"far-away-host-{secrets.token_hex(4)}"  # 22 bytes
    handle = tmp_path / "h.json"

    async def main() -> None:
        async with ab.open_writer(tcp="tcp://127.0.0.1:0") as writer:
            writer.handle.save(handle)
            local = Proc("subscribe", str(handle), "--name", "local", "--quiet")
            boxed = Proc("subscribe", str(handle), "--name", "boxed", "--quiet", prefix=_elsewhere(box))
            remote = Proc(
                "subscribe", str(handle), "--name", "remote", "--quiet", "--transport", "tcp", prefix=_elsewhere(far)
            )
            procs.extend((local, boxed, remote))
            for p in (local, boxed, remote):
                await anyio.to_thread.run_sync(p.wait_for, "attached")
            for _ in range(200):  # the TCP server lists its reader once it said HELLO
                if len(writer.statistics().readers) == 4:
                    break
                await anyio.sleep(0.05)
            where = {r.name: (r.pid, r.host, r.transport) for r in writer.statistics().readers}
            assert where["local"] == (local.pid, HERE, "shm")
            assert where["boxed"] == (boxed.pid, box, "shm")
            assert where["remote"] == (remote.pid, far, "tcp")
            res = await anyio.to_thread.run_sync(lambda: run("stats", str(handle), "--once", "--interval", "0"))
            assert f"writer pid {os.getpid()} on {HERE} " in res.stdout.splitlines()[0], res.stdout
            for name, pid, host in (("local", local.pid, HERE), ("boxed", boxed.pid, box)):
                assert re.search(rf"^\s+\d+\s+{name}\s+{pid}\s+{host}\s+yes\s", res.stdout, re.M), res.stdout
            assert re.search(rf"^\s+tcp\s+remote\s+{remote.pid}\s+{far[:16]}\s+yes\s", res.stdout, re.M), res.stdout

    anyio.run(main)
    for p in procs:
        assert p.wait() == 0, p.err  # the writer closed: every reader ends cleanly


def test_stats_live_view_ends_when_the_writer_closes(tmp_path: Path, procs: list[Proc]) -> None:
    handle = tmp_path / "h.json"
    pub = Proc("publish", str(handle), "--ticks", "50")
    procs.append(pub)
    wait_file(handle)
    live = Proc("stats", str(handle), "--interval", "0.1")
    procs.append(live)
    live.wait_for("no readers attached")
    pub.popen.send_signal(signal.SIGTERM)
    assert pub.wait() == 0
    assert live.wait() == 0
    assert any("closed by the writer" in line for line in live.out), live.out


def test_keygen_prints_and_writes_curve_key_pairs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keygen"]) == 0
    keys = ab.CurveKeys.model_validate_json(capsys.readouterr().out)  # the library's own key format
    for public, secret in ((keys.server_public, keys.server_secret), (keys.client_public, keys.client_secret)):
        assert len(public) == len(secret) == 40
        assert zmq.curve_public(secret.encode()) == public.encode()  # a real pair
    assert keys.server_public != keys.client_public

    out = tmp_path / "keys.json"
    assert main(["keygen", "--out", str(out), "--public"]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    saved = ab.CurveKeys.load(out)
    public = json.loads(capsys.readouterr().out)
    assert public == {"server_public": saved.server_public, "client_public": saved.client_public}
    assert main(["keygen", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [err.strip()] and "--force" in err
    assert ab.CurveKeys.load(out) == saved  # untouched
    assert main(["keygen", "--out", str(out), "--force"]) == 0
    assert ab.CurveKeys.load(out) != saved
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


def test_publish_with_fixed_keys(tmp_path: Path, procs: list[Proc]) -> None:
    keys = tmp_path / "keys.json"
    assert run("keygen", "--out", str(keys)).returncode == 0
    handle = tmp_path / "h.json"
    pub = Proc("publish", str(handle), "--ticks", "100", "--tcp", "tcp://127.0.0.1:0", "--keys", str(keys))
    procs.append(pub)
    wait_file(handle)
    sub = Proc("subscribe", str(handle), "--transport", "tcp", "--count", "2")
    procs.append(sub)
    assert sub.wait() == 0, sub.err
    assert any("fixed keys" in line for line in pub.err)
    # The handle carries the key file's keys, so a restarted writer keeps readers' keys valid.
    h, k = ab.Handle.load(handle), ab.CurveKeys.load(keys)
    assert (h.server_key, h.client_public_key, h.client_secret_key) == (
        k.server_public,
        k.client_public,
        k.client_secret,
    )
    pub.popen.send_signal(signal.SIGTERM)
    assert pub.wait() == 0


def _bad_handles(tmp_path: Path) -> dict[str, Path]:
    files = {"not-json": "hello", "not-a-handle": '{"version": 1}', "a-list": "[1, 2]"}
    paths = {}
    for name, text in files.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(text)
    gone = ab.Handle(
        directory="/dev/shm",
        name="aiobroadcast-" + "0" * 32,
        capacity=4,
        slot_bytes=256,
        max_readers=1,
        policy="block",
        codec="json",
        writer_pid=1,
    )
    paths["segment-gone"] = tmp_path / "gone.json"
    gone.save(paths["segment-gone"])
    return paths


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["subscribe", "{missing}"], "does not exist"),
        (["subscribe", "{not-json}"], "not a handle file"),
        (["subscribe", "{not-a-handle}"], "not a valid handle file"),
        (["subscribe", "{segment-gone}"], "is gone"),
        (["stats", "{missing}", "--once"], "does not exist"),
        (["stats", "{a-list}", "--once"], "not a handle file"),
        (["stats", "{not-json}", "--interval", "0"], "--interval must be more than 0"),
        (["stats", "{segment-gone}", "--once"], "is gone"),
        (["publish", "/nonexistent-dir/h.json"], "cannot write the handle file"),
        (["publish", "{out}", "--capacity", "1"], "capacity must be at least 2"),
        (["publish", "{out}", "--advertise", "writer"], "--advertise needs --tcp"),
        (["publish", "{out}", "--tcp", "tcp://127.0.0.1:0", "--advertise", "writer:5555"], "without scheme or port"),
        (["publish", "{out}", "--tcp", "tcp://127.0.0.1:0", "--keys", "{missing}"], "key file"),
        (["publish", "{out}", "--tcp", "tcp://127.0.0.1:0", "--keys", "{not-a-handle}"], "not a valid key file"),
        (["publish", "{out}", "--tcp", "10.0.0.1:5555"], "tcp:// endpoint"),
        (["publish", "{out}", "--ticks", "0"], "--ticks RATE must be more than 0"),
        (["demo", "--readers", "0", "--remote", "0"], "at least one reader"),
        (["relay", "{missing}", "--out", "{out}"], "cannot read handle file"),
    ],
)
def test_user_mistakes_are_one_line_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    paths = {k: str(v) for k, v in _bad_handles(tmp_path).items()}
    paths["missing"] = str(tmp_path / "missing.json")
    paths["out"] = str(tmp_path / "out.json")
    code = main([a.format(**paths) for a in args])  # in this process: an uncaught error fails the test
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("aiobroadcast: error:")]
    assert len(errors) == 1 and says in errors[0], err
    assert not os.path.exists(paths["out"])


def test_a_user_mistake_in_a_real_process_prints_no_traceback(tmp_path: Path) -> None:
    for args in (["subscribe", str(tmp_path / "missing.json")], ["stats", str(tmp_path), "--once"]):
        res = run(*args)
        assert res.returncode == 2
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert res.stderr.startswith("aiobroadcast: error: ")


def test_bad_json_input_is_one_line_and_closes_the_channel(tmp_path: Path) -> None:
    handle = tmp_path / "h.json"
    res = run("publish", str(handle), "--json", stdin='{"ok": 1}\nnot json\n')
    assert res.returncode == 2
    errors = [line for line in res.stderr.splitlines() if line.startswith("aiobroadcast: error:")]
    assert errors == [errors[0]] and "stdin line 2 is not JSON" in errors[0]
    assert "Traceback" not in res.stderr
    assert not handle.exists()


def test_subscribe_exit_codes_when_the_writer_dies_or_ends_early(tmp_path: Path, procs: list[Proc]) -> None:
    handle = tmp_path / "h.json"
    pub = Proc("publish", str(handle), "--ticks", "50")
    procs.append(pub)
    wait_file(handle)
    segment = ab.Handle.load(handle).path
    sub = Proc("subscribe", str(handle), "--name", "orphan", "--wait", "5")
    procs.append(sub)
    sub.wait_for(r"^\{")
    pub.popen.kill()  # SIGKILL: the writer cannot close anything
    pub.wait()
    assert sub.wait() == 1
    errors = [line for line in sub.err if line.startswith("aiobroadcast: error:")]
    assert len(errors) == 1 and "died without closing the channel" in errors[0], sub.err
    sweep_until_gone(segment)

    # --count not reached before the channel closes: 1 too.
    res_pub = Proc("publish", str(handle), "--wait-readers", "1", stdin=subprocess.PIPE)
    procs.append(res_pub)
    sub2 = Proc("subscribe", str(handle), "--count", "5", "--wait", "10")
    procs.append(sub2)
    res_pub.wait_for("1 reader attached")
    assert res_pub.popen.stdin is not None
    res_pub.popen.stdin.write("only\none\n")
    res_pub.popen.stdin.close()
    assert sub2.wait() == 1
    assert sub2.out == ["only", "one"]
    assert any("closed after 2 of the 5 messages" in line for line in sub2.err)


def test_sigint_and_sigterm_stop_readers_cleanly(tmp_path: Path, procs: list[Proc]) -> None:
    handle = tmp_path / "h.json"
    pub = Proc("publish", str(handle), "--ticks", "50")
    procs.append(pub)
    wait_file(handle)
    a = Proc("subscribe", str(handle), "--name", "a")
    b = Proc("subscribe", str(handle), "--name", "b")
    procs += [a, b]
    a.wait_for(r"^\{")
    b.wait_for(r"^\{")
    a.popen.send_signal(signal.SIGINT)
    b.popen.send_signal(signal.SIGTERM)
    assert a.wait() == 130
    assert b.wait() == 0
    for p in (a, b):
        assert "Traceback" not in "\n".join(p.err)
        assert re.search(r"received \d+ messages?$", p.err[-1])
    pub.popen.send_signal(signal.SIGINT)
    assert pub.wait() == 130
    assert re.search(r"published \d+ messages?;", pub.err[-1])
    assert not handle.exists()


def test_sigterm_stops_a_publisher_waiting_for_input(tmp_path: Path, procs: list[Proc]) -> None:
    handle = tmp_path / "h.json"
    pub = Proc("publish", str(handle), stdin=subprocess.PIPE)  # stdin stays open, silent
    procs.append(pub)
    wait_file(handle)
    pub.popen.send_signal(signal.SIGTERM)
    assert pub.wait(timeout=10) == 0
    assert not handle.exists()


def test_demo_runs_local_and_remote_readers() -> None:
    res = subprocess.run(
        [*CLI, "demo", "--count", "2000"],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
        env={**os.environ, "AIOBROADCAST_DEMO_NEWLINES": "1"},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "local readers (shared memory): reader-0, reader-1, reader-2" in out
    assert re.search(r"remote readers \(TCP tcp://127\.0\.0\.1:\d+, CurveZMQ\): remote-0", out)
    rows = {m.group(1): m for m in re.finditer(r"^(\S+)\s+(shared memory|TCP)\s+(\d+)\s", out, re.M)}
    assert set(rows) == {"reader-0", "reader-1", "reader-2", "remote-0"}
    assert rows["remote-0"].group(2) == "TCP" and rows["reader-0"].group(2) == "shared memory"
    assert all(m.group(3) == "2000" for m in rows.values())
    assert "2000 messages to each of 4 readers (3 local, 1 remote)" in out
    assert re.search(r"sent\s+[\d,]+\s+[\d,]+ msg/s\s+slowest reader lag", out)


def test_demo_ctrl_c_leaves_no_process_and_no_segment() -> None:
    demo = Proc(
        "demo", "--count", "1000000", "--rate", "2000", new_session=True, env={"AIOBROADCAST_DEMO_NEWLINES": "1"}
    )
    try:
        demo.wait_for(r"msg/s", timeout=60)
        family = [psutil.Process(demo.pid), *psutil.Process(demo.pid).children(recursive=True)]
        assert len(family) >= 5  # the writer and four readers (and multiprocessing's helper)
        os.killpg(demo.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
        assert demo.wait(30) == 130
        assert any("interrupted after" in line for line in demo.out)
        assert any(line.startswith("remote-0") for line in demo.out)  # the summary still comes
        deadline = time.monotonic() + 10
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in family):
            assert time.monotonic() < deadline, [p for p in family if p.is_running()]
            time.sleep(0.1)
    finally:
        demo.stop()


def test_the_command_line_does_not_load_zeromq_until_a_command_needs_it() -> None:
    """The CLI sits on top of the library and imports no transport module for a name (the TCP
    server's reader name comes from aiobroadcast._base.constants): building every command's parser
    loads no ZeroMQ, so ``stats`` and ``subscribe`` over shared memory start without it."""
    probe = "import sys; from aiobroadcast.cli import build_parser; build_parser(); print('zmq' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert res.stdout.strip() == "False"
    keygen = subprocess.run([*CLI, "keygen", "--public"], capture_output=True, text=True, timeout=60, check=False)
    assert keygen.returncode == 0, keygen.stderr
    assert set(json.loads(keygen.stdout)) == {"server_public", "client_public"}
