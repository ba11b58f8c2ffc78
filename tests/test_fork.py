"""A fork child inherits no role (docs/design.md, "Fork"): real processes that fork while they hold
a writer or a reader, with the fork and forkserver start methods (and spawn where it means
something). Field notes, "Liveness and fork".

A liveness lock rides on an open file description, which fork shares with the child: unless the
child lets go of it, the parent's lock outlives the parent. These tests kill the parent and check
that its peers see it dead while its child lives on; that a child's exit leaves the parent's
channel alone; that a child's use of an inherited role fails with a clear error; and that a child
opens a reader of its own.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import psutil
import pytest
from _fork_workers import fork_exit_proc, forking_reader_proc, forking_writer_proc, inherit_proc, own_reader_parent_proc
from _workers import Backend, spawn

import aiobroadcast as ab
from aiobroadcast._base import tuning as _tuning

pytestmark = pytest.mark.anyio

#: The start methods that start a helper: only "fork" copies the parent's descriptors and
#: mappings into it; "forkserver" is the default of Python 3.14 and must keep working.
HELPER_METHODS = ["fork", "forkserver"]


def files_of(handle: ab.Handle) -> list[str]:
    return sorted(n for n in os.listdir(handle.directory) if n.startswith(handle.name))


@contextmanager
def killed_at_exit(pid: int) -> Iterator[psutil.Process]:
    """The helper a child started: it outlives that child, so the test kills it (before the
    child's own clean-up, which waits for every holder of the child's sentinel pipe)."""
    helper = psutil.Process(pid)
    try:
        yield helper
    finally:
        try:
            helper.kill()
        except psutil.NoSuchProcess:
            pass


def alive_and_not_a_zombie(p: psutil.Process) -> bool:
    try:
        return bool(p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


async def sweep(handle: ab.Handle) -> None:
    """Remove what a SIGKILLed writer left, once old enough to be stale."""
    age = time.time() - os.stat(handle.path).st_mtime
    await anyio.sleep(max(0.0, _tuning.STALE_MIN_AGE_S + 0.2 - age))
    assert handle.path in ab.sweep_stale(handle.directory)


async def stats_row(handle_file: Path, name: str) -> list[str] | None:
    """The columns of reader ``name`` in ``aiobroadcast stats --once``, None if not listed."""
    res = await anyio.run_process(
        [sys.executable, "-m", "aiobroadcast", "stats", str(handle_file), "--once", "--interval", "0"], check=False
    )
    out = res.stdout.decode()
    assert res.returncode == 0, out + res.stderr.decode()
    for line in out.splitlines():
        cols = line.split()
        if len(cols) > 4 and cols[0].isdigit() and cols[1] == name:
            return cols
    return None


# --- the parent dies, its fork child lives on ---------------------------------------------------------
@pytest.mark.parametrize("method", HELPER_METHODS)
async def test_a_killed_writer_with_a_live_child_is_gone_for_its_readers(anyio_backend: Backend, method: str) -> None:
    """A writer process started a helper (from its running event loop) and is SIGKILLed while the
    helper lives on: its reader drains what was published, then gets WriterGone, promptly. A
    helper forked with the writer's lock would keep the writer alive for its readers forever."""
    count = 5
    with spawn(forking_writer_proc, anyio_backend, method, count, daemon=False) as w:
        handle = ab.Handle.parse(await w.recv("handle"))
        async with ab.open_reader(handle, name="survivor") as reader:
            w.send("go")
            with killed_at_exit(await w.recv("helper")) as helper:
                assert await w.recv("sent") == count
                w.sigkill()
                with anyio.fail_after(10):  # liveness bound: the reader is woken by the writer's exit
                    got = [await reader.get() for _ in range(count)]
                    with pytest.raises(ab.WriterGone) as gone:
                        await reader.get()
                assert got == list(range(count))
                assert gone.value.pid == w.pid
                assert alive_and_not_a_zombie(helper)  # it really outlived the writer
    await sweep(handle)
    assert files_of(handle) == []


