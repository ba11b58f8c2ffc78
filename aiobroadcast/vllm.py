"""A drop-in for vLLM's ``MessageQueue`` (``vllm.distributed.device_communicators.shm_broadcast``).

Change the import and keep the code::

    from aiobroadcast.vllm import MessageQueue

The constructor (the writer), ``create_from_handle`` (a reader), ``create_from_process_group``,
``create_from_process_group_single_reader`` (every rank a writer, one reader), ``export_handle``,
``wait_until_ready``, ``enqueue``, ``dequeue``, ``broadcast_object``, ``shutdown`` and
``shutting_down`` behave as vLLM's, over ``aiobroadcast.blocking``: readers on the writer's
node read its shared-memory ring and sleep on a socket instead of spinning; readers on other
nodes come over TCP with CurveZMQ (authenticated and encrypted; nothing is unpickled before it
is authenticated), not over a plain PUB socket.

The surface is vLLM 0.33.0's, with the calls its multiprocess executor makes
(``tests/test_vllm_executor.py`` makes them in its order): the constructor's keywords and
defaults (``enable_shm_tensor_arena`` among them), ``create_from_process_group(pg,
max_chunk_bytes, max_chunks, writer_rank=0, external_writer_handle=None, blocking=True)``,
``create_from_handle(handle, -1)`` (any rank that is not local reads over TCP), and the
``Handle``'s ``local_reader_ranks``, ``remote_subscribe_addr`` (None when the queue has no
remote readers) and ``remote_addr_ipv6``. Without ``connect_ip`` the remote readers are offered
the address vLLM's ``get_ip()`` gives (``$VLLM_HOST_IP``, else the interface that routes
outwards). ``max_chunks=1`` makes a ring of two slots (a ring has two at least). A ring
/dev/shm cannot hold raises ``InsufficientQueueSpace``, a ``RuntimeError`` whose message starts
"Insufficient space in /dev/shm", as vLLM's (vLLM also weighs the cgroup's memory limit; this
does not).

What differs, on purpose:

- The roles are two classes, ``MessageQueueWriter`` and ``MessageQueueReader``, both
  ``MessageQueue``\\ s. The writer has no ``dequeue``: calling it raises an ``AttributeError``
  saying what to do, and mypy flags it, where vLLM raises ``RuntimeError("Only readers can
  dequeue")`` at run time. The readers have no ``enqueue``.
- A dead reader is dropped within about a second (the writer logs which rank it was) instead
  of hanging the writer; a reader of a dead writer gets ``aiobroadcast.WriterGone``.
- ``close()`` ends the queue for its readers (``aiobroadcast.EndOfStream`` after the last
  message); it also happens when the writer is garbage-collected or its process exits.
- ``enqueue`` before every reader attached waits for them (vLLM would lose the message for
  a late reader): ``wait_until_ready`` is then optional.
- ``dequeue(indefinite=...)`` is accepted and changes nothing: a waiting reader logs nothing
  (``aiobroadcast stats`` shows who waits for whom).
- Timeouts raise ``aiobroadcast.WaitTimeout``, a ``TimeoutError``; a cancelled ``dequeue``
  raises ``QueueCancelled``, a ``RuntimeError`` whose message starts with "cancelled", as
  vLLM's; negative timeouts never mean "forever".
- ``enable_shm_tensor_arena=True`` makes the channel's arena (``open_writer(arena_bytes=...)``,
  ``ARENA_BYTES``, reserved at once, where vLLM's 2 GiB are paged in lazily): a contiguous CPU
  tensor of 256 KiB or more (vLLM: 8 MiB) is copied once into it, and each local reader gets a
  zero-copy view, writable as vLLM's, valid for as long as it or a view of it is referenced;
  its bytes are released when the last one is freed, not at the next ``dequeue`` (there is no
  CUDA-event gating: a reader that copies to a device asynchronously keeps the tensor until the
  copy is done). A full arena falls back to copying through the ring, as vLLM's falls back to
  pickling; remote readers get copies. Without the arena every object is pickled into the
  message and each reader unpickles its own copy; a dense CPU tensor travels as its bytes, its
  dtype and shape, as vLLM's reducer sends it (float8 and ``uint16``/``uint32``/``uint64`` too,
  whose form in torch's own pickling torch cannot read back), a large one out of band. A
  message larger than a chunk takes several slots, or streams through the ring, instead of
  vLLM's overflow socket.
- ``shutdown()`` wakes a parked ``dequeue`` of a remote (TCP) reader too, where vLLM's wakes
  local readers only (its remote reader sleeps on until its process is killed); on the writer
  it only sets ``shutting_down``, as vLLM's. A queue is closed when collected, at its
  process's exit, and at a ``multiprocessing`` child's exit (``os._exit``, which runs no
  ``atexit`` hook); vLLM's executor drops its queues after its workers exited, so its workers
  never see the end of the stream (a reader that does gets ``EndOfStream``, where vLLM's would
  wait on).
- ``dequeue`` also takes ``cancel=`` (a ``threading.Event``, as earlier vLLM did). A
  reader polls for at most ~50 us after a read before it sleeps (``_spin_condition.busy_loop_s``
  is 0 here, 1 s in vLLM, whose reader spins a core for a second after every read); vLLM's
  environment knobs (``VLLM_RINGBUFFER_WARNING_INTERVAL``, ``VLLM_USE_SPINLOOP_EXT``) are not
  read.
- Wrong arguments raise ``ValueError`` where vLLM asserts (``python -O`` drops asserts):
  ``local_reader_ranks`` that do not name ``n_local_reader`` ranks, an
  ``n_local_reader`` above ``n_reader``. ``create_from_handle`` of a rank that is not local on
  a queue without remote readers raises ``BroadcastError`` at once; if the writer rank of
  ``create_from_process_group`` cannot make the queue, every rank raises.
- The ``Handle`` is a frozen dataclass that carries the channel's handle (and its CurveZMQ
  reader keys: send it only to the ranks) instead of vLLM's ring name and ZeroMQ addresses:
  ``buffer_handle``, ``local_subscribe_addr``, ``local_notify_addr`` and
  ``tensor_arena_handle`` are not there.
- vLLM's transport internals are not there: ``ShmRingBuffer``, ``SpinCondition`` (but for
  ``_spin_condition.busy_loop_s`` and ``last_read``), ``acquire_read``/``acquire_write``,
  ``ReadTimeoutWithWarnings``, ``MessageQueue.recv``, ``check_shm_free_space``,
  ``_reduce_tensor``, and the attributes ``buffer``, ``current_idx``, ``local_socket``,
  ``remote_socket``, ``local_reader_rank`` and ``tensor_arena``. ``close()`` and
  ``statistics()`` are added.

torch is imported only when ``create_from_process_group`` is given a torch ``ProcessGroup``; any
other group object with ``rank``, ``world_size`` and ``broadcast_obj(obj, src)`` (as vLLM's
``StatelessProcessGroup``) works without it.

Thread safety is the blocking API's: every method may be called from any thread (``shutdown``
from a monitor thread wakes a parked ``dequeue``).
"""

