"""Revoking a remote reader over real sockets and processes (docs/security.md, "Revoking a
reader"): credentials issued and revoked with ``aiobroadcast keygen``, a writer serving with the
allow list, a reader kept, and the revoked reader in a process of its own that keeps every key and
credential it was given (tests/_revoked_reader.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
from _peers import ON_ASYNCIO, tcp_writer, the_server, until
from test_seal_wire import ByteRelay, ZmtpMitm, listening_ports, middle_for

import aiobroadcast as ab
from aiobroadcast._base.handle import AllowList, Handle
from aiobroadcast._tcp import seal, wire
from aiobroadcast._tcp.readers import REVOKED
from aiobroadcast.blocking import open_writer as open_blocking_writer

pytestmark = pytest.mark.anyio

CLI = [sys.executable, "-m", "aiobroadcast"]
REVOKED_READER = str(Path(__file__).with_name("_revoked_reader.py"))


def keygen(*args: str) -> None:
    done = subprocess.run([*CLI, "keygen", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


class Events:
    """The JSON lines a process prints, gathered by a thread."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[dict[str, Any]] = []
        assert proc.stdout is not None
        stdout = proc.stdout
        threading.Thread(target=lambda: self.lines.extend(json.loads(line) for line in stdout), daemon=True).start()

    def get(self, key: str) -> list[Any]:
        return [line[key] for line in list(self.lines) if key in line]


def bodies(groups: list[list[bytes]]) -> list[tuple[int, int, bytes]]:
    """The sealed bodies of the BATCH groups among ``groups``: (seq, flags, sealed)."""
    out = []
    for group in groups:
        if group[0] == wire.BATCH:
            first, items = wire.decode_batch(group[1], group[2:-1])
            out += [(first + k, flags, bytes(body)) for k, (body, flags) in enumerate(items)]
    return out


def opens_with_any(holders: list[seal.Opener], seq: int, flags: int, sealed: bytes) -> bool:
    for opener in holders:
        try:
            opener.open(seq, flags, sealed)
        except seal.SealError:
            continue
        return True
    return False


