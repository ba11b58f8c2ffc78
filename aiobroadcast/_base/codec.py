"""Turning objects into message bodies and back.

A body is what travels in the ring. With the pickle codec it is a pickle stream (protocol 5),
and large buffers are copied once into shared memory and at most once out:

- A ``bytes`` of 64 KiB or more, anywhere in the message, stays in the stream, copied once: the C
  pickler writes such a payload by itself (it commits the stream's framing before the payload's
  short header and hands the payload to the file's ``write`` as the object itself), so the
  encoder's sink receives it without a copy. The encoder notes where each such header is in an
  index after the stream's ``STOP`` (pickle ignores what follows ``STOP``). A zero-copy reader
  uses the index to take the payloads out as views (``decode_pickle_view``); any other reader
  unpickles the stream as it is. Only a payload a view can stand for is indexed: the message
  itself, or a value of lists, tuples and dicts, at any depth of them. One an object is built
  from (an argument or the state of a reconstructor: a sliced numpy array's data, an
  ``array.array``'s, which refuse a view) or that is hashed (a dict's key, a set's member: a
  view of a bytearray cannot be) is not, and arrives as ``bytes`` (``_held_payloads``).
- Numpy arrays and other ``PickleBuffer`` producers of ``OOB_MIN_BYTES`` and up travel out of
  band (pickle's ``buffer_callback``), after the stream; the body is then "out of band"
  (``oob``) and a large ``bytes`` in the same message that a view can stand for travels out of
  band too (its header in the stream becomes ``NEXT_BUFFER``). A reader gets writable copies of
  the arrays' buffers, or read-only views with ``decode_pickle_view``.

Bodies: ``stream [index]`` in band; ``u64 count, u64 stream length, u64 length word per buffer,
stream, buffers`` out of band. An index is ``u64 header offset`` per payload, ``u32 count`` and
the byte ``_INDEX_TAG`` (a stream without an index ends with ``STOP``).
"""

from __future__ import annotations

import copyreg
import importlib
import json
import pickle
import struct
import sys
import threading
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from .errors import SchemaViolation, SerializationError

#: ``PickleBuffer`` producers (numpy arrays, bytearrays) from this size up travel out of band (one
#: copy, straight into the ring). Below it the out-of-band bookkeeping costs more than it saves.
#: A ``bytes`` is handed over by reference from 64 KiB up (the C pickler's ``FRAME_SIZE_TARGET``,
#: from which it writes a payload by itself: see the module's text).
OOB_MIN_BYTES = 256 * 1024
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEAD_1 = struct.Struct("<QQQ")  # the out-of-band header of a body with one buffer
_INDEX_1 = struct.Struct("<QIB")  # the index of a stream with one large bytes
_INDEX_TAG = 0xA5  # the last byte of a stream with an index (a stream without one ends with STOP)
_BYTES_KIND = 1 << 63  # set in an out-of-band length: the buffer is a bytes object's payload

# Pickle opcodes the encoder looks for where a chunk of the stream ends (pickletools' names).
_PROTO_5 = b"\x80\x05"
_FRAME = 0x95
_NEXT_BUFFER = b"\x97"
_SHORT_HEADERS = frozenset((0x42, 0x58))  # BINBYTES, BINUNICODE: opcode + u32 length
_LONG_HEADERS = frozenset((0x8E, 0x8D, 0x96))  # BINBYTES8, BINUNICODE8, BYTEARRAY8: opcode + u64
_BYTES_HEADERS = frozenset((0x42, 0x8E))

Buffer = bytes | bytearray | memoryview


class _OutOfBand:
    """Marks, among the sink's pieces, where pickle handed a buffer over out of band."""

    __slots__ = ("raw",)

    def __init__(self, raw: memoryview) -> None:
        self.raw = raw


class _Sink:
    """The file a pickler writes to: it keeps the pieces it is given, without joining them, in
    the order of the stream (a ``_OutOfBand`` where the buffer callback took a buffer)."""

    __slots__ = ("parts", "write")

    def __init__(self) -> None:
        self.parts: list[Any] = []
        self.write = self.parts.append