from __future__ import annotations

import json
import logging
import multiprocessing.util
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ._base import fork as _fork
from ._base.errors import BroadcastError, InsufficientSharedMemory, WaitTimeout, WouldBlock
from ._base.handle import Handle as ChannelHandle
from ._broadcast import blocking
from ._broadcast.open import DEFAULT_DIRECTORY
from ._broadcast.reader_open import _ring_reachable

__all__ = [
    "Handle",
    "InsufficientQueueSpace",
    "MessageQueue",
    "MessageQueueReader",
    "MessageQueueWriter",
    "QueueCancelled",
]

log = logging.getLogger("aiobroadcast")

#: vLLM's defaults: 10 chunks of 24 MiB (240 MiB of /dev/shm, reserved at creation).
DEFAULT_MAX_CHUNK_BYTES = 24 * 1024 * 1024
DEFAULT_MAX_CHUNKS = 10
#: The arena ``enable_shm_tensor_arena=True`` makes (vLLM's: 8 slots of 256 MiB, paged lazily).
ARENA_BYTES = 256 * 1024 * 1024
#: How often a ``dequeue`` given a ``cancel`` event looks at it (nothing signals an Event).
CANCEL_CHECK_S = 0.1
#: How often a writer still waiting for its readers says so.
READY_LOG_S = 60.0
#: What a fork child may do instead of using a queue it inherited (``_fork.role``).
QUEUE_FIX = "read the queue with MessageQueue.create_from_handle(queue.export_handle(), rank)"


