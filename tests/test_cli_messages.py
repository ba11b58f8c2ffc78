"""What the command line says when something is wrong, run as a user runs it (real processes,
real sockets): errors name their cause, hints appear only where they help, help texts state each
default once, and counts agree with their nouns."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import aiobroadcast as ab
from aiobroadcast import blocking
from aiobroadcast.cli import build_parser
from aiobroadcast.cli._common import HelpFormatter

CLI = [sys.executable, "-m", "aiobroadcast"]
ROOT = Path(__file__).resolve().parent.parent
WAIT_HINT = "--wait SECONDS waits for the writer to start"


def run(*args: str, timeout: float = 60.0, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], input=stdin, capture_output=True, text=True, timeout=timeout, check=False)


def one_error(res: subprocess.CompletedProcess[str]) -> str:
    """The one ``aiobroadcast: error:`` line of a failed command (and no traceback)."""
    assert "Traceback" not in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("aiobroadcast: error: ")]
    assert len(errors) == 1, res.stderr
    return errors[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def dead_writer_segment(tmp_path: Path) -> Iterator[Path]:
    """A handle file whose segment is still there, its writer's process gone without closing it."""
    handle = tmp_path / "dead.json"
    script = (
        "import os, sys\n"
        "from aiobroadcast import blocking\n"
        "w = blocking.open_writer(codec='json', capacity=4, slot_bytes=256)\n"
        "w.handle.save(sys.argv[1])\n"
        "os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", script, str(handle)], check=True, timeout=60)
    segment = ab.Handle.load(handle).path
    assert os.path.exists(segment)
    try:
        yield handle
    finally:
        deadline = time.monotonic() + 10
        while os.path.exists(segment) and time.monotonic() < deadline:
            ab.sweep_stale(os.path.dirname(segment))  # young files are kept 2 s
            time.sleep(0.2)


# --- 1. the --wait hint -------------------------------------------------------------------------
def test_the_wait_hint_comes_only_where_a_writer_may_still_start(tmp_path: Path) -> None:
    # The handle file does not exist yet: a writer may still start and write it.
    missing = one_error(run("subscribe", str(tmp_path / "missing.json")))
    assert "does not exist" in missing and WAIT_HINT in missing

    # The endpoint does not exist yet (nothing listens there): a writer may still start on it.
    with blocking.open_writer(codec="json", tcp="tcp://127.0.0.1:0") as w:
        handle = w.handle
    port = free_port()
    unserved = tmp_path / "unserved.json"
    ab.Handle.parse({**handle.model_dump(), "tcp": f"tcp://127.0.0.1:{port}"}).save(unserved)
    res = run("subscribe", str(unserved), "--transport", "tcp", "--connect-timeout", "1")
    assert res.returncode == 2
    assert "no answer from the writer" in one_error(res) and WAIT_HINT in one_error(res)

    # The writer's segment is gone (it closed): a writer never comes back to this handle.
    gone = tmp_path / "gone.json"
    handle.save(gone)
    res = run("subscribe", str(gone), "--transport", "shm")
    assert res.returncode == 2
    assert "is gone" in one_error(res) and WAIT_HINT not in one_error(res)

    # The segment is there, its writer's process has exited without closing it.
    with dead_writer_segment(tmp_path) as dead:
        res = run("subscribe", str(dead))
        assert res.returncode == 2
        assert "has closed or exited" in one_error(res) and WAIT_HINT not in one_error(res)

    # A writer answers at the endpoint, but it is not this handle's (other keys): waiting for it
    # to "start" is no help.
    with blocking.open_writer(codec="json", tcp=f"tcp://127.0.0.1:{port}") as other:
        assert other.handle.tcp == f"tcp://127.0.0.1:{port}"
        res = run("subscribe", str(unserved), "--transport", "tcp", "--connect-timeout", "30")
    assert res.returncode == 2
    assert WAIT_HINT not in one_error(res), res.stderr