def _tail_header(chunk: bytes, first: bool) -> tuple[int, int, int] | None:
    """Where a chunk the pickler wrote ends: ``(header_size, opcode, payload_length)`` if it ends
    with the header of a payload written by itself (the next piece), ``(0, 0, 0)`` if it ends
    with the stream's ops, ``None`` if it is not what the C pickler writes (the caller then keeps
    the message in band).

    A chunk is: ``PROTO 5`` (first chunk only), one frame (``FRAME`` + u64 length + ops, or, under
    4 bytes, its ops alone), then the payload's header when a payload follows."""
    if first:
        if not chunk.startswith(_PROTO_5):
            return None
        pos = 2
    else:
        pos = 0
    n = len(chunk)
    while pos < n and chunk[pos] == _FRAME:
        pos += 9 + _U64.unpack_from(chunk, pos + 1)[0]
    rest = n - pos
    if rest < 5:
        return (0, 0, 0) if rest >= 0 else None  # the end of a frame, or an unframed one (< 4 bytes)
    if rest <= 8 and chunk[-5] in _SHORT_HEADERS:
        return (5, chunk[-5], _U32.unpack_from(chunk, n - 4)[0])
    if 9 <= rest <= 12 and chunk[-9] in _LONG_HEADERS:
        return (9, chunk[-9], _U64.unpack_from(chunk, n - 8)[0])
    return None


class PickleEncoder:
    """Encodes with pickle protocol 5; takes large buffers out of band.

    One C pickler (and its sink) is kept and reused: building one costs more than a small
    message. A C pickler must never be re-entered: a ``__reduce__`` that publishes (a logging
    handler that broadcasts), or another thread, would corrupt its state or crash the process. So
    the kept pickler is taken out of a one-place pool; a call that finds it taken encodes with a
    pickler of its own. Safe from any thread and from inside an ``encode``."""

    def __init__(self, arena: bool = False) -> None:
        #: Once torch is imported, tensors are pickled with ``_reduce_tensor`` (their bytes; a
        #: large contiguous one out of band, as a numpy array). ``arena``: every large buffer
        #: travels out of band (into the channel's arena), and a ``bytes`` of ``OOB_MIN_BYTES``
        #: or more that a view can stand for too, even without arrays beside it.
        self._arena = arena
        #: The kept pickler while no call uses it. ``list.pop`` and ``append`` are atomic, so a
        #: call takes it or finds the list empty (another call has it) without a lock; a lock's
        #: acquire and release cost more than the rest of encoding a small message here.
        self._idle = [_Pickling(arena)]

    def encode(self, obj: object) -> tuple[Sequence[Buffer], int, bool]:
        """Return the body as parts, its total length, and whether it has out-of-band parts."""
        try:
            pickling = self._idle.pop()
        except IndexError:  # re-entered, or used by another thread right now
            pickling = _Pickling(self._arena)
            if "torch" in sys.modules:
                pickling.reduce_tensors()
            return pickling.encode(obj)
        if not pickling.tensors and "torch" in sys.modules:
            pickling.reduce_tensors()
        try:
            return pickling.encode(obj)
        finally:
            self._idle.append(pickling)


