"""The fan-in factories' options (``CollectorOptions``, ``SenderOptions``: the same for both
front ends), their defaults and checks (``CollectorSpec``, ``sender_plan``), the sweep of dead
collectors' rendezvous directories, and the async factories ``open_collector``/``open_sender``."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypedDict, TypeVar, Unpack, overload

from pydantic import BaseModel

from .._base import tuning as _tuning
from .._base.errors import (
    BroadcastError,
    InvalidArgument,
)
from .._base.handle import (
    CurveKeys,
    Policy,
    require,
)
from .._broadcast.open import _Opening
from .._broadcast.writer_open import DEFAULT_DIRECTORY, _open_channel, _WriterSpec
from .._shm import segment as _segment
from .collector import Collector
from .collector import _private as _collector_token
from .gather import Gather
from .handle import (
    DIR_RE,
    CollectorHandle,
    directory_problem,
)
from .remote import RemoteOptions
from .rendezvous import SenderArgs, SenderPlan
from .sender import Sender
from .sender import _private as _sender_token

M = TypeVar("M", bound=BaseModel)


class CollectorOptions(TypedDict, total=False):
    """``open_collector``'s keyword arguments but ``schema``, for both factories (their defaults:
    ``CollectorSpec``'s)."""

    expect: Iterable[str] | None
    codec: Literal["pickle", "json"]
    capacity: int
    slot_bytes: int
    policy: Policy
    max_message_bytes: int | None
    directory: str


class SenderOptions(TypedDict, total=False):
    """``open_sender``'s keyword arguments but ``name`` and ``schema``, for both factories (their
    defaults: ``sender_plan``'s)."""

    capacity: int | None
    slot_bytes: int | None
    connect_timeout: float
    tcp: str | None
    advertise: str | None
    keys: CurveKeys | None
    heartbeat_s: float
    data_port: int


def refuse_unknown(factory: str, options: Mapping[str, object], known: type) -> None:
    """What a signature would raise for a keyword it does not take (``**options`` takes any)."""
    unknown = sorted(set(options) - set(known.__annotations__))
    if unknown:
        raise TypeError(f"{factory}() got unexpected keyword arguments: {', '.join(unknown)}")


class CollectorSpec:
    """``open_collector``'s arguments, checked, with their defaults (written here only); shared
    by the async and blocking factories."""

    def __init__(
        self,
        *,
        expect: Iterable[str] | None = None,
        schema: type[BaseModel] | None = None,
        codec: Literal["pickle", "json"] = "pickle",
        capacity: int = 64,
        slot_bytes: int = 1 << 16,
        policy: Policy = "block",
        max_message_bytes: int | None = None,
        directory: str = DEFAULT_DIRECTORY,
    ) -> None:
        # The rings' own checks (capacity, slot_bytes, policy, codec), as open_writer makes them.
        ring = _WriterSpec(
            capacity=capacity,
            slot_bytes=slot_bytes,
            max_readers=1,
            policy=policy,
            schema=schema,
            codec=codec,
            max_message_bytes=max_message_bytes,
            directory=directory,
        )
        require(directory_problem(directory))
        if max_message_bytes is not None and max_message_bytes <= 0:
            raise InvalidArgument("max_message_bytes must be positive")
        self.expect = None if expect is None else tuple(expect)
        if isinstance(expect, str):
            raise InvalidArgument("expect must be a collection of sender names, not one string")
        self.schema = schema
        self.handle = CollectorHandle(
            directory=directory,
            name=f"aiobroadcast-fanin-{secrets.token_hex(16)}",
            capacity=ring.capacity,
            slot_bytes=ring.slot_bytes,
            policy=policy,
            codec="pydantic-json" if schema is not None else codec,
            schema_path=None if schema is None else _schema_path(schema),
            max_message_bytes=max_message_bytes,
            collector_pid=os.getpid(),
        )

    def create(self) -> Gather:
        sweep_stale_collectors(self.handle.directory)
        try:
            return Gather(self.handle, self.schema, self.expect)
        except OSError as exc:
            raise BroadcastError(
                f"cannot create the collector's directory in {self.handle.directory!r}: {exc}"
            ) from exc


_RENDEZVOUS_RE = re.compile(DIR_RE)


