"""Turning objects into message bodies and back.

A body is what travels in the ring. With the pickle codec, large buffers (numpy arrays and other
``PickleBuffer`` producers, ``OOB_MIN_BYTES`` and up) travel out of band after the pickle, so they
are copied once into shared memory and once out; the reader gets writable copies that never alias
the ring. Large ``bytes`` objects (the message itself, or an item of a top-level tuple, list or
dict) travel out of band too. The pickler writes into a sink that keeps pieces instead of joining
them, and hands over any ``bytes`` of 64 KiB or more as the object itself, so a large ``bytes``
anywhere in the message is copied once, into the ring, below the out-of-band size as well.
"""

from __future__ import annotations

import importlib
import json
import pickle
import struct
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from ._exceptions import SerializationError

#: Buffers from this size up travel out of band (one copy, straight into the ring). Below it the
#: out-of-band bookkeeping costs more than it saves (measured at 64 KiB: 15 us out of band against
#: 4 us in band with an extra copy, 2 us in band through the sink).
OOB_MIN_BYTES = 256 * 1024
_OOB_COUNT = struct.Struct("<Q")
_OOB_LEN = struct.Struct("<Q")
_BYTES_KIND = 1 << 63  # set in an out-of-band length: the buffer becomes a bytes object (copied)
_SHALLOW_MAX = 64  # containers larger than this are not scanned for large bytes

Buffer = bytes | bytearray | memoryview


class _LargeBytes:
    """Stands in for a large ``bytes`` while pickling, so it can travel out of band (pickle
    never offers exact ``bytes`` to a reducer). Unpickles as ``bytes``."""

    __slots__ = ("data", "encoder")

    def __init__(self, data: bytes, encoder: PickleEncoder) -> None:
        self.data = data
        self.encoder = encoder

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        pb = pickle.PickleBuffer(self.data)
        self.encoder._bytes_ids.add(id(pb))
        return (bytes, (pb,))


class _Sink:
    """The file a pickler writes to: it keeps the pieces it is given, without joining them.
    The C pickler hands a ``bytes`` payload of 64 KiB or more to ``write`` as the object itself,
    so such a payload reaches the ring with a single copy."""

    __slots__ = ("parts", "write")

    def __init__(self) -> None:
        self.parts: list[Any] = []
        self.write = self.parts.append


class PickleEncoder:
    """Encodes with pickle protocol 5; collects large buffers out of band."""

    def __init__(self) -> None:
        self._bufs: list[pickle.PickleBuffer] = []
        self._bytes_ids: set[int] = set()
        sink = _Sink()
        self._pieces = sink.parts
        self._pickler = pickle.Pickler(sink, protocol=5, buffer_callback=self._callback)

    def _lift(self, obj: Any) -> Any:
        """Replace large ``bytes`` at the top of ``obj`` by ``_LargeBytes`` (cheap for small
        messages: a type check, or a short loop over a small container)."""
        t = type(obj)
        if t is bytes:
            return _LargeBytes(obj, self) if len(obj) >= OOB_MIN_BYTES else obj
        if (t is tuple or t is list) and len(obj) <= _SHALLOW_MAX:
            for x in obj:
                if type(x) is bytes and len(x) >= OOB_MIN_BYTES:
                    return t(self._lift(y) if type(y) is bytes else y for y in obj)
            return obj
        if t is dict and len(obj) <= _SHALLOW_MAX:
            for x in obj.values():
                if type(x) is bytes and len(x) >= OOB_MIN_BYTES:
                    return {k: self._lift(v) if type(v) is bytes else v for k, v in obj.items()}
        return obj

    def _callback(self, pb: pickle.PickleBuffer) -> bool:
        if pb.raw().nbytes < OOB_MIN_BYTES:
            return True  # small: keep it in the pickle
        self._bufs.append(pb)
        return False

    def encode(self, obj: object) -> tuple[Sequence[Buffer], int, bool]:
        """Return the body as parts, its total length, and whether it has out-of-band parts."""
        self._bufs = []
        pickler = self._pickler
        pieces = self._pieces
        try:
            pickler.dump(self._lift(obj))
        except Exception as exc:
            pickler.clear_memo()
            pieces.clear()
            self._bytes_ids = set()
            raise SerializationError(f"cannot pickle {type(obj).__qualname__} object: {exc}") from exc
        pickler.clear_memo()
        if len(pieces) == 1 and not self._bufs:  # a small message: one frame
            body = pieces.pop()
            return (body,), len(body), False
        # A bytes piece may be the caller's own (immutable) payload, never copied; any other large
        # piece (a bytearray, an in-band PickleBuffer) is copied now, so the body is the object as
        # it is at encode time.
        data: list[Buffer] = [p if type(p) is bytes else bytes(memoryview(p).cast("B")) for p in pieces]
        pieces.clear()
        if not self._bufs:
            return data, sum(len(p) for p in data), False
        bufs, self._bufs = self._bufs, []
        ours, self._bytes_ids = self._bytes_ids, set()
        raws = [pb.raw() for pb in bufs]
        head = bytearray(_OOB_COUNT.pack(len(raws)))
        head += _OOB_LEN.pack(sum(len(p) for p in data))
        for pb, r in zip(bufs, raws, strict=True):
            head += _OOB_LEN.pack(r.nbytes | (_BYTES_KIND if id(pb) in ours else 0))
        parts: list[Buffer] = [bytes(head), *data, *raws]
        return parts, sum(memoryview(p).nbytes for p in parts), True


