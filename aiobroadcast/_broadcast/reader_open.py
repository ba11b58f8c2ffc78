"""Opening a reader: ``open_reader``'s arguments checked (``_ReaderSpec``), the channel's decoder,
and the transport's side of the reader (``source_steps``: the ring's, or a TCP source whose
welcome is awaited), written once for the async and the blocking factories (``open.py``,
``blocking.py``)."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from pydantic import BaseModel

from .._base.codec import SchemaCodec, decode_json, decode_pickle, decode_pickle_view, import_schema
from .._base.errors import BroadcastError, InvalidArgument, InvalidHandle
from .._base.handle import Handle
from .._base.steps import drive
from .._shm import segment as _segment
from .._shm.arena import arena_path
from .._shm.layout import name_key
from .._shm.place import NameTaken
from .._shm.subscriber import ShmSource
from .reader import Source

if TYPE_CHECKING:
    from .._tcp.client import TcpSource


Transport = Literal["auto", "shm", "tcp"]


class ReaderOptions(TypedDict, total=False):
    """``open_reader``'s keyword arguments but ``schema`` (the blocking factory takes them so)."""

    name: str | None
    transport: Transport
    trust_pickle: bool
    connect_timeout: float
    spin_us: float | None
    zero_copy: bool
    take_ahead: int | None


@dataclass(frozen=True, kw_only=True)
class _ReaderSpec:
    """``open_reader``'s arguments (defaults as documented there), checked: shared by the async
    and the blocking factories."""

    name: str | None = None
    schema: type[BaseModel] | None = None
    transport: Transport = "auto"
    trust_pickle: bool = True
    connect_timeout: float = 10.0
    spin_us: float | None = None
    zero_copy: bool = False
    take_ahead: int | None = None

    def __post_init__(self) -> None:
        if self.transport not in ("auto", "shm", "tcp"):
            raise InvalidArgument(f"transport must be 'auto', 'shm' or 'tcp', not {self.transport!r}")
        if self.spin_us is not None and not 0 <= self.spin_us <= 1_000_000:
            raise InvalidArgument(f"spin_us must be None or between 0 and 1,000,000, not {self.spin_us!r}")
        t = self.take_ahead
        if t is not None and (type(t) is not int or t < 1):
            raise InvalidArgument(f"take_ahead must be None or a positive integer, not {t!r}")

    def decoder(self, h: Handle) -> Callable[[Any, bool], Any]:
        """The reader's decoder for the channel of ``h``."""
        if h.codec == "pickle" and not self.trust_pickle:
            raise InvalidHandle("this channel sends pickle, and trust_pickle=False refuses it")
        decode = _decoder(h, self.schema)
        if self.zero_copy and decode is decode_pickle:
            decode = decode_pickle_view
        return decode

    def steps(self, h: Handle) -> Generator[TcpSource, None, tuple[Source, str]]:
        """``source_steps`` for a reader of these arguments on the channel of ``h`` (its decoder
        chosen now: ``decoder``), for either factory to drive."""
        decode = self.decoder(h)
        hold = decode is decode_pickle_view
        return source_steps(h, self.name, decode, self.transport, hold=hold, take_ahead=self.take_ahead)


#: the numbers of this process's unnamed readers (``reader-<pid>-<n>``)
_unnamed = itertools.count(1)
#: names an unnamed reader tries before it gives up (each taken by a process with its pid elsewhere)
UNNAMED_TRIES = 64


def _reader_names(name: str | None) -> Iterator[str]:
    """The names to open a reader under, in turn while the one before is taken: ``name`` alone;
    without one, ``reader-<pid>-<n>`` for this process's next numbers. A default name is taken
    only by a process with our pid in another pid namespace (a container sharing the ring, or
    a remote reader): the next number is tried then."""
    if name is not None:
        yield name
        return
    pid = os.getpid()
    for _ in range(UNNAMED_TRIES):
        yield f"reader-{pid}-{next(_unnamed)}"


