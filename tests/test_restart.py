"""A writer restarted with the same channel (``publish --channel``, or ``--keys`` and a fixed
``--tcp`` port) accepts the handles of its earlier runs; readers attached across the restart end
(``WriterGone``), ``subscribe --follow`` re-attaches; another key's or another channel's handle
is still refused. Real processes (the CLI), real shared memory, real sockets."""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from test_cli import Proc, run, wait_file

import aiobroadcast as ab
from aiobroadcast import blocking
from aiobroadcast._tcp import seal
from aiobroadcast._tcp.receiving import ClientProtocol, Ended, Welcomed
from aiobroadcast._tcp.serving import Admitted, ServerConfig, ServerEvent, ServerProtocol


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


def group_keys(reader: blocking.BlockingReader[Any]) -> set[bytes]:
    """The sealing keys (AES-256-GCM) a remote reader holds, as its server's WELCOME gave them."""
    opener = reader._src._proto._opener  # type: ignore[attr-defined]
    return {k.key for k in opener._keys.values()}


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
    (``WriterGone``, restarted) instead of resuming in run 2's numbering. The data plane's keys
    are the new server process's own: fixed CurveZMQ keys fix no sealing key, so no nonce (key
    id, counter) of run 1 is used again under the same key."""
    keys = keygen(tmp_path / "k.json")
    endpoint = free_endpoint()
    h_file = tmp_path / "h.json"
    pub1, h1 = publish(procs, h_file, "--tcp", endpoint, "--keys", str(keys))
    with blocking.open_reader(h1, transport="tcp", name="across", connect_timeout=20) as across:
        assert "seq" in across.get(timeout=20)
        run1_keys = group_keys(across)
        kill_with_server(pub1)
        pub2, h2 = publish(procs, h_file, "--tcp", endpoint, "--keys", str(keys))
        assert (h2.name, h2.tcp) == (h1.name, h1.tcp)
        with pytest.raises(ab.WriterGone) as gone:
            for _ in range(1000):
                across.get(timeout=30)
        assert gone.value.restarted, gone.value
    with blocking.open_reader(h1, transport="tcp", name="later", connect_timeout=20) as later:
        assert "seq" in later.get(timeout=20)
        run2_keys = group_keys(later)
    assert run1_keys and run2_keys and not run1_keys & run2_keys
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


def test_publish_make_keys_makes_the_key_file_at_the_first_start_only(tmp_path: Path, procs: list[Proc]) -> None:
    """``--keys FILE --make-keys``: the first start makes FILE (mode 0600) and serves with it;
    the next start finds it and serves with the same keys, so the handle is the same channel's."""
    keys, h_file = tmp_path / "k.json", tmp_path / "h.json"
    endpoint = free_endpoint()
    pub, h1 = publish(procs, h_file, "--tcp", endpoint, "--keys", str(keys), "--make-keys")
    made = ab.CurveKeys.load(keys)
    assert keys.stat().st_mode & 0o777 == 0o600
    assert (h1.server_key, h1.client_secret_key) == (made.server_public, made.client_secret)
    pub.wait_for(f"made fresh CurveZMQ keys in {keys}")
    stop(pub)
    pub, h2 = publish(procs, h_file, "--tcp", endpoint, "--keys", str(keys), "--make-keys")
    assert ab.CurveKeys.load(keys) == made and (h2.name, h2.server_key) == (h1.name, h1.server_key)
    assert not any("made fresh" in line for line in pub.err)
    assert read_one(h1, "tcp")["seq"] >= 0
    stop(pub)
    res = run("publish", str(h_file), "--make-keys")
    assert res.returncode == 2 and "--make-keys needs --keys" in res.stderr


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
        sub.wait_for(r"follower: writer restarted; re-attached, (remote|local), .*; messages missed: unknown$", 30)
        deadline = time.monotonic() + 30
        while not ticks_after(sub, since):
            assert time.monotonic() < deadline, (sub.out[-5:], sub.err)
            time.sleep(0.05)
    stop(pub)
    sub.popen.send_signal(signal.SIGTERM)
    assert sub.wait() == 0, sub.err
    assert sub.err[-1].startswith("follower: received ")


# --- the run, in the protocol (sans-IO: the frames a real socket would carry) --------------------
CHANNEL = "c" * 32
KEY = b"k" * 32


def _server(run: str) -> ServerProtocol:
    config = ServerConfig(
        "lag", KEY, 4, 16, hb_interval=1.0, hb_timeout=5.0, max_remote=4, channel=CHANNEL, run=run, data_port=5555
    )
    return ServerProtocol(config, start=0, now=0.0, returning=1, sealer=seal.Sealer(CHANNEL.encode(), secret=KEY))


def _to_server(client: ClientProtocol, srv: ServerProtocol, ident: bytes = b"r") -> list[ServerEvent | None]:
    return [srv.receive(ident, frames, now=0.0, published=srv.end) for frames in client.data_to_send()]


def _to_client(srv: ServerProtocol, client: ClientProtocol) -> list[Any]:
    return [client.receive(frames, 0.0) for _ident, frames in srv.data_to_send()]


