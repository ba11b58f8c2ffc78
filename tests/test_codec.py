"""The pickle codec's out-of-band threshold: large buffers are copied once, straight into the ring."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from aiobroadcast._codec import OOB_MIN_BYTES, PickleEncoder, decode_pickle
from aiobroadcast._exceptions import SerializationError


def _round_trip(obj: object) -> tuple[object, int, bool]:
    parts, total, oob = PickleEncoder().encode(obj)
    body = bytearray(b"".join(bytes(memoryview(p).cast("B")) for p in parts))
    assert len(body) == total
    return decode_pickle(memoryview(body), oob), len(parts), oob


def test_small_messages_are_one_part_in_band() -> None:
    got, nparts, oob = _round_trip((1, b"x" * 100))
    assert got == (1, b"x" * 100) and nparts == 1 and not oob


def test_large_bytes_in_band_are_referenced_not_copied_and_mutable_buffers_are_copied() -> None:
    payload = b"x" * (OOB_MIN_BYTES - 1)  # in band, but large: the pickler hands it over as is
    parts, _total, oob = PickleEncoder().encode((1, payload))
    assert not oob and any(p is payload for p in parts)
    assert _round_trip((1, payload))[0] == (1, payload)
    # A mutable buffer is copied at encode time: the body is the object as it was then.
    mutable = bytearray(b"y" * 100_000)
    parts, total, _oob = PickleEncoder().encode(mutable)
    mutable[:] = b"z" * len(mutable)
    body = b"".join(bytes(p) for p in parts)
    assert len(body) == total and decode_pickle(memoryview(body), False) == bytearray(b"y" * 100_000)


def test_large_bytes_and_arrays_travel_out_of_band_without_a_copy() -> None:
    payload = b"y" * OOB_MIN_BYTES
    arr = np.arange(OOB_MIN_BYTES // 8, dtype=np.int64)
    parts, _total, oob = PickleEncoder().encode({"b": payload, "a": arr})
    assert oob
    # The large parts are views of the objects themselves: the only copy is the one into the ring.
    assert any(isinstance(p, memoryview) and p.obj is payload for p in parts)
    assert any(isinstance(p, memoryview) and np.shares_memory(np.asarray(p), arr) for p in parts)
    got, _nparts, _oob = _round_trip({"b": payload, "a": arr})
    assert isinstance(got, dict) and got["b"] == payload and type(got["b"]) is bytes
    assert np.array_equal(got["a"], arr)


def test_a_failure_half_way_leaves_nothing_for_the_next_message() -> None:
    """The encoder reuses one pickler and its sink: a message that fails after a large piece
    was already handed over must not leak that piece (or pickler state) into the next body."""
    encoder = PickleEncoder()
    with pytest.raises(SerializationError, match="cannot pickle"):
        encoder.encode((b"x" * 100_000, threading.Lock()))
    message = (1, b"y" * 70_000)
    parts, total, oob = encoder.encode(message)
    fresh_parts, fresh_total, _oob = PickleEncoder().encode(message)
    body = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    # Byte for byte what a fresh encoder makes (a stale prefix would still unpickle to the same
    # value: pickle returns what is on top of its stack at STOP).
    assert (len(body), total) == (fresh_total, fresh_total)
    assert body == b"".join(bytes(memoryview(p).cast("B")) for p in fresh_parts)
    assert decode_pickle(memoryview(body), oob) == message