class QueueCancelled(BroadcastError, RuntimeError):
    """Raised by ``dequeue`` when ``shutdown()`` was called or its ``cancel`` event was set while
    it waited. A ``RuntimeError`` whose message starts with "cancelled", as vLLM's."""


class InsufficientQueueSpace(InsufficientSharedMemory, RuntimeError):
    """Raised by the constructor (and so by ``create_from_process_group``) when /dev/shm cannot
    hold the ring: an ``aiobroadcast.InsufficientSharedMemory`` that is also the
    ``RuntimeError("Insufficient space in /dev/shm ...")`` vLLM raises there."""

    def __init__(self, needed: int, available: int, directory: str) -> None:
        super().__init__(needed, available, directory)
        mib = 1 << 20
        self.args = (
            f"Insufficient space in {directory} for the message queue: {needed / mib:.0f} MiB required, "
            f"{available / mib:.0f} MiB free. Increase {directory} (e.g. --shm-size or --ipc=host), or "
            "lower max_chunks or max_chunk_bytes",
        )


@dataclass(frozen=True)
class Handle:
    """What ``export_handle`` returns and ``create_from_handle`` takes: picklable, so it goes
    through ``torch.distributed.broadcast_object_list`` or any object channel. It carries the
    channel's CurveZMQ reader keys: it admits a remote reader, so send it only to the ranks."""

    local_reader_ranks: list[int] = field(default_factory=list)
    channel: str = ""  #: the aiobroadcast channel's handle (JSON)
    n_reader: int = 0
    n_local_reader: int = 0

    @property
    def remote_subscribe_addr(self) -> str | None:
        """As vLLM's: the ``tcp://host:port`` remote readers connect to (a rank not among
        ``local_reader_ranks``, or -1), None when the queue has no remote readers."""
        if self.n_reader == self.n_local_reader or not self.channel:
            return None
        tcp = json.loads(self.channel).get("tcp")
        return tcp if isinstance(tcp, str) else None

    @property
    def remote_addr_ipv6(self) -> bool:
        """As vLLM's: whether ``remote_subscribe_addr`` is an IPv6 address (``tcp://[...]:port``)."""
        return (self.remote_subscribe_addr or "").startswith("tcp://[")


class _SpinCondition:
    """vLLM's knobs for a reader's spinning, kept for code (vLLM's own tests among it) that sets
    them. ``busy_loop_s`` (default 0: aiobroadcast's adaptive poll of at most 50 us): a waiting
    ``dequeue`` polls the ring, without sleeping, until ``busy_loop_s`` after ``last_read`` (the
    time of the last message taken)."""

    def __init__(self) -> None:
        self.busy_loop_s = 0.0
        self.last_read = time.monotonic()


