"""``aiobroadcast.vllm.MessageQueue`` against vLLM's own test flow, and what it does differently.

The first part is copied from vLLM's tests/distributed/test_shm_broadcast.py (vLLM v0.11 and
later; Apache-2.0, Copyright contributors to the vLLM project): ``get_arrays``,
``distributed_run``, ``worker_fn_wrapper``, ``worker_fn`` (4 gloo ranks, writer rank 2, 10,000
numpy arrays of random sizes with random sleeps, over a torch ProcessGroup and a
StatelessProcessGroup) and the two shutdown flows. Changed: the import of ``MessageQueue``; what
else vLLM's test imports from vLLM comes from ``_vllm_harness``; ``multiprocess`` is the
standard library's ``multiprocessing`` with fork (as ``multiprocess`` on Linux); and in
``distributed_run`` a free port replaces the fixed 12345 (runs share this machine) and a rank
killed for time fails the test (vLLM's drops it silently). Not copied: the tests that count
calls of vLLM's private ``SpinCondition.wait``, and those of vLLM's tensor reducer.

torch is in the ``vllm`` extra; without it the copied tests skip and the rest still runs.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from _vllm_harness import StatelessProcessGroup, get_open_port, group_member, update_environment_variables

import aiobroadcast as ab
from aiobroadcast.vllm import MessageQueue, MessageQueueReader, MessageQueueWriter, QueueCancelled

try:
    import numpy as np
    import torch.distributed as dist
except ImportError:
    dist = None

needs_torch = pytest.mark.skipif(
    dist is None, reason="torch is not installed (pip install -e '.[vllm]'): vLLM's flow runs over torch.distributed"
)

mp = multiprocessing.get_context("fork")


# --- vLLM's test_shm_broadcast.py -------------------------------------------------------------
def get_arrays(n: int, seed: int = 0) -> list[Any]:
    np.random.seed(seed)
    sizes = np.random.randint(1, 10_000, n)
    # on average, each array will have 5k elements
    # with int64, each array will have 40kb
    return [np.random.randint(1, 100, i) for i in sizes]


def distributed_run(fn: Callable[..., None], world_size: int, timeout: float = 60) -> None:
    """Run a function in multiple processes with proper error handling."""
    number_of_processes = world_size
    processes = []
    port = str(get_open_port())
    for i in range(number_of_processes):
        env = {}
        env["RANK"] = str(i)
        env["LOCAL_RANK"] = str(i)
        env["WORLD_SIZE"] = str(number_of_processes)
        env["LOCAL_WORLD_SIZE"] = str(number_of_processes)
        env["MASTER_ADDR"] = "localhost"
        env["MASTER_PORT"] = port
        p = mp.Process(target=fn, args=(env,))
        processes.append(p)
        p.start()

    # Monitor processes and fail fast if any process fails
    start_time = time.time()
    failed_processes: list[tuple[int, object]] = []

    # Wait for all processes, checking for failures
    while time.time() - start_time < timeout:
        all_done = True
        for i, p in enumerate(processes):
            if p.is_alive():
                all_done = False
            elif p.exitcode != 0:
                # Process failed
                failed_processes.append((i, p.exitcode))
                break

        if failed_processes or all_done:
            break
        time.sleep(0.1)  # Check every 100ms

    # Check for timeout if no failures detected yet
    for i, p in enumerate(processes):
        if p.is_alive():
            p.kill()
            p.join()
            failed_processes.append((i, f"killed after {timeout} s"))

    # Report failures
    if failed_processes:
        error_msg = "Distributed test failed:\n"
        for rank, status in failed_processes:
            error_msg += f"  Rank {rank}: Exit code {status}\n"
        raise AssertionError(error_msg)


def worker_fn_wrapper(fn: Callable[[], None]) -> Callable[[dict[str, str]], None]:
    # `mp.Process` cannot accept environment variables directly
    # so we need to pass the environment variables as arguments
    # and update the environment variables in the function
    def wrapped_fn(env: dict[str, str]) -> None:
        update_environment_variables(env)
        dist.init_process_group(backend="gloo")
        fn()

    return wrapped_fn


@worker_fn_wrapper
def worker_fn() -> None:
    rank = dist.get_rank()
    if rank == 0:
        port = get_open_port()
        ip = "127.0.0.1"
        dist.broadcast_object_list([ip, port], src=0)
    else:
        recv = [None, None]
        dist.broadcast_object_list(recv, src=0)
        ip, port = recv  # type: ignore

    stateless_pg = StatelessProcessGroup.create(ip, port, rank, dist.get_world_size())

    for pg in [dist.group.WORLD, stateless_pg]:
        writer_rank = 2
        broadcaster = MessageQueue.create_from_process_group(pg, 40 * 1024, 2, writer_rank)
        if rank == writer_rank:
            seed = random.randint(0, 1000)
            dist.broadcast_object_list([seed], writer_rank)
        else:
            recv = [None]
            dist.broadcast_object_list(recv, writer_rank)
            seed = recv[0]  # type: ignore

        if pg == dist.group.WORLD:
            dist.barrier()
        else:
            pg.barrier()

        # in case we find a race condition
        # print the seed so that we can reproduce the error
        print(f"Rank {rank} got seed {seed}")
        # test broadcasting with about 400MB of data
        N = 10_000
        if rank == writer_rank:
            arrs = get_arrays(N, seed)
            for x in arrs:
                broadcaster.broadcast_object(x)
                time.sleep(random.random() / 1000)
        else:
            arrs = get_arrays(N, seed)
            for x in arrs:
                y = broadcaster.broadcast_object(None)
                assert np.array_equal(x, y)
                time.sleep(random.random() / 1000)

        if pg == dist.group.WORLD:
            dist.barrier()
            print(f"torch distributed passed the test! Rank {rank}")
        else:
            pg.barrier()
            print(f"StatelessProcessGroup passed the test! Rank {rank}")


@needs_torch
def test_shm_broadcast() -> None:
    distributed_run(worker_fn, 4)


# --- create_from_process_group_single_reader (vLLM 0.33's signature and return shape) ------------
@worker_fn_wrapper
def single_reader_fn() -> None:
    """Every rank writes its own queue; rank 1 gets every rank's handle and reads them all, in
    rank order, over a torch group and a StatelessProcessGroup. The writers wait for the reader
    (``blocking=True``); the reader does not (it must attach first)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        port = get_open_port()
        dist.broadcast_object_list([port], src=0)
    else:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        port = box[0]
    stateless_pg = StatelessProcessGroup.create("127.0.0.1", port, rank, world)
    reader_rank = 1
    for pg in [dist.group.WORLD, stateless_pg]:
        mq, handles = MessageQueue.create_from_process_group_single_reader(
            pg, 1 << 16, 4, reader_rank=reader_rank, blocking=rank != reader_rank
        )
        assert isinstance(mq, MessageQueueWriter)
        if rank != reader_rank:
            assert handles == []
            for i in range(100):
                mq.enqueue((rank, i))
        else:
            assert len(handles) == world and all(h.n_reader == h.n_local_reader == 1 for h in handles)
            readers = [MessageQueue.create_from_handle(h, 0) for h in handles]
            for i in range(100):
                mq.enqueue((rank, i))
                assert [q.dequeue(timeout=30) for q in readers] == [(r, i) for r in range(world)]
            with pytest.raises(AttributeError, match="no dequeue"):
                mq.dequeue()  # type: ignore[attr-defined]
            for q in readers:
                q.close()
        mq.close()
        if pg == dist.group.WORLD:
            dist.barrier()
        else:
            pg.barrier()
    print(f"single reader passed: rank {rank}")


