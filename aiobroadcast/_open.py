"""The factories: the only way to get a ``Writer`` or a ``Reader``."""

from __future__ import annotations

import os
import secrets
from collections.abc import Generator
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar, overload

from pydantic import BaseModel

from . import _ring
from ._codec import PickleEncoder, SchemaCodec, decode_pickle, import_schema, schema_path
from ._exceptions import InvalidHandle
from ._handle import Handle, Policy
from ._reader import Reader
from ._reader import _private as _reader_token
from ._shm_reader import ShmSource
from ._writer import Writer
from ._writer import _private as _writer_token

M = TypeVar("M", bound=BaseModel)


class _Closable(Protocol):
    async def aclose(self) -> None: ...


R = TypeVar("R", bound=_Closable)

DEFAULT_DIRECTORY = "/dev/shm"


class _Opening(Generic[R]):
    """Returned by ``open_writer``/``open_reader``: use ``async with`` (closes at the end) or
    ``await`` (then call ``aclose()`` yourself)."""

    def __init__(self, make: Any) -> None:
        self._make = make
        self._obj: R | None = None

    def __await__(self) -> Generator[Any, None, R]:
        async def _open() -> R:
            obj: R = self._make()
            return obj

        return _open().__await__()

    async def __aenter__(self) -> R:
        self._obj = self._make()
        return self._obj

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._obj is not None
        await self._obj.aclose()


@overload
def open_writer(
    *,
    capacity: int = ...,
    slot_bytes: int = ...,
    max_readers: int = ...,
    policy: Policy = ...,
    schema: None = ...,
    max_message_bytes: int | None = ...,
    directory: str = ...,
) -> _Opening[Writer[Any]]: ...
@overload
def open_writer(
    *,
    capacity: int = ...,
    slot_bytes: int = ...,
    max_readers: int = ...,
    policy: Policy = ...,
    schema: type[M],
    max_message_bytes: int | None = ...,
    directory: str = ...,
) -> _Opening[Writer[M]]: ...
def open_writer(
    *,
    capacity: int = 64,
    slot_bytes: int = 1 << 16,
    max_readers: int = 16,
    policy: Policy = "block",
    schema: type[BaseModel] | None = None,
    max_message_bytes: int | None = None,
    directory: str = DEFAULT_DIRECTORY,
) -> _Opening[Writer[Any]]:
    """Create a channel in shared memory and return its writer.

    - ``capacity``: slots in the ring; ``slot_bytes``: bytes per slot (rounded up to 64; a
      message larger than a slot takes several, of any size). The ring takes
      ``capacity * slot_bytes`` of ``directory`` (``/dev/shm``), reserved now.
    - ``max_readers``: readers that may be attached at once.
    - ``policy``: ``"block"`` (``put`` waits for the slowest live reader) or ``"lag"`` (never
      waits; a reader more than ``capacity`` behind gets ``ReaderLagged``).
    - ``schema``: a pydantic model; ``put`` validates and sends JSON, readers get the model.
    - ``max_message_bytes``: encoded messages above this raise ``MessageTooLarge``.

    Raises ``ValueError`` for bad arguments, ``InsufficientSharedMemory`` when the ring does not
    fit, ``BroadcastError`` on a platform the ring does not support.
    """
    if capacity < 2:
        raise ValueError("capacity must be at least 2")
    if max_readers < 1:
        raise ValueError("max_readers must be at least 1")
    if slot_bytes < 64:
        raise ValueError("slot_bytes must be at least 64")
    if policy not in _ring.POLICIES:
        raise ValueError(f"policy must be one of {_ring.POLICIES}, not {policy!r}")
    slot_bytes = (slot_bytes + 63) // 64 * 64

    def make() -> Writer[Any]:
        _ring.sweep_stale(directory)
        token = secrets.token_hex(16)
        encoder: PickleEncoder | SchemaCodec
        if schema is None:
            encoder, codec = PickleEncoder(), "pickle"
        else:
            encoder, codec = SchemaCodec(schema), "pydantic-json"
        seg = _ring.create_segment(
            directory,
            token,
            capacity,
            slot_bytes,
            max_readers,
            _ring.POLICIES.index(policy),
            _ring.CODECS.index(codec),
        )
        try:
            handle = Handle(
                directory=directory,
                name=f"aiobroadcast-{token}",
                capacity=capacity,
                slot_bytes=slot_bytes,
                max_readers=max_readers,
                policy=policy,
                codec=codec,  # type: ignore[arg-type]
                schema_path=schema_path(schema) if schema is not None else None,
                writer_pid=os.getpid(),
            )
            return Writer(_writer_token, seg, handle, encoder, max_message_bytes)
        except BaseException:
            seg.close()
            _ring._unlink_quiet(seg.path)
            raise

    return _Opening(make)


@overload
def open_reader(handle: Handle | str, *, name: str | None = ..., schema: None = ...) -> _Opening[Reader[Any]]: ...
@overload
def open_reader(handle: Handle | str, *, name: str | None = ..., schema: type[M]) -> _Opening[Reader[M]]: ...
def open_reader(
    handle: Handle | str, *, name: str | None = None, schema: type[BaseModel] | None = None
) -> _Opening[Reader[Any]]:
    """Attach to a channel from any process on the host and return a reader.

    The reader starts with the next message published. ``handle`` is a ``Handle`` or its JSON;
    ``name`` identifies the reader in statistics and logs (default ``reader-<pid>``); ``schema``
    is the pydantic model of a schema channel (default: imported from the handle).

    Raises ``InvalidHandle`` (does not parse, segment gone, other layout, writer gone),
    ``TooManyReaders``.
    """
    h = Handle.parse(handle)

    def make() -> Reader[Any]:
        decode: Any
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

            def decode(body: Any, oob: bool) -> Any:
                return codec.decode(body)
        elif model is not None:
            checked = model

            def decode(body: Any, oob: bool) -> Any:
                return checked.model_validate(decode_pickle(body, oob))
        else:
            decode = decode_pickle
        seg = _ring.attach_segment(h.path, h.token, h.capacity, h.slot_bytes, h.max_readers)
        reader_name = name or f"reader-{os.getpid()}"
        try:
            source = ShmSource(seg, h, reader_name, decode)
        except BaseException:
            seg.close()
            raise
        return Reader(_reader_token, source, h, reader_name)

    return _Opening(make)