class MessageQueue:
    """vLLM's ``MessageQueue``: ``MessageQueue(n_reader, n_local_reader, ...)`` makes the writer
    (a ``MessageQueueWriter``), ``create_from_handle`` a reader (a ``MessageQueueReader``)."""

    _is_writer: bool
    handle: Handle
    shutting_down: bool

    # vLLM's constructor signature, as MessageQueueWriter.__init__ has it: __new__ must accept
    # the same arguments, and spelling them out keeps vLLM's names and defaults in the signature.
    def __new__(
        cls,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: list[int] | None = None,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        connect_ip: str | None = None,
        enable_shm_tensor_arena: bool = False,
    ) -> MessageQueueWriter:
        return object.__new__(MessageQueueWriter)

    def export_handle(self) -> Handle:
        return self.handle

    @staticmethod
    def create_from_handle(handle: Handle, rank: int) -> MessageQueueReader:
        """Attach the reader of group rank ``rank``: over shared memory if ``rank`` is one of the
        handle's local reader ranks, else over TCP (vLLM's executor opens a peer's queue with
        rank -1: any rank that is not local)."""
        return MessageQueueReader(handle, rank)

    @staticmethod
    def create_from_process_group(
        pg: Any,
        max_chunk_bytes: int,
        max_chunks: int,
        writer_rank: int = 0,
        external_writer_handle: Handle | None = None,
        blocking: bool = True,
    ) -> MessageQueueWriter | MessageQueueReader:
        """Collective: every rank of ``pg`` calls it. Rank ``writer_rank`` gets the writer, the
        others a reader each: local ones (on the writer's node: those that can map its ring)
        over shared memory, the others over TCP. ``external_writer_handle`` (looked at on rank
        ``writer_rank`` only): that rank attaches to this existing queue, as the reader of its
        own rank, instead of making one, and passes its handle on; the other ranks then read
        that queue, locally if they are among its local reader ranks. ``blocking``: also
        ``wait_until_ready()``; with False that handshake is left to the caller."""
        group = _Group(pg)
        same_node = _same_node(group, writer_rank)
        mq: MessageQueueWriter | MessageQueueReader
        if group.rank == writer_rank:
            local = [r for r in range(group.world_size) if same_node[r] and r != writer_rank]
            try:
                if external_writer_handle is not None:
                    mq = MessageQueueReader(external_writer_handle, group.rank)
                else:
                    mq = MessageQueueWriter(group.world_size - 1, len(local), local, max_chunk_bytes, max_chunks)
            except BaseException as exc:
                group.broadcast(f"{type(exc).__name__}: {exc}", writer_rank)  # the readers fail too
                raise
            group.broadcast(mq.export_handle(), writer_rank)
        else:
            handle = group.broadcast(None, writer_rank)
            if not isinstance(handle, Handle):
                raise BroadcastError(f"rank {writer_rank} could not make the message queue: {handle}")
            mq = MessageQueueReader(handle, group.rank)
        if blocking:
            mq.wait_until_ready()
        return mq

    @staticmethod
    def create_from_process_group_single_reader(
        pg: Any, max_chunk_bytes: int, max_chunks: int, reader_rank: int = 0, blocking: bool = False
    ) -> tuple[MessageQueueWriter, list[Handle]]:
        """Collective, as vLLM's: every rank of ``pg`` gets a queue it writes (one reader: rank
        ``reader_rank``, over shared memory if on its node, else over TCP), and rank
        ``reader_rank`` also gets every rank's handle, in rank order (the others get ``[]``); it
        reads rank ``r``'s queue with ``MessageQueue.create_from_handle(handles[r], 0)``.
        ``blocking``: also ``wait_until_ready()`` (on a rank other than the reader: the reader
        must attach meanwhile). For a fan-in without a process group, see
        ``aiobroadcast.blocking.open_collector``."""
        group = _Group(pg)
        same_node = _same_node(group, reader_rank)
        mine: Handle | str
        try:
            mq = MessageQueueWriter(1, 1 if same_node[group.rank] else 0, None, max_chunk_bytes, max_chunks)
        except BaseException as exc:
            group.gather(f"rank {group.rank}: {type(exc).__name__}: {exc}", reader_rank)  # the reader fails too
            raise
        mine = mq.export_handle()
        handles = group.gather(mine, reader_rank)
        if group.rank != reader_rank:
            handles = []
        bad = [h for h in handles if not isinstance(h, Handle)]
        if bad:
            mq.close()
            raise BroadcastError(f"a rank could not make its message queue: {bad[0]}")
        if blocking:
            mq.wait_until_ready()
        return mq, handles

    def wait_until_ready(self) -> None:
        """Collective, as vLLM's: the writer returns once every reader is attached; a reader is
        ready as soon as it exists (it attached in ``create_from_handle``)."""

    def shutdown(self) -> None:
        """Set ``shutting_down``; a reader's parked ``dequeue`` wakes and raises ``QueueCancelled``."""
        self.shutting_down = True