class _Pickling:
    """One pickler, its sink, and the out-of-band callback: used by one call at a time."""

    __slots__ = ("_bytes_oob", "_pickler", "_pieces", "tensors")

    def __init__(self, bytes_oob: bool = False) -> None:
        sink = _Sink()
        self._pieces = sink.parts
        self._pickler = pickle.Pickler(sink, protocol=5, buffer_callback=self._callback)
        self.tensors = False
        self._bytes_oob = bytes_oob

    def reduce_tensors(self) -> None:
        """From now on pickle ``torch.Tensor`` with ``_reduce_tensor`` (torch is imported)."""
        import torch

        table = dict(copyreg.dispatch_table)
        table[torch.Tensor] = _reduce_tensor
        self._pickler.dispatch_table = table
        self.tensors = True

    def _callback(self, pb: pickle.PickleBuffer) -> bool:
        raw = pb.raw()
        if raw.nbytes < OOB_MIN_BYTES:
            return True  # small: keep it in the pickle
        self._pieces.append(_OutOfBand(raw))
        return False

    def encode(self, obj: object) -> tuple[Sequence[Buffer], int, bool]:
        pickler = self._pickler
        pieces = self._pieces
        if pieces:  # an earlier encode was interrupted (Ctrl-C) after its dump: drop what it left
            pieces.clear()
            pickler.clear_memo()
        try:
            pickler.dump(obj)
        except BaseException as exc:
            # Whatever stopped the dump (an unpicklable object, or Ctrl-C, SystemExit, a
            # cancellation raised inside a __reduce__), the memo and the sink must be emptied:
            # the next message would otherwise refer to memo entries of this one.
            pickler.clear_memo()
            pieces.clear()
            if isinstance(exc, Exception):
                raise SerializationError(f"cannot pickle {type(obj).__qualname__} object: {exc}") from exc
            raise
        pickler.clear_memo()
        if len(pieces) == 1:  # a small message: one chunk
            body = pieces.pop()
            return (body,), len(body), False
        try:
            return _assemble(pieces, self._bytes_oob)
        finally:
            pieces.clear()


# For ``_walk``: the opcodes that push a value holding no payload, by the size of their argument,
# and those whose data follows a length, by the size of the length.
_ATOMS: dict[int, int] = {
    **dict.fromkeys(b"N\x88\x89)\x97", 0),  # NONE NEWTRUE NEWFALSE EMPTY_TUPLE NEXT_BUFFER
    ord("K"): 1,  # BININT1
    ord("M"): 2,  # BININT2
    ord("J"): 4,  # BININT
    ord("G"): 8,  # BINFLOAT
    0x82: 1,  # EXT1 (a callable from copyreg's extension registry)
    0x83: 2,  # EXT2
    0x84: 4,  # EXT4
}
_SIZED: dict[int, int] = {
    0x8C: 1,  # SHORT_BINUNICODE
    ord("C"): 1,  # SHORT_BINBYTES
    0x8A: 1,  # LONG1
    ord("U"): 1,  # SHORT_BINSTRING
    ord("X"): 4,  # BINUNICODE
    ord("B"): 4,  # BINBYTES
    0x8B: 4,  # LONG4
    ord("T"): 4,  # BINSTRING
    0x8D: 8,  # BINUNICODE8
    0x8E: 8,  # BINBYTES8
    0x96: 8,  # BYTEARRAY8
}
_LENGTHS = {4: _U32, 8: _U64}
_NEW_OBJECT = {ord("R"): 2, 0x81: 2, 0x92: 3, 0x93: 2}  # REDUCE NEWOBJ NEWOBJ_EX STACK_GLOBAL: values taken
#: copyreg's extension registry: while it is empty, the pickler names every callable an object is
#: rebuilt with by ``STACK_GLOBAL`` (else perhaps by an ``EXT`` code).
_EXTENSIONS: dict[tuple[str, str], int] = copyreg._extension_registry  # type: ignore[attr-defined]  # noqa: SLF001 (no public view of it)


def _may_hold(chunk: bytes) -> bool:
    """Whether a chunk of the stream may have a value that holds a payload other than as a
    list's item or a dict's or tuple's value: such a value starts with ``STACK_GLOBAL`` (0x93,
    the callable an object is rebuilt with), ``EMPTY_DICT`` (0x7D: a key), ``EMPTY_SET`` (0x8F)
    or ``FROZENSET`` (0x91: a member). A false yes (some data has the byte) only costs a walk."""
    return 0x93 in chunk or 0x7D in chunk or 0x8F in chunk or 0x91 in chunk


