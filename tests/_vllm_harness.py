"""What vLLM's tests/distributed/test_shm_broadcast.py imports from vLLM besides MessageQueue,
rebuilt here so that its test functions run unchanged without vLLM installed.

- ``StatelessProcessGroup``: vLLM's (vllm/distributed/utils.py) reduced to what the tests use:
  ``create``, ``rank``, ``world_size``, ``broadcast_obj`` and ``barrier``, over a torch TCPStore
  as vLLM's.
- ``get_open_port`` and ``update_environment_variables``: as vLLM's utilities.

And ``QueueGroup``/``group_member`` for the test that a group without torch never imports it
(in a module that does not import torch, so that spawned children do not either).
"""

from __future__ import annotations

import os
import pickle
import random
import socket
import sys
import time
from typing import Any

from aiobroadcast.vllm import MessageQueue


def get_open_port() -> int:
    """A free port below the kernel's ephemeral range (vLLM's takes one from it): the port is
    bound later, by another process, and meanwhile a connection's source port or a ``bind(0)``
    (the ranks' TCP readers, the writer's TCP server) can take any port of that range
    (EADDRINUSE at the rendezvous). Below the range only an explicit bind takes a port."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in the 12000 ports below {low}")


def update_environment_variables(envs: dict[str, str]) -> None:
    os.environ.update(envs)


class StatelessProcessGroup:
    """A group of ``world_size`` processes that exchange pickled objects through a TCPStore
    served by rank 0, with no torch.distributed process group."""

    def __init__(self, rank: int, world_size: int, store: Any) -> None:
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self._sent = 0
        self._received = [0] * world_size
        self._barriers = 0

    @staticmethod
    def create(host: str, port: int, rank: int, world_size: int) -> StatelessProcessGroup:
        from torch.distributed import TCPStore

        store = TCPStore(host_name=host, port=port, world_size=world_size, is_master=rank == 0)
        return StatelessProcessGroup(rank, world_size, store)

    def broadcast_obj(self, obj: Any, src: int) -> Any:
        if self.rank == src:
            self.store.set(f"broadcast_from/{src}/{self._sent}", pickle.dumps(obj))
            self._sent += 1
            return obj
        key = f"broadcast_from/{src}/{self._received[src]}"
        self._received[src] += 1
        return pickle.loads(self.store.get(key))

    def barrier(self) -> None:
        """Every rank arrives, then every rank leaves. Rank 0 serves the store, so it returns
        only once all ranks have seen the barrier complete (a rank still reading from the store
        would otherwise find it gone when rank 0 exits after the last barrier)."""
        n = self._barriers
        self._barriers += 1
        self.store.add(f"barrier/{n}/in", 1)
        while self.store.add(f"barrier/{n}/in", 0) < self.world_size:
            time.sleep(0.001)
        self.store.add(f"barrier/{n}/out", 1)
        if self.rank == 0:
            while self.store.add(f"barrier/{n}/out", 0) < self.world_size:
                time.sleep(0.001)


class QueueGroup:
    """A process group without torch: ``broadcast_obj`` over one queue per (source, destination)."""

    def __init__(self, rank: int, queues: list[list[Any]]) -> None:
        self.rank = rank
        self.world_size = len(queues)
        self._queues = queues

    def broadcast_obj(self, obj: Any, src: int) -> Any:
        if self.rank == src:
            for dst, q in enumerate(self._queues[src]):
                if dst != src:
                    q.put(obj)
            return obj
        return self._queues[src][self.rank].get(timeout=60)


def group_member(rank: int, queues: list[list[Any]], results: Any) -> None:
    try:
        mq = MessageQueue.create_from_process_group(QueueGroup(rank, queues), 1024, 4, writer_rank=1)
        if rank == 1:
            for i in range(500):
                mq.broadcast_object(("msg", i))
            got: Any = "writer"
        else:
            got = [mq.broadcast_object() for _ in range(500)] == [("msg", i) for i in range(500)]
        results.put((rank, got, "torch" in sys.modules, type(mq).__name__))
        mq.close()
    except BaseException as exc:
        results.put((rank, repr(exc), None, None))
        raise
