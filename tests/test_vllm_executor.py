"""vLLM 0.33.0's multiprocess executor, its ``MessageQueue`` calls in its order, on ``aiobroadcast.vllm``.

``vllm/v1/executor/multiproc_executor.py`` makes one broadcast queue in the executor (scheduler
outputs to every worker rank) and one response queue per worker rank (results back), hands the
handles around through the worker processes' ready pipes, opens a peer's queue with rank -1 over
TCP, and shuts them all down through the death pipes. Here the same calls run in the same order
(``MultiprocExecutor._init_executor``, ``collective_rpc`` and ``shutdown``;
``WorkerProc._init_message_queues``, ``worker_main``, ``worker_busy_loop`` and
``wait_for_response_handle_ready``), on gloo ranks on the CPU, with the model, the config, the
watchdog and the logging taken out. The only line that names the queue's module is the import.

Two layouts, as ``nnodes_within_dp`` chooses in ``_init_message_queues``:

- one node: every worker reads the executor's queue as a local reader
  (``create_from_handle(handle, rank)``) and answers on a ``MessageQueue(1, 1)`` whose handle
  goes back through its ready pipe;
- two nodes (on one host: rank 2 plays a rank of the second node, whose executor has no queue):
  every rank joins ``create_from_process_group(..., external_writer_handle=handle,
  blocking=False)``, where rank 0 attaches to the executor's queue and passes its handle on, so
  rank 2 reads it over TCP; the response queues are those of
  ``create_from_process_group_single_reader`` (one reader, rank 0's executor: local for the
  ranks of its node, TCP for rank 2, whose handle the executor opens with rank -1).

torch is in the ``vllm`` extra; without it the test skips.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
import threading
import time
import traceback
from enum import Enum, auto
from multiprocessing.connection import Connection, wait
from typing import Any

import pytest
from _vllm_harness import get_open_port

from aiobroadcast.vllm import Handle, MessageQueue

dist = pytest.importorskip("torch.distributed", reason="torch is not installed (pip install -e '.[vllm]')")

mp = multiprocessing.get_context("fork")

#: vLLM's VLLM_MQ_MAX_CHUNK_BYTES_MB default, for the executor's broadcast queue.
MAX_CHUNK_BYTES = 16 * 1024 * 1024
#: What vLLM's GroupCoordinator gives its single-reader response queues.
SINGLE_READER_CHUNK_BYTES, SINGLE_READER_CHUNKS = 1 << 22, 6
#: Exit code of a worker that failed other than by the executor's shutdown.
WORKER_FAILED = 3


class ResponseStatus(Enum):
    SUCCESS = auto()
    FAILURE = auto()


class Worker:
    """Stands for the model worker: the methods the executor's RPCs name."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def get_rank(self) -> int:
        return self.rank

    def echo(self, payload: Any) -> Any:
        return payload

    def fail(self) -> None:
        raise ValueError(f"rank {self.rank} fails on purpose")


# --- a worker process (WorkerProc) ---------------------------------------------------------------
def single_reader_queue(rank: int, world_size: int, same_node: bool) -> tuple[MessageQueue, list[Handle]]:
    """The calls ``MessageQueue.create_from_process_group_single_reader`` makes for reader rank
    0 (written out: the drop-in gets that method elsewhere): one queue per rank, with one
    reader, local if on the reader's node; every handle gathered at the reader rank."""
    queue = MessageQueue(
        n_reader=1,
        n_local_reader=1 if same_node else 0,
        max_chunk_bytes=SINGLE_READER_CHUNK_BYTES,
        max_chunks=SINGLE_READER_CHUNKS,
    )
    handles: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(queue.export_handle(), handles, dst=0)
    return queue, handles or []


