"""The factories: the only way to get a ``Writer`` or a ``Reader``."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Generator, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypedDict, TypeVar, overload

import anyio
import anyio.to_thread
from pydantic import BaseModel

from .._base.codec import (
    JsonCodec,
    PickleEncoder,
    SchemaCodec,
    decode_json,
    decode_pickle,
    decode_pickle_view,
    import_schema,
    schema_path,
)
from .._base.constants import REKEY_BYTES, REKEY_BYTES_MAX, REKEY_MESSAGES, REKEY_MESSAGES_MAX
from .._base.errors import BroadcastError, InvalidArgument, InvalidHandle
from .._base.files import unlink_quietly
from .._base.handle import AllowList, CurveKeys, Handle, Policy, check_directory, check_endpoint, require
from .._base.steps import drive
from .._shm import layout as _layout
from .._shm import segment as _segment
from .._shm.arena import arena_path
from .._shm.layout import name_key
from .._shm.place import NameTaken
from .._shm.subscriber import ShmSource
from .._tcp.settings import ServerSettings
from .._tcp.supervisor import SERVER_START_S, ServerProcess, read_answer
from .channel import WriterChannel
from .reader import Reader, Source
from .reader import _private as _reader_token
from .writer import Writer
from .writer import _private as _writer_token

if TYPE_CHECKING:
    from .._tcp.client import TcpSource

M = TypeVar("M", bound=BaseModel)

log = logging.getLogger("aiobroadcast")

DEFAULT_DIRECTORY = "/dev/shm"
Transport = Literal["auto", "shm", "tcp"]

#: ``open_writer(channel=...)``: a name that stays the channel's across writer restarts
_CHANNEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class _Closable(Protocol):
    async def aclose(self) -> None: ...


R = TypeVar("R", bound=_Closable)


class _Opening(Generic[R]):
    """Returned by ``open_writer``/``open_reader``: use ``async with`` (closes at the end) or
    ``await`` (then call ``aclose()`` yourself)."""

    def __init__(self, make: Callable[[], Awaitable[R]]) -> None:
        self._make = make
        self._obj: R | None = None

    def __await__(self) -> Generator[Any, None, R]:
        return self._make().__await__()

    async def __aenter__(self) -> R:
        self._obj = await self._make()
        return self._obj

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._obj is not None
        await self._obj.aclose()


@dataclass(frozen=True, kw_only=True)
class _WriterSpec:
    """``open_writer``'s arguments, checked, and the channel's creation: shared by the async and
    the blocking factories (``aiobroadcast.blocking``). The defaults are written here only:
    ``open_writer``'s signature reads them from this class."""

    capacity: int = 64
    slot_bytes: int = 1 << 16
    max_readers: int = 16
    policy: Policy = "block"
    schema: type[BaseModel] | None = None
    codec: Literal["pickle", "json"] = "pickle"
    max_message_bytes: int | None = None
    directory: str = DEFAULT_DIRECTORY
    tcp: str | None = None
    insecure: bool = False
    advertise: str | None = None
    keys: CurveKeys | None = None
    heartbeat_s: float = 0.5
    tcp_window: int = 256
    rekey_messages: int = REKEY_MESSAGES
    rekey_bytes: int = REKEY_BYTES
    data_port: int = 0
    allow_list: str | None = None
    channel: str | None = None
    #: a fan-in remote sender's ring: its TCP server serves one reader, the collector
    #: (``ServerConfig.sole_reader``); set by ``open_sender(tcp=...)``, not an ``open_writer`` option
    sole_reader: bool = field(default=False, metadata={"internal": True})
    arena_bytes: int = 0

    def __post_init__(self) -> None:
        if self.capacity < 2:
            raise InvalidArgument("capacity must be at least 2")
        if self.max_readers < 1:
            raise InvalidArgument("max_readers must be at least 1")
        if self.slot_bytes < 64:
            raise InvalidArgument("slot_bytes must be at least 64")
        if self.policy not in _layout.POLICIES:
            raise InvalidArgument(f"policy must be one of {_layout.POLICIES}, not {self.policy!r}")
        if self.codec not in ("pickle", "json"):
            raise InvalidArgument(f"codec must be 'pickle' or 'json', not {self.codec!r}")
        if self.tcp is not None:
            require(check_endpoint(self.tcp, bind=True))
        for name, value, most in (
            ("rekey_messages", self.rekey_messages, REKEY_MESSAGES_MAX),
            ("rekey_bytes", self.rekey_bytes, REKEY_BYTES_MAX),
        ):
            if type(value) is not int or not 1 <= value <= most:
                raise InvalidArgument(f"{name} must be an integer from 1 to {most}, not {value!r}")
        if type(self.data_port) is not int or not 0 <= self.data_port <= 65535:
            raise InvalidArgument(f"data_port must be a port number (0: any free port), not {self.data_port!r}")
        if self.allow_list is not None:
            if self.tcp is None or self.insecure:
                raise InvalidArgument("allow_list needs tcp= and CurveZMQ, not insecure=True")
            AllowList.load(self.allow_list)  # readable, and a list: said here rather than by the server
            object.__setattr__(self, "allow_list", os.path.abspath(os.fspath(self.allow_list)))
        if type(self.arena_bytes) is not int or self.arena_bytes < 0:
            raise InvalidArgument(f"arena_bytes must be 0 (no arena) or a size in bytes, not {self.arena_bytes!r}")
        if self.arena_bytes and (self.policy != "block" or self.codec != "pickle" or self.schema is not None):
            raise InvalidArgument('an arena (arena_bytes) needs policy "block" and the pickle codec without schema')
        if self.channel is not None and (type(self.channel) is not str or not _CHANNEL_RE.fullmatch(self.channel)):
            raise InvalidArgument(
                "channel must be a name of 1 to 128 letters, digits, '.', '_' or '-' (not starting with "
                f"'.', '_' or '-'), not {self.channel!r}"
            )
        require(check_directory(self.directory, self.ring_readers))
        object.__setattr__(self, "slot_bytes", (self.slot_bytes + 63) // 64 * 64)

    @property
    def ring_readers(self) -> int:
        return self.max_readers + (1 if self.tcp else 0)  # a place for the TCP server

    def fixed_token(self) -> str | None:
        """The channel id (the handle's token, which names the segment) when it is to be the same
        at every run of this writer, so that the handles of earlier runs open readers on this
        one: with a ``channel`` name, or serving TCP on a fixed port with fixed keys (the handle
        carries the keys and the endpoint, and they would work again). Derived from what names
        the channel: the directory, the name, the endpoint and the public keys (another name,
        endpoint or key pair is another channel, whose handles are refused). None: a random id,
        as for a channel that can never be reached again once its writer is gone (fresh keys, a
        free port), and for a fan-in sender's ring (its collector may still drain the last one)."""
        if self.sole_reader:
            return None
        keys = self.keys if self.tcp is not None and not self.insecure else None
        keyed = keys is not None and self.tcp is not None and not self.tcp.endswith(":0")
        if self.channel is None and not keyed:
            return None
        parts = {
            "directory": os.path.normpath(self.directory),
            "channel": self.channel,
            "tcp": self.tcp,
            "advertise": self.advertise,
            "server_public": keys.server_public if keys else None,
            "client_public": keys.client_public if keys else None,
        }
        text = json.dumps(parts, sort_keys=True).encode()
        return hashlib.sha256(b"aiobroadcast channel id\0" + text).hexdigest()[:32]

    def create(self) -> WriterChannel:
        """Create the segment and the channel's writing side (without the TCP server). A fixed
        channel id takes its segment's path over from a dead earlier run (``take_over_dead``)."""
        _segment.sweep_stale(self.directory)
        token = self.fixed_token()
        if token is None:
            token = secrets.token_hex(16)
        else:
            _segment.take_over_dead(self.directory, token)
        encoder: PickleEncoder | SchemaCodec | JsonCodec
        if self.schema is not None:
            encoder, channel_codec = SchemaCodec(self.schema), "pydantic-json"
        elif self.codec == "json":
            encoder, channel_codec = JsonCodec(), "json"
        else:
            encoder, channel_codec = PickleEncoder(arena=self.arena_bytes > 0), "pickle"
        seg = _segment.create_segment(
            self.directory,
            token,
            self.capacity,
            self.slot_bytes,
            self.ring_readers,
            _layout.POLICIES.index(self.policy),
            _layout.CODECS.index(channel_codec),
        )
        try:
            handle = Handle(
                directory=self.directory,
                name=f"aiobroadcast-{token}",
                capacity=self.capacity,
                slot_bytes=self.slot_bytes,
                max_readers=self.ring_readers,
                policy=self.policy,
                codec=channel_codec,  # type: ignore[arg-type]
                schema_path=schema_path(self.schema) if self.schema is not None else None,
                writer_pid=os.getpid(),
                arena_bytes=(self.arena_bytes + 63) // 64 * 64,
            )
            return WriterChannel(seg, handle, encoder, self.max_message_bytes, handle.arena_bytes)
        except BaseException:
            seg.close()
            unlink_quietly(seg.path)
            unlink_quietly(arena_path(seg.path))
            raise


@overload
def open_writer(
    *,
    capacity: int = ...,
    slot_bytes: int = ...,
    max_readers: int = ...,
    policy: Policy = ...,
    schema: None = ...,
    codec: Literal["pickle", "json"] = ...,
    max_message_bytes: int | None = ...,
    directory: str = ...,
    tcp: str | None = ...,
    insecure: bool = ...,
    advertise: str | None = ...,
    keys: CurveKeys | None = ...,
    heartbeat_s: float = ...,
    tcp_window: int = ...,
    rekey_messages: int = ...,
    rekey_bytes: int = ...,
    data_port: int = ...,
    allow_list: str | None = ...,
    arena_bytes: int = ...,
    channel: str | None = ...,
) -> _Opening[Writer[Any]]: ...
@overload
def open_writer(
    *,
    capacity: int = ...,
    slot_bytes: int = ...,
    max_readers: int = ...,
    policy: Policy = ...,
    schema: type[M],
    codec: Literal["pickle", "json"] = ...,
    max_message_bytes: int | None = ...,
    directory: str = ...,
    tcp: str | None = ...,
    insecure: bool = ...,
    advertise: str | None = ...,
    keys: CurveKeys | None = ...,
    heartbeat_s: float = ...,
    tcp_window: int = ...,
    rekey_messages: int = ...,
    rekey_bytes: int = ...,
    data_port: int = ...,
    allow_list: str | None = ...,
    arena_bytes: int = ...,
    channel: str | None = ...,
) -> _Opening[Writer[M]]: ...
def open_writer(
    *,
    capacity: int = _WriterSpec.capacity,
    slot_bytes: int = _WriterSpec.slot_bytes,
    max_readers: int = _WriterSpec.max_readers,
    policy: Policy = _WriterSpec.policy,
    schema: type[BaseModel] | None = None,
    codec: Literal["pickle", "json"] = _WriterSpec.codec,
    max_message_bytes: int | None = _WriterSpec.max_message_bytes,
    directory: str = _WriterSpec.directory,
    tcp: str | None = _WriterSpec.tcp,
    insecure: bool = _WriterSpec.insecure,
    advertise: str | None = _WriterSpec.advertise,
    keys: CurveKeys | None = _WriterSpec.keys,
    heartbeat_s: float = _WriterSpec.heartbeat_s,
    tcp_window: int = _WriterSpec.tcp_window,
    rekey_messages: int = _WriterSpec.rekey_messages,
    rekey_bytes: int = _WriterSpec.rekey_bytes,
    data_port: int = _WriterSpec.data_port,
    allow_list: str | None = _WriterSpec.allow_list,
    arena_bytes: int = _WriterSpec.arena_bytes,
    channel: str | None = _WriterSpec.channel,
) -> _Opening[Writer[Any]]:
    """Create a channel in shared memory and return its writer.

    - ``capacity``: slots in the ring; ``slot_bytes``: bytes per slot (rounded up to 64; a
      message larger than a slot takes several, of any size). The ring takes
      ``capacity * slot_bytes`` of ``directory`` (``/dev/shm``), reserved now.
    - ``max_readers``: local readers that may be attached at once (and, with ``tcp``, remote ones).
    - ``policy``: ``"block"`` (``put`` waits for the slowest live reader) or ``"lag"`` (never
      waits; a reader more than ``capacity`` behind gets ``ReaderLagged``).
    - ``schema``: a pydantic model; ``put`` validates and sends JSON, readers get the model.
      ``codec="json"`` sends plain JSON values without a schema. Neither ever runs pickle.
    - ``max_message_bytes``: encoded messages above this raise ``MessageTooLarge``.
    - ``tcp``: also serve remote readers on this ZeroMQ endpoint, e.g. ``"tcp://10.0.0.5:0"``
      (port 0: a free port, read back into the handle). Only that address is bound. The stream
      is encrypted and authenticated with CurveZMQ; ``insecure=True`` sends plain TCP (still
      HMAC-signed) for closed test networks, and logs a warning.
    - ``advertise``: the host name readers should connect to, when it differs from the bound
      address (e.g. ``tcp="tcp://0.0.0.0:5555", advertise="writer"`` in a container network).
    - ``keys``: fixed ``CurveKeys`` (default: fresh keys for this channel). With fixed keys and a
      fixed port in ``tcp``, the channel is the same at every run (see ``channel``): a writer
      opened again with the same keys and endpoint accepts the handles of its earlier runs.
    - ``heartbeat_s``: remote liveness; a silent remote reader is dropped after 6 heartbeats.
    - ``tcp_window``: messages a remote reader may have in flight (its credit).
    - ``rekey_messages``, ``rekey_bytes``: remote readers' data is sealed (AES-256-GCM) under a
      group key that the TCP server replaces after this many messages or bytes under one key
      (defaults 2**24 and 2**36; at most 2**32 and 2**48; docs/security.md). Readers get the
      next key before it is used.
    - ``data_port``: the port of the TCP server's second socket, which carries the sealed
      message bodies (on the host of ``tcp``); 0 (the default): a free port, chosen by the
      system. Give one when a firewall must let it through. The TCP server process started
      again after a crash binds it again.
    - ``allow_list``: the path of an allow list of remote readers (``AllowList``, made with
      ``aiobroadcast keygen --reader NAME``): the server then admits only readers that present
      a CurveZMQ key on it (each reader its own, in the handle ``keygen --reader`` writes for
      it), not the handle's shared client key. The server reads the file again at its
      heartbeats when it changed (and at once on ``SIGHUP``): a reader taken off it
      (``keygen --revoke NAME``) is dropped, refused from then on, and the group key changes
      so that nothing sealed after that opens with the keys it held (docs/security.md,
      "Revoking a reader"). Needs ``tcp`` and CurveZMQ (not ``insecure``).
    - ``arena_bytes``: make a tensor arena of this size beside the ring (policy ``"block"``,
      pickle codec): the large out-of-band buffers of a message (numpy arrays and torch CPU
      tensors of 256 KiB or more, and the large ``bytes`` beside them) are copied once into it,
      and a ``zero_copy`` reader's views of them stay valid for as long as they are referenced
      (docs/design.md, "The arena"). A full arena never blocks ``put``: the message is copied
      through the ring instead, and counted (``statistics().arena_fallbacks``). Reserved now.
    - ``channel``: a name (letters, digits, ``.``, ``_``, ``-``; up to 128) that makes the channel
      the same at every run of its writer: a writer opened again with the same name, directory
      (and, serving TCP, the same endpoint and keys) accepts the handles of its earlier runs, over
      shared memory and over TCP. Default: none (a channel of its own each time, unless fixed
      keys and a fixed port make it the same, as said for ``keys``). Two writers of one channel
      cannot be open at once: the second raises ``BroadcastError``; what a dead earlier run left
      is taken over. Readers attached to an earlier run end with ``WriterGone`` (or
      ``EndOfStream`` if it closed the channel) and open the handle again: a new run numbers its
      messages anew (docs/tcp.md, "Restarts").

    Raises ``InvalidArgument`` (a ``ValueError``) for bad arguments, ``InsufficientSharedMemory`` when the ring does not
    fit, ``BroadcastError`` when the endpoint cannot be bound or the platform is not supported.
    """
    spec = _WriterSpec(
        capacity=capacity,
        slot_bytes=slot_bytes,
        max_readers=max_readers,
        policy=policy,
        schema=schema,
        codec=codec,
        max_message_bytes=max_message_bytes,
        directory=directory,
        tcp=tcp,
        insecure=insecure,
        advertise=advertise,
        keys=keys,
        heartbeat_s=heartbeat_s,
        tcp_window=tcp_window,
        rekey_messages=rekey_messages,
        rekey_bytes=rekey_bytes,
        data_port=data_port,
        allow_list=allow_list,
        arena_bytes=arena_bytes,
        channel=channel,
    )

    async def make() -> Writer[Any]:
        return Writer(_writer_token, await _open_channel(spec))

    return _Opening(make)


#: Opening a channel (``channel_steps``): yields the TCP server's start, whose answer the front
#: end waits for (in a worker thread, or here) and sends in, or throws what stopped the wait.
ChannelSteps = Generator["_ServerStart", dict[str, Any], WriterChannel]


def channel_steps(spec: _WriterSpec) -> ChannelSteps:
    """Create the channel, and start its TCP server if ``spec`` asks for one: the logic of both
    factories, which differ only in how they wait for the server's answer. On failure (an error
    or a cancellation thrown in) nothing is left open: the server killed, the channel closed
    (it has no server yet, so closing it does not wait)."""
    channel = spec.create()
    try:
        if spec.tcp is not None:
            start = _ServerStart(channel, spec)
            try:
                answer = yield start
            except BaseException:
                start.kill()
                raise
            start.finish(answer)
    except BaseException:
        channel.close_blocking()
        raise
    return channel


async def _open_channel(spec: _WriterSpec) -> WriterChannel:
    """``channel_steps`` in a task (``_steps.drive``): the server's answer is waited for in a
    worker thread, which a cancellation abandons (the steps then kill the server)."""

    async def answer(start: _ServerStart) -> dict[str, Any]:
        return await anyio.to_thread.run_sync(start.answer, abandon_on_cancel=True)

    return await drive(channel_steps(spec), answer)


class WriterOptions(TypedDict, total=False):
    """``open_writer``'s keyword arguments but ``schema`` (the blocking factory takes them so)."""

    capacity: int
    slot_bytes: int
    max_readers: int
    policy: Policy
    codec: Literal["pickle", "json"]
    max_message_bytes: int | None
    directory: str
    tcp: str | None
    insecure: bool
    advertise: str | None
    keys: CurveKeys | None
    heartbeat_s: float
    tcp_window: int
    rekey_messages: int
    rekey_bytes: int
    data_port: int
    allow_list: str | None
    arena_bytes: int
    channel: str | None


class _ServerStart:
    """Starting the TCP server process for a writer: the parts before and after waiting for its
    answer (``answer``, within ``SERVER_START_S``), shared by the async and blocking factories."""

    def __init__(self, channel: WriterChannel, spec: _WriterSpec) -> None:
        assert spec.tcp is not None
        self._channel = channel
        self._spec = spec
        handle = channel.handle
        if spec.insecure:
            log.warning(
                "aiobroadcast: serving %s WITHOUT encryption (insecure=True); use only on a closed network", spec.tcp
            )
            self._keys = None
            self._hmac_key: str | None = secrets.token_hex(32)
        else:
            self._keys = spec.keys or CurveKeys.generate()
            self._hmac_key = None
        settings = ServerSettings.for_writer(spec, handle, spec.tcp, self._keys, self._hmac_key)
        self._server = ServerProcess(settings)
        self.proc = self._server.spawn()

    def answer(self) -> dict[str, Any]:
        """Wait (blocking) for the server's answer: its endpoint, or why it could not serve."""
        return read_answer(self.proc, SERVER_START_S)

    def kill(self) -> None:
        proc = self.proc
        proc.kill()
        proc.wait()
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        proc.stdout.close()

    def finish(self, answer: dict[str, Any]) -> None:
        """Give the writer the full handle and its server; ``BroadcastError`` (and the process
        killed) if the server could not serve."""
        spec = self._spec
        if "error" in answer:
            self.kill()
            raise BroadcastError(f"cannot serve {spec.tcp}: {answer['error']}")
        self._server.serve(self.proc, answer["endpoint"])
        k = self._keys
        full = self._channel.handle.model_copy(
            update={
                "tcp": _advertised(answer["endpoint"], spec.advertise),
                "insecure": spec.insecure,
                "server_key": k.server_public if k else None,
                "client_public_key": k.client_public if k else None,
                "client_secret_key": k.client_secret if k else None,
                "hmac_key": self._hmac_key,
            }
        )
        self._channel.serve_tcp(self._server, Handle.model_validate(full.model_dump()))


def _advertised(endpoint: str, host: str | None) -> str:
    if host is None:
        return endpoint
    port = endpoint.rsplit(":", 1)[1]
    return f"tcp://{host}:{port}"


@overload
def open_reader(
    handle: Handle | str,
    *,
    name: str | None = ...,
    schema: None = ...,
    transport: Transport = ...,
    trust_pickle: bool = ...,
    connect_timeout: float = ...,
    spin_us: float | None = ...,
    zero_copy: bool = ...,
    take_ahead: int | None = ...,
) -> _Opening[Reader[Any]]: ...
@overload
def open_reader(
    handle: Handle | str,
    *,
    name: str | None = ...,
    schema: type[M],
    transport: Transport = ...,
    trust_pickle: bool = ...,
    connect_timeout: float = ...,
    spin_us: float | None = ...,
    zero_copy: bool = ...,
    take_ahead: int | None = ...,
) -> _Opening[Reader[M]]: ...
def open_reader(
    handle: Handle | str,
    *,
    name: str | None = None,
    schema: type[BaseModel] | None = None,
    transport: Transport = "auto",
    trust_pickle: bool = True,
    connect_timeout: float = 10.0,
    spin_us: float | None = None,
    zero_copy: bool = False,
    take_ahead: int | None = None,
) -> _Opening[Reader[Any]]:
    """Attach to a channel and return a reader. It starts with the next message published.

    - ``handle``: a ``Handle`` or its JSON.
    - ``name``: identifies the reader in statistics and logs; unique per channel: no two live
      readers, local or remote, hold one name (``InvalidArgument`` names the holder; a dead
      reader's name is free at once). Default ``reader-<pid>-<n>``, ``n`` counting this process's
      unnamed readers from 1 (if a process with the same pid elsewhere holds that name, as in
      containers, the next ``n``).
    - ``schema``: the pydantic model of a schema channel (default: imported from the handle).
    - ``transport``: ``"shm"`` (same host), ``"tcp"`` (the writer's TCP endpoint), or
      ``"auto"``: shared memory when the writer's ring is reachable from here, else TCP.
    - ``trust_pickle=False`` refuses a channel that sends pickle (only JSON or schema codecs).
    - ``spin_us``: how long a waiting ``get`` polls for the next message before it sleeps.
      ``None`` (default): 50 us, and only while messages come densely (the previous wait was
      under 200 us), so an idle reader uses no CPU. ``0``: never poll. A larger value trades CPU
      for latency: with ``spin_us`` above the gap between messages the reader never sleeps (it
      keeps a core busy, passing through the event loop on every round). After a sleep of
      0.1 s or more (an idle stream) a reader sleeps again without polling.
    - ``zero_copy=True`` (pickle channels): large buffers are not copied out of the ring. A
      ``bytes`` of 64 KiB or more arrives as a read-only ``memoryview`` where the message itself
      or its lists, tuples and dicts hold it (as ``bytes``, as for any reader, where an object is
      built from it, such as a sliced numpy array's data, or it is a dict key or set member), and
      a contiguous numpy array of 256 KiB or more as a read-only array, both on the message's
      slot: the message is otherwise what a default reader decodes. **They are
      valid until the next ``get``/``get_nowait`` on this reader (by any task) or its
      ``aclose``**: the reader keeps the slot until then, and the writer may reuse it after. Copy
      what must live longer (``bytes(view)``). A message larger than a slot, and any message
      under policy ``"lag"``, is copied out once anyway (its views are then of that copy). No
      effect on JSON and schema channels, nor with ``schema=``. On a channel with an arena
      (``open_writer(arena_bytes=...)``) every view has a lifetime instead: the buffers the
      writer put in the arena (numpy arrays, torch CPU tensors and ``bytes`` of 256 KiB or more)
      are views of it, **valid for as long as they, or views of them, are referenced** (until
      this reader closes; torch tensors are writable, as vLLM's arena gives them), and whatever
      is not in it (a message that found the arena full) is copied.
    - ``take_ahead``: at most how many whole one-slot messages a shared-memory reader takes out
      of the ring in one ``get`` and hands out one per ``get`` after (docs/design.md, "Taking
      ahead"). ``None`` (default): 32. ``1``: one message per ``get``, so each message stays in
      the ring, counted in the reader's lag, until its own ``get``. A positive integer.

    Raises ``InvalidHandle`` (does not parse, segment gone, other layout, writer gone, pickle
    refused), ``InvalidArgument`` (the name is taken), ``TooManyReaders``, ``TransportError``
    (remote writer unreachable or silent for ``connect_timeout`` seconds; a handshake refused for
    wrong keys fails at once instead).
    """
    h = Handle.parse(handle)

    spec = _ReaderSpec(
        name=name,
        schema=schema,
        transport=transport,
        trust_pickle=trust_pickle,
        connect_timeout=connect_timeout,
        spin_us=spin_us,
        zero_copy=zero_copy,
        take_ahead=take_ahead,
    )

    async def make() -> Reader[Any]:
        decode = spec.decoder(h)
        source, reader_name = await _open_source(
            h,
            name,
            decode,
            transport,
            connect_timeout,
            hold=decode is decode_pickle_view,
            take_ahead=take_ahead,
        )
        return Reader(_reader_token, source, h, reader_name, spin_us)

    return _Opening(make)


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
    """Opening a reader's source (``_make_source``), written once for both front ends (driven by
    ``_steps.drive`` or ``drive_blocking``): yields a TCP source whose welcome the driver waits
    for. Returns the source and the name it holds, the next default name if one was taken."""
    names = _reader_names(name)
    reader_name = next(names)
    while True:
        try:
            source, welcome = _make_source(h, reader_name, decode, transport, hold=hold, take_ahead=take_ahead)
            if welcome is not None:
                yield welcome  # the wait closes it if it fails
            return source, reader_name
        except NameTaken:
            following = next(names, None)
            if following is None:
                raise
            reader_name = following


async def _open_source(
    h: Handle,
    name: str | None,
    decode: Callable[[Any, bool], Any],
    transport: Transport,
    connect_timeout: float,
    *,
    hold: bool = False,
    take_ahead: int | None = None,
) -> tuple[Source, str]:
    """The transport's side of a reader (``source_steps``), its TCP welcome awaited."""

    async def welcome(source: TcpSource) -> None:
        await source.wait_welcome(connect_timeout)

    return await drive(source_steps(h, name, decode, transport, hold=hold, take_ahead=take_ahead), welcome)


def _make_source(
    h: Handle,
    name: str,
    decode: Callable[[Any, bool], Any],
    transport: Transport,
    *,
    hold: bool = False,
    take_ahead: int | None = None,
) -> tuple[Source, TcpSource | None]:
    """The transport's side of a reader, built once for both front ends: the ring when asked
    for or reachable, else TCP. A TCP source comes back a second time: the caller waits for its
    welcome (``wait_welcome`` in a task, ``wait_welcome_blocking`` in a thread) before use."""
    if _over_tcp(h, transport):
        from .._tcp.client import TcpSource

        tcp_source = TcpSource(h, name, decode)
        return tcp_source, tcp_source
    return _shm_source(h, name, decode, hold, take_ahead=take_ahead), None


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


def _raw(body: Any, oob: bool) -> tuple[bytes, bool]:
    return bytes(body), oob


def _open_raw_reader(h: Handle, *, name: str | None, transport: Transport) -> _Opening[Reader[tuple[bytes, bool]]]:
    """A reader that hands out message bodies undecoded, as ``(body, out_of_band)``: relays
    republish them without ever unpickling."""

    async def make() -> Reader[tuple[bytes, bool]]:
        source, reader_name = await _open_source(h, name, _raw, transport, 10.0)
        return Reader(_reader_token, source, h, reader_name)

    return _Opening(make)