@_fork.role("writer", QUEUE_FIX, ends=("close", "shutdown"), keep=("export_handle",))
class MessageQueueWriter(MessageQueue):
    """The writer's ``MessageQueue``: ``enqueue`` and ``broadcast_object``; no ``dequeue``."""

    _is_writer = True

    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: list[int] | None = None,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        connect_ip: str | None = None,
        enable_shm_tensor_arena: bool = False,
    ) -> None:
        """As vLLM's: ``n_reader`` readers, ``n_local_reader`` of them on this node (group ranks
        ``local_reader_ranks``, default ``0 .. n_local_reader-1``), a ring of ``max_chunks``
        slots of ``max_chunk_bytes`` (larger messages take several slots, or stream), and for
        the remote readers a TCP endpoint on ``connect_ip`` (default: as vLLM's ``get_ip()``,
        ``$VLLM_HOST_IP``, else the address of the interface that routes outwards).

        ``enable_shm_tensor_arena=True``: large CPU tensors go through an arena of
        ``ARENA_BYTES`` beside the ring, and local readers get zero-copy views of them that stay
        valid while referenced (see the module's text). Raises ``InsufficientQueueSpace`` (a
        ``RuntimeError``) when /dev/shm cannot hold the ring (and the arena)."""
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        if len(local_reader_ranks) != n_local_reader:
            raise ValueError(f"local_reader_ranks {local_reader_ranks} must name n_local_reader={n_local_reader} ranks")
        if not 0 <= n_local_reader <= n_reader:
            raise ValueError(f"n_local_reader={n_local_reader} must be between 0 and n_reader={n_reader}")
        self.n_local_reader = n_local_reader
        self.n_remote_reader = n_reader - n_local_reader
        tcp = None
        if self.n_remote_reader:
            ip = connect_ip or _host_ip()
            tcp = f"tcp://[{ip}]:0" if ":" in ip else f"tcp://{ip}:0"
        try:
            self._writer: blocking.BlockingWriter[Any] = blocking.open_writer(
                capacity=2 if max_chunks == 1 else max_chunks,  # a ring has two slots at least
                slot_bytes=max_chunk_bytes,
                max_readers=max(1, n_local_reader, self.n_remote_reader),
                tcp=tcp,
                arena_bytes=ARENA_BYTES if enable_shm_tensor_arena else 0,
            )
        except InsufficientSharedMemory as exc:
            raise InsufficientQueueSpace(exc.needed, exc.available, DEFAULT_DIRECTORY) from exc
        self._owner = os.getpid()
        self._finalizer = _close_at_exit(self, self._owner, self._writer.close)
        self.handle = Handle(list(local_reader_ranks), self._writer.handle.to_json(), n_reader, n_local_reader)
        self.shutting_down = False
        self._ready = n_reader == 0

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Publish ``obj`` to every reader, waiting while the slowest live reader is a whole
        ring behind (and, the first time, for every reader to attach). ``timeout``: raise
        ``WaitTimeout`` (a ``TimeoutError``) after that many seconds instead."""
        if not self._ready:
            self._wait_ready(None if timeout is None else time.monotonic() + max(0.0, timeout))
        self._writer.put(obj, timeout)

    def broadcast_object(self, obj: Any = None) -> Any:
        self.enqueue(obj)
        return obj

    def wait_until_ready(self) -> None:
        """Wait until every reader is attached (they start with the next message published)."""
        self._wait_ready(None)

    def close(self) -> None:
        """End the queue: readers get what was enqueued, then ``EndOfStream``. Closing again
        does nothing; a close while another thread's is under way returns once that one is over."""
        self._finalizer()
        _close_here(self._owner, self._writer.close)  # the finalizer runs once: wait for another thread's

    def statistics(self) -> Any:
        """The channel's ``WriterStatistics``: readers by rank name, their lag, who a blocked
        ``enqueue`` waits for."""
        return self._writer.statistics()

    if not TYPE_CHECKING:

        @property
        def dequeue(self) -> None:
            raise AttributeError(
                "this is the writer's MessageQueue: it has no dequeue(). Read in the reader processes, "
                "with MessageQueue.create_from_handle(writer.export_handle(), rank).dequeue() (or "
                "broadcast_object(), which enqueues here and dequeues there)"
            )

    def _wait_ready(self, deadline: float | None) -> None:
        start = time.monotonic()
        said = start
        while True:
            # A ring reader is listed once the entry it starts at is fixed, at or before our head
            # (ReaderPlace.join), a TCP reader once its server admitted it, starting at the ring's
            # next_msg as the server loaded it then: each gets every message published after this.
            readers = self._writer.statistics().readers
            local = sum(r.transport == "shm" for r in readers)
            remote = sum(r.transport == "tcp" for r in readers)
            if local >= self.n_local_reader and remote >= self.n_remote_reader:
                self._ready = True
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise WaitTimeout(
                    f"the timeout passed before every reader attached: {local} of {self.n_local_reader} local and "
                    f"{remote} of {self.n_remote_reader} remote attached"
                )
            if now - said >= READY_LOG_S:
                said = now
                log.warning(
                    "aiobroadcast: the message queue has waited %.0f s for its readers: %d of %d local and "
                    "%d of %d remote attached",
                    now - start,
                    local,
                    self.n_local_reader,
                    remote,
                    self.n_remote_reader,
                )
            time.sleep(0.005)