@needs_torch
def test_create_from_process_group_single_reader_gives_the_reader_every_ranks_queue() -> None:
    distributed_run(single_reader_fn, 3)


@worker_fn_wrapper
def worker_fn_test_shutdown_busy() -> None:
    rank = dist.get_rank()
    writer_rank = 2
    message_queue = MessageQueue.create_from_process_group(dist.group.WORLD, 40 * 1024, 2, writer_rank)

    if not message_queue._is_writer:
        # Put into busy mode
        message_queue._spin_condition.busy_loop_s = 9999

        shutdown_event = threading.Event()

        def shutdown_thread(mq, shutdown_event):  # type: ignore[no-untyped-def]
            shutdown_event.wait()
            mq.shutdown()

        threading.Thread(target=shutdown_thread, args=(message_queue, shutdown_event)).start()

        with pytest.raises(TimeoutError):
            message_queue.dequeue(timeout=0.01)

        shutdown_event.set()

        with pytest.raises(RuntimeError, match="cancelled"):
            message_queue.dequeue(timeout=1)

        assert message_queue.shutting_down

    print(f"torch distributed passed the test! Rank {rank}")
    dist.barrier()


@needs_torch
def test_message_queue_shutdown_busy() -> None:
    distributed_run(worker_fn_test_shutdown_busy, 4)


@worker_fn_wrapper
def worker_fn_test_shutdown_idle() -> None:
    rank = dist.get_rank()
    writer_rank = 2
    message_queue = MessageQueue.create_from_process_group(dist.group.WORLD, 40 * 1024, 2, writer_rank)

    if not message_queue._is_writer:
        # Put into idle mode
        message_queue._spin_condition.last_read = 0

        shutdown_event = threading.Event()

        def shutdown_thread(mq, shutdown_event):  # type: ignore[no-untyped-def]
            shutdown_event.wait()
            mq.shutdown()

        threading.Thread(target=shutdown_thread, args=(message_queue, shutdown_event)).start()

        with pytest.raises(TimeoutError):
            message_queue.dequeue(timeout=0.01)

        shutdown_event.set()

        with pytest.raises(RuntimeError, match="cancelled"):
            message_queue.dequeue(timeout=1)

        assert message_queue.shutting_down

    print(f"torch distributed passed the test! Rank {rank}")
    dist.barrier()