def _held_payloads(pieces: list[Any]) -> set[int] | None:
    """Where, in ``pieces``, the large ``bytes`` payloads are that a zero-copy reader must hand
    over as ``bytes``, not as views: those an object holds (an argument or the state of a
    reconstructor, ``REDUCE``, ``NEWOBJ``, ``BUILD``: a sliced numpy array's data, an
    ``array.array``'s, a pydantic model's field; or an item an object's own ``__setitem__`` or
    ``extend`` takes), which may refuse a view or keep one, and those that are hashed (a dict's
    key, a set's or frozenset's member, or inside one): a view of a bytearray cannot be. A
    payload that is the message itself, or a list's item or a dict's or tuple's value, at any
    depth of those, is not held. ``None`` if the stream is not what the C pickler writes at
    protocol 5 (then every payload counts as held).

    A stream none of whose chunks (the payloads are not searched) ``_may_hold`` holds no payload;
    any other is walked, at about 0.2 microseconds an op: a few microseconds for a message of a
    few dozen values."""
    # The head of _walk's chunk loop, written out again for this quick pass: it runs per message
    # a zero-copy reader assembles (_assemble), where a shared chunk iterator would add a call
    # per chunk.
    if not _EXTENSIONS:
        n = len(pieces)
        i = 0
        first = True
        while i < n:
            piece = pieces[i]
            i += 1
            if type(piece) is _OutOfBand:
                continue
            if type(piece) is not bytes:
                return None
            if _may_hold(piece):
                break
            if i == n:  # the end of the stream, and no holder in it
                return set()
            tail = _tail_header(piece, first)
            first = False
            if tail is None:
                return None
            if tail[0]:
                i += 1  # the payload
    try:
        return _walk(pieces)
    except (IndexError, KeyError, struct.error):
        return None