def source_steps(
    h: Handle,
    name: str | None,
    decode: Callable[[Any, bool], Any],
    transport: Transport,
    *,
    hold: bool = False,
    take_ahead: int | None = None,
) -> Generator[TcpSource, None, tuple[Source, str]]:
    """Opening a reader's source, written once for both front ends (driven by ``_base.steps.drive``
    or ``drive_blocking``): the ring when asked for or reachable, else a TCP source, which it
    yields: the driver waits for its welcome (``wait_welcome`` in a task, ``wait_welcome_blocking``
    in a thread) before use. Returns the source and the name it holds, the next default name if
    one was taken."""
    names = _reader_names(name)
    reader_name = next(names)
    while True:
        try:
            if _over_tcp(h, transport):
                from .._tcp.client import TcpSource

                tcp_source = TcpSource(h, reader_name, decode)
                yield tcp_source  # the wait closes it if it fails
                return tcp_source, reader_name
            return _shm_source(h, reader_name, decode, hold, take_ahead=take_ahead), reader_name
        except NameTaken:
            following = next(names, None)
            if following is None:
                raise
            reader_name = following


async def _open_source(
    steps: Generator[TcpSource, None, tuple[Source, str]], connect_timeout: float
) -> tuple[Source, str]:
    """The transport's side of a reader (``source_steps``), its TCP welcome awaited."""

    async def welcome(source: TcpSource) -> None:
        await source.wait_welcome(connect_timeout)

    return await drive(steps, welcome)


def _over_tcp(h: Handle, transport: Transport) -> bool:
    """Whether a reader goes over TCP: when asked to, or (``auto``) when the ring is not reachable."""
    if transport == "tcp" or (transport == "auto" and h.tcp is not None and not _ring_reachable(h)):
        if h.tcp is None:
            raise InvalidHandle("this channel has no TCP endpoint (open_writer(tcp=...) serves one)")
        return True
    return False


def _shm_source(
    h: Handle,
    name: str,
    decode: Callable[[Any, bool], Any],
    hold: bool,
    *,
    arena_views: bool = False,
    take_ahead: int | None = None,
) -> ShmSource:
    """``arena_views``: arena bodies as views with a lifetime even for a copying decoder (vLLM's
    readers: the arena's tensors are views, everything else copies). A zero-copy reader of a
    channel with an arena is such a reader: every view it gets has a lifetime."""
    if h.arena_bytes and decode is decode_pickle_view:
        decode, hold, arena_views = decode_pickle, False, True
    seg = _segment.attach_segment(h.path, h.token, h.capacity, h.slot_bytes, h.max_readers)
    try:
        source = ShmSource(seg, h, name, decode, hold=hold, take_ahead=take_ahead)
    except NameTaken as exc:
        seg.close()
        if exc.holder is not None or h.tcp is None:
            raise
        raise NameTaken(name, _remote_holder(h, name)) from None
    except BaseException:
        seg.close()
        raise
    if h.arena_bytes:
        try:
            source.attach_arena(arena_path(h.path), arena_views or hold)
        except BaseException:
            source.close()
            raise
    return source


def _remote_holder(h: Handle, name: str) -> str | None:
    """The remote reader that holds ``name``, as the writer's TCP server reports it (its report
    is written as it admits a reader, after it claimed the name: looked for a few times)."""
    from .._shm.place import HOLDER_LOOK_S, HOLDER_LOOKS
    from .._tcp.report import read_report, report_path

    key = name_key(name)
    for _ in range(HOLDER_LOOKS):
        report = read_report(report_path(h.path))
        for r in report.readers if report is not None else ():
            if name_key(r.name) == key:
                return f"remote reader pid {r.pid}" + (f" on {r.host}" if r.host else "") + ", over TCP"
        time.sleep(HOLDER_LOOK_S)
    return None


def _ring_reachable(h: Handle) -> bool:
    """The ring is reachable when its file exists here and carries the handle's token."""
    try:
        seg = _segment.attach_segment(h.path, h.token, h.capacity, h.slot_bytes, h.max_readers)
    except (InvalidHandle, BroadcastError):
        return False
    seg.close()
    return True


def _decoder(h: Handle, schema: type[BaseModel] | None) -> Callable[[Any, bool], Any]:
    model = schema
    if h.codec == "pydantic-json":
        if model is None:
            if h.schema_path is None:
                raise InvalidHandle("schema channel without schema_path: pass schema=")
            try:
                model = import_schema(h.schema_path)
            except (ImportError, AttributeError, TypeError, ValueError) as exc:
                raise InvalidHandle(
                    f"cannot import the channel's schema {h.schema_path!r} here: {exc}; pass schema="
                ) from exc
        codec = SchemaCodec(model)

        def decode_model(body: Any, oob: bool) -> Any:
            return codec.decode(body)

        return decode_model
    if h.codec == "json":
        return decode_json
    if model is not None:
        checked = model

        def decode_checked(body: Any, oob: bool) -> Any:
            return checked.model_validate(decode_pickle(body, oob))

        return decode_checked
    return decode_pickle
