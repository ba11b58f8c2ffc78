"""A writer restarted with the same channel (``publish --channel``, or ``--keys`` and a fixed
``--tcp`` port) accepts the handles of its earlier runs; readers attached across the restart end
(``WriterGone``), ``subscribe --follow`` re-attaches; another key's or another channel's handle
is still refused. Real processes (the CLI), real shared memory, real sockets."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from test_cli import Proc, run, wait_file

import aiobroadcast as ab
from aiobroadcast import blocking


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Processes a test starts; all stopped at the end, whatever happened."""
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop()


def free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def keygen(path: Path) -> Path:
    assert run("keygen", "--out", str(path)).returncode == 0
    return path


def publish(procs: list[Proc], handle: Path, *args: str) -> tuple[Proc, ab.Handle]:
    """Start ``publish HANDLE --ticks 50 ARGS`` in a session of its own (so that it can be
    killed with its TCP server); its handle once saved."""
    if handle.exists():
        handle.unlink()
    pub = Proc("publish", str(handle), "--ticks", "50", *args, new_session=True)
    procs.append(pub)
    wait_file(handle, 30)
    return pub, ab.Handle.load(handle)


def stop(pub: Proc) -> None:
    pub.popen.send_signal(signal.SIGTERM)
    assert pub.wait() == 0, pub.err


def kill_with_server(pub: Proc) -> None:
    """SIGKILL the writer and its TCP server at once (its process group): nobody says goodbye."""
    os.killpg(pub.pid, signal.SIGKILL)
    pub.wait()


def read_one(handle: ab.Handle, transport: Literal["shm", "tcp"]) -> Any:
    with blocking.open_reader(handle, transport=transport, name="later", connect_timeout=20) as reader:
        return reader.get(timeout=20)


def test_shared_memory_a_named_channel_accepts_the_handle_of_its_earlier_run(tmp_path: Path, procs: list[Proc]) -> None:
    """``publish --channel demo``: run 1 is SIGKILLed with a reader attached; run 2 takes its
    segment's path over. The reader attached across the restart ends with ``WriterGone`` (it
    never sees run 2's messages); the handle saved from run 1 opens a reader on run 2; the handle
    of another channel name does not."""
    h1_file, h2_file = tmp_path / "h1.json", tmp_path / "h2.json"
    pub1, h1 = publish(procs, h1_file, "--channel", "demo")
    with blocking.open_reader(h1, transport="shm", name="across") as across:
        assert "seq" in across.get(timeout=20)
        os.kill(pub1.pid, signal.SIGKILL)
        pub1.wait()
        pub2, h2 = publish(procs, h2_file, "--channel", "demo")
        assert h2.name == h1.name and h2.writer_pid != h1.writer_pid
        with pytest.raises(ab.WriterGone):
            for _ in range(1000):  # what run 1 published before it died, then the end
                across.get(timeout=20)
    assert read_one(h1, "shm")["seq"] >= 0
    stop(pub2)

    other, _ = publish(procs, h2_file, "--channel", "other")
    with pytest.raises(ab.InvalidHandle, match="is gone"):
        read_one(h1, "shm")
    stop(other)


def test_tcp_fixed_keys_and_endpoint_accept_the_handle_of_an_earlier_run(tmp_path: Path, procs: list[Proc]) -> None:
    """``publish --tcp <fixed port> --keys k``, run twice: the handle of run 1 opens a reader on
    run 2 (over TCP and over shared memory). A remote reader attached to run 1, whose writer and
    server are SIGKILLed together, reconnects to run 2 by itself, and is told its stream ended
    (``WriterGone``, restarted) instead of resuming in run 2's numbering."""
    keys = keygen(tmp_path / "k.json")
    endpoint = free_endpoint()
    h_file = tmp_path / "h.json"
    pub1, h1 = publish(procs, h_file, "--tcp", endpoint, "--keys", str(keys))
    with blocking.open_reader(h1, transport="tcp", name="across", connect_timeout=20) as across:
        assert "seq" in across.get(timeout=20)
        kill_with_server(pub1)
        pub2, h2 = publish(procs, h_file, "--tcp", endpoint, "--keys", str(keys))
        assert (h2.name, h2.tcp) == (h1.name, h1.tcp)
        with pytest.raises(ab.WriterGone) as gone:
            for _ in range(1000):
                across.get(timeout=30)
        assert gone.value.restarted, gone.value
    assert read_one(h1, "tcp")["seq"] >= 0
    assert read_one(h1, "shm")["seq"] >= 0
    stop(pub2)