# --- 2. --transport auto and a writer that is gone ----------------------------------------------
def test_auto_transport_fails_at_once_on_a_closed_writers_handle(tmp_path: Path) -> None:
    """The ring is gone from this host and nothing listens at the handle's endpoint: the writer
    has closed, and subscribe says so instead of waiting ``--connect-timeout`` for TCP. (The
    deadline of the run is shorter than that timeout: waiting it out fails the test.)"""
    path = tmp_path / "h.json"
    with blocking.open_writer(codec="json", tcp="tcp://127.0.0.1:0") as w:
        w.handle.save(path)
        w.put("one")
    try:
        res = run("subscribe", str(path), "--connect-timeout", "120", timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("subscribe --transport auto waited for TCP on a writer that is known to be gone")
    assert res.returncode == 2
    line = one_error(res)
    assert "has closed or exited" in line and w.handle.name in line, line
    assert WAIT_HINT not in line


def test_auto_transport_still_reads_a_live_writer_over_tcp_when_its_ring_is_elsewhere(tmp_path: Path) -> None:
    """The shortcut above must not cost a reader whose ring is on another host (here: a handle
    whose directory has no such segment) a live writer: it goes on over TCP."""
    elsewhere = tempfile.mkdtemp(prefix="ab-")  # short: socket paths beside a segment are limited
    with blocking.open_writer(codec="json", tcp="tcp://127.0.0.1:0") as w:
        path = tmp_path / "h.json"
        # As a reader on another host sees it: the ring's file is not in its directory there.
        ab.Handle.parse({**w.handle.model_dump(), "directory": elsewhere}).save(path)
        sub = subprocess.Popen(
            [*CLI, "subscribe", str(path), "--count", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            deadline = time.monotonic() + 30
            while not w.statistics().readers or all(r.transport != "tcp" for r in w.statistics().readers):
                assert sub.poll() is None, sub.communicate()
                assert time.monotonic() < deadline, "the remote reader never attached"
                time.sleep(0.05)
            w.put("hello")
            out, err = sub.communicate(timeout=30)
        finally:
            if sub.poll() is None:
                sub.kill()
                sub.communicate()
    os.rmdir(elsewhere)
    assert sub.returncode == 0, err
    assert out == "hello\n"
    assert "over TCP" in err


# --- 6. bench, relay, help texts, plurals ----------------------------------------------------------
def test_bench_usage_errors_have_the_documented_prefix() -> None:
    res = run("bench", "--repeat", "0")
    assert res.returncode == 2
    assert "--repeat must be at least 1" in one_error(res)


COMMANDS = ("demo", "publish", "subscribe", "stats", "keygen", "relay", "bench")


def option_helps(help_text: str) -> dict[str, str]:
    """Each option's entry in a ``--help`` text (its first words: its flags), joined into one line."""
    entries: dict[str, str] = {}
    current: list[str] = []
    for line in help_text.splitlines():
        if re.match(r"^  -", line):
            current = [line.strip()]
            entries[line.split()[0].rstrip(",")] = ""
        elif current and line.startswith("    ") and line.strip():
            current.append(line.strip())
        else:
            current = []
            continue
        entries[next(reversed(entries))] = " ".join(current)
    return entries


@pytest.mark.parametrize("command", COMMANDS)
def test_help_states_each_default_once_and_none_for_required_options(command: str) -> None:
    res = run(command, "--help")
    assert res.returncode == 0, res.stderr
    options = option_helps(res.stdout)
    assert len(options) >= 3, res.stdout
    for flag, text in options.items():
        assert "(default: None)" not in text, (flag, text)
        assert "(default: False)" not in text, (flag, text)  # a flag's default is not to be given
        assert text.count("default") <= 1, (flag, text)
    if command == "relay":
        assert "default" not in options["--out"], options["--out"]
    # Every other default is stated (0 too: it is not a flag's False).
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[command]
    if parser.formatter_class is not HelpFormatter:
        return  # bench: its help states its defaults in its own words
    for action in parser._actions:
        option = action.option_strings[0] if action.option_strings else None
        default = action.default
        if option is None or action.required or default is None or default is False or default == argparse.SUPPRESS:
            continue
        stated = options[option]
        assert f"default: {default}" in stated or "(default:" in (action.help or ""), (option, stated)


def test_relay_says_when_its_upstream_closes_and_exits_1(tmp_path: Path) -> None:
    upstream = tmp_path / "up.json"
    out = tmp_path / "local.json"
    with blocking.open_writer(codec="json", tcp="tcp://127.0.0.1:0") as w:
        w.handle.save(upstream)
        relay = subprocess.Popen(
            [*CLI, "relay", str(upstream), "--out", str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 30
            while not out.exists():
                assert relay.poll() is None, relay.communicate()
                assert time.monotonic() < deadline, "the relay never wrote its handle"
                time.sleep(0.05)
            with blocking.open_reader(ab.Handle.load(out), name="local") as local:
                w.put("a")
                w.put("b")
                assert local.get(timeout=30) == "a"
                assert local.get(timeout=30) == "b"
                w.close()  # upstream closes
                with pytest.raises(ab.EndOfStream):
                    local.get(timeout=30)
            stdout, stderr = relay.communicate(timeout=30)
        finally:
            if relay.poll() is None:
                relay.kill()
                relay.communicate()
    assert relay.returncode == 1, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("aiobroadcast: error: ")]
    assert len(errors) == 1 and "closed" in errors[0] and "2 messages" in errors[0], stderr
    assert "Traceback" not in stderr
    assert not out.exists()  # as publish does: its handle file goes with its channel
    assert "relaying" in stdout


def test_relay_says_when_its_upstream_writer_dies_and_exits_1(tmp_path: Path) -> None:
    upstream = tmp_path / "up.json"
    out = tmp_path / "local.json"
    pub = subprocess.Popen(
        [*CLI, "publish", str(upstream), "--tcp", "tcp://127.0.0.1:0", "--ticks", "50"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    relay = None
    try:
        deadline = time.monotonic() + 30
        while not upstream.exists():
            assert pub.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        segment = ab.Handle.load(upstream).path
        relay = subprocess.Popen(
            [*CLI, "relay", str(upstream), "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        while not out.exists():
            assert relay.poll() is None and time.monotonic() < deadline, relay.communicate()
            time.sleep(0.05)
        with blocking.open_reader(ab.Handle.load(out), name="local") as local:
            local.get(timeout=30)  # ticks flow through the relay
            pub.kill()  # SIGKILL: the upstream writer cannot close anything
            pub.wait()
            with pytest.raises(ab.WriterGone):
                while True:
                    local.get(timeout=30)
        _stdout, stderr = relay.communicate(timeout=30)
    finally:
        for p in (pub, relay):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()
    assert relay.returncode == 1, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("aiobroadcast: error: ")]
    assert len(errors) == 1 and "died without closing" in errors[0], stderr
    assert not out.exists()
    deadline = time.monotonic() + 10
    while os.path.exists(segment) and time.monotonic() < deadline:
        ab.sweep_stale(os.path.dirname(segment))  # young files are kept 2 s
        time.sleep(0.2)


def test_relay_that_cannot_write_its_handle_file_says_so(tmp_path: Path) -> None:
    upstream = tmp_path / "up.json"
    with blocking.open_writer(codec="json", tcp="tcp://127.0.0.1:0") as w:
        w.handle.save(upstream)
        res = run("relay", str(upstream), "--out", str(tmp_path / "no-such-dir" / "local.json"))
    assert res.returncode == 2
    assert "cannot write the handle file" in one_error(res)


def test_relay_help_documents_its_exit_codes() -> None:
    res = run("relay", "--help")
    text = re.sub(r"\s+", " ", res.stdout)
    assert "Exit codes:" in text and "1 the upstream channel ended" in text


def test_relay_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    upstream = tmp_path / "up.json"
    out = tmp_path / "local.json"
    with blocking.open_writer(codec="json", tcp="tcp://127.0.0.1:0") as w:
        w.handle.save(upstream)
        relay = subprocess.Popen(
            [*CLI, "relay", str(upstream), "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            deadline = time.monotonic() + 30
            while not out.exists():
                assert relay.poll() is None, relay.communicate()
                assert time.monotonic() < deadline
                time.sleep(0.05)
            segment = ab.Handle.load(out).path
            relay.send_signal(signal.SIGTERM)
            _stdout, stderr = relay.communicate(timeout=30)
        finally:
            if relay.poll() is None:
                relay.kill()
                relay.communicate()
    assert relay.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert not out.exists() and not os.path.exists(segment)


def test_counts_agree_with_their_nouns(tmp_path: Path) -> None:
    handle = tmp_path / "h.json"
    lines = tmp_path / "lines.txt"
    lines.write_text("x\n")  # published once the one reader is attached
    with lines.open() as stdin:
        pub = subprocess.Popen(
            [*CLI, "publish", str(handle), "--wait-readers", "1"],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    try:
        # Attached until the channel closes: still counted in publish's summary at the end.
        sub = run("subscribe", str(handle), "--name", "only", "--wait", "30")
        _out, err = pub.communicate(timeout=30)
    finally:
        if pub.poll() is None:
            pub.kill()
            pub.communicate()
    assert sub.returncode == 0, sub.stderr
    assert sub.stderr.splitlines()[-1] == "only: received 1 message"
    assert "waiting for 1 reader to attach" in err
    assert "1 reader attached: only (shm)" in err
    assert "published 1 message; 1 reader was attached at the end; channel closed" in err

    # No reader at all: the TCP server's place in the ring is not a reader.
    res = run("publish", str(tmp_path / "empty.json"), "--tcp", "tcp://127.0.0.1:0", stdin="")
    assert res.returncode == 0, res.stderr
    assert "published 0 messages; 0 readers were attached at the end" in res.stderr


# --- 5. the README's dependencies ----------------------------------------------------------------
def test_the_readme_lists_every_dependency() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower() for d in deps}  # type: ignore[union-attr]
    readme = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    listed = re.search(r"Dependencies: ([^.]*)\.", readme)
    assert listed is not None
    assert {n.strip().lower() for n in listed.group(1).split(",")} == names


# --- 3. a source tree that shadows the installed package ------------------------------------------
def _copy_tree(dest: Path) -> None:
    """The source tree as a user has it after a clone: no compiled extension in it."""
    shutil.copytree(
        ROOT / "aiobroadcast",
        dest / "aiobroadcast",
        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"),
    )
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, dest / name)


def test_a_source_tree_that_shadows_a_non_editable_install_says_so_in_one_line(tmp_path: Path) -> None:
    """README command 1 installs the package (not editable) into .venv inside the source tree;
    from there, ``python -m aiobroadcast`` and scripts import the tree's own package, which has
    no compiled extension. That is one line with the fix, not a 12-frame traceback."""
    tree = tmp_path / "src"
    _copy_tree(tree)
    venv = tree / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    # The dependencies (and pip) from this interpreter: no download.
    ours = [p for p in sys.path if p.endswith("site-packages")]
    Path(site, "deps.pth").write_text("\n".join(ours) + "\n")
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", str(tree)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    installed = Path(site, "aiobroadcast")
    assert list(installed.glob("_shm/_atomics*.so"))

    # From elsewhere the installed package works.
    res = subprocess.run(
        [python, "-m", "aiobroadcast", "keygen", "--public"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr

    # From the source tree: one line, exit 1.
    res = subprocess.run(
        [python, "-m", "aiobroadcast", "demo"], cwd=tree, capture_output=True, text=True, timeout=60, check=False
    )
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("aiobroadcast: error: ")
    assert f"the source tree at {tree}" in lines[0] and "shadows the installed package" in lines[0]
    assert str(installed) in lines[0]
    assert "run from another directory" in lines[0] and "pip install -e ." in lines[0]

    # A script in the tree gets an ImportError (tools that catch ImportError keep working) that
    # says the same.
    probe = (
        "try:\n"
        "    import aiobroadcast\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__mro__[1:3], exc.name, str(exc), sep='|')\n"
    )
    (tree / "probe.py").write_text(probe)
    res = subprocess.run([python, "probe.py"], cwd=tree, capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    _mro, name, message = res.stdout.strip().split("|")
    assert name == "aiobroadcast._shm._atomics"
    assert "shadows the installed package" in message and "pip install -e ." in message


def test_a_package_without_its_extension_and_no_install_says_how_to_build_it(tmp_path: Path) -> None:
    """No installed copy to shadow (an editable checkout never built): the line says to build."""
    tree = tmp_path / "src"
    _copy_tree(tree)
    # Only the standard library and the dependencies: not this checkout (nor its editable install).
    env = {**os.environ, "PYTHONPATH": "", "PYTHONNOUSERSITE": "1"}
    script = (
        "import sys\n"
        f"sys.path[:] = [p for p in sys.path if p not in ('', {str(ROOT)!r})]\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]\n"
        f"sys.path.insert(0, {str(tree)!r})\n"
        "try:\n"
        "    import aiobroadcast\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert res.returncode == 0, res.stderr
    assert "has no compiled extension" in res.stdout and "pip install -e ." in res.stdout
    assert "shadows" not in res.stdout