# The listing guard of _shm.segment.sweep_stale again (listdir, skip what is not ours): the
# two sweeps look for other files under other locks, and a helper for four lines would hide that.
def sweep_stale_collectors(directory: str) -> list[str]:
    """Remove the rendezvous directories of collectors that died (SIGKILL cannot clean up): those
    whose ``collector`` lock nobody holds, older than ``STALE_MIN_AGE_S``. Only this user's
    directories, never through a symbolic link. Returns what was removed."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not _RENDEZVOUS_RE.match(name):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            if time.time() - st.st_mtime < _tuning.STALE_MIN_AGE_S:
                continue
            fd = os.open(os.path.join(path, "collector"), os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if not _segment.try_lock(fd, 0):
                continue  # its collector lives
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def _schema_path(schema: type[BaseModel]) -> str:
    from .._base.codec import schema_path

    return schema_path(schema)


@overload
def open_collector(*, schema: None = ..., **options: Unpack[CollectorOptions]) -> _Opening[Collector[Any]]: ...
@overload
def open_collector(*, schema: type[M], **options: Unpack[CollectorOptions]) -> _Opening[Collector[M]]: ...
def open_collector(
    *, schema: type[BaseModel] | None = None, **options: Unpack[CollectorOptions]
) -> _Opening[Collector[Any]]:
    """Create a collector (the receiving end of a fan-in) and return it.

    - ``expect``: the names of the senders to wait for: iteration ends once each of them has
      been reported closed or gone (others may join too). Default None: iteration ends at
      ``aclose``.
    - ``schema``/``codec``/``max_message_bytes``: what every sender sends, as ``open_writer``
      (defaults None, ``"pickle"``, None).
    - ``capacity``/``slot_bytes``: each sender's ring (a sender may choose its own; defaults 64
      and 65536); memory per sender is bounded by it. ``policy``: ``"block"`` (the default:
      lossless, a sender waits) or ``"lag"``.
    - ``directory``: where the rendezvous and the rings live (default ``/dev/shm``).

    Raises ``InvalidArgument`` for bad arguments, ``BroadcastError`` if the directory cannot be made.
    """
    refuse_unknown("open_collector", options, CollectorOptions)
    spec = CollectorSpec(schema=schema, **options)

    async def make() -> Collector[Any]:
        return Collector(_collector_token, spec.create())

    return _Opening(make)


def sender_plan(
    handle: CollectorHandle | str, name: str, schema: type[BaseModel] | None, options: SenderOptions
) -> SenderPlan:
    """``open_sender``'s arguments, with their defaults (written here only), as a plan for either
    factory."""
    refuse_unknown("open_sender", options, SenderOptions)
    tcp = options.get("tcp")
    args = SenderArgs(
        handle, name, schema, options.get("capacity"), options.get("slot_bytes"), options.get("connect_timeout", 10.0)
    )
    if tcp is None:
        return SenderPlan(args, None)
    remote = RemoteOptions(
        tcp, options.get("advertise"), options.get("keys"), options.get("heartbeat_s", 0.5), options.get("data_port", 0)
    )
    return SenderPlan(args, remote)


@overload
def open_sender(
    handle: CollectorHandle | str, *, name: str, schema: None = ..., **options: Unpack[SenderOptions]
) -> _Opening[Sender[Any]]: ...
@overload
def open_sender(
    handle: CollectorHandle | str, *, name: str, schema: type[M], **options: Unpack[SenderOptions]
) -> _Opening[Sender[M]]: ...
def open_sender(
    handle: CollectorHandle | str, *, name: str, schema: type[BaseModel] | None = None, **options: Unpack[SenderOptions]
) -> _Opening[Sender[Any]]:
    """Attach a sender named ``name`` to the collector of ``handle`` (its ``CollectorHandle`` or
    JSON) and return it. Items put before the collector attaches wait in the ring (a full ring
    holds the sender back): nothing sent is lost.

    - ``name``: unique among the collector's live senders; the collector's items carry it.
    - ``schema``: the collector's pydantic model (default: imported from the handle).
    - ``capacity``/``slot_bytes``: this sender's ring (default None: the collector's).
    - ``connect_timeout``: how long to wait for the name to be freed when a sender of that
      name ended and the collector has not reported it yet (default 10 s).

    - ``tcp``: a **remote sender** (the collector on another host): serve this sender's ring on
      this ZeroMQ endpoint (e.g. ``"tcp://10.0.0.5:0"``), with the broadcast side's security, and
      hand ``sender.remote_handle`` to the collector, which reads it with
      ``collector.attach(remote_handle, name=...)``. Nothing put before it attaches is lost (a full
      ring holds the sender back); once it closes or dies, ``put`` raises ``CollectorGone``.
      ``advertise``, ``keys``, ``heartbeat_s``, ``data_port``: as ``open_writer``'s (defaults
      None, None, 0.5, 0). No rendezvous
      with the collector's directory: ``name`` is what the collector's ``attach`` is given.

    Raises ``InvalidHandle`` (a broadcast channel's handle, or not a handle), ``InvalidArgument``
    (a bad name, or a name a live sender holds), ``CollectorGone`` (the collector closed or died),
    ``TransportError`` (the name of an ended sender was not released within ``connect_timeout``).
    """
    plan = sender_plan(handle, name, schema, options)

    async def make() -> Sender[Any]:
        if plan.remote is None:
            ch, h = plan.local()
        else:
            spec, h = plan.remote
            ch = await _open_channel(spec)
        return Sender(_sender_token, ch, name, h)

    return _Opening(make)