def decode_pickle(body: memoryview | bytes | bytearray, oob: bool) -> Any:
    """Decode a pickle body. ``body`` may be a view of the ring: nothing returned aliases it."""
    if not oob:
        return pickle.loads(body)
    mv = memoryview(body)
    (n,) = _OOB_COUNT.unpack_from(mv, 0)
    lens = struct.unpack_from(f"<{n + 1}Q", mv, 8)
    pos = 8 + 8 * (n + 1)
    data = mv[pos : pos + lens[0]]
    pos += lens[0]
    buffers: list[Buffer] = []
    for word in lens[1:]:
        ln = word & ~_BYTES_KIND
        if word & _BYTES_KIND:
            buffers.append(mv[pos : pos + ln])  # bytes(view) copies it: no alias of the ring
        else:
            buffers.append(bytearray(mv[pos : pos + ln]))  # a writable copy, never a view of the ring
        pos += ln
    return pickle.loads(data, buffers=buffers)


class SchemaCodec:
    """Validates with a pydantic model and encodes as JSON: no pickle on either side."""

    def __init__(self, schema: type[BaseModel]) -> None:
        self.schema = schema

    def encode(self, obj: object) -> tuple[Sequence[Buffer], int, bool]:
        # An instance is validated again: model_construct() or assignment may have made it invalid.
        data = dict(obj) if isinstance(obj, BaseModel) else obj
        model = self.schema.model_validate(data)  # raises pydantic.ValidationError
        data = model.model_dump_json().encode()
        return (data,), len(data), False

    def decode(self, body: memoryview | bytes | bytearray) -> Any:
        return self.schema.model_validate_json(bytes(body))


class JsonCodec:
    """Plain JSON values (dicts, lists, strings, numbers, booleans, None): never pickle."""

    def encode(self, obj: object) -> tuple[Sequence[Buffer], int, bool]:
        try:
            data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise SerializationError(f"cannot encode {type(obj).__qualname__} object as JSON: {exc}") from exc
        return (data,), len(data), False


def decode_json(body: memoryview | bytes | bytearray, oob: bool) -> Any:
    return json.loads(bytes(body))


def schema_path(schema: type[BaseModel]) -> str:
    return f"{schema.__module__}:{schema.__qualname__}"


def import_schema(path: str) -> type[BaseModel]:
    """Import the pydantic model named ``module:QualName``."""
    module_name, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, BaseModel)):
        raise TypeError(f"{path} is not a pydantic model")
    return obj
