"""A put whose time passes names what held it: the readers (name, pid, host, how far behind, alive
or not) in ``WaitTimeout``'s message and in its ``holders``; a sender's, its collector; a
call's, each worker that did not answer and why. The holders are real processes, stopped with
SIGSTOP: alive, holding their place, reading nothing."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import pytest
from _blocking_workers import collect_proc, recv
from _fanin_workers import collector_proc
from _rpc_workers import worker_proc
from _tcp_workers import ASYNCIO, message, reader_proc
from _tcp_workers import ReaderOpts as TcpReaderOpts
from _tcp_workers import spawn as tcp_spawn
from _workers import Child, spawn

import aiobroadcast as ab
from aiobroadcast import blocking
from aiobroadcast._base.stats import HOLDER_STUCK
from aiobroadcast.vllm import MessageQueue

#: Generous bound for "it happens" (never a performance claim): a loaded 2-core machine.
WITHIN_S = 30.0
HERE = socket.gethostname()[:16]


@contextmanager
def stopped(child: Child) -> Iterator[None]:
    """The child stopped (SIGSTOP) for the block; continued after, whatever happened."""
    os.kill(child.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(child.pid, signal.SIGCONT)


@pytest.mark.parametrize("what", ["put", "put_many"])
def test_a_put_that_times_out_names_the_stopped_reader_holding_it(what: str) -> None:
    with (
        blocking.open_writer(capacity=4, slot_bytes=256) as writer,
        spawn(collect_proc, writer.handle.to_json(), "stuck-reader") as child,
    ):
        pid = recv(child, "attached")["pid"]
        with stopped(child):
            for i in range(4):
                writer.put(i, timeout=WITHIN_S)  # the ring is full now: the reader has read nothing
            with pytest.raises(ab.WaitTimeout) as info:
                if what == "put":
                    writer.put("one more", timeout=0.3)
                else:
                    writer.put_many(["one", "two"], timeout=0.3)
        exc = info.value
        assert isinstance(exc, ab.WouldBlock) and isinstance(exc, TimeoutError)  # the type is unchanged
        (holder,) = exc.holders
        assert (holder.name, holder.pid, holder.lag, holder.transport) == ("stuck-reader", pid, 4, "shm")
        text = str(exc)
        assert text.startswith(f"{what}: the timeout passed waiting for room for {1 if what == 'put' else 2} ring slot")
        said = f"reader 'stuck-reader' (pid {pid} on {HERE}), 4 ring entries (4 messages) behind: {HOLDER_STUCK}"
        assert said in text
        assert "this process" not in text  # another process: it is not said to be this one


def test_a_put_that_waits_for_another_threads_put_names_what_that_one_waits_for() -> None:
    with (
        blocking.open_writer(capacity=2, slot_bytes=256) as writer,
        spawn(collect_proc, writer.handle.to_json(), "stuck-reader") as child,
    ):
        pid = recv(child, "attached")["pid"]
        os.kill(child.pid, signal.SIGSTOP)  # it has read nothing: the ring fills
        writer.put(0)
        writer.put(1)
        first = threading.Thread(target=writer.put, args=("waits for room",), daemon=True)
        try:
            first.start()
            deadline = time.monotonic() + WITHIN_S
            while not writer.statistics().waiting_for:  # the other put announced its wait
                assert first.is_alive() and time.monotonic() < deadline
                time.sleep(0.01)
            with pytest.raises(ab.WaitTimeout) as info:
                writer.put("behind it", timeout=0.3)
        finally:
            os.kill(child.pid, signal.SIGCONT)
        first.join(WITHIN_S)
        assert not first.is_alive()
        text = str(info.value)
        assert text.startswith("put: the timeout passed while another thread's put held this writer")
        assert f"that put waits for: reader 'stuck-reader' (pid {pid} on {HERE})" in text
        assert [h.name for h in info.value.holders] == ["stuck-reader"]


def test_a_message_larger_than_the_ring_with_its_reader_in_this_thread_says_why_it_cannot_finish() -> None:
    """The reader is this thread's: it would read only after the put returns, which it never
    does. The timeout bounds the wait, and the error says why: the message streams through the
    ring and needs its readers running meanwhile."""
    with (
        blocking.open_writer(capacity=4, slot_bytes=256) as writer,
        blocking.open_reader(writer.handle, name="r1") as reader,
    ):
        with pytest.raises(ab.WaitTimeout) as info:
            writer.put(b"x" * 3000, timeout=0.3)  # 14 slots: 3.5 times the ring
        text = str(info.value)
        assert re.search(r"a message of 14 ring slots, 3\.5 times the ring's capacity of 4, streamed", text), text
        assert "4 of its fragments were published" in text
        assert (
            f"reader 'r1' (pid {os.getpid()} on {HERE}, the pid and host of this process), has not taken its "
            "first fragment" in text
        )
        assert "streams through it and needs its readers running meanwhile" in text
        assert [(h.name, h.pid) for h in info.value.holders] == [("r1", os.getpid())]
        # Read from another thread, as the error says: the cut-short message is dropped whole, the
        # next one arrives.
        got: list[object] = []
        taker = threading.Thread(target=lambda: got.append(reader.get(timeout=WITHIN_S)), daemon=True)
        taker.start()
        writer.put("after", timeout=WITHIN_S)
        taker.join(WITHIN_S)
        assert got == ["after"]


def test_a_streamed_put_says_how_far_its_reader_is_behind_its_first_fragment() -> None:
    with blocking.open_writer(capacity=4, slot_bytes=256) as writer, blocking.open_reader(writer.handle, name="r1"):
        writer.put(1)
        writer.put(2)
        with pytest.raises(ab.WaitTimeout) as info:
            writer.put(b"x" * 3000, timeout=0.3)
        text = str(info.value)
        assert "(2 of its fragments were published; readers drop it whole)" in text, text
        assert "), 2 ring entries (2 messages) behind its first fragment: " in text, text


def test_a_holder_whose_process_died_is_said_to_be_gone() -> None:
    """What the error says of a reader that died holding the writer (the writer drops it on its
    next look, within a second): read from the ring the way a timed-out put reads it."""
    with (
        blocking.open_writer(capacity=2, slot_bytes=256) as writer,
        spawn(collect_proc, writer.handle.to_json(), "doomed") as child,
    ):
        pid = recv(child, "attached")["pid"]
        os.kill(child.pid, signal.SIGSTOP)
        writer.put(0)
        writer.put(1)
        os.kill(child.pid, signal.SIGKILL)
        child.proc.join(WITHIN_S)
        ch = writer._ch
        (holder,) = ch.serving.holding(1)  # no put waited since: nobody dropped it yet
        assert (holder.name, holder.pid) == ("doomed", pid)
        text = ch.serving.describe_reader(holder)
        assert text == (
            f"reader 'doomed' (pid {pid} on {HERE}), 2 ring entries (2 messages) behind: its process is gone; "
            "the writer drops it within a second"
        )


# --- fan-in: a sender's ring is read by its collector alone ------------------------------------------
def test_a_sender_put_that_times_out_names_its_stopped_collector() -> None:
    with spawn(collector_proc, 4) as child:
        handle = recv(child, "handle")
        collector = ab.CollectorHandle.parse(handle)
        try:
            with blocking.open_sender(handle, name="a", capacity=4) as sender:
                ring = sender._w.handle.path
                sender.put("first")
                child.send("go")  # the collector attaches this sender's ring and takes one item
                recv(child, "took")
                with stopped(child):
                    for i in range(4):
                        sender.put(i, timeout=WITHIN_S)
                    with pytest.raises(ab.WaitTimeout) as info:
                        sender.put("one more", timeout=0.3)
        finally:
            # The collector never drains the ring it was left (it is killed): remove what it would.
            child.cleanup()
            shutil.rmtree(collector.path, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ring)
        text = str(info.value)
        assert text.startswith(f"sender 'a' of collector {collector.name!r}, whose ring only the collector reads: put:")
        said = f"reader 'collector' (pid {child.pid} on {HERE}), 4 ring entries (4 messages) behind: {HOLDER_STUCK}"
        assert said in text
        assert [(h.name, h.pid, h.lag) for h in info.value.holders] == [("collector", child.pid, 4)]


def test_a_sender_put_that_times_out_says_its_collector_has_not_attached_it_yet() -> None:
    with blocking.open_collector(capacity=4, slot_bytes=256) as collector:
        with blocking.open_sender(collector.handle, name="early") as sender:
            for i in range(4):
                sender.put(i, timeout=WITHIN_S)  # nobody took the ring yet: its place waits at 0
            with pytest.raises(ab.WaitTimeout) as info:
                sender.put_many(["one more"], timeout=0.3)
            text = str(info.value)
            assert text.startswith(f"sender 'early' of collector {collector.handle.name!r}")
            assert (
                f"the place reserved for the reader of pid {os.getpid()}, 4 ring entries (4 messages) behind, "
                "which has not attached yet" in text
            )
            assert [h.pid for h in info.value.holders] == [os.getpid()]
        assert collector.get_many(10, timeout=WITHIN_S) == [ab.Item("early", i) for i in range(4)]


# --- calls: the workers that did not answer, and why ------------------------------------------------
NAMES = ("a", "b", "c")


@contextmanager
def pool_workers(handle: str) -> Iterator[dict[str, Child]]:
    """The pool's three workers, each a blocking worker in a process of its own."""
    with (
        spawn(worker_proc, handle, "a", "blocking") as a,
        spawn(worker_proc, handle, "b", "blocking") as b,
        spawn(worker_proc, handle, "c", "blocking") as c,
    ):
        children = {"a": a, "b": b, "c": c}
        for child in children.values():
            recv(child, "ready")
        yield children


