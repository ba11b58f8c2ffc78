"""The TCP wire protocol between a writer's server and remote readers (docs/design.md,
docs/security.md).

Every frame group starts with a one-byte kind. Two connections per reader:

- the control connection (HELLO, ACK, NACK, BYE; WELCOME, KEYS, HEARTBEAT, UNKNOWN, REFUSED):
  CurveZMQ encrypts and authenticates it; in insecure mode a last frame carries an HMAC-SHA256
  of the others, checked with ``compare_digest`` before anything else is parsed;
- the data connection (BATCH, LAGGED, END, server to reader only): ZeroMQ without CurveZMQ
  (a PLAIN password from WELCOME admits it), each body and each frame sealed by ``_seal.py``
  under the group key that WELCOME and KEYS deliver, each frame group ending with the
  server's MAC for its one reader (``_seal.WriterMac``, its key in that reader's WELCOME).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

#: 2: a batch carries its bodies in one or more frames (large bodies alone), not one blob.
#: 3: the pickle body format of aiobroadcast/_codec.py (large bytes indexed, or out of band).
#: 4: sealed data frames on a connection of their own (the group key in WELCOME and KEYS).
#: 5: the data connection's PLAIN password in WELCOME (a reader of 4 would connect without it and
#: starve); insecure=True: the control handshake is PLAIN.
#: 6: every data frame group ends with the writer's MAC for its reader (its key in WELCOME): a
#: reader of 5 would take the MAC frame for bodies, and accept what another reader forged.
PROTOCOL_VERSION = 6

# reader -> server
HELLO = b"H"  # json {version, name, pid, host (optional), window, resume, channel}
ACK = b"A"  # u64 next seq wanted (everything before it consumed); also the heartbeat
NACK = b"N"  # u64 next seq wanted: resend from there
BYE = b"B"
# server -> reader, on the control connection
WELCOME = b"W"  # json {start, policy, hb_interval, hb_timeout, window, data_port, keys, mac_key (hex)}
KEYS = b"K"  # the keys message of _seal.py (after a rekey)
HEARTBEAT = b"P"  # u64 end (next seq the server will have), u64 closed
# server -> reader, on the data connection; each group ends with the writer's MAC for its reader
# (_seal.WRITER_MAC: u64 counter, 16-byte tag)
BATCH = b"M"  # header, then frames that each hold whole sealed bodies (a large one alone, small ones joined)
LAGGED = b"L"  # sealed: u64 from_seq, u64 missed
END = b"E"  # sealed: u64 final seq, then the reason
# server -> reader, on the control connection again
UNKNOWN = b"U"  # "who are you?": the server dropped this reader; say HELLO again
REFUSED = b"R"  # reason

U64 = struct.Struct("<Q")
U64x2 = struct.Struct("<QQ")
BATCH_HEAD = struct.Struct("<QI")  # first seq, count; then count x ENTRY
ENTRY = struct.Struct("<QB")  # body length, flags (1: out-of-band pickle)
MAC_BYTES = 32

#: largest frame a reader accepts (a body larger than this is refused by the socket)
DEFAULT_MAX_FRAME = 1 << 31
#: largest frame the server accepts from a reader (control frames are tiny: the largest, a HELLO
#: with a name of NAME_CHARS characters each escaped as two UTF-16 units and a host name of
#: HOST_CHARS, is under 3.5 KiB)
MAX_CONTROL_FRAME = 4 * 1024
#: the longest data-connection password a WELCOME may name (the server's are 32 hex digits)
MAX_DATA_TOKEN = 128
#: the user name of the PLAIN handshakes (the data connection; the control connection under
#: insecure=True): the password is what admits
PLAIN_USER = b"aiobroadcast"
#: frames of a reader's message, the signature included: the kind and at most one argument
MAX_CONTROL_FRAMES = 3
#: a reader's name and host name as they travel in HELLO (longer ones are cut by the reader)
NAME_CHARS = 256
HOST_CHARS = 64
#: the largest sequence number either side uses (they count messages from 0)
MAX_SEQ = 2**63 - 1
#: a body at least this large travels in a frame of its own: it is never copied into a joined
#: frame, and the server hands the frame it made from the ring to ZeroMQ as is (shared, not
#: copied, when it goes to several readers or again after a loss). Smaller bodies are joined,
#: since a frame costs more than a copy of a few KiB.
FRAME_ALONE = 16 * 1024


class FrameError(ValueError):
    """A frame that is not well formed or not authentic."""


def _nbytes(f: Any) -> int:
    return memoryview(f).nbytes


def _mac(key: bytes, frames: Sequence[Any]) -> bytes:
    """HMAC-SHA256 of the frames, each preceded by its length (so no two different frame
    groups, e.g. ``[b"ab", b"c"]`` and ``[b"a", b"bc"]``, have the same signature)."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for f in frames:
        mac.update(U64.pack(_nbytes(f)))
        mac.update(f)
    return mac.digest()