def worker_main(
    rank: int,
    world_size: int,
    local_world_size: int,
    nnodes: int,
    dist_port: int,
    input_shm_handle: Handle | None,
    ready_writer: Connection,
    death_reader: Connection,
    inherited_fds: list[int],
) -> None:
    for fd in inherited_fds:  # the parent's ends of every worker's pipes (fork)
        os.close(fd)
    os.environ["VLLM_HOST_IP"] = "127.0.0.1"  # what vLLM's get_ip() answers on a node set up for it
    shutdown_requested = threading.Event()
    failed = False
    rpc_broadcast_mq: Any = None
    worker_response_mq: Any = None
    try:
        # init_device: the distributed groups first.
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank, world_size=world_size)
        worker = Worker(rank)
        # _init_message_queues
        if nnodes == 1:
            assert input_shm_handle is not None
            rpc_broadcast_mq = MessageQueue.create_from_handle(input_shm_handle, rank)
            worker_response_mq = MessageQueue(1, 1)
            peer_response_handles: list[Handle] = []
        else:
            rpc_broadcast_mq = MessageQueue.create_from_process_group(
                dist.group.WORLD,
                SINGLE_READER_CHUNK_BYTES,
                SINGLE_READER_CHUNKS,
                writer_rank=0,
                external_writer_handle=input_shm_handle,
                blocking=False,
            )
            worker_response_mq, peer_response_handles = single_reader_queue(
                rank, world_size, same_node=rank < local_world_size
            )

        # monitor_death_pipe: the executor's end closing means shut down.
        def death_pipe_monitor(queues_to_shutdown: list[Any]) -> None:
            try:
                death_reader.recv()
            except EOFError:
                shutdown_requested.set()
                for mq in queues_to_shutdown:
                    if mq is not None:
                        mq.shutdown()

        threading.Thread(target=death_pipe_monitor, args=([rpc_broadcast_mq, worker_response_mq],), daemon=True).start()

        ready_writer.send(
            {
                "status": "READY",
                "handle": worker_response_mq.export_handle(),
                "peer_response_handles": peer_response_handles,
            }
        )
        # In the executor's order, or both deadlock.
        rpc_broadcast_mq.wait_until_ready()
        worker_response_mq.wait_until_ready()
        ready_writer.close()

        # worker_busy_loop
        while True:
            method, args, kwargs, output_rank = rpc_broadcast_mq.dequeue(indefinite=True)
            try:
                result: tuple[ResponseStatus, Any] = (ResponseStatus.SUCCESS, getattr(worker, method)(*args, **kwargs))
            except Exception as exc:
                result = (ResponseStatus.FAILURE, str(exc))
            if output_rank is None or rank == output_rank:
                worker_response_mq.enqueue(result)
    except Exception:
        # vLLM's way out: the parked dequeue raised once the death pipe's monitor shut it down.
        failed = not shutdown_requested.is_set()
        if failed:
            traceback.print_exc()
    finally:
        # WorkerProc.shutdown: shut the queues down and drop them (which closes them here: a
        # fork child's exit runs no atexit hook).
        if rpc_broadcast_mq is not None:
            rpc_broadcast_mq.shutdown()
        if worker_response_mq is not None:
            worker_response_mq.shutdown()
        rpc_broadcast_mq = worker_response_mq = None
    if failed:
        sys.exit(WORKER_FAILED)


# --- the executor (MultiprocExecutor) ------------------------------------------------------------
class WorkerProcHandle:
    def __init__(self, proc: Any, rank: int, ready_pipe: Connection, death_writer: Connection) -> None:
        self.proc = proc
        self.rank = rank
        self.ready_pipe = ready_pipe
        self.death_writer = death_writer
        self.worker_response_mq: Any = None
        self.peer_worker_response_mqs: list[Any] = []