def _walk(pieces: list[Any]) -> set[int] | None:
    """Run pickle's stack machine on symbols: a payload is its position in ``pieces``, a list,
    dict or tuple the list of the values it holds (a dict's keys not among them), any other value
    ``None``. What is taken by an object or hashed is noted; at the end, every payload reachable
    from a noted value through lists, dicts and tuples is held."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: list[Any] = []
    taken: list[Any] = []
    atoms = _ATOMS
    sized = _SIZED
    n = len(pieces)
    i = 0
    while i < n:
        chunk = pieces[i]
        i += 1
        if type(chunk) is _OutOfBand:
            continue
        if type(chunk) is not bytes:
            return None
        pos = 0
        end = len(chunk)
        while pos < end:
            op = chunk[pos]
            pos += 1
            if op == 0x94:  # MEMOIZE
                memo.append(stack[-1])
            elif op in sized:
                size = sized[op]
                length = chunk[pos] if size == 1 else _LENGTHS[size].unpack_from(chunk, pos)[0]
                pos += size + length
                if pos <= end:
                    stack.append(None)
                elif pos - length == end and i < n:  # the header ends the chunk: the payload is the next piece
                    stack.append(i if op in _BYTES_HEADERS and type(pieces[i]) is bytes else None)
                    i += 1
                else:
                    return None
            elif op in atoms:
                pos += atoms[op]
                stack.append(None)
            elif op == 0x28:  # MARK
                marks.append(len(stack))
            elif op in _NEW_OBJECT:  # the new object takes the values it is built from
                k = _NEW_OBJECT[op]
                taken += stack[-k:]
                del stack[-k:]
                stack.append(None)
            elif op == 0x62:  # BUILD: the object under the state takes it
                taken.append(stack.pop())
            elif op == 0x85 or op == 0x86 or op == 0x87:  # TUPLE1, TUPLE2, TUPLE3
                k = op - 0x84
                items = stack[-k:]
                del stack[-k:]
                stack.append(items)
            elif op == 0x74:  # TUPLE
                at = marks.pop()
                items = stack[at:]
                del stack[at:]
                stack.append(items)
            elif op == 0x5D or op == 0x7D:  # EMPTY_LIST, EMPTY_DICT
                stack.append([])
            elif op == 0x65 or op == 0x75 or op == 0x61 or op == 0x73:  # APPENDS, SETITEMS, APPEND, SETITEM
                at = marks.pop() if op == 0x65 or op == 0x75 else len(stack) - (1 if op == 0x61 else 2)
                items = stack[at:]
                del stack[at:]
                target = stack[-1]
                if type(target) is not list:  # an object's own method takes them (a dict or list subclass)
                    taken += items
                elif op == 0x65 or op == 0x61:
                    target += items
                else:
                    taken += items[::2]  # the keys: hashed
                    target += items[1::2]
            elif op == 0x90 or op == 0x91:  # ADDITEMS, FROZENSET: hashed
                at = marks.pop()
                taken += stack[at:]
                del stack[at:]
                if op == 0x91:
                    stack.append(None)
            elif op == 0x8F:  # EMPTY_SET
                stack.append(None)
            elif op == 0x68:  # BINGET
                stack.append(memo[chunk[pos]])
                pos += 1
            elif op == 0x6A:  # LONG_BINGET
                stack.append(memo[_U32.unpack_from(chunk, pos)[0]])
                pos += 4
            elif op == 0x95:  # FRAME
                pos += 8
            elif op == 0x80:  # PROTO
                pos += 1
            elif op == 0x98:  # READONLY_BUFFER
                pass
            elif op == 0x30:  # POP
                stack.pop()
            elif op == 0x31:  # POP_MARK
                del stack[marks.pop() :]
            elif op == 0x32:  # DUP
                stack.append(stack[-1])
            elif op == 0x2E:  # STOP: what is left is the message itself
                stack.pop()
            else:  # BINPUT and the like: not written at protocol 5
                return None
    held: set[int] = set()
    seen: set[int] = set()
    while taken:
        value = taken.pop()
        if type(value) is int:
            held.add(value)
        elif type(value) is list and id(value) not in seen:
            seen.add(id(value))
            taken += value
    return held


def _in_band(piece: Any) -> Buffer:
    # A bytes piece is immutable (the caller's own payload, or a chunk of the stream): never copied.
    # Any other (a bytearray or numpy array pickled in band) is copied now, so that the body is the
    # object as it is at encode time.
    return piece if type(piece) is bytes else bytes(memoryview(piece).cast("B"))


def _assemble(pieces: list[Any], bytes_oob: bool = False) -> tuple[Sequence[Buffer], int, bool]:
    """The body from the sink's pieces (see the module's text); or, if the pieces are not shaped
    as the C pickler writes them, the stream as it is, without index. ``bytes_oob``: a ``bytes``
    of ``OOB_MIN_BYTES`` or more makes the body out of band even without arrays (an arena's).

    The last piece is the end of the stream: only a chunk followed by a payload is looked into."""
    n = len(pieces)
    force = bytes_oob and any(type(p) is bytes and len(p) >= OOB_MIN_BYTES for p in pieces[1:-1])
    if n == 3 and not force:  # the common shape: the start of the stream, one large bytes, the end
        start, payload, end = pieces
        if type(payload) is bytes and type(start) is bytes:
            tail = _tail_header(start, True)
            if tail is not None and tail[1] in _BYTES_HEADERS and tail[2] == len(payload):
                if (not _may_hold(start) and not _may_hold(end) and not _EXTENSIONS) or (
                    _held_payloads(pieces) == set()
                ):
                    end = end + _INDEX_1.pack(len(start) - tail[0], 1, _INDEX_TAG)
                # else an object holds it, or it is hashed: the stream as it is, without index
                return (start, payload, end), len(start) + tail[2] + len(end), False
    oob = force or any(type(p) is _OutOfBand for p in pieces)
    data: list[Buffer] = []
    bufs: list[Buffer] = []
    lens: list[int] = []
    index: list[int] = []
    at = 0  # where in the stream the next piece goes
    first = True
    held: set[int] | None = None  # the positions of the payloads an object holds (None: all of them)
    walked = False
    i = 0
    while i < n:
        piece = pieces[i]
        i += 1
        if type(piece) is _OutOfBand:
            bufs.append(piece.raw)
            lens.append(piece.raw.nbytes)
            continue
        if i == n:
            data.append(_in_band(piece))
            break
        tail = _tail_header(piece, first) if type(piece) is bytes else None
        first = False
        if tail is None:
            return _whole(pieces)
        size, opcode, length = tail
        if not size:
            data.append(piece)
            at += len(piece)
            continue
        payload = pieces[i]
        if type(payload) is _OutOfBand or memoryview(payload).nbytes != length:
            return _whole(pieces)
        i += 1
        if opcode in _BYTES_HEADERS and type(payload) is bytes and not walked:  # once, if needed at all
            held, walked = _held_payloads(pieces), True
        if opcode in _BYTES_HEADERS and type(payload) is bytes and held is not None and i - 1 not in held:
            if oob:  # out of band with the arrays: the header becomes "the next buffer"
                piece = piece[:-size] + _NEXT_BUFFER
                bufs.append(payload)
                lens.append(length | _BYTES_KIND)
                data.append(piece)
                at += len(piece)
                continue
            index.append(at + len(piece) - size)
            data.append(piece)
            data.append(payload)
        else:  # a large str, a buffer pickled in band, or a held bytes: stays in the stream
            data.append(piece)
            data.append(_in_band(payload))
        at += len(piece) + length
    if index:
        data.append(struct.pack(f"<{len(index)}QIB", *index, len(index), _INDEX_TAG))
    data_len = sum(len(p) for p in data)
    if not bufs:
        return data, data_len, False
    head = struct.pack(f"<{len(lens) + 2}Q", len(bufs), data_len, *lens)
    size = len(head) + data_len + sum(ln & ~_BYTES_KIND for ln in lens)
    return [head, *data, *bufs], size, True


def _whole(pieces: list[Any]) -> tuple[Sequence[Buffer], int, bool]:
    if any(type(p) is _OutOfBand for p in pieces):  # pragma: no cover - the C pickler's writes are known
        raise SerializationError("cannot take this message's buffers out of band")
    data = [_in_band(p) for p in pieces]
    return data, sum(len(p) for p in data), False


def _oob_split(mv: memoryview) -> tuple[memoryview, tuple[int, ...], int]:
    """An out-of-band body's pickle stream, its buffers' length words, and where the first starts.
    Layout: u64 count, u64 stream length, u64 length word per buffer, the stream, the buffers."""
    (n,) = _U64.unpack_from(mv, 0)
    words = struct.unpack_from(f"<{n + 1}Q", mv, 8)
    pos = 8 + 8 * (n + 1)
    return mv[pos : pos + words[0]], words[1:], pos + words[0]


#: dtypes whose tensors torch's own pickling writes but cannot read back (torch 2.x: "UntypedStorage
#: has no attribute 'dtype'"); vLLM sends them, as bytes
_BYTES_ONLY_DTYPES = frozenset(
    (
        "uint16",
        "uint32",
        "uint64",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
)


def _reduce_tensor(t: Any) -> Any:
    """A dense contiguous CPU tensor as a ``PickleBuffer`` of its bytes (out of band when it is
    ``OOB_MIN_BYTES`` or more: one copy into shared memory), its dtype and shape, as vLLM's
    reducer does; a non-contiguous one so too when torch cannot read back its own pickle of that
    dtype; any other as torch pickles it. (Two tensors of one storage arrive as two copies.)"""
    import torch

    if (
        t.device.type != "cpu"
        or t.layout != torch.strided
        or t.requires_grad
        or t.is_quantized
        or t.is_conj()
        or t.is_neg()
    ):
        return t.__reduce_ex__(5)
    if not t.is_contiguous():
        if str(t.dtype).removeprefix("torch.") not in _BYTES_ONLY_DTYPES:
            return t.__reduce_ex__(5)
        t = t.contiguous()
    flat = t.detach().reshape(-1).view(torch.uint8)
    return _rebuild_tensor, (pickle.PickleBuffer(flat.numpy()), str(t.dtype).removeprefix("torch."), tuple(t.shape))


_twins = threading.local()


def writable_twins() -> dict[int, memoryview]:
    """This thread's map from a read-only view handed to ``pickle.loads`` to the writable view of
    the same memory (the arena's: a tensor is rebuilt on it, as vLLM's arena does; numpy arrays
    and ``bytes`` payloads get the read-only one). Filled and emptied around one ``loads``."""
    twins: dict[int, memoryview] | None = getattr(_twins, "map", None)
    if twins is None:
        twins = _twins.map = {}
    return twins


def _rebuild_tensor(buf: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    """The tensor ``_reduce_tensor`` pickled: on ``buf`` (an arena view: shares its lifetime), or
    on a copy of it when ``buf`` is a read-only view of the ring (valid only until the next get)."""
    import torch

    mv = memoryview(buf)
    if mv.readonly:
        twin = writable_twins().get(id(buf))
        mv = twin if twin is not None else memoryview(bytearray(mv))
    flat = torch.frombuffer(mv, dtype=torch.uint8) if mv.nbytes else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)


def decode_pickle(body: memoryview | bytes | bytearray, oob: bool) -> Any:
    """Decode a pickle body. ``body`` may be a view of the ring: nothing returned aliases it."""
    if not oob:
        return pickle.loads(body)
    mv = memoryview(body)
    n, data_len, word = _HEAD_1.unpack_from(mv, 0)
    if n == 1:  # the common case, without the loop
        end = 24 + data_len
        raw = mv[end : end + (word & ~_BYTES_KIND)]
        return pickle.loads(mv[24:end], buffers=(bytes(raw) if word & _BYTES_KIND else bytearray(raw),))
    data, words, pos = _oob_split(mv)
    buffers: list[Buffer] = []
    for word in words:
        ln = word & ~_BYTES_KIND
        if word & _BYTES_KIND:
            buffers.append(bytes(mv[pos : pos + ln]))  # the payload of a bytes: copied once
        else:
            buffers.append(bytearray(mv[pos : pos + ln]))  # a writable copy, never a view of the ring
        pos += ln
    return pickle.loads(data, buffers=buffers)


def decode_pickle_view(body: memoryview | bytes | bytearray, oob: bool) -> Any:
    """Decode a pickle body without copying its large buffers: a large ``bytes`` arrives as a
    read-only ``memoryview`` of ``body``, an array as a read-only array on it. They alias
    ``body``, so they are valid while it is (for the ring: until the reader moves on)."""
    mv = memoryview(body).toreadonly()
    if not oob:
        if mv[-1] != _INDEX_TAG:
            return pickle.loads(mv)
        return _loads_indexed(mv)
    data, words, pos = _oob_split(mv)
    buffers: list[Buffer] = []
    for word in words:
        ln = word & ~_BYTES_KIND
        buffers.append(mv[pos : pos + ln])
        pos += ln
    return pickle.loads(data, buffers=buffers)


def _loads_indexed(mv: memoryview) -> Any:
    """Unpickle a stream with an index, its large ``bytes`` payloads as views of ``mv``: the
    stream is rebuilt without them (each header becomes ``NEXT_BUFFER``), a small copy."""
    end = len(mv) - 13
    off, k, _tag = _INDEX_1.unpack_from(mv, end)
    if k == 1:  # the common case, without the loop
        if mv[off] == 0x42:  # BINBYTES
            start = off + 5
            stop = start + _U32.unpack_from(mv, off + 1)[0]
        else:  # BINBYTES8
            start = off + 9
            stop = start + _U64.unpack_from(mv, off + 1)[0]
        return pickle.loads(b"".join((mv[:off], _NEXT_BUFFER, mv[stop:end])), buffers=(mv[start:stop],))
    end -= 8 * (k - 1)
    pieces: list[Buffer] = []
    views: list[memoryview] = []
    pos = 0
    for off in struct.unpack_from(f"<{k}Q", mv, end):
        if mv[off] == 0x42:  # BINBYTES
            size, length = 5, _U32.unpack_from(mv, off + 1)[0]
        else:  # BINBYTES8
            size, length = 9, _U64.unpack_from(mv, off + 1)[0]
        pieces.append(mv[pos:off])
        pieces.append(_NEXT_BUFFER)
        pos = off + size + length
        views.append(mv[off + size : pos])
    pieces.append(mv[pos:end])
    return pickle.loads(b"".join(pieces), buffers=views)


class SchemaCodec:
    """Validates with a pydantic model and encodes as JSON: no pickle on either side."""

    def __init__(self, schema: type[BaseModel]) -> None:
        self.schema = schema

    def encode(self, obj: object) -> tuple[Sequence[Buffer], int, bool]:
        # An instance is validated again: model_construct() or assignment may have made it invalid.
        data = dict(obj) if isinstance(obj, BaseModel) else obj
        try:
            model = self.schema.model_validate(data)
        except ValidationError as exc:
            raise SchemaViolation(self.schema.__qualname__, exc.errors(include_url=False)) from exc
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
