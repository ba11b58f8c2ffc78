"""``zero_copy`` changes how a reader holds a message, never what it decodes: for any object, a
zero-copy reader decodes what a default reader decodes. A large ``bytes`` held by the message
itself or by plain containers (dict, list, tuple, set, frozenset) may arrive as a read-only view
(and does: that is the point of ``zero_copy``); one an object is built from (a reconstructor's
argument or state: a sliced numpy array's data, an ``array.array``'s, a pydantic model's field)
arrives as ``bytes``, which the object may insist on. Checked on the codec over many kinds of
objects, and over a real ring and a real TCP connection for a smaller set.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from aiobroadcast import blocking
from aiobroadcast._base.codec import OOB_MIN_BYTES, PickleEncoder, decode_pickle, decode_pickle_view

# A failing example is printed: its large buffers make a long repr, which Hypothesis warns of.
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

#: The C pickler writes a ``bytes`` of this size or more by itself, so a zero-copy reader can view it.
VIEW_MIN = 64 * 1024
#: Byte sizes around both thresholds (a bytes from 64 KiB, a PickleBuffer out of band from 256 KiB).
SIZES = [0, 9, 1000, VIEW_MIN - 1, VIEW_MIN, 70_000, 140_000, OOB_MIN_BYTES, OOB_MIN_BYTES + 4_000]


def data(size: int, seed: int) -> bytes:
    return ((np.arange(size, dtype=np.int64) * 7 + seed) % 251).astype(np.uint8).tobytes()


# --- objects built from bytes (module level: pickle finds them by name) -----------------------------
class Blob:
    """Rebuilt by ``REDUCE`` from a ``bytes`` argument, which it insists on (as ``array.array`` does)."""

    def __init__(self, payload: bytes) -> None:
        if type(payload) is not bytes:
            raise TypeError(f"Blob wants bytes, not {type(payload).__name__}")
        self.payload = payload

    def __reduce__(self) -> tuple[Any, ...]:
        return (Blob, (self.payload,))


class Keyword:
    """Rebuilt by ``NEWOBJ_EX``: its ``bytes`` is a keyword argument of ``__new__``."""

    payload: bytes

    def __new__(cls, *, payload: bytes) -> Keyword:
        if type(payload) is not bytes:
            raise TypeError(f"Keyword wants bytes, not {type(payload).__name__}")
        obj = super().__new__(cls)
        obj.payload = payload
        return obj

    def __getnewargs_ex__(self) -> tuple[tuple[()], dict[str, bytes]]:
        return (), {"payload": self.payload}


class Holder:
    """Pickled by default (``NEWOBJ``, then ``BUILD`` with its ``__dict__``): holds anything."""

    def __init__(self, held: Any) -> None:
        self.held = held


class BytesDict(dict[str, Any]):
    """A dict subclass: the unpickler fills it through its own ``__setitem__`` (``SETITEMS``)."""

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, memoryview):
            raise TypeError("BytesDict takes no views")
        super().__setitem__(key, value)


class BytesList(list[Any]):
    """A list subclass: the unpickler fills it through its own ``extend`` (``APPENDS``)."""

    def extend(self, items: Any) -> None:
        items = list(items)
        if any(isinstance(item, memoryview) for item in items):
            raise TypeError("BytesList takes no views")
        super().extend(items)


@dataclasses.dataclass
class Packet:
    payload: bytes
    meta: dict[str, Any]


class Frame(BaseModel):
    payload: bytes
    parts: list[bytes] = []
    n: int = 0


# --- strategies ------------------------------------------------------------------------------------
sizes = st.sampled_from(SIZES)
seeds = st.integers(0, 250)


@st.composite
def raw_bytes(draw: st.DrawFn) -> bytes:
    return data(draw(sizes), draw(seeds))


#: One large bytes per example, drawn wherever this is: the same object, so the pickle memo
#: refers to it (a top-level view must not be handed out if an object also holds it).
shared_bytes = st.shared(raw_bytes(), key="shared bytes")

DTYPES = ["i1", "u2", "<i4", ">i4", "i8", "f2", "f4", ">f8", "c8", "c16", "?", "M8[ms]", "U3"]
VIEWS = ["c", "fortran", "transpose", "step", "reversed", "columns", "both reversed", "broadcast", "0-d"]


@st.composite
def ndarrays(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    """Views of every stride and order, of every dtype above, small and large."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    nbytes = draw(st.sampled_from([8, 1000, *SIZES[4:], 2 * OOB_MIN_BYTES + 8]))
    count = max(nbytes // dtype.itemsize, 1)
    if dtype.kind == "U":
        count = min(count, 30_000)  # a large str array takes long to build; 360 KB is large enough
    cols = draw(st.sampled_from([1, 3, 8]))
    rows = max(count // cols, 1)
    base = (np.arange(rows * cols) % 97).astype(dtype).reshape(rows, cols)
    view = draw(st.sampled_from(VIEWS))
    if view == "c":
        return base if draw(st.booleans()) else base.reshape(-1)
    if view == "fortran":
        return np.asfortranarray(base)
    if view == "transpose":
        return base.T
    if view == "step":
        return base.reshape(-1)[:: draw(st.integers(2, 5))]
    if view == "reversed":
        return base.reshape(-1)[::-1]
    if view == "columns":
        return base[:, ::2]
    if view == "both reversed":
        return base[::-1, ::-1]
    if view == "broadcast":
        return np.broadcast_to(base[:1], (max(rows, 2), cols))
    return np.array(base[0, 0])  # 0-d


@st.composite
def object_arrays(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    arr = np.empty(3, dtype=object)
    arr[:] = [draw(shared_bytes), draw(raw_bytes()), "x"]
    return arr


@st.composite
def arrays(draw: st.DrawFn) -> array.array[Any]:
    typecode = draw(st.sampled_from("bBhHiIlLqQfd"))
    out = array.array(typecode)
    out.frombytes((np.arange(draw(sizes) // out.itemsize) % 100).astype(np.dtype(typecode)).tobytes())
    return out


leaves = st.one_of(
    raw_bytes(),
    shared_bytes,
    raw_bytes().map(bytearray),
    ndarrays(),
    object_arrays(),
    arrays(),
    st.integers(-5, 5),
    st.text(max_size=5),
    st.none(),
    st.floats(allow_nan=False),
    st.just(np.float64(2.5)),
)


def containers(kids: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    names = st.text("abc", max_size=3)
    return st.one_of(
        st.lists(kids, max_size=4),
        st.tuples(kids, kids),
        st.dictionaries(names, kids, max_size=3),
        st.frozensets(st.one_of(raw_bytes(), st.integers()), max_size=2),
        st.builds(Blob, st.one_of(raw_bytes(), shared_bytes)),
        st.builds(lambda b: Keyword(payload=b), st.one_of(raw_bytes(), shared_bytes)),
        st.builds(Holder, kids),
        st.builds(lambda d: BytesDict(d), st.dictionaries(names, kids, max_size=3)),
        st.builds(BytesList, st.lists(kids, max_size=3)),
        st.builds(collections.OrderedDict, st.dictionaries(names, kids, max_size=3)),
        st.builds(collections.deque, st.lists(kids, max_size=3)),
        st.builds(Packet, st.one_of(raw_bytes(), shared_bytes), st.dictionaries(names, kids, max_size=2)),
        st.builds(Frame, payload=st.one_of(raw_bytes(), shared_bytes), parts=st.lists(raw_bytes(), max_size=2)),
    )


messages = st.recursive(leaves, containers, max_leaves=8)


# --- what "decodes alike" means --------------------------------------------------------------------
def held_by_objects(obj: Any) -> set[int]:
    """The ids of the bytes objects in ``obj`` that an object holds or that are hashed (a dict's
    key, a set's member, or inside one): those must not be views."""
    held: set[int] = set()
    seen: set[tuple[int, bool]] = set()  # a value is walked once inside objects and once outside

    def walk(x: Any, in_object: bool) -> None:
        if type(x) is bytes:
            if in_object:
                held.add(id(x))
            return
        if (id(x), in_object) in seen:
            return
        seen.add((id(x), in_object))
        if type(x) in (list, tuple):
            for item in x:
                walk(item, in_object)
        elif type(x) in (set, frozenset):
            for item in x:
                walk(item, True)
        elif type(x) is dict:
            for k, v in x.items():
                walk(k, True)
                walk(v, in_object)
        else:
            for item in _parts(x):
                walk(item, True)

    walk(obj, False)
    return held


def _parts(x: Any) -> list[Any]:
    """What an object holds, for the comparison and for ``held_by_objects``."""
    if isinstance(x, np.ndarray):
        return list(x.ravel()) if x.dtype == object else []
    if isinstance(x, BaseModel):
        return [x.__dict__]
    if isinstance(x, dict):
        return [list(x.items()), getattr(x, "__dict__", {})]
    if isinstance(x, list | collections.deque):
        return [list(x), getattr(x, "__dict__", {})]
    return [vars(x)] if hasattr(x, "__dict__") else []


def assert_alike(want: Any, got: Any, *, viewable: bool, held: set[int], path: str = "message") -> None:
    """``got`` is ``want``; where ``viewable``, a large bytes of ``want`` that is not ``held``
    must be a read-only view in ``got`` (zero-copy's promise)."""
    if type(want) is bytes and viewable and len(want) >= VIEW_MIN and id(want) not in held:
        assert type(got) is memoryview and got.readonly and got == want, f"{path}: not a view"
        return
    assert type(got) is type(want), f"{path}: {type(got).__name__}, not {type(want).__name__}"
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        if want.dtype == object:
            for k, (w, g) in enumerate(zip(want.ravel(), got.ravel(), strict=True)):
                assert_alike(w, g, viewable=False, held=held, path=f"{path}[{k}]")
        else:
            assert np.array_equal(got, want), path
    elif type(want) in (list, tuple):
        assert len(got) == len(want), path
        for k, (w, g) in enumerate(zip(want, got, strict=True)):
            assert_alike(w, g, viewable=viewable, held=held, path=f"{path}[{k}]")
    elif type(want) is dict:
        assert list(got) == list(want), path
        for key in want:
            assert_alike(want[key], got[key], viewable=viewable, held=held, path=f"{path}[{key!r}]")
    elif type(want) in (set, frozenset, bytes, bytearray, str, int, float, type(None), np.float64, array.array):
        assert got == want, path
    else:  # an object: whatever it holds it gets as it was pickled
        for k, (w, g) in enumerate(zip(_parts(want), _parts(got), strict=True)):
            assert_alike(w, g, viewable=False, held=held, path=f"{path}<{k}>")


def check_alike(obj: Any, default: Any, zero_copy: Any) -> None:
    # The default reader decodes what pickle does (which is not always the object: numpy gives
    # a byte-swapped array that is not contiguous back in native order).
    assert_alike(pickle.loads(pickle.dumps(obj, protocol=5)), default, viewable=False, held=set())
    assert_alike(default, zero_copy, viewable=True, held=held_by_objects(default))


# --- on the codec: breadth ----------------------------------------------------------------------------
@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages)
def test_a_zero_copy_decode_is_the_default_decode_with_views(obj: Any) -> None:
    parts, total, oob = PickleEncoder().encode(obj)
    body = bytearray(b"".join(bytes(memoryview(p).cast("B")) for p in parts))  # as unhashable as the ring
    assert len(body) == total
    check_alike(obj, decode_pickle(memoryview(body), oob), decode_pickle_view(memoryview(body), oob))


def test_the_two_reported_objects_and_their_neighbours() -> None:
    """The reported cases, by name: a sliced array and an ``array.array`` (each alone, and beside
    a top-level bytes and an array out of band), a 0-d and a Fortran-ordered array; and large
    bytes that are hashed (a view of the body cannot be: "unhashable type")."""
    sliced = np.arange(40_000.0)[::2]
    floats = array.array("d", range(20_000))
    key = data(70_000, 3)
    for obj in [
        sliced,
        floats,
        (sliced, data(70_000, 1), floats),
        [np.arange(OOB_MIN_BYTES // 8), sliced, data(OOB_MIN_BYTES, 2)],
        np.array(7.0),
        np.asfortranarray(np.arange(40_000.0).reshape(200, 200)),
        {key: 1},
        {(key, 2): [key]},  # a key, and the same bytes as a list's item: bytes in both places
        {key},
        [frozenset([key]), np.arange(OOB_MIN_BYTES // 8)],
    ]:
        parts, _total, oob = PickleEncoder().encode(obj)
        body = bytearray(b"".join(bytes(memoryview(p).cast("B")) for p in parts))  # as unhashable as the ring
        check_alike(obj, decode_pickle(body, oob), decode_pickle_view(body, oob))


# --- over a real ring and a real TCP connection ------------------------------------------------------
transport_messages = st.recursive(
    st.one_of(raw_bytes(), shared_bytes, ndarrays(), arrays(), object_arrays()),
    lambda kids: st.one_of(
        st.tuples(kids, kids),
        st.dictionaries(st.text("ab", max_size=2), kids, max_size=2),
        st.builds(Blob, shared_bytes),
        st.builds(Frame, payload=raw_bytes()),
        st.builds(Holder, kids),
    ),
    max_leaves=3,
)


@pytest.fixture(params=["shm", "tcp"])
def channel(request: pytest.FixtureRequest) -> Iterator[tuple[Callable[[Any], None], Any, Any]]:
    """A writer (with a TCP server for "tcp"), a zero-copy reader over the transport and a default
    reader over the ring; opened once for all the examples (a TCP server takes a second to start)."""
    tcp = "tcp://127.0.0.1:0" if request.param == "tcp" else None
    # 8 MiB: a message of up to 6 MiB (the test's bound) fits, beside a slot the zero-copy reader holds.
    with blocking.open_writer(capacity=128, slot_bytes=64 * 1024, tcp=tcp) as writer:
        with (
            blocking.open_reader(writer.handle, transport=request.param, zero_copy=True) as zero_copy,
            blocking.open_reader(writer.handle) as default,
        ):
            yield writer.put, zero_copy, default


def test_over_the_transports_every_message_arrives_alike(channel: tuple[Callable[[Any], None], Any, Any]) -> None:
    put, zero_copy, default = channel
    sent = 0

    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(transport_messages)
    def one(obj: Any) -> None:
        nonlocal sent
        assume(PickleEncoder().encode((sent, obj))[1] < 6 * 1024 * 1024)
        put((sent, obj))
        k_default, got_default = default.get(timeout=30)
        k_view, got_view = zero_copy.get(timeout=30)  # a DeserializationError would lose it
        assert k_default == k_view == sent  # nothing lost, nothing out of order
        sent += 1
        check_alike(obj, got_default, got_view)

    one()
    put((sent, "last"))
    assert default.get(timeout=30) == zero_copy.get(timeout=30) == (sent, "last")
