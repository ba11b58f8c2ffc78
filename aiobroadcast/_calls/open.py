"""Opening a pool's roles: the arguments (``_PoolSpec``), the steps of opening a caller and
a worker (written once), and the async and blocking factories that drive them."""

from __future__ import annotations

import os
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

from .._base.errors import InvalidArgument
from .._base.handle import Handle
from .._base.steps import drive, drive_blocking
from .._broadcast import blocking as blocking_roles
from .._broadcast.open import DEFAULT_DIRECTORY, _Opening, open_reader, open_writer
from .._fanin import blocking as fanin_blocking
from .._fanin.handle import CollectorHandle
from .._fanin.open import open_collector, open_sender
from .blocking import BlockingCaller, BlockingWorker
from .roles import Caller, Worker
from .types import _HELLO, PoolHandle, _check_workers, _private


# --- opening ----------------------------------------------------------------------------------------
class PoolOptions(TypedDict, total=False):
    """``open_caller``'s keyword arguments but ``workers``, for the async and the blocking
    factory alike. ``capacity`` (default 64) and ``slot_bytes`` (default 64 KiB): the request
    ring and each worker's reply ring. ``max_request_bytes``/``max_reply_bytes`` (default None:
    what a ring holds): size limits (``MessageTooLarge``). ``directory``: where the rings live
    (default ``/dev/shm``)."""

    capacity: int
    slot_bytes: int
    max_request_bytes: int | None
    max_reply_bytes: int | None
    directory: str


class _PoolSpec:
    """``open_caller``'s arguments, checked, with their defaults; shared by the async and
    blocking factories."""

    def __init__(
        self,
        workers: Iterable[str],
        *,
        capacity: int = 64,
        slot_bytes: int = 1 << 16,
        max_request_bytes: int | None = None,
        max_reply_bytes: int | None = None,
        directory: str = DEFAULT_DIRECTORY,
        **unknown: object,
    ) -> None:
        if unknown:  # what Python says of a factory that spells its keywords out
            raise TypeError(f"open_caller() got an unexpected keyword argument {next(iter(unknown))!r}")
        self.workers = _check_workers(workers)
        self.capacity = capacity
        self.slot_bytes = slot_bytes
        self.max_request_bytes = max_request_bytes
        self.max_reply_bytes = max_reply_bytes
        self.directory = directory

    def writer_options(self) -> dict[str, Any]:
        """The request channel: one reader place per worker."""
        return {
            "capacity": self.capacity,
            "slot_bytes": self.slot_bytes,
            "max_readers": len(self.workers),
            "max_message_bytes": self.max_request_bytes,
            "directory": self.directory,
        }

    def collector_options(self) -> dict[str, Any]:
        """The reply collector: it waits for the pool's workers."""
        return {
            "expect": self.workers,
            "capacity": self.capacity,
            "slot_bytes": self.slot_bytes,
            "max_message_bytes": self.max_reply_bytes,
            "directory": self.directory,
        }


# --- the steps of opening, as events: each driver matches them (``_open_async``, ``_open_blocking``) ---
# (Frozen dataclasses alike in shape, as _tcp's events are: each is its own type, for match.)
@dataclass(frozen=True, slots=True)
class OpenWriter:
    """Open the request channel's writer with ``options`` (``open_writer``'s)."""

    options: dict[str, Any]


@dataclass(frozen=True, slots=True)
class OpenCollector:
    """Open the reply collector with ``options`` (``open_collector``'s)."""

    options: dict[str, Any]


@dataclass(frozen=True, slots=True)
class OpenSender:
    """Open a worker's reply sender to the collector of ``handle``, under ``name``."""

    handle: CollectorHandle
    name: str


@dataclass(frozen=True, slots=True)
class OpenReader:
    """Open a worker's reader of the request channel of ``handle``, under ``name``, on this
    host's shared memory (a pool's workers share its host)."""

    handle: Handle
    name: str


@dataclass(frozen=True, slots=True)
class Put:
    """Put ``item`` with ``sender``."""

    sender: Any
    item: object


@dataclass(frozen=True, slots=True)
class Close:
    """Close ``role`` (a step that failed after it opened)."""

    role: Any


OpenEvent = OpenWriter | OpenCollector | OpenSender | OpenReader | Put | Close


def caller_steps(spec: _PoolSpec) -> Generator[OpenEvent, Any, tuple[Any, Any]]:
    """Opening a caller, written once: the request channel, then the reply collector; on a
    failure (or a cancellation) the channel is closed again. Returns (writer, collector)."""
    writer = yield OpenWriter(spec.writer_options())
    try:
        collector = yield OpenCollector(spec.collector_options())
    except BaseException:
        yield Close(writer)
        raise
    return writer, collector


