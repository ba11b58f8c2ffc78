"""The TCP wire protocol between a writer's server and remote readers (docs/design.md).

Every frame group starts with a one-byte kind. With CurveZMQ every frame is encrypted and
authenticated by the transport; in insecure mode a last frame carries an HMAC-SHA256 of the
others, checked with ``compare_digest`` before anything else is parsed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from typing import Any

PROTOCOL_VERSION = 1

# reader -> server
HELLO = b"H"  # json {version, name, pid, window, resume}
ACK = b"A"  # u64 next seq wanted (everything before it consumed); also the heartbeat
NACK = b"N"  # u64 next seq wanted: resend from there
BYE = b"B"
# server -> reader
WELCOME = b"W"  # json {start, policy, hb_interval, hb_timeout, window}
BATCH = b"M"  # header, blob
HEARTBEAT = b"P"  # u64 end (next seq the server will have), u64 closed
LAGGED = b"L"  # u64 from_seq, u64 missed
END = b"E"  # u64 final seq, reason
UNKNOWN = b"U"  # "who are you?": the server dropped this reader; say HELLO again
REFUSED = b"R"  # reason

U64 = struct.Struct("<Q")
U64x2 = struct.Struct("<QQ")
BATCH_HEAD = struct.Struct("<QI")  # first seq, count; then count x ENTRY
ENTRY = struct.Struct("<QB")  # body length, flags (1: out-of-band pickle)
MAC_BYTES = 32

#: largest frame a reader accepts (a body larger than this is refused by the socket)
DEFAULT_MAX_FRAME = 1 << 31
#: largest frame the server accepts from a reader (control frames are tiny)
MAX_CONTROL_FRAME = 64 * 1024


class FrameError(ValueError):
    """A frame that is not well formed or not authentic."""


def sign(key: bytes | None, frames: list[bytes]) -> list[bytes]:
    if key is None:
        return frames
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for f in frames:
        mac.update(U64.pack(len(f)))
        mac.update(f)
    return [*frames, mac.digest()]


def verify(key: bytes | None, frames: list[bytes]) -> list[bytes]:
    """Return the frames without their MAC, or raise ``FrameError`` if it does not match."""
    if key is None:
        return frames
    if len(frames) < 2 or len(frames[-1]) != MAC_BYTES:
        raise FrameError("missing signature")
    body = frames[:-1]
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for f in body:
        mac.update(U64.pack(len(f)))
        mac.update(f)
    if not hmac.compare_digest(mac.digest(), frames[-1]):
        raise FrameError("bad signature")
    return body


def encode_json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def decode_json(raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FrameError(f"bad JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise FrameError("expected a JSON object")
    return obj


def encode_batch(first: int, items: list[tuple[bytes, int]]) -> list[bytes]:
    head = bytearray(BATCH_HEAD.pack(first, len(items)))
    for body, flags in items:
        head += ENTRY.pack(len(body), flags)
    blob = items[0][0] if len(items) == 1 else b"".join(b for b, _ in items)
    return [BATCH, bytes(head), blob]


def decode_batch(head: bytes, blob: bytes) -> tuple[int, list[tuple[memoryview, int]]]:
    """Split a batch into ``(first seq, [(body, flags), ...])``; raise ``FrameError`` if the
    lengths do not add up."""
    if len(head) < BATCH_HEAD.size:
        raise FrameError("truncated batch header")
    first, count = BATCH_HEAD.unpack_from(head, 0)
    if len(head) != BATCH_HEAD.size + count * ENTRY.size:
        raise FrameError("batch header length does not match its count")
    out = []
    pos = 0
    mv = memoryview(blob)
    for k in range(count):
        ln, flags = ENTRY.unpack_from(head, BATCH_HEAD.size + k * ENTRY.size)
        if pos + ln > len(blob):
            raise FrameError("batch is shorter than its header says")
        out.append((mv[pos : pos + ln], flags))
        pos += ln
    if pos != len(blob):
        raise FrameError("batch is longer than its header says")
    return first, out