class Executor:
    def __init__(self, nnodes: int) -> None:
        self.world_size, self.local_world_size = (2, 2) if nnodes == 1 else (3, 2)
        # The leader node's executor makes the broadcast queue.
        self.rpc_broadcast_mq: Any = MessageQueue(
            self.world_size,
            self.local_world_size,
            max_chunk_bytes=MAX_CHUNK_BYTES,
            connect_ip="127.0.0.1",
            enable_shm_tensor_arena=False,
        )
        scheduler_output_handle = self.rpc_broadcast_mq.export_handle()
        self.check_broadcast_handle(scheduler_output_handle)
        self.workers: list[WorkerProcHandle] = []
        try:
            self.start_workers(nnodes, scheduler_output_handle)
        except BaseException:
            for w in self.workers:
                w.proc.kill()
                w.proc.join()
            raise

    def start_workers(self, nnodes: int, scheduler_output_handle: Handle) -> None:
        dist_port = get_open_port()
        inherited_fds: list[int] = []
        for rank in range(self.world_size):
            # Ranks past the leader node's are the second node's (its executor has no queue).
            handle = scheduler_output_handle if rank < self.local_world_size else None
            ready_reader, ready_writer = mp.Pipe(duplex=False)
            death_reader, death_writer = mp.Pipe(duplex=False)
            fds = [*inherited_fds, ready_reader.fileno(), death_writer.fileno()]
            proc = mp.Process(
                target=worker_main,
                args=(rank, self.world_size, self.local_world_size, nnodes, dist_port, handle),
                kwargs={"ready_writer": ready_writer, "death_reader": death_reader, "inherited_fds": fds},
                name=f"VllmWorker-{rank}",
                daemon=True,
            )
            proc.start()
            ready_writer.close()
            death_reader.close()
            inherited_fds += [death_writer.fileno(), ready_reader.fileno()]
            self.workers.append(WorkerProcHandle(proc, rank, ready_reader, death_writer))
        self.wait_for_ready()

        self.response_mqs: list[Any] = []  # readers (vLLM's annotation, list[MessageQueue], has no dequeue)
        for rank in range(self.world_size):
            if rank < self.local_world_size:
                mq = self.workers[rank].worker_response_mq
            else:
                mq = self.workers[0].peer_worker_response_mqs[rank]
            assert mq is not None
            self.response_mqs.append(mq)
        # In the workers' order, or both deadlock.
        assert self.rpc_broadcast_mq is not None
        self.rpc_broadcast_mq.wait_until_ready()
        for response_mq in self.response_mqs:
            response_mq.wait_until_ready()

    def check_broadcast_handle(self, handle: Handle) -> None:
        assert handle.local_reader_ranks == list(range(self.local_world_size))
        if self.world_size == self.local_world_size:
            assert handle.remote_subscribe_addr is None
        else:
            assert (handle.remote_subscribe_addr or "").startswith("tcp://127.0.0.1:")

    def wait_for_ready(self) -> None:
        pipes = {w.ready_pipe: w for w in self.workers}
        deadline = time.monotonic() + 60
        while pipes:
            ready = wait(list(pipes), timeout=max(0.0, deadline - time.monotonic()))
            assert ready, f"workers {[w.rank for w in pipes.values()]} never said READY"
            for pipe in ready:
                assert isinstance(pipe, Connection)
                w = pipes.pop(pipe)
                response = pipe.recv()
                assert response["status"] == "READY"
                self.wait_for_response_handle_ready(response, w)

    def wait_for_response_handle_ready(self, handles: dict[str, Any], w: WorkerProcHandle) -> None:
        response_handle = handles["handle"]
        if len(response_handle.local_reader_ranks) > 0:
            w.worker_response_mq = MessageQueue.create_from_handle(response_handle, 0)
        w.peer_worker_response_mqs = [
            MessageQueue.create_from_handle(handle, -1) if handle.remote_subscribe_addr is not None else None
            for handle in handles["peer_response_handles"]
        ]
        if w.rank < self.local_world_size:
            assert w.worker_response_mq is not None
        else:  # the second node's rank answers its reader over TCP only
            assert response_handle.local_reader_ranks == []
            assert (response_handle.remote_subscribe_addr or "").startswith("tcp://127.0.0.1:")

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), unique_reply_rank: int | None = None) -> Any:
        assert self.rpc_broadcast_mq is not None
        deadline = time.monotonic() + 30
        self.rpc_broadcast_mq.enqueue((method, args, {}, unique_reply_rank))
        response_mqs: Any = self.response_mqs
        if unique_reply_rank is not None:
            response_mqs = (response_mqs[unique_reply_rank],)
        responses = []
        for mq in response_mqs:
            status, result = mq.dequeue(timeout=max(0.0, deadline - time.monotonic()))
            if status != ResponseStatus.SUCCESS:
                raise RuntimeError(f"Worker failed with error '{result}'")
            responses.append(result)
        return responses[0] if unique_reply_rank is not None else responses

    def shutdown(self) -> list[int | None]:
        """The executor's shutdown: close the death pipes, give the workers their grace period
        (vLLM's ``_ensure_worker_termination``), then shut every queue down and drop it; the
        workers' exit codes."""
        for w in self.workers:
            w.death_writer.close()
        codes = []
        for w in self.workers:
            w.proc.join(5)  # within 5 s: each is woken at once (a TCP reader too)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join()
            codes.append(w.proc.exitcode)
        for w in self.workers:
            if w.worker_response_mq is not None:
                w.worker_response_mq.shutdown()
                w.worker_response_mq = None
        if self.rpc_broadcast_mq is not None:
            self.rpc_broadcast_mq.shutdown()
            self.rpc_broadcast_mq = None
        for mq in self.response_mqs:
            mq.shutdown()
        self.response_mqs = []
        return codes


@pytest.mark.parametrize("nnodes", [1, 2], ids=["one-node", "two-nodes"])
def test_the_executors_calls_in_its_order(nnodes: int) -> None:
    executor = Executor(nnodes)
    try:
        world = executor.world_size
        assert executor.collective_rpc("get_rank") == list(range(world))
        payload = os.urandom(5 << 20)  # larger than a single-reader queue's chunk; over TCP too
        assert executor.collective_rpc("echo", (payload,)) == [payload] * world
        assert executor.collective_rpc("get_rank", unique_reply_rank=world - 1) == world - 1
        with pytest.raises(RuntimeError, match=f"rank {world - 1} fails on purpose"):
            executor.collective_rpc("fail", unique_reply_rank=world - 1)
        with pytest.raises(RuntimeError, match="rank 0 fails on purpose"):
            executor.collective_rpc("fail")
        for mq in executor.response_mqs[1:]:  # the failures the first one cut short
            assert mq.dequeue(timeout=30)[0] == ResponseStatus.FAILURE
        assert executor.collective_rpc("get_rank") == list(range(world))  # nothing left over anywhere
    finally:
        codes = executor.shutdown()
        del executor
        gc.collect()
    # Every worker left its parked dequeue through shutdown() ("cancelled"), the TCP reader too.
    assert codes == [0] * world