@needs_torch
def test_message_queue_shutdown_idle() -> None:
    distributed_run(worker_fn_test_shutdown_idle, 4)


# --- what aiobroadcast's MessageQueue adds (no torch needed) -------------------------------------
def test_roles_are_two_classes_and_the_wrong_call_says_what_to_do() -> None:
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=4)
    try:
        assert isinstance(writer, MessageQueueWriter) and isinstance(writer, MessageQueue)
        reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
        assert isinstance(reader, MessageQueueReader) and isinstance(reader, MessageQueue)
        assert writer._is_writer and not reader._is_writer
        with pytest.raises(AttributeError, match=r"no dequeue\(\).*create_from_handle"):
            writer.dequeue()  # type: ignore[attr-defined]
        with pytest.raises(AttributeError, match=r"no enqueue\(\)"):
            reader.enqueue("x")  # type: ignore[attr-defined]
        assert not hasattr(writer, "dequeue") and not hasattr(reader, "enqueue")
        writer.wait_until_ready()
        reader.wait_until_ready()
        assert writer.broadcast_object({"step": 1}) == {"step": 1}
        assert reader.broadcast_object() == {"step": 1}
        reader.close()
    finally:
        writer.close()


def test_timeouts_cancel_and_shutdown_in_one_process() -> None:
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        with pytest.raises(TimeoutError):
            reader.dequeue(timeout=-1)  # vLLM #41357: a negative timeout never waits forever
        cancel = threading.Event()
        threading.Timer(0.1, cancel.set).start()
        with pytest.raises(QueueCancelled, match=r"^cancelled"):
            reader.dequeue(cancel=cancel)
        writer.enqueue("a")
        writer.enqueue("b")
        with pytest.raises(TimeoutError):  # the ring is full: the reader has not read
            writer.enqueue("c", timeout=0.05)
        assert [reader.dequeue(), reader.dequeue()] == ["a", "b"]
        threading.Timer(0.1, reader.shutdown).start()
        with pytest.raises(RuntimeError, match="cancelled"):
            reader.dequeue()
        writer.enqueue("after shutdown")  # a message that is there is still delivered
        assert reader.dequeue() == "after shutdown"
        writer.close()
        with pytest.raises(ab.EndOfStream):
            reader.dequeue(timeout=5)
    finally:
        reader.close()
        writer.close()


def test_remote_readers_come_over_tcp() -> None:
    """Ranks not among the local reader ranks read over TCP (CurveZMQ), as vLLM's remote ranks."""
    writer = MessageQueue(2, 1, local_reader_ranks=[0], max_chunk_bytes=4096, max_chunks=32, connect_ip="127.0.0.1")
    try:
        local = MessageQueue.create_from_handle(writer.export_handle(), 0)
        remote = MessageQueue.create_from_handle(writer.export_handle(), 1)
        assert local.statistics().place >= 0 and remote.statistics().place == -1
        for i in range(20):
            writer.enqueue(i)  # the first waits until both are attached
        assert [local.dequeue(timeout=10) for _ in range(20)] == list(range(20))
        assert [remote.dequeue(timeout=10) for _ in range(20)] == list(range(20))
        local.close()
        remote.close()
    finally:
        writer.close()


def test_a_rank_that_is_not_local_needs_a_queue_with_remote_readers() -> None:
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    try:
        with pytest.raises(ab.BroadcastError, match="not one of the local reader ranks"):
            MessageQueue.create_from_handle(writer.export_handle(), 5)
        with pytest.raises(ValueError, match="local_reader_ranks"):
            MessageQueue(2, 2, local_reader_ranks=[0], max_chunk_bytes=4096, max_chunks=2)
    finally:
        writer.close()