@_fork.role("reader", QUEUE_FIX, ends=("close", "shutdown"), keep=("export_handle",))
class MessageQueueReader(MessageQueue):
    """A reader's ``MessageQueue``: ``dequeue`` and ``broadcast_object``; no ``enqueue``."""

    _is_writer = False

    def __new__(cls, handle: Handle, rank: int) -> MessageQueueReader:
        return object.__new__(cls)

    def __init__(self, handle: Handle, rank: int) -> None:
        self.handle = handle
        self.shutting_down = False
        self._spin_condition = _SpinCondition()
        # Reader names are unique per channel, as ranks are per group. A reader without a rank
        # (create_from_handle(handle, -1)) takes the default name, unique too (reader-<pid>-<n>).
        name = f"rank-{rank}" if rank >= 0 else None
        if name is not None and rank in handle.local_reader_ranks:
            reader = blocking.open_arena_reader(handle.channel, name=name)
        else:
            if handle.n_reader == handle.n_local_reader:
                raise BroadcastError(
                    f"rank {rank} is not one of the local reader ranks {handle.local_reader_ranks}, and the "
                    "queue was made for local readers only (n_reader == n_local_reader)"
                )
            reader = blocking.open_reader(handle.channel, name=name, transport="tcp")
        self._reader: blocking.BlockingReader[Any] = reader
        self._owner = os.getpid()
        self._finalizer = _close_at_exit(self, self._owner, reader.close)

    def dequeue(
        self, timeout: float | None = None, cancel: threading.Event | None = None, indefinite: bool = False
    ) -> Any:
        """The next object, waiting for it (asleep, no CPU). ``timeout``: raise ``WaitTimeout`` (a
        ``TimeoutError``) after that many seconds; ``cancel`` set, or ``shutdown()`` called,
        while it waits: raise ``QueueCancelled``. ``indefinite`` changes nothing (see the module).
        Raises ``EndOfStream`` once the writer closed and everything was taken, ``WriterGone``
        if its process died."""
        try:
            obj = self._reader.get_nowait()
        except WouldBlock:
            obj = self._wait(timeout, cancel)
        self._spin_condition.last_read = time.monotonic()
        return obj

    def broadcast_object(self, obj: Any = None) -> Any:
        return self.dequeue()

    def shutdown(self) -> None:
        self.shutting_down = True
        self._reader._interrupt()  # noqa: SLF001 (see _wait)

    def close(self) -> None:
        """Detach this reader (the writer stops waiting for it at once). Closing again does
        nothing; a close while another thread's is under way returns once that one is over."""
        self._finalizer()
        _close_here(self._owner, self._reader.close)  # the finalizer runs once: wait for another thread's

    def statistics(self) -> Any:
        """The reader's ``ReaderStatistics``."""
        return self._reader.statistics()

    if not TYPE_CHECKING:

        @property
        def enqueue(self) -> None:
            raise AttributeError(
                "this is a reader's MessageQueue: it has no enqueue(). Only the writer (the MessageQueue "
                "made by MessageQueue(n_reader, n_local_reader, ...)) enqueues"
            )

    def _wait(self, timeout: float | None, cancel: threading.Event | None) -> Any:
        def stop() -> BaseException | None:
            if self.shutting_down or (cancel is not None and cancel.is_set()):
                why = "shutdown() was called" if self.shutting_down else "its cancel event was set"
                return QueueCancelled(f"cancelled: {why}")
            return None

        spin = self._spin_condition
        busy_ns = None
        if spin.busy_loop_s > 0:
            busy_ns = max(0, int((spin.last_read + spin.busy_loop_s - time.monotonic()) * 1e9))
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        # vLLM's dequeue stops on shutdown() or a cancel event and spins as its busy loop says:
        # the blocking reader's get with a stop condition, which its public get does not offer
        # (it has no such users); this drop-in is its one other user.
        return self._reader._get(deadline, stop, CANCEL_CHECK_S if cancel is not None else None, busy_ns)  # noqa: SLF001


