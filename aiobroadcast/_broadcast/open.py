"""The factories: the only way to get a ``Writer`` or a ``Reader`` (what opening one checks and
does: writer_open.py, reader_open.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from types import TracebackType
from typing import Any, Generic, Literal, Protocol, TypeVar, Unpack, overload

from pydantic import BaseModel

from .._base.handle import CurveKeys, Handle, Policy
from .reader import Reader
from .reader import _private as _reader_token
from .reader_open import ReaderOptions, Transport, _open_source, _ReaderSpec, source_steps
from .writer import Writer
from .writer import _private as _writer_token
from .writer_open import DEFAULT_DIRECTORY, WriterOptions, _open_channel, _WriterSpec

__all__ = ["DEFAULT_DIRECTORY", "Transport", "open_reader", "open_writer"]

M = TypeVar("M", bound=BaseModel)


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


# The overloads take the options as one typed set (``WriterOptions``, as the blocking factory
# does); the implementation writes them out, so that its signature (``help``, ``inspect``) shows
# each one with its default.
@overload
def open_writer(*, schema: None = ..., **options: Unpack[WriterOptions]) -> _Opening[Writer[Any]]: ...
@overload
def open_writer(*, schema: type[M], **options: Unpack[WriterOptions]) -> _Opening[Writer[M]]: ...
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
    # Every keyword is a field of _WriterSpec, named alike (tests/test_blocking.py holds them to
    # one set, defaults included): passed on as they came, before any other name is bound here.
    spec = _WriterSpec(**locals())

    async def make() -> Writer[Any]:
        return Writer(_writer_token, await _open_channel(spec))

    return _Opening(make)


@overload
def open_reader(
    handle: Handle | str, *, schema: None = ..., **options: Unpack[ReaderOptions]
) -> _Opening[Reader[Any]]: ...
@overload
def open_reader(handle: Handle | str, *, schema: type[M], **options: Unpack[ReaderOptions]) -> _Opening[Reader[M]]: ...
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
    options = dict(locals())  # as in open_writer: every keyword is a field of _ReaderSpec, named alike
    h = Handle.parse(options.pop("handle"))
    spec = _ReaderSpec(**options)

    async def make() -> Reader[Any]:
        source, reader_name = await _open_source(spec.steps(h), connect_timeout)
        return Reader(_reader_token, source, h, reader_name, spin_us)

    return _Opening(make)


def _raw(body: Any, oob: bool) -> tuple[bytes, bool]:
    return bytes(body), oob


def _open_raw_reader(h: Handle, *, name: str | None, transport: Transport) -> _Opening[Reader[tuple[bytes, bool]]]:
    """A reader that hands out message bodies undecoded, as ``(body, out_of_band)``: relays
    republish them without ever unpickling."""

    async def make() -> Reader[tuple[bytes, bool]]:
        source, reader_name = await _open_source(source_steps(h, name, _raw, transport), 10.0)
        return Reader(_reader_token, source, h, reader_name)

    return _Opening(make)
