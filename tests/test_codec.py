"""The pickle codec's out-of-band threshold: large buffers are copied once, straight into the ring."""

from __future__ import annotations

import numpy as np

from aiobroadcast._codec import OOB_MIN_BYTES, PickleEncoder, decode_pickle


def _round_trip(obj: object) -> tuple[object, int, bool]:
    parts, total, oob = PickleEncoder().encode(obj)
    body = bytearray(b"".join(bytes(memoryview(p).cast("B")) for p in parts))
    assert len(body) == total
    return decode_pickle(memoryview(body), oob), len(parts), oob


def test_small_bytes_travel_in_band_as_one_part() -> None:
    payload = b"x" * (OOB_MIN_BYTES - 1)
    got, nparts, oob = _round_trip((1, payload))
    assert got == (1, payload) and nparts == 1 and not oob


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
