"""Turning objects into message bodies and back.

A body is what travels in the ring. With the pickle codec, large buffers (numpy arrays and other
``PickleBuffer`` producers, 64 KiB and up) travel out of band after the pickle, so they are
copied once into shared memory and once out; the reader gets writable copies that never alias
the ring.
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

OOB_MIN_BYTES = 64 * 1024
_OOB_COUNT = struct.Struct("<Q")
_OOB_LEN = struct.Struct("<Q")

Buffer = bytes | bytearray | memoryview


class PickleEncoder:
    """Encodes with pickle protocol 5; collects large buffers out of band."""

    def __init__(self) -> None:
        self._bufs: list[pickle.PickleBuffer] = []

    def _callback(self, pb: pickle.PickleBuffer) -> bool:
        if pb.raw().nbytes < OOB_MIN_BYTES:
            return True  # small: keep it in the pickle
        self._bufs.append(pb)
        return False

    def encode(self, obj: object) -> tuple[Sequence[Buffer], int, bool]:
        """Return the body as parts, its total length, and whether it has out-of-band parts."""
        self._bufs = []
        try:
            data = pickle.dumps(obj, protocol=5, buffer_callback=self._callback)
        except Exception as exc:
            raise SerializationError(f"cannot pickle {type(obj).__qualname__} object: {exc}") from exc
        if not self._bufs:
            return (data,), len(data), False
        raws = [pb.raw() for pb in self._bufs]
        self._bufs = []
        head = bytearray(_OOB_COUNT.pack(len(raws)))
        head += _OOB_LEN.pack(len(data))
        for r in raws:
            head += _OOB_LEN.pack(r.nbytes)
        parts: list[Buffer] = [bytes(head), data, *raws]
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
    buffers = []
    for ln in lens[1:]:
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