def check_stuck_worker(out: dict[str, ab.Outcome[Any]], stuck: Child, timeout: float) -> None:
    assert out["a"] == ab.Reply("a", ("a", "x")) and out["c"] == ab.Reply("c", ("c", "x"))
    late = out["b"]
    assert isinstance(late, ab.NoReply) and late.reason == "deadline"
    assert late.detail == (
        f"worker 'b' did not answer within {timeout} s: it has not taken the request: its reader 'b' "
        f"(pid {stuck.pid} on {HERE}), 1 ring entry (1 message) behind: {HOLDER_STUCK}"
    )
    with pytest.raises(ab.NoReplyError, match=rf"worker 'b' .* \(pid {stuck.pid} on "):
        late.unwrap()


def check_unsent(out: dict[str, ab.Outcome[Any]], stuck: Child) -> None:
    for name in NAMES:  # nobody got it: the request ring was full
        late = out[name]
        assert isinstance(late, ab.NoReply) and late.reason == "deadline"
        assert "the request was not sent; put: the timeout passed waiting for room for 1 ring slot" in late.detail
        assert f"reader 'b' (pid {stuck.pid} on {HERE}), 2 ring entries (2 messages) behind" in late.detail


def check_slow_handlers(out: dict[str, ab.Outcome[Any]], children: dict[str, Child]) -> None:
    for name in NAMES:
        late = out[name]
        assert isinstance(late, ab.NoReply) and late.reason == "deadline"
        assert late.detail.endswith(
            f"it took the request (pid {children[name].pid} on {HERE}) and has not replied: its handler is still "
            "running, or its process stopped after taking it"
        )