def test_another_key_or_another_channel_name_is_still_refused(tmp_path: Path, procs: list[Proc]) -> None:
    """At the same endpoint, a writer with other keys refuses the handle at the CurveZMQ
    handshake, and a writer with the same keys but another channel name refuses it by name."""
    keys, other_keys = keygen(tmp_path / "k.json"), keygen(tmp_path / "k2.json")
    endpoint = free_endpoint()
    h_file = tmp_path / "h.json"
    pub, h1 = publish(procs, h_file, "--tcp", endpoint, "--keys", str(keys), "--channel", "a")
    stop(pub)

    pub, _ = publish(procs, h_file, "--tcp", endpoint, "--keys", str(other_keys), "--channel", "a")
    with pytest.raises(ab.TransportError, match="refused this reader's keys"):
        read_one(h1, "tcp")
    stop(pub)

    pub, h3 = publish(procs, h_file, "--tcp", endpoint, "--keys", str(keys), "--channel", "b")
    assert h3.name != h1.name
    with pytest.raises(ab.TransportError, match="another channel"):
        read_one(h1, "tcp")
    with pytest.raises(ab.InvalidHandle):
        read_one(h1, "shm")
    stop(pub)

    pub, _ = publish(procs, h_file, "--tcp", endpoint, "--keys", str(keys), "--channel", "a")
    assert read_one(h1, "tcp")["seq"] >= 0  # the one that is the same channel again
    stop(pub)


def ticks_after(sub: Proc, since: float) -> list[dict[str, Any]]:
    return [t for t in map(json.loads, list(sub.out)) if t["time"] > since]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_subscribe_follow_reattaches_after_restarts(tmp_path: Path, procs: list[Proc], transport: str) -> None:
    """``subscribe --follow`` reads on across a clean restart (SIGTERM: the channel closes) and
    a crash (SIGKILL of the writer and its server), with the handle it opened at the start,
    saying each time that it re-attached and that what it missed is not known."""
    keys = keygen(tmp_path / "k.json")
    endpoint = free_endpoint()
    h_file = tmp_path / "h.json"
    args = ("--tcp", endpoint, "--keys", str(keys))
    pub, _ = publish(procs, h_file, *args)
    sub = Proc("subscribe", str(h_file), "--follow", "--transport", transport, "--name", "follower")
    procs.append(sub)
    sub.wait_for(r'"seq"', 30)
    h_file.rename(tmp_path / "h-of-run-1.json")  # the follower must get on with the handle it has

    for how in ("closed", "restarted" if transport == "tcp" else "died"):
        if how == "closed":
            stop(pub)
        else:
            kill_with_server(pub)
        since = time.time()
        pub, _ = publish(procs, h_file, *args)
        # (A remote follower learns that its writer restarted from the new run's server.)
        sub.wait_for(f"follower: .*{how}.*waiting for it to start again", 30)
        sub.wait_for(r"follower: writer restarted; re-attached \(.*\); messages missed: unknown", 30)
        deadline = time.monotonic() + 30
        while not ticks_after(sub, since):
            assert time.monotonic() < deadline, (sub.out[-5:], sub.err)
            time.sleep(0.05)
    stop(pub)
    sub.popen.send_signal(signal.SIGTERM)
    assert sub.wait() == 0, sub.err
    assert sub.err[-1].startswith("follower: received ")