def worker_steps(handle: object, name: str) -> Generator[OpenEvent, Any, tuple[Any, Any]]:
    """Opening a worker, written once: claim the name (the reply sender), attach to the
    requests, say hello (calls from now on reach us); on a failure, close what was opened.
    Returns (reader, sender)."""
    h = _worker_start(handle, name)
    sender = yield OpenSender(h.replies, name)
    try:
        reader = yield OpenReader(h.requests, name)
        try:
            yield Put(sender, (_HELLO, True, os.getpid()))
        except BaseException:
            yield Close(reader)
            raise
    except BaseException:
        yield Close(sender)
        raise
    return reader, sender


async def _open_async(event: OpenEvent) -> object:
    """An opening step in a task (``_base.steps.drive``), with the async factories."""
    match event:
        case OpenWriter(options):
            return await open_writer(**options)
        case OpenCollector(options):
            return await open_collector(**options)
        case OpenSender(handle, name):
            return await open_sender(handle, name=name)
        case OpenReader(handle, name):
            return await open_reader(handle, name=name, transport="shm")
        case Put(sender, item):
            return await sender.put(item)
        case Close(role):
            return await role.aclose()


def _open_blocking(event: OpenEvent) -> object:
    """An opening step in this thread (``_base.steps.drive_blocking``), with the blocking factories."""
    match event:
        case OpenWriter(options):
            return blocking_roles.open_writer(**options)
        case OpenCollector(options):
            return fanin_blocking.open_collector(**options)
        case OpenSender(handle, name):
            return fanin_blocking.open_sender(handle, name=name)
        case OpenReader(handle, name):
            return blocking_roles.open_reader(handle, name=name, transport="shm")
        case Put(sender, item):
            return sender.put(item)
        case Close(role):
            return role.close()


def open_caller(*, workers: Iterable[str], **options: Unpack[PoolOptions]) -> _Opening[Caller[Any, Any]]:
    """Create a pool of the named ``workers`` (unique names, as a fan-in's senders) and return its
    caller. Start the workers with ``caller.handle``; ``call`` waits (within its timeout) for
    those not attached yet. ``capacity``/``slot_bytes``: the request ring and each worker's reply
    ring. ``max_request_bytes``/``max_reply_bytes``: size limits (``MessageTooLarge``). The
    options and their defaults: ``PoolOptions``."""
    spec = _PoolSpec(workers, **options)

    async def make() -> Caller[Any, Any]:
        writer, collector = await drive(caller_steps(spec), _open_async)
        return Caller(_private, writer, collector, spec.workers)

    return _Opening(make)


def _worker_start(handle: object, name: str) -> PoolHandle:
    h = PoolHandle.parse(handle)  # type: ignore[arg-type]
    if name not in h.workers:
        raise InvalidArgument(f"{name!r} is not one of this pool's workers {list(h.workers)}")
    return h


def open_worker(handle: PoolHandle | str, *, name: str) -> _Opening[Worker[Any, Any]]:
    """Join the pool of ``handle`` (``caller.handle`` or its JSON) as worker ``name`` (one of the
    names the caller gave). Raises ``InvalidHandle`` (not a pool's handle), ``InvalidArgument``
    (a name not in the pool, or held by a live worker), ``CollectorGone`` (the caller closed)."""

    async def make() -> Worker[Any, Any]:
        reader, sender = await drive(worker_steps(handle, name), _open_async)
        return Worker(_private, reader, sender, name)

    return _Opening(make)


def open_blocking_caller(*, workers: Iterable[str], **options: Unpack[PoolOptions]) -> BlockingCaller[Any, Any]:
    """``aiobroadcast.blocking.open_caller``: the arguments and errors of ``open_caller``."""
    spec = _PoolSpec(workers, **options)
    writer, collector = drive_blocking(caller_steps(spec), _open_blocking)
    return BlockingCaller(_private, writer, collector, spec.workers)


def open_blocking_worker(handle: PoolHandle | str, *, name: str) -> BlockingWorker[Any, Any]:
    """``aiobroadcast.blocking.open_worker``: the arguments and errors of ``open_worker``."""
    reader, sender = drive_blocking(worker_steps(handle, name), _open_blocking)
    return BlockingWorker(_private, reader, sender, name)


for _fn, _name in ((open_blocking_caller, "open_caller"), (open_blocking_worker, "open_worker")):
    _fn.__module__ = "aiobroadcast.blocking"
    _fn.__name__ = _fn.__qualname__ = _name