@pytest.mark.parametrize("method", HELPER_METHODS)
async def test_a_killed_reader_with_a_live_child_is_dropped(
    anyio_backend: Backend, method: str, tmp_path: Path
) -> None:
    """A reader process started a helper while it held a zero-copy message (a view of the ring,
    which the helper inherits too), read one more message, stopped reading and is SIGKILLed while
    the helper lives on. ``aiobroadcast stats`` shows it dead at once (it said "alive" before), and
    a writer blocked on it drops it within the liveness bound and goes on."""
    handle_file = tmp_path / "handle.json"
    async with ab.open_writer(capacity=4, slot_bytes=1 << 17) as writer:
        writer.handle.save(str(handle_file))
        with spawn(forking_reader_proc, anyio_backend, writer.handle.to_json(), method, daemon=False) as r:
            await r.recv("attached")
            await writer.put(bytes(1 << 16))
            info = await r.recv("helper")
            assert info["kept"] == "memoryview"
            with killed_at_exit(info["pid"]) as helper:
                await writer.put(1)
                assert await r.recv("stalled") == 2
                with pytest.raises(ab.WouldBlock):
                    for _ in range(writer.handle.capacity):
                        writer.put_nowait("fill")
                row = await stats_row(handle_file, "forker")
                # place, name, pid, host, alive, ...
                assert row is not None and row[2] == str(r.pid) and row[4] == "yes", row
                r.sigkill()
                with anyio.fail_after(10):
                    while True:
                        row = await stats_row(handle_file, "forker")
                        if row is None or row[4] == "NO":  # dead, or dropped already
                            break
                        await anyio.sleep(0.1)
                with anyio.fail_after(10):  # liveness bound: dropped within a few liveness periods
                    await writer.put("after")
                assert alive_and_not_a_zombie(helper)
                stats = writer.statistics()
                assert stats.dropped_readers == 1
                assert stats.readers == ()
                assert await stats_row(handle_file, "forker") is None
    assert files_of(writer.handle) == []


# --- the child exits ------------------------------------------------------------------------------------
async def test_a_child_that_exits_leaves_the_parents_channel_alone(anyio_backend: Backend) -> None:
    """A writer's fork child leaves the writer's ``async with`` and ends with ``sys.exit``, which
    runs the atexit hooks and finalizers it inherited: the channel's files stay, the channel stays
    open, and a reader that attaches afterwards receives everything the parent publishes."""
    with spawn(fork_exit_proc, anyio_backend) as w:
        handle = ab.Handle.parse(await w.recv("handle"))
        report = await w.recv("child-exited")
        assert report["code"] == 0  # the inherited writer refused to publish, with the fork message
        assert report["files"] == [handle.name, f"{handle.name}-w.sock"]
        async with ab.open_reader(handle, name="after-the-child") as reader:
            w.send("go")
            with anyio.fail_after(10):
                assert [await reader.get() for _ in range(3)] == [0, 1, 2]
                with pytest.raises(ab.EndOfStream):
                    await reader.get()
        assert await w.recv("closed") == []


# --- the child uses what it inherited -------------------------------------------------------------------
@pytest.mark.parametrize("tcp", [False, True], ids=["shm", "shm+tcp"])
async def test_a_child_cannot_use_inherited_roles_and_does_not_disturb_them(anyio_backend: Backend, tcp: bool) -> None:
    """A process forks a child handed its writer and readers (shared memory, and TCP). Every use
    in the child fails with ClosedResourceError naming the owner and what to do instead; closing
    them in the child does nothing (no file removed, no reader woken, no close published); no
    unclosed-resource warning. The parent, while the child lives on, publishes, reads, lists its
    readers, and closes: its TCP server stops on request (not killed for a pipe the child holds)."""
    with spawn(inherit_proc, anyio_backend, tcp, daemon=False) as w:
        done = await w.recv("done", within_s=60)
    seen = done["child"]
    names = ["shm", "tcp"] if tcp else ["shm"]
    refused = ["writer.put_nowait", "writer.statistics", "writer.put", "writer.put_many"]
    refused += [f"{n}.{call}" for n in names for call in ("get_nowait", "statistics", "get")]
    owner = re.escape(str(w.pid))
    for what in refused:
        role = "writer" if what.startswith("writer") else "reader"
        assert re.fullmatch(
            rf"ClosedResourceError: this {role} belongs to process {owner}; a fork child inherits no role: "
            rf"open your own reader with open_reader\({role}\.handle\)",
            seen[what],
        ), (what, seen[what])
    for what in ["writer.aclose", *[f"{n}.aclose" for n in names]]:
        assert seen[what] == "ok", (what, seen[what])
    assert seen["warnings"] == "[]"
    assert done["child_exitcode"] == 0
    assert done["got"] == {n: ["before", "after"] for n in names}
    expected_readers = ["parent-shm", "parent-tcp", "tcp-server"] if tcp else ["parent-shm"]
    assert done["readers"] == expected_readers
    assert any(f.endswith("-w.sock") for f in done["files"]) and len(done["files"]) > 1
    assert done["server_exitcode"] == (0 if tcp else None)
    assert done["files_after"] == []