def test_a_blocking_call_names_the_workers_that_did_not_answer_and_why() -> None:
    with blocking.open_caller(workers=NAMES, capacity=2) as caller, pool_workers(caller.handle.to_json()) as children:
        caller.wait_ready(timeout=WITHIN_S)
        with stopped(children["b"]):
            check_stuck_worker(caller.call("x", timeout=1.0), children["b"], 1.0)
            caller.call("x", timeout=0.2)  # the ring holds two requests b has not taken: full
            check_unsent(caller.call("x", timeout=0.3), children["b"])
        check_slow_handlers(caller.call(("sleep", 30.0), timeout=3.0), children)


@pytest.mark.anyio
async def test_an_async_call_names_the_workers_that_did_not_answer_and_why() -> None:
    async with ab.open_caller(workers=NAMES, capacity=2) as caller:
        with pool_workers(caller.handle.to_json()) as children:
            await caller.wait_ready(timeout=WITHIN_S)
            with stopped(children["b"]):
                check_stuck_worker(await caller.call("x", timeout=1.0), children["b"], 1.0)
                await caller.call("x", timeout=0.2)
                check_unsent(await caller.call("x", timeout=0.3), children["b"])
            check_slow_handlers(await caller.call(("sleep", 30.0), timeout=3.0), children)