def control_password(key: bytes) -> bytes:
    """The PLAIN password of the control connection under insecure=True, derived from the
    handle's HMAC key: the server refuses a peer without it at the handshake. It travels in
    clear (as everything does in that mode); it is not the key, and signs nothing."""
    return hmac.new(key, b"aiobroadcast control connection", hashlib.sha256).hexdigest().encode()


def sign(key: bytes | None, frames: list[Any]) -> list[Any]:
    """``frames``: bytes or any buffer (a ``zmq.Frame``); with a key, the HMAC frame is added."""
    if key is None:
        return frames
    return [*frames, _mac(key, frames)]


def verify(key: bytes | None, frames: list[Any]) -> list[Any]:
    """Return the frames without their MAC, or raise ``FrameError`` if it does not match."""
    if key is None:
        return frames
    if len(frames) < 2 or _nbytes(frames[-1]) != MAC_BYTES:
        raise FrameError("missing signature")
    body = frames[:-1]
    if not hmac.compare_digest(_mac(key, body), bytes(frames[-1])):
        raise FrameError("bad signature")
    return body


def version_mismatch(version: int) -> bytes:
    """The server's REFUSED to a HELLO of another protocol version: which, and what to do."""
    return (
        f"protocol version mismatch: this reader speaks {version}, the writer's server "
        f"{PROTOCOL_VERSION} (use the same aiobroadcast version on both sides)"
    ).encode()[:256]


def encode_json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class Hello(BaseModel):
    """A reader's HELLO, validated field by field before the server acts on any of it: strict
    types (no float or bool where an integer belongs, no Infinity or NaN), bounded numbers and
    strings, and the JSON parser's own nesting limit. ``resume``: the next message the reader
    needs (None: a new reader, starting with the next message published)."""

    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")

    version: int
    name: Annotated[str, Field(max_length=NAME_CHARS)] = "?"
    pid: Annotated[int, Field(ge=0, le=2**32)] = 0
    host: Annotated[str, Field(max_length=HOST_CHARS)] = ""
    window: Annotated[int, Field(ge=1, le=2**31)]
    resume: Annotated[int, Field(ge=0, le=MAX_SEQ)] | None = None
    #: the channel id (token) of the reader's handle: a handle of an earlier writer at the same
    #: endpoint, with the same keys, is refused by name instead of failing to open every frame
    channel: Annotated[str, Field(max_length=256)] | None = None


def decode_hello(raw: bytes) -> Hello:
    """Parse and validate a HELLO body, or raise ``FrameError`` saying what is wrong."""
    try:
        return Hello.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "body"
        raise FrameError(f"bad HELLO ({where}: {first['msg']})") from None


def decode_json(raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FrameError(f"bad JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise FrameError("expected a JSON object")
    return obj


def encode_batch(first: int, items: Sequence[tuple[Any, int]]) -> list[Any]:
    """``items``: ``(body, flags)``, a body being bytes or a buffer such as a ``zmq.Frame``.
    A body of ``FRAME_ALONE`` bytes or more is a frame of its own, passed through as it is (no
    copy here); runs of smaller ones are joined into one frame."""
    head = bytearray(BATCH_HEAD.pack(first, len(items)))
    frames: list[Any] = [BATCH, b""]
    run: list[Any] = []
    for body, flags in items:
        n = len(body)
        head += ENTRY.pack(n, flags)
        if n >= FRAME_ALONE:
            if run:
                frames.append(run[0] if len(run) == 1 else b"".join(run))
                run = []
            frames.append(body)
        else:
            run.append(body)
    if run:
        frames.append(run[0] if len(run) == 1 else b"".join(run))
    frames[1] = bytes(head)
    return frames


def decode_batch(head: bytes, parts: Sequence[Any]) -> tuple[int, list[tuple[memoryview, int]]]:
    """Split a batch into ``(first seq, [(body, flags), ...])``, the bodies being views of
    ``parts`` (the frames after the header); raise ``FrameError`` unless every frame holds
    whole bodies and the lengths add up."""
    if len(head) < BATCH_HEAD.size:
        raise FrameError("truncated batch header")
    first, count = BATCH_HEAD.unpack_from(head, 0)
    if len(head) != BATCH_HEAD.size + count * ENTRY.size:
        raise FrameError("batch header length does not match its count")
    out = []
    views = [memoryview(p).cast("B") for p in parts]
    if not views:
        raise FrameError("batch without a body frame")
    frame = 0
    mv = views[0]
    pos = 0
    for k in range(count):
        ln, flags = ENTRY.unpack_from(head, BATCH_HEAD.size + k * ENTRY.size)
        if pos == len(mv) and (ln or pos) and frame + 1 < len(views):
            frame += 1  # this frame is used up: the body starts the next one
            mv = views[frame]
            pos = 0
        if pos + ln > len(mv):
            raise FrameError("batch is shorter than its header says")
        out.append((mv[pos : pos + ln], flags))
        pos += ln
    if pos != len(mv) or frame != len(views) - 1:
        raise FrameError("batch is longer than its header says")
    return first, out