def test_a_role_cannot_be_sent_to_another_process() -> None:
    """The spawn and forkserver start methods pickle a child's arguments: a writer or a reader
    refuses with a BroadcastError that says to send the handle instead."""

    async def main() -> None:
        async with ab.open_writer(capacity=2, slot_bytes=256) as writer:
            async with ab.open_reader(writer.handle) as reader:
                for role, obj in (("writer", writer), ("reader", reader)):
                    with pytest.raises(ab.BroadcastError, match=rf"send {role}\.handle .* and open_reader"):
                        pickle.dumps(obj)

    anyio.run(main)


# --- the child opens its own reader ---------------------------------------------------------------------
@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
async def test_a_child_opens_its_own_reader(anyio_backend: Backend, method: str) -> None:
    """What a child may do: open its own reader from the handle. Started with each start method by
    a process that holds a writer, it receives everything published after it attached, then the
    end of the stream."""
    count = 8
    with spawn(own_reader_parent_proc, anyio_backend, method, count, daemon=False) as w:
        done = await w.recv("done", within_s=60)
    assert done["got"] == [*range(count), "end"]
    assert done["exitcode"] == 0


@pytest.mark.parametrize("hold", [False, True], ids=["nothing-held", "a-view-held"])
def test_the_child_lets_go_of_what_it_inherited(hold: bool) -> None:
    """Right after a fork, the child holds no lock of its parent's: no descriptor of the segment
    that carries one (the kernel lists a description's locks in /proc/self/fdinfo). It has no
    mapping or descriptor of the segment left at all, unless a view of the ring was alive at the
    fork (a zero-copy message): that one stays mapped and readable, with what it held, through a
    descriptor that carries no lock. Nor has it the parent's sockets (bound beside the segment),
    the reader's pidfd of the writer, or its epoll instance; their files are all still there."""
    proc = subprocess.run(
        [sys.executable, "-c", CHILD_LETS_GO, str(hold)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parent, child = (json.loads(line) for line in proc.stdout.splitlines())
    # What the parent holds (so the counts see what they count): locks and mappings of the writer
    # and the reader, their two sockets, the reader's pidfd of the writer and its epoll instance.
    assert parent["locking"] >= 2 and parent["maps"] == 2
    assert (parent["sockets"], parent["pidfds"], parent["epolls"]) == (2, 1, 1)
    kept = 1 if hold else 0
    assert child == {
        "locking": 0,
        "fds": kept,
        "maps": kept,
        "sockets": 0,
        "pidfds": 0,
        "epolls": 0,
        "intact": True,
        "files": parent["files"],
    }


#: Run in a fresh interpreter: a writer and a zero-copy reader in one process, which forks.
CHILD_LETS_GO = r"""
import json, os, sys, anyio, aiobroadcast as ab

hold = sys.argv[1] == "True"

async def main():
    writer = await ab.open_writer(capacity=2, slot_bytes=1 << 17)
    reader = await ab.open_reader(writer.handle, zero_copy=True)
    await writer.put(bytes(range(256)) * 256)
    view = await reader.get()
    return writer, reader, view

writer, reader, view = anyio.run(main)
if not hold:
    del view
path = writer.handle.path
st = os.stat(path)

def ours():
    with open("/proc/net/unix") as f:  # socket inode -> the path it is bound to
        bound = {int(c[6]): c[7] for c in (line.split() for line in f) if len(c) > 7 and c[6].isdigit()}
    fds = locking = sockets = pidfds = epolls = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
            s = os.stat(int(fd))
            with open(f"/proc/self/fdinfo/{fd}") as f:
                info = f.read()
        except OSError:
            continue
        if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
            fds += 1
            locking += "lock:" in info
        elif link.startswith("socket:["):
            sockets += bound.get(int(link[8:-1]), "").startswith(path + "-")
        pidfds += link == "anon_inode:[pidfd]"
        epolls += link == "anon_inode:[eventpoll]"
    with open("/proc/self/maps") as f:
        maps = sum(line.rstrip().endswith(path) for line in f)
    intact = not hold or bytes(view) == bytes(range(256)) * 256
    names = sorted(n for n in os.listdir(writer.handle.directory) if n.startswith(writer.handle.name))
    return {"locking": locking, "fds": fds, "maps": maps, "sockets": sockets, "pidfds": pidfds,
            "epolls": epolls, "intact": intact, "files": names}

print(json.dumps(ours()), flush=True)
pid = os.fork()
if pid == 0:
    print(json.dumps(ours()), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
if hold:
    del view
anyio.run(reader.aclose)
anyio.run(writer.aclose)
"""
