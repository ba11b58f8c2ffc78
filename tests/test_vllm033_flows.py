"""vLLM 0.33.0's ``tests/distributed/test_shm_broadcast.py`` flows on ``aiobroadcast.vllm.MessageQueue``.

Written for this project, following what each of vLLM's tests does through ``MessageQueue``'s
public surface (vLLM's test name in brackets):

- ``test_tensors_through_a_process_group`` [``test_tensor_broadcast``, and the cases of
  ``test_tensor_pickle_roundtrip`` sent through the queue instead of vLLM's private pickler]:
  torch CPU tensors of several dtypes and shapes, some nested in lists and dicts, one larger than
  a chunk, from a gloo rank to the others over a torch group and a ``StatelessProcessGroup``;
  each reader compares them bit for bit, cycles the ring several times over and finds what it
  kept unchanged and writable.
- ``test_tensors_through_a_queue_with_the_tensor_arena`` [``test_arena_broadcast``]: the
  constructor with ``enable_shm_tensor_arena=True``, two local readers; tensors arrive equal, and
  one a reader keeps stays equal to what was sent while many later large tensors go through.
- ``test_tensors_of_every_dtype_vllm_carries`` [the ``fp8`` case of ``test_tensor_pickle_roundtrip``,
  and ``test_arena_dtype_roundtrip``'s float8]: float8 and uint16/32/64 CPU tensors,
  contiguous, transposed and large (out of band), which vLLM's reducer sends as their bytes,
  as the codec does (torch's own pickling of these dtypes cannot be unpickled).
- ``test_32_writers_made_at_once_each_announce_their_own_address``
  [``test_remote_subscribe_addr_unique_concurrent_writers``]: 32 queues for one remote reader
  each (``n_local_reader=0``), made by 32 threads at once; each announces its own
  ``remote_subscribe_addr``, and a reader opened on each (rank -1, as vLLM's executor, or a rank
  that is not local, as vLLM's test) gets its queue's messages.
- ``test_readers_idle_and_busy_wake_for_the_next_message`` [``test_message_queue_idle_wake``,
  ``test_message_queue_busy_to_idle``], then every rank's ``shutdown()``, the writer's too, as
  0.33's flows end.

Already run by ``test_vllm_compat.py``, unchanged in 0.33.0: ``test_shm_broadcast``,
``test_message_queue_shutdown_busy`` and ``test_message_queue_shutdown_idle``;
``create_from_process_group_single_reader`` is there too. Not taken: vLLM's tests of its
internals (the count of ``SpinCondition.wait`` calls, ``_reduce_tensor``, ``ShmTensorArena``'s
slots, ``acquire_read``/``acquire_write``, ``check_shm_free_space``, its warning logs), which the
drop-in does not have (see ``aiobroadcast.vllm``).

torch is in the ``vllm`` extra; without it these tests skip.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _vllm_harness import StatelessProcessGroup, get_open_port

from aiobroadcast.vllm import MessageQueue

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[vllm]')")
dist = pytest.importorskip("torch.distributed")

mp = multiprocessing.get_context("fork")

MiB = 1 << 20


# --- ranks -------------------------------------------------------------------------------------
def run_ranks(fn: Callable[[int, int, int], None], world: int, timeout: float = 60) -> None:
    """Run ``fn(rank, world, store_port)`` in ``world`` forked processes joined in a gloo group
    (``dist.group.WORLD``); ``store_port`` is free for a ``StatelessProcessGroup``. Fails with
    each failed rank's traceback; a rank still running after ``timeout`` is killed and fails it."""
    init = f"tcp://127.0.0.1:{get_open_port()}"
    store_port = get_open_port()
    errors: Any = mp.Queue()

    def rank_main(rank: int) -> None:
        try:
            dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
            fn(rank, world, store_port)
            dist.barrier()
            dist.destroy_process_group()
        except BaseException:
            errors.put(f"rank {rank}:\n{traceback.format_exc()}")
            raise

    procs = [mp.Process(target=rank_main, args=(r,)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    failed: list[str] = []
    for r, p in enumerate(procs):
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
            failed.append(f"rank {r}: killed after {timeout} s")
        elif p.exitcode != 0:
            failed.append(f"rank {r}: exit code {p.exitcode}")
            for q in procs:  # the others would wait for it in a collective
                if q.is_alive():
                    q.kill()
                    q.join()
    while not errors.empty():
        failed.append(errors.get())
    assert not failed, "\n".join(failed)


def barrier(pg: Any) -> None:
    if pg is dist.group.WORLD:
        dist.barrier()
    else:
        pg.barrier()


def bits(t: Any) -> Any:
    """A tensor's values as bytes (every dtype, fp8 too, compares so; a conjugate view by its
    values), in row-major order whatever its strides."""
    return t.detach().resolve_conj().contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensor(got: Any, sent: Any, what: str) -> None:
    assert type(got) is type(sent), what
    assert (got.dtype, got.shape, got.device, got.requires_grad) == (
        sent.dtype,
        sent.shape,
        sent.device,
        sent.requires_grad,
    ), what
    assert torch.equal(bits(got), bits(sent)), what


# --- tensors through create_from_process_group ---------------------------------------------------
def tensor_cases() -> dict[str, Any]:
    """Tensors of the dtypes and shapes vLLM 0.33 sends through its queue, the same in every
    rank (a seeded generator)."""
    g = torch.Generator().manual_seed(33)

    def randn(*shape: int) -> Any:
        return torch.randn(*shape, generator=g)

    return {
        "f32": randn(100, 10),
        "f16": randn(33, 7).half(),
        "f64": randn(5, 3, 2).double(),
        "bf16": randn(512, 512).to(torch.bfloat16),
        "int8": torch.randint(-128, 127, (300,), generator=g, dtype=torch.int8),
        "uint8": torch.randint(0, 255, (17, 3), generator=g, dtype=torch.uint8),
        "int32": torch.randint(-(2**31), 2**31 - 1, (64,), generator=g, dtype=torch.int32),
        "int64": torch.randint(-(2**62), 2**62, (8, 8), generator=g, dtype=torch.int64),
        "bool": randn(9, 9) > 0,
        "complex64": torch.randn(16, dtype=torch.complex64, generator=g),
        "empty": torch.empty(0, 8),
        "scalar": torch.tensor(3.14),
        "noncontig": randn(64, 64).t(),
        "sliced": randn(16, 16)[2:9, ::3],
        "requires_grad": randn(8, 8).requires_grad_(),
        "conj": torch.randn(4, dtype=torch.complex64, generator=g).conj(),
        "param": torch.nn.Parameter(randn(4), requires_grad=False),
    }


def tensor_payload() -> dict[str, Any]:
    g = torch.Generator().manual_seed(34)
    return {
        "mid": torch.randn(1024, 512, generator=g),  # 2 MiB: less than a chunk
        "big": torch.randn(4096, 2048, generator=g).to(torch.bfloat16),  # 16 MiB: two chunks' worth
        "nested": ["plain", 123, {"inner": torch.arange(5)}, (torch.ones(2, 3, dtype=torch.int16),)],
        "cases": tensor_cases(),
    }


def tensors_rank(rank: int, world: int, store_port: int) -> None:
    stateless = StatelessProcessGroup.create("127.0.0.1", store_port, rank, world)
    writer_rank = 1
    for pg in [dist.group.WORLD, stateless]:
        mq: Any = MessageQueue.create_from_process_group(pg, 8 * MiB, 4, writer_rank)
        sent = tensor_payload()
        if rank == writer_rank:
            mq.enqueue(sent)
            for i in range(16):  # four times round the ring of 4 chunks
                mq.enqueue({"junk": torch.full((1024, 512), float(i))})
        else:
            got = mq.dequeue(timeout=30)
            assert got.keys() == sent.keys()
            assert_same_tensor(got["mid"], sent["mid"], "mid")
            assert_same_tensor(got["big"], sent["big"], "big")
            assert got["nested"][:2] == ["plain", 123]
            assert_same_tensor(got["nested"][2]["inner"], torch.arange(5), "nested inner")
            assert_same_tensor(got["nested"][3][0], torch.ones(2, 3, dtype=torch.int16), "nested tuple")
            assert got["cases"].keys() == sent["cases"].keys()
            for name, tensor in sent["cases"].items():
                assert_same_tensor(got["cases"][name], tensor, name)
            for i in range(16):
                junk = mq.dequeue(timeout=30)
                assert torch.equal(junk["junk"], torch.full((1024, 512), float(i)))
            # What the reader kept is its own: the ring's reuse did not change it, and it writes.
            assert_same_tensor(got["mid"], sent["mid"], "mid after the ring was reused")
            assert_same_tensor(got["big"], sent["big"], "big after the ring was reused")
            got["mid"] += 1.0
            got["big"][0, 0] = 1.0
            assert torch.equal(got["mid"], sent["mid"] + 1.0)
            for name in ("f32", "int64", "noncontig", "sliced", "param", "bool"):
                got["cases"][name].zero_()
                assert not got["cases"][name].any(), name
        barrier(pg)
        mq.close()


def test_tensors_through_a_process_group() -> None:
    run_ranks(tensors_rank, 3)


#: Dtypes vLLM 0.33 carries (its ``_reduce_tensor`` sends any CPU tensor's bytes as uint8) whose
#: pickling by torch's own reducer, in band, torch cannot unpickle (torch 2.13: "UntypedStorage has
#: no attribute 'dtype'"); the codec sends their bytes too.
BYTES_ONLY_DTYPES = ["float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"]


def test_tensors_of_every_dtype_vllm_carries() -> None:
    g = torch.Generator().manual_seed(37)
    sent = {}
    for name in BYTES_ONLY_DTYPES:
        dtype = getattr(torch, name)
        base = torch.randn(16, 8, generator=g)
        sent[name] = (base if dtype.is_floating_point else (base.abs() * 1000).to(torch.int64)).to(dtype)
        sent[name + " transposed"] = sent[name].t()  # not contiguous
        big = torch.randn(512, 256, generator=g)  # 256 KiB or more: out of band
        sent[name + " large"] = (big if dtype.is_floating_point else (big.abs() * 1000).to(torch.int64)).to(dtype)
    writer = MessageQueue(1, 1, max_chunk_bytes=4 * MiB, max_chunks=4)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        writer.enqueue(sent)
        got = reader.dequeue(timeout=30)
        for name, tensor in sent.items():
            assert_same_tensor(got[name], tensor, name)
    finally:
        reader.close()
        writer.close()


# --- tensors through a queue with the tensor arena ----------------------------------------------
LATER = 24  #: large messages sent after the one a reader keeps


def arena_rank(rank: int, world: int, store_port: int) -> None:
    writer_rank = 0
    readers = [r for r in range(world) if r != writer_rank]
    box: list[Any] = [None]
    if rank == writer_rank:
        mq: Any = MessageQueue(
            len(readers),
            len(readers),
            local_reader_ranks=readers,
            max_chunk_bytes=8 * MiB,
            max_chunks=4,
            enable_shm_tensor_arena=True,
        )
        box[0] = mq.export_handle()
        dist.broadcast_object_list(box, src=writer_rank)
    else:
        dist.broadcast_object_list(box, src=writer_rank)
        mq = MessageQueue.create_from_handle(box[0], rank)
    mq.wait_until_ready()

    g = torch.Generator().manual_seed(35)
    sent = {
        "huge": torch.randn(2048, 2048, generator=g),  # 16 MiB: vLLM 0.33 puts it in an arena slot
        "mid": torch.randn(1024, 512, generator=g),  # 2 MiB: below vLLM's arena threshold
        "half": torch.randn(1024, 2048, generator=g).to(torch.bfloat16),
    }
    if rank == writer_rank:
        mq.enqueue(sent)
        for i in range(LATER):
            mq.enqueue(torch.full((2048, 2048), float(i)))
        dist.barrier()  # the readers dropped what they kept
        mq.enqueue("after")
    else:
        kept = mq.dequeue(timeout=30)
        for name, tensor in sent.items():
            assert_same_tensor(kept[name], tensor, name)
        for i in range(LATER):
            later = mq.dequeue(timeout=30)
            assert torch.equal(later, torch.full((2048, 2048), float(i))), i
            del later
        # Kept across every later message: still what was sent.
        for name, tensor in sent.items():
            assert_same_tensor(kept[name], tensor, f"{name} kept across {LATER} later messages")
        del kept
        dist.barrier()
        assert mq.dequeue(timeout=30) == "after"
    mq.close()


def test_tensors_through_a_queue_with_the_tensor_arena() -> None:
    run_ranks(arena_rank, 3)


# --- 32 writers for remote readers, made at once ----------------------------------------------
def test_32_writers_made_at_once_each_announce_their_own_address() -> None:
    n = 32
    made: list[Any] = [None] * n
    failures: list[BaseException] = []
    start = threading.Barrier(n)

    def make(i: int) -> None:
        try:
            start.wait(timeout=30)
            made[i] = MessageQueue(1, 0, max_chunk_bytes=4096, max_chunks=2, connect_ip="127.0.0.1")
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=make, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    writers = [w for w in made if w is not None]
    readers: list[Any] = [None] * n
    try:
        assert not failures, failures
        assert len(writers) == n
        handles = [w.export_handle() for w in writers]
        addrs = [h.remote_subscribe_addr for h in handles]
        assert all(a is not None and a.startswith("tcp://127.0.0.1:") for a in addrs), addrs
        assert len(set(addrs)) == n, addrs
        assert all(h.local_reader_ranks == [] and not h.remote_addr_ipv6 for h in handles)

        def attach(i: int) -> None:
            try:
                # vLLM's executor opens a peer's queue with rank -1; vLLM's test with rank 0,
                # which is no local reader rank of a queue without local readers.
                readers[i] = MessageQueue.create_from_handle(handles[i], -1 if i % 2 else 0)
                readers[i].wait_until_ready()
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=attach, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for i, w in enumerate(writers):
            w.wait_until_ready()
            w.enqueue(("ping", i))
            w.enqueue(np.full(3, i))
        for t in threads:
            t.join(60)
        assert not failures, failures
        for i, r in enumerate(readers):
            assert r.dequeue(timeout=30) == ("ping", i)
            assert np.array_equal(r.dequeue(timeout=30), np.full(3, i))
    finally:
        for r in readers:
            if r is not None:
                r.close()
        closing = [threading.Thread(target=w.close) for w in writers]  # each waits for its TCP server
        for t in closing:
            t.start()
        for t in closing:
            t.join(60)


# --- readers idle and busy ----------------------------------------------------------------------
def idle_busy_rank(rank: int, world: int, store_port: int) -> None:
    writer_rank = 2
    mq: Any = MessageQueue.create_from_process_group(dist.group.WORLD, 40 * 1024, 2, writer_rank)
    array = np.random.default_rng(36).integers(1, 100, 100)
    sent = ["hello world", array, 12345, list(range(3))]
    if mq._is_writer:
        for message in sent:
            dist.barrier()
            time.sleep(0.1)  # the readers are waiting in dequeue by then
            mq.enqueue(message)
    else:
        # Idle (last read long ago): a dequeue with nothing to take times out, then wakes for
        # a message that comes while it waits.
        mq._spin_condition.last_read = 0
        with pytest.raises(TimeoutError):
            mq.dequeue(timeout=0.01)
        dist.barrier()
        assert mq.dequeue(timeout=5) == "hello world"
        dist.barrier()
        assert np.array_equal(mq.dequeue(timeout=5), array)
        # Busy (spinning after a read), then idle again.
        mq._spin_condition.busy_loop_s = 9999
        dist.barrier()
        assert mq.dequeue(timeout=5) == 12345
        mq._spin_condition.busy_loop_s = 0
        with pytest.raises(TimeoutError):
            mq.dequeue(timeout=0.01)
        dist.barrier()
        assert mq.dequeue(timeout=5) == [0, 1, 2]
    mq.shutdown()
    assert mq.shutting_down
    dist.barrier()
    mq.close()


def test_readers_idle_and_busy_wake_for_the_next_message() -> None:
    run_ranks(idle_busy_rank, 4)
