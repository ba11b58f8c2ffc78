"""The pickle codec: large buffers are copied once, straight into the ring, and a zero-copy
reader can take them out as views."""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest

from aiobroadcast._base.codec import OOB_MIN_BYTES, PickleEncoder, _assemble, decode_pickle, decode_pickle_view
from aiobroadcast._base.errors import SerializationError


def _body(obj: object) -> tuple[bytearray, bool]:
    parts, total, oob = PickleEncoder().encode(obj)
    body = bytearray(b"".join(bytes(memoryview(p).cast("B")) for p in parts))
    assert len(body) == total
    return body, oob


def _round_trip(obj: object) -> tuple[object, int, bool]:
    parts, _total, oob = PickleEncoder().encode(obj)
    body, oob = _body(obj)
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
    # The large parts are the objects themselves: the only copy is the one into the ring.
    assert any(p is payload for p in parts)
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


def test_a_stream_with_large_bytes_unpickles_as_it_is_and_indexes_them() -> None:
    """In band, the body is a plain pickle followed by an index: any unpickler reads it."""
    message = {"a": [1, b"p" * 70_000], "b": (b"q" * 100_000, "s" * 100_000)}
    body, oob = _body(message)
    assert not oob and body[-1] != ord(".")  # the index follows STOP
    assert pickle.loads(body) == message
    assert decode_pickle(memoryview(body), oob) == message


def test_views_of_large_bytes_alias_the_body_and_are_read_only() -> None:
    shared = b"r" * 80_000
    message = [1, b"p" * 70_000, {"k": shared, "again": shared}, "s" * 100_000, bytearray(b"b" * 90_000)]
    body, oob = _body(message)
    got = decode_pickle_view(memoryview(body), oob)
    assert isinstance(got, list) and got[0] == 1
    view = got[1]
    assert isinstance(view, memoryview) and view.readonly and view == b"p" * 70_000
    assert got[2]["k"] is got[2]["again"] and got[2]["k"] == shared  # pickle's memo still holds
    # A large str and a bytearray pickled in band are what they were.
    assert got[3] == "s" * 100_000 and type(got[4]) is bytearray and got[4] == bytearray(b"b" * 90_000)
    at = bytes(body).index(b"p" * 70_000)
    body[at] = ord("X")  # the view is of the body itself, not a copy
    assert view[0] == ord("X")
    # A message without large bytes has no index and decodes as usual.
    small, oob = _body((1, b"x" * 100))
    assert small[-1] == ord(".") and decode_pickle_view(memoryview(small), oob) == (1, b"x" * 100)


def test_arrays_and_bytes_out_of_band_together_decode_both_ways() -> None:
    arr = np.arange(OOB_MIN_BYTES // 8, dtype=np.int64)
    message = (b"p" * 70_000, arr, b"q" * 70_000)
    body, oob = _body(message)
    assert oob
    copied = decode_pickle(memoryview(body), oob)
    assert isinstance(copied, tuple)
    assert copied[0] == b"p" * 70_000 and type(copied[0]) is bytes and type(copied[2]) is bytes
    assert np.array_equal(copied[1], arr) and copied[1].flags.writeable
    viewed = decode_pickle_view(memoryview(body), oob)
    assert isinstance(viewed, tuple)
    assert isinstance(viewed[0], memoryview) and viewed[0] == b"p" * 70_000 and viewed[2] == b"q" * 70_000
    assert np.array_equal(viewed[1], arr) and not viewed[1].flags.writeable


def test_pieces_not_shaped_as_the_pickler_writes_them_stay_in_band() -> None:
    """The encoder moves a payload out of the stream only where the chunk before it ends with
    that payload's header; anything else is kept as it is."""
    payload = b"z" * 70_000
    pieces = [b"\x80\x05\x95\x01\x00\x00\x00\x00\x00\x00\x00N", payload, b"."]
    parts, total, oob = _assemble(list(pieces))
    assert not oob and list(parts) == pieces and total == sum(len(p) for p in pieces)