def test_a_group_without_torch_never_imports_torch() -> None:
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: nothing imported torch
    world = 3
    queues = [[ctx.Queue() for _ in range(world)] for _ in range(world)]
    results = ctx.Queue()
    procs = [ctx.Process(target=group_member, args=(r, queues, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = sorted(results.get(timeout=120) for _ in range(world))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got == [
        (0, True, False, "MessageQueueReader"),
        (1, "writer", False, "MessageQueueWriter"),
        (2, True, False, "MessageQueueReader"),
    ]


def test_a_reader_slow_to_join_still_gets_the_first_message_after_the_handshake(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's contract: a reader that took part in the handshake gets every message enqueued
    after it. The reader here is held up (0.5 s) exactly between making its ring record active
    and loading the head it starts at; wait_until_ready must not count it before that load, or
    the writer's first message lands before the reader's start and is not its."""
    from aiobroadcast._shm import atomic, place

    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=4)
    results: Any = mp.Queue()

    def slow_reader() -> None:
        def fence_then_stall() -> None:  # join's fence: after `active`, before the head is loaded
            atomic.fence()
            time.sleep(0.5)

        monkeypatch.setattr(place, "fence", fence_then_stall)  # in this child only
        reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
        try:
            results.put(reader.dequeue(timeout=5))
        except ab.WaitTimeout:
            results.put("nothing in 5 s")
        finally:
            reader.close()

    child = mp.Process(target=slow_reader)
    child.start()
    try:
        writer.wait_until_ready()
        writer.enqueue("first")
        writer.enqueue("second")
        assert results.get(timeout=30) == "first"
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
        writer.close()
    assert child.exitcode == 0


def test_a_fork_child_that_drops_an_inherited_queue_leaves_it_open() -> None:
    """A child forked after the queue was made (a worker pool) inherits its finalizer; dropping
    the object there, or exiting through sys.exit, must not close the parent's channel."""
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=4)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:

        def drop_and_exit() -> None:
            nonlocal writer, reader
            del writer, reader
            sys.exit(0)

        child = mp.Process(target=drop_and_exit)
        child.start()
        child.join(30)
        assert child.exitcode == 0
        assert not reader.statistics().writer_closed
        assert os.path.exists(ab.Handle.parse(writer.export_handle().channel).path)
        writer.enqueue("still open")
        assert reader.dequeue(timeout=5) == "still open"
    finally:
        reader.close()
        writer.close()


_kept: list[Any] = []  # what a multiprocessing child keeps referenced until it exits


def _keep_a_writer(out: Any) -> None:
    _kept.append(MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2))
    out.send(_kept[-1].export_handle())


def _keep_a_remote_reader(handle: Any, out: Any) -> None:
    _kept.append(MessageQueue.create_from_handle(handle, -1))
    out.send("attached")


def test_a_multiprocessing_child_that_exits_with_its_queues_referenced_closes_them() -> None:
    """A multiprocessing child ends in os._exit, which runs no atexit hook: a vLLM worker whose
    queues are still referenced then (its death-pipe thread holds them) must not leave its ring
    in /dev/shm, nor its remote reader for the writer to drop after the heartbeat timeout."""
    ours, theirs = mp.Pipe()
    child = mp.Process(target=_keep_a_writer, args=(theirs,))
    child.start()
    path = ab.Handle.parse(ours.recv().channel).path
    child.join(30)
    assert child.exitcode == 0
    assert not os.path.exists(path)

    writer = MessageQueue(1, 0, max_chunk_bytes=4096, max_chunks=4, connect_ip="127.0.0.1")
    try:
        child = mp.Process(target=_keep_a_remote_reader, args=(writer.export_handle(), theirs))
        child.start()
        assert ours.recv() == "attached"
        child.join(30)
        assert child.exitcode == 0

        def remote() -> list[Any]:
            return [r for r in writer.statistics().readers if r.transport == "tcp"]

        deadline = time.monotonic() + 2  # a reader that never said goodbye is dropped after 3 s
        while remote() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not remote()
    finally:
        writer.close()


def test_a_ring_too_large_for_dev_shm_raises_vllms_runtime_error() -> None:
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    with pytest.raises(RuntimeError, match=r"^Insufficient space in /dev/shm") as caught:
        MessageQueue(1, 1, max_chunk_bytes=free + (1 << 30), max_chunks=2)
    assert isinstance(caught.value, ab.InsufficientSharedMemory)


def test_a_queue_of_one_chunk() -> None:
    """vLLM takes max_chunks=1 (its own tests do); the ring then has two slots."""
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=1)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        for i in range(5):
            writer.enqueue(i)
            assert reader.dequeue(timeout=5) == i
    finally:
        reader.close()
        writer.close()


def test_remote_readers_are_offered_the_address_vllms_get_ip_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without connect_ip (as create_from_process_group_single_reader makes a remote rank's
    queue) and without $VLLM_HOST_IP, the queue listens where vLLM's get_ip() says this host is
    reached: the address of the interface that routes outwards, not the host name's (which
    /etc/hosts often maps to 127.0.1.1 or 127.0.0.1, out of reach of the other nodes)."""
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("8.8.8.8", 80))  # nothing is sent
            expected = probe.getsockname()[0]
    except OSError:
        pytest.skip("this host has no IPv4 route outwards")
    writer = MessageQueue(1, 0, max_chunk_bytes=4096, max_chunks=2)
    try:
        assert (writer.export_handle().remote_subscribe_addr or "").startswith(f"tcp://{expected}:")
    finally:
        writer.close()