# --- a writer that serves remote readers ----------------------------------------------------------------
def test_a_put_held_by_the_tcp_server_names_the_stopped_remote_reader_behind_it() -> None:
    """The TCP server reads the ring in one place for its remote readers: a remote reader that
    stops acknowledging holds the server, which holds the writer. The error names both."""
    with (
        blocking.open_writer(
            capacity=4, slot_bytes=256, tcp="tcp://127.0.0.1:0", heartbeat_s=1.0, tcp_window=4
        ) as writer,
        tcp_spawn(reader_proc, ASYNCIO, None, writer.handle.to_json(), TcpReaderOpts(name="far")) as child,
    ):
        recv(child, "attached")  # type: ignore[arg-type]
        with stopped(child):  # type: ignore[arg-type]
            deadline = time.monotonic() + WITHIN_S
            n = 0
            while True:  # until the server holds the writer for "far"
                try:
                    writer.put(message(n), timeout=0.3)
                    n += 1
                    continue
                except ab.WaitTimeout as exc:
                    info = exc
                if any(h.transport == "tcp" and h.lag for h in info.holders) or time.monotonic() > deadline:
                    break  # the server's report (each heartbeat) shows what "far" has not acknowledged
        text = str(info)
        kinds = [(h.name, h.transport) for h in info.holders]
        assert kinds == [("tcp-server", "tcp-server"), ("far", "tcp")], text
        far = info.holders[1]
        assert (far.pid, far.host) == (child.pid, socket.gethostname())
        server = info.holders[0]
        assert server.pid in writer._ch.serving.server.pids  # type: ignore[union-attr]
        assert f"reader 'tcp-server' (pid {server.pid} on {HERE}), " in text
        assert "the TCP server, held by a slow remote reader" in text
        assert f"remote reader far (remote pid {child.pid} on {socket.gethostname()}, {far.lag} messages " in text


# --- vLLM's MessageQueue: enqueue is a blocking put -------------------------------------------------------
def test_an_enqueue_that_times_out_names_the_reader_and_the_readers_not_attached() -> None:
    writer = MessageQueue(2, 2, max_chunk_bytes=4096, max_chunks=2)
    try:
        with pytest.raises(ab.WaitTimeout, match=r"before every reader attached: 0 of 2 local and 0 of 0 remote"):
            writer.enqueue("a", timeout=0.1)
        first = MessageQueue.create_from_handle(writer.export_handle(), 0)
        second = MessageQueue.create_from_handle(writer.export_handle(), 1)
        try:
            writer.enqueue("a")
            writer.enqueue("b")
            assert [second.dequeue(), second.dequeue()] == ["a", "b"]  # the first reader reads nothing
            with pytest.raises(ab.WaitTimeout) as info:
                writer.enqueue("c", timeout=0.1)
            (holder,) = info.value.holders
            assert holder.pid == os.getpid() and holder.lag == 2
            assert f"reader {holder.name!r} (pid {os.getpid()} on {HERE}, the pid and host of this process)" in str(
                info.value
            )
        finally:
            first.close()
            second.close()
    finally:
        writer.close()


@pytest.mark.anyio
async def test_a_call_that_could_not_begin_says_another_call_held_the_caller() -> None:
    async with ab.open_caller(workers=["w"]) as caller:
        with spawn(worker_proc, caller.handle.to_json(), "w", "blocking") as child:
            recv(child, "ready")
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: caller.call(("sleep", 2.0), timeout=WITHIN_S))
                await anyio.sleep(0.1)  # the first call holds the caller's turn for 2 s
                second = await caller.call("x", timeout=0.2)
            assert second == {
                "w": ab.NoReply(
                    "w",
                    "deadline",
                    "worker 'w' did not answer within 0.2 s: the call did not begin: another call of this caller "
                    "held it past the deadline",
                )
            }