def _close_at_exit(
    queue: MessageQueue, pid: int, close: Callable[[], None]
) -> weakref.finalize[[int, Callable[[], None]], MessageQueue]:
    """Close ``queue`` when it is collected, or at the exit of the process that made it, the
    exit of a ``multiprocessing`` child too (it ends in ``os._exit``, which runs no ``atexit``
    hook, but runs ``multiprocessing``'s finalizers): a vLLM worker that exits with a queue
    still referenced (by its death-pipe thread) must not leave its ring in /dev/shm, nor its
    remote reader for the writer to time out."""
    finalizer = weakref.finalize(queue, _close_here, pid, close)
    multiprocessing.util.Finalize(queue, finalizer, exitpriority=0)
    return finalizer


def _close_here(pid: int, close: Callable[[], None]) -> None:
    """Close a queue when it is collected or at exit, in the process that made it only: a fork
    child inherits the finalizer (and drops the object, or exits through ``sys.exit``), and must
    not end its parent's channel."""
    if os.getpid() == pid:
        close()


# --- process groups ----------------------------------------------------------------------------
class _GroupLike(Protocol):
    rank: int
    world_size: int

    def broadcast_obj(self, obj: Any, src: int) -> Any: ...


class _Group:
    """A torch ``ProcessGroup`` (torch imported only then) or a vLLM ``StatelessProcessGroup``-like
    object, seen as ``rank``, ``world_size`` and ``broadcast(obj, src)`` over group ranks."""

    def __init__(self, pg: Any) -> None:
        self.broadcast: Callable[[Any, int], Any]
        #: Every rank's ``obj`` at rank ``dst``, in rank order (what the other ranks get: unspecified).
        self.gather: Callable[[Any, int], list[Any]]
        if type(pg).__module__.split(".")[0] == "torch":
            import torch.distributed as dist

            self.rank = dist.get_rank(pg)
            self.world_size = dist.get_world_size(pg)
            ranks = dist.get_process_group_ranks(pg)

            def broadcast(obj: Any, src: int) -> Any:
                box = [obj]
                dist.broadcast_object_list(box, src=ranks[src], group=pg)
                return box[0]

            self.broadcast = broadcast

            def gather(obj: Any, dst: int) -> list[Any]:
                out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
                dist.gather_object(obj, out, dst=ranks[dst], group=pg)
                return out or []

            self.gather = gather
        else:
            group: _GroupLike = pg
            self.rank = group.rank
            self.world_size = group.world_size
            self.broadcast = group.broadcast_obj

            def gather_by_broadcast(obj: Any, dst: int) -> list[Any]:
                return [self.broadcast(obj if r == self.rank else None, r) for r in range(self.world_size)]

            self.gather = gather_by_broadcast


def _same_node(group: _Group, writer_rank: int) -> list[bool]:
    """Which ranks share the writer's node: those that can map a probe ring it makes (the test
    ``open_reader(transport="auto")`` uses). Collective."""
    probe = blocking.open_writer(capacity=2, slot_bytes=64, max_readers=1) if group.rank == writer_rank else None
    try:
        channel = group.broadcast(probe.handle.to_json() if probe is not None else None, writer_rank)
        mine = probe is not None or _ring_reachable(ChannelHandle.parse(channel))
        # Every rank's answer to every rank; the writer's probe lives until all have looked.
        return [bool(group.broadcast(mine if r == group.rank else None, r)) for r in range(group.world_size)]
    finally:
        if probe is not None:
            probe.close()


#: Public addresses a UDP socket is "connected" to (nothing is sent) to learn which local address
#: routes outwards, as vLLM's ``get_ip()`` does.
_ROUTE_PROBES = ((socket.AF_INET, ("8.8.8.8", 80)), (socket.AF_INET6, ("2001:4860:4860::8888", 80)))


def _host_ip() -> str:
    """The address remote readers connect to when ``connect_ip`` is not given, as vLLM's
    ``get_ip()``: ``$VLLM_HOST_IP``, else the address of the interface that routes outwards
    (IPv4, then IPv6), else the host name's address (vLLM's last resort is 0.0.0.0, which no
    reader can connect to)."""
    if ip := os.environ.get("VLLM_HOST_IP"):
        return ip
    for family, probe in _ROUTE_PROBES:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(probe)
                return str(s.getsockname()[0])
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())
