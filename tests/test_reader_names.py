"""Reader names are unique per channel (docs/design.md, "Reader names"): a second live reader
under a name is refused with the holder named, on shared memory and over TCP, local against
remote and remote against local; a dead holder's name (SIGKILL) is free at once; unnamed
readers get distinct names; and two processes claiming one name at the same moment: one wins."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import aiobroadcast as ab
from aiobroadcast import blocking

ASYNCIO = pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio")
LOOPBACK = "tcp://127.0.0.1:0"

#: a reader process: opens a reader under argv[2] (transport argv[3]) of the handle in argv[1],
#: says "ready <pid>" (or "taken <message>"), then holds it until its stdin closes
HOLDER = textwrap.dedent(
    """
    import sys, time
    from aiobroadcast import blocking, InvalidArgument
    handle, name, transport = sys.argv[1], sys.argv[2], sys.argv[3]
    start = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    while time.time() < start:
        pass  # every racer starts its claim at the same instant
    try:
        reader = blocking.open_reader(handle, name=name, transport=transport)
    except InvalidArgument as exc:
        print("taken", exc, flush=True)
        sys.stdin.read()
        sys.exit(0)
    print("ready", reader.statistics().name, flush=True)
    sys.stdin.read()
    reader.close()
    """
)


class Holder:
    """A reader in a process of its own."""

    def __init__(self, handle: ab.Handle, name: str, transport: str = "shm", start: float = 0.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, handle.to_json(), name, transport, repr(start)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = self.proc.pid

    def answer(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the reader process {self.pid} exited with {self.proc.wait()}"
        return line.strip()

    def ready(self) -> None:
        """Its reader is open (it was not refused)."""
        line = self.answer()
        assert line.startswith("ready "), line

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        elif self.proc.stdin is not None:
            self.proc.stdin.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for h in made:
        h.stop()


def names(writer: Any) -> list[str]:
    return sorted(r.name for r in writer.statistics().readers if r.name != "tcp-server")


def test_a_second_live_reader_under_a_name_is_refused_and_names_the_holder(holders: list[Holder]) -> None:
    with blocking.open_writer(capacity=8, slot_bytes=256) as writer:
        h = Holder(writer.handle, "worker-1")
        holders.append(h)
        assert h.answer() == "ready worker-1"
        # another process
        with pytest.raises(ab.InvalidArgument, match=rf"'worker-1' is already attached .*pid {h.pid}\b") as info:
            blocking.open_reader(writer.handle, name="worker-1")
        assert "place" in str(info.value)
        # this process, twice: the first one holds the name while it is open
        with blocking.open_reader(writer.handle, name="worker-2") as mine:
            with pytest.raises(ab.InvalidArgument, match=rf"'worker-2' .*pid {os.getpid()}\b"):
                blocking.open_reader(writer.handle, name="worker-2")
            assert names(writer) == ["worker-1", "worker-2"]
            writer.put("after")
            assert mine.get(timeout=5) == "after"
        # closed: the name is free again at once
        with blocking.open_reader(writer.handle, name="worker-2"):
            assert names(writer) == ["worker-1", "worker-2"]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [ASYNCIO])
async def test_the_async_open_refuses_a_taken_name_and_the_refusal_costs_nothing() -> None:
    async with ab.open_writer(capacity=4, slot_bytes=256, max_readers=2) as writer:
        async with ab.open_reader(writer.handle, name="a") as a:
            for _ in range(3):  # a refusal leaves no place taken (max_readers=2)
                with pytest.raises(ab.InvalidArgument, match="'a' is already attached"):
                    await ab.open_reader(writer.handle, name="a")
            async with ab.open_reader(writer.handle, name="b") as b:
                await writer.put(1)
                with anyio.fail_after(5):
                    assert (await a.get(), await b.get()) == (1, 1)


def test_a_sigkilled_holders_name_is_free_at_once(holders: list[Holder]) -> None:
    with blocking.open_writer(capacity=4, slot_bytes=256) as writer:
        h = Holder(writer.handle, "phoenix")
        holders.append(h)
        assert h.answer() == "ready phoenix"
        with pytest.raises(ab.InvalidArgument, match=rf"pid {h.pid}\b"):
            blocking.open_reader(writer.handle, name="phoenix")
        os.kill(h.pid, signal.SIGKILL)
        h.proc.wait(10)
        # The writer has not dropped it (it never waited on it): its record is still there, but
        # the kernel released its locks with the process, the name's with them.
        assert "phoenix" in names(writer)
        with blocking.open_reader(writer.handle, name="phoenix") as again:
            writer.put("x")
            assert again.get(timeout=5) == "x"
            assert again.statistics().name == "phoenix"


def test_unnamed_readers_get_distinct_names() -> None:
    with blocking.open_writer(capacity=4, slot_bytes=256) as writer:
        with blocking.open_reader(writer.handle) as r1, blocking.open_reader(writer.handle) as r2:
            n1, n2 = r1.statistics().name, r2.statistics().name
            assert n1 != n2
            for n in (n1, n2):
                assert re.fullmatch(rf"reader-{os.getpid()}-\d+", n), n
            assert names(writer) == sorted([n1, n2])


def test_an_unnamed_reader_skips_a_default_name_another_process_holds(holders: list[Holder]) -> None:
    """A process with our pid in another pid namespace (containers sharing the ring) can hold
    the name our next unnamed reader would take: it takes the next number instead."""
    from aiobroadcast._broadcast import reader_open as _open

    with blocking.open_writer(capacity=4, slot_bytes=256) as writer:
        with blocking.open_reader(writer.handle) as first:
            n = int(first.statistics().name.rsplit("-", 1)[1])
        h = Holder(writer.handle, f"reader-{os.getpid()}-{n + 1}")  # the next default name
        holders.append(h)
        assert h.answer().startswith("ready")
        with blocking.open_reader(writer.handle) as r:
            assert r.statistics().name == f"reader-{os.getpid()}-{n + 2}"
        assert next(_open._unnamed) == n + 3


def test_two_processes_claiming_one_name_at_the_same_moment_one_wins(holders: list[Holder]) -> None:
    with blocking.open_writer(capacity=4, slot_bytes=256, max_readers=16) as writer:
        for rnd in range(3):
            start = time.time() + 3.0  # the processes are up by then (imports take a second under load)
            racers = [Holder(writer.handle, f"contested-{rnd}", start=start) for _ in range(4)]
            holders.extend(racers)
            answers = [r.answer() for r in racers]
            won = [r for r, a in zip(racers, answers, strict=True) if a.startswith("ready")]
            assert len(won) == 1, answers
            for r, a in zip(racers, answers, strict=True):
                if r is not won[0]:
                    assert a.startswith("taken"), a
                    assert f"pid {won[0].pid}" in a or "attaching right now" in a, a
            assert names(writer).count(f"contested-{rnd}") == 1
            for r in racers:
                r.stop()


def test_the_tcp_servers_name_is_reserved() -> None:
    with blocking.open_writer(capacity=4, slot_bytes=256) as writer:
        with pytest.raises(ab.InvalidArgument, match="TCP server"):
            blocking.open_reader(writer.handle, name="tcp-server")


def test_names_are_unique_across_local_and_remote_readers(holders: list[Holder]) -> None:
    with blocking.open_writer(capacity=8, slot_bytes=256, tcp=LOOPBACK) as writer:
        # a remote reader (another process) holds "far": a local one is refused, naming it
        far = Holder(writer.handle, "far", "tcp")
        holders.append(far)
        assert far.answer() == "ready far"
        with pytest.raises(ab.InvalidArgument, match=rf"'far' .*remote reader pid {far.pid}\b.*over TCP"):
            blocking.open_reader(writer.handle, name="far", transport="shm")
        # ... and so is another remote one
        with pytest.raises(ab.InvalidArgument, match=rf"'far' .*remote reader pid {far.pid}\b"):
            blocking.open_reader(writer.handle, name="far", transport="tcp")
        # a local reader holds "near": a remote one is refused, naming its pid
        with blocking.open_reader(writer.handle, name="near", transport="shm"):
            with pytest.raises(ab.InvalidArgument, match=rf"'near' .*pid {os.getpid()}\b"):
                blocking.open_reader(writer.handle, name="near", transport="tcp")
            assert names(writer) == ["far", "near"]
        # the remote reader leaves: its name is free for a local reader
        far.stop()
        deadline = time.monotonic() + 10
        while True:
            try:
                with blocking.open_reader(writer.handle, name="far", transport="shm") as mine:
                    writer.put(7)
                    assert mine.get(timeout=5) == 7
                break
            except ab.InvalidArgument:
                assert time.monotonic() < deadline, "the departed remote reader's name stayed taken"
                time.sleep(0.05)
        # and the local one's, closed, for a remote reader
        with blocking.open_reader(writer.handle, name="near", transport="tcp") as remote:
            writer.put(8)
            assert remote.get(timeout=10) == 8
        # unnamed remote readers take distinct names
        with (
            blocking.open_reader(writer.handle, transport="tcp") as r1,
            blocking.open_reader(writer.handle, transport="tcp") as r2,
        ):
            assert r1.statistics().name != r2.statistics().name
        with pytest.raises(ab.InvalidArgument, match="TCP server"):
            blocking.open_reader(writer.handle, name="tcp-server", transport="tcp")


def test_a_sigkilled_remote_holders_name_is_free_once_the_server_drops_it(holders: list[Holder]) -> None:
    with blocking.open_writer(capacity=8, slot_bytes=256, tcp=LOOPBACK, heartbeat_s=0.2) as writer:
        h = Holder(writer.handle, "remote-1", "tcp")
        holders.append(h)
        assert h.answer() == "ready remote-1"
        with pytest.raises(ab.InvalidArgument, match=rf"remote reader pid {h.pid}\b"):
            blocking.open_reader(writer.handle, name="remote-1", transport="shm")
        os.kill(h.pid, signal.SIGKILL)
        h.proc.wait(10)
        deadline = time.monotonic() + 20  # silent for the heartbeat timeout, then dropped
        while True:
            try:
                with blocking.open_reader(writer.handle, name="remote-1", transport="tcp") as again:
                    writer.put("back")
                    assert again.get(timeout=10) == "back"
                break
            except ab.InvalidArgument:
                assert time.monotonic() < deadline, "the dead remote reader's name stayed taken"
                time.sleep(0.1)


def test_vllm_queues_name_their_readers_uniquely() -> None:
    """The drop-in names a reader by its rank (``rank-<n>``, unique per group as ranks are); a
    reader without a rank (``create_from_handle(handle, -1)``, vLLM's executor's peers) takes the
    default name, so several of them attach. Two queues are two channels: the same rank reads both."""
    from aiobroadcast.vllm import MessageQueue

    queues = [MessageQueue(3, 1, max_chunk_bytes=4096, max_chunks=4, connect_ip="127.0.0.1") for _ in range(2)]
    readers: list[Any] = []
    try:
        for q in queues:
            readers.append(MessageQueue.create_from_handle(q.export_handle(), 0))  # rank-0 of each queue
            readers.append(MessageQueue.create_from_handle(q.export_handle(), -1))
            readers.append(MessageQueue.create_from_handle(q.export_handle(), -1))
        for q in queues:
            q.wait_until_ready()
            got = [(r.name, r.transport) for r in q.statistics().readers if r.transport != "tcp-server"]
            assert len(got) == 3 and len({name for name, _ in got}) == 3, got
            assert ("rank-0", "shm") in got
            q.enqueue("hello")
        assert [r.dequeue(timeout=30) for r in readers] == ["hello"] * 6
        # one rank's reader twice on one queue: a mistake, refused with the holder named
        with pytest.raises(ab.InvalidArgument, match=rf"'rank-0' is already attached .*pid {os.getpid()}\b"):
            MessageQueue.create_from_handle(queues[0].export_handle(), 0)
    finally:
        for r in readers:
            r.close()
        for q in queues:
            q.close()