def _resume(client: ClientProtocol, srv: ServerProtocol, ident: bytes = b"r") -> list[ServerEvent | None]:
    """A welcomed reader meets a server that holds no session of it (a new server process): its
    HELLO (signed in its old session) is answered UNKNOWN, and its HELLO in a new session is
    what the server takes."""
    client._hello(client.next)
    events = _to_server(client, srv, ident)
    for answer in _to_client(srv, client):
        assert answer is None  # UNKNOWN: the reader says HELLO again, in a session of its own
    return events + _to_server(client, srv, ident)


def test_a_returning_reader_is_told_its_writer_restarted_and_resumes_only_in_its_own_run() -> None:
    """A reader welcomed by run "one" names it in the HELLO that resumes. A server of the same
    run (its TCP server process started again by the writer) takes it back where it was; a
    server of another run of the same channel does not admit it and answers RESTARTED, which
    ends its stream; a WELCOME of another run ends it too."""
    client = ClientProtocol(key=KEY, channel=CHANNEL, name="c", pid=1, host="h", window=4, now=0.0)
    first = _server("one")
    assert any(isinstance(e, Admitted) for e in _to_server(client, first))
    assert any(isinstance(e, Welcomed) for e in _to_client(first, client)) and client.run == "one"

    same_run = _server("one")  # the supervisor's new server: the reader resumes
    assert any(isinstance(e, Admitted) for e in _resume(client, same_run))
    assert _to_client(same_run, client) == [None]  # a repeated WELCOME: the stream goes on

    restarted = _server("two")
    assert _resume(client, restarted) == [None, None]  # not admitted
    assert b"r" not in restarted.readers.clients
    assert _to_client(restarted, client) == [Ended("restarted")]

    # A server that does not check (it admitted the HELLO): its WELCOME names another run.
    other = ClientProtocol(key=KEY, channel=CHANNEL, name="o", pid=2, host="h", window=4, now=0.0)
    _to_server(other, first, b"o")
    assert any(isinstance(e, Welcomed) for e in _to_client(first, other))
    lax = _server("two")
    run, other.run = other.run, None
    admitted = _resume(other, lax, b"o")  # as a reader of a version that does not name its run would
    other.run = run
    assert any(isinstance(e, Admitted) for e in admitted)
    assert _to_client(lax, other) == [Ended("restarted")]


def test_a_reader_of_the_dead_run_closing_late_leaves_the_new_runs_wake_up_socket(
    tmp_path: Path, procs: list[Proc]
) -> None:
    """The segment's path is the same at every run, and so are the wake-up sockets beside it: a
    reader of a SIGKILLed run that closes after the new run's reader took the same place must
    not remove that reader's socket (the writer could then no longer wake it)."""
    h_file = tmp_path / "h.json"
    pub1, h1 = publish(procs, h_file, "--channel", "sockets")
    old = blocking.open_reader(h1, transport="shm", name="old")
    try:
        old.get(timeout=20)
        os.kill(pub1.pid, signal.SIGKILL)
        pub1.wait()
        pub2, _ = publish(procs, h_file, "--channel", "sockets")
        with blocking.open_reader(h1, transport="shm", name="new") as new:
            place = new.statistics().place
            assert place == old.statistics().place  # the same place: the same socket path
            sock = f"{h1.path}-r{place}.sock"
            assert os.path.exists(sock)
            old.close()
            assert os.path.exists(sock)
            assert "seq" in new.get(timeout=20)
    finally:
        old.close()
    stop(pub2)


def test_one_channel_has_one_writer_at_a_time_and_a_bad_name_is_refused() -> None:
    """A second writer of an open channel is refused, naming the first; so is a path that is
    not this user's channel file; a channel name that could not be one is an InvalidArgument.
    Other names, and the same name in another directory, are other channels."""
    with blocking.open_writer(channel="one", capacity=4, slot_bytes=64) as first:
        with pytest.raises(ab.BroadcastError, match=rf"open already: its writer \(pid {os.getpid()}\)"):
            blocking.open_writer(channel="one", capacity=4, slot_bytes=64)
        with blocking.open_writer(channel="two", capacity=4, slot_bytes=64) as second:
            assert second.handle.name != first.handle.name
        elsewhere = Path(tempfile.mkdtemp(prefix="ab-", dir="/dev/shm"))  # short: socket paths
        with blocking.open_writer(channel="one", capacity=4, slot_bytes=64, directory=str(elsewhere)) as third:
            assert third.handle.name != first.handle.name
            in_the_way = third.handle.path
    os.mkdir(in_the_way)  # where the channel's file would go: not a regular file
    try:
        with pytest.raises(ab.BroadcastError, match="in the way"):
            blocking.open_writer(channel="one", capacity=4, slot_bytes=64, directory=str(elsewhere))
    finally:
        os.rmdir(in_the_way)
        os.rmdir(elsewhere)
    for bad in ("", "-x", "a/b", "x" * 129, "é"):
        with pytest.raises(ab.InvalidArgument, match="channel must be a name"):
            blocking.open_writer(channel=bad)