@ON_ASYNCIO
async def test_a_revoked_reader_reads_nothing_sealed_after_and_cannot_come_back(tmp_path: Path) -> None:
    """Two readers with credentials of their own (keygen --reader), on a writer serving with the
    allow list (the handle's shared key is refused). One is revoked (keygen --revoke; the writer
    finds the change at its heartbeat): its process, still running with every key and credential
    it was given, is told REFUSED "revoked"; its HELLO on the connection it still holds is
    refused; a new connection with its credentials fails the CurveZMQ handshake (ZAP); and no body
    sealed after the revocation, tapped on the path to the other reader, opens with any key it
    ever held (those sealed before do). The other reader reads every message, before and after."""
    allow = tmp_path / "allow.json"
    AllowList().save(allow)
    async with tcp_writer(allow_list=str(allow), capacity=64) as writer:
        writer.handle.save(tmp_path / "writer.json")
        with pytest.raises(ab.TransportError):  # the shared key is not on the list
            await ab.open_reader(writer.handle, transport="tcp")
        for name in ("stays", "gone"):
            keygen("--reader", name, "--allow-list", str(allow), "--handle", str(tmp_path / "writer.json"),
                   "--out", str(tmp_path / f"{name}.json"))  # fmt: skip
        assert sorted(AllowList.load(allow).readers) == ["gone", "stays"]
        the_server().send_signal(signal.SIGHUP)  # read the list now
        stays = Handle.load(tmp_path / "stays.json")
        assert stays.client_public_key != writer.handle.client_public_key
        control, data = listening_ports(writer)
        middle = middle_for(control, data)
        groups: list[list[bytes]] = []  # what crossed the path of "stays"'s data connection

        def tap(group: list[bytes]) -> list[list[bytes]]:
            groups.append(list(group))
            return [group]

        relay, mitm = ByteRelay(control, middle), ZmtpMitm(data, tap, middle)
        proc = subprocess.Popen(  # noqa: ASYNC220 - its output is read by a thread (Events)
            [sys.executable, REVOKED_READER, str(tmp_path / "gone.json")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert stays.tcp is not None
            tapped = stays.model_copy(update={"tcp": stays.tcp.replace("127.0.0.1", middle)})
            with anyio.fail_after(20):
                while True:  # until the server read the list (SIGHUP, at its next turn)
                    try:
                        reader = await ab.open_reader(tapped, transport="tcp", name="stays")
                        break
                    except ab.TransportError:
                        await anyio.sleep(0.1)
            events = Events(proc)
            async with reader:
                await until(lambda: bool(events.get("keys")), 20)
                for i in range(10):
                    await writer.put(i)
                    with anyio.fail_after(20):
                        assert await reader.get() == i
                await until(lambda: [s for batch in events.get("opened") for s in batch] == list(range(10)), 20)
                before = len(groups)
                keygen("--revoke", "gone", "--allow-list", str(allow))
                await until(lambda: bool(events.get("refused")), 20)  # at the server's next heartbeats
                for i in range(10, 30):
                    await writer.put(i)
                    with anyio.fail_after(20):
                        assert await reader.get() == i  # nothing lost across the revocation
                await until(lambda: bool(events.get("reconnect")), 30)
                assert events.get("refused") == [REVOKED.decode()]
                assert events.get("hello_again") == [f"R {REVOKED.decode()}"]
                assert events.get("reconnect") == ["failed_auth"]
                assert not any(events.get("opens"))  # nothing it was still sent opened
                holders = []
                for message in events.get("keys"):
                    opener = seal.Opener(writer.handle.token.encode())
                    opener.install(bytes.fromhex(message))
                    holders.append(opener)
                sealed_before, sealed_after = bodies(groups[:before]), bodies(groups[before:])
                assert [s for s, _, _ in sealed_before] == list(range(10))
                assert all(opens_with_any(holders, *b) for b in sealed_before)  # the check can succeed
                assert sorted({s for s, _, _ in sealed_after}) == list(range(10, 30))
                assert not any(opens_with_any(holders, *b) for b in sealed_after)
                assert proc.poll() is None  # still running, with all it held
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
            relay.close()
            mitm.close()


def keygen_fails(*args: str) -> str:
    done = subprocess.run([*CLI, "keygen", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.returncode, done.stderr)
    return done.stderr


def test_keygen_says_what_is_wrong_with_a_reader_or_a_revocation(tmp_path: Path) -> None:
    allow = tmp_path / "allow.json"
    AllowList(readers={"a": "x" * 40}).save(allow)
    assert "no reader 'b' on the allow list (readers: a)" in keygen_fails("--revoke", "b", "--allow-list", str(allow))
    assert "needs --allow-list FILE" in keygen_fails("--revoke", "a")
    assert "--handle FILE" in keygen_fails("--reader", "c", "--allow-list", str(allow), "--out", str(tmp_path / "c"))
    (tmp_path / "bad.json").write_text("{}")
    stderr = keygen_fails("--revoke", "a", "--allow-list", str(tmp_path / "bad.json"))
    assert "not a readable aiobroadcast allow list" not in stderr  # an empty list: nobody to revoke
    assert "no reader 'a'" in stderr
    (tmp_path / "junk.json").write_text("[1]")
    assert "not a readable aiobroadcast allow list" in keygen_fails(
        "--revoke", "a", "--allow-list", str(tmp_path / "junk.json")
    )
    assert AllowList.load(allow).readers == {"a": "x" * 40}  # nothing changed by a refusal


@pytest.mark.parametrize("kw", [{"insecure": True}, {"tcp": None}, {"allow_list": "/nonexistent/allow.json"}])
def test_open_writer_refuses_an_allow_list_it_cannot_use(kw: dict[str, Any], tmp_path: Path) -> None:
    allow = tmp_path / "allow.json"
    AllowList().save(allow)
    options: dict[str, Any] = {"tcp": "tcp://127.0.0.1:0", "allow_list": str(allow), "directory": str(tmp_path), **kw}
    with pytest.raises(ab.InvalidArgument, match="allow"):
        open_blocking_writer(**options)


@ON_ASYNCIO
async def test_a_reader_revoked_while_reading_is_told_so_and_its_handle_opens_no_reader_again(tmp_path: Path) -> None:
    """An ordinary remote reader, revoked on SIGHUP (the list changed by ``AllowList``): its
    ``get`` raises ``TransportError`` saying it was revoked, and its handle no longer opens a
    reader (the handshake is refused)."""
    allow = tmp_path / "allow.json"
    AllowList().save(allow)
    async with tcp_writer(allow_list=str(allow)) as writer:
        writer.handle.save(tmp_path / "writer.json")
        keygen("--reader", "r", "--allow-list", str(allow), "--handle", str(tmp_path / "writer.json"),
               "--out", str(tmp_path / "r.json"))  # fmt: skip
        server = the_server()
        server.send_signal(signal.SIGHUP)
        mine = Handle.load(tmp_path / "r.json")
        with anyio.fail_after(20):
            while True:
                try:
                    reader = await ab.open_reader(mine, transport="tcp", name="r")
                    break
                except ab.TransportError:
                    await anyio.sleep(0.1)
        async with reader:
            await writer.put("before")
            with anyio.fail_after(20):
                assert await reader.get() == "before"
            AllowList.load(allow).without("r").save(allow)
            server.send_signal(signal.SIGHUP)
            with anyio.fail_after(20), pytest.raises(ab.TransportError, match="refused this reader: revoked"):
                await reader.get()
        with pytest.raises(ab.TransportError, match="allow list"):
            await ab.open_reader(mine, transport="tcp")
