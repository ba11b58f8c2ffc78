"""The TCP wire protocol between a writer's server and remote readers (docs/design.md,
docs/security.md).

Every frame group starts with a one-byte kind. Two connections per reader:

- the control connection (HELLO, ACK, NACK, BYE; WELCOME, KEYS, HEARTBEAT, UNKNOWN, REFUSED):
  CurveZMQ encrypts and authenticates it; in insecure mode a last frame carries the session
  (the reader's nonce, the server's, a counter per direction) and an HMAC-SHA256 of it, its
  direction and the others, checked with ``compare_digest`` before anything else is parsed
  (``sign``, ``verify``; ``ReaderSigner`` and ``Session`` keep each side's state);
- the data connection (BATCH, LAGGED, END, server to reader only): ZeroMQ without CurveZMQ
  (a PLAIN password from WELCOME admits it), each body and each frame sealed by ``seal.py``
  under the group key that WELCOME and KEYS deliver, each frame group ending with the
  server's MAC for its one reader (``seal.WriterMac``, its key in that reader's WELCOME).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from pydantic import BaseModel, ConfigDict, Field, ValidationError

#: 2: a batch carries its bodies in one or more frames (large bodies alone), not one blob.
#: 3: the pickle body format of aiobroadcast/_base/codec.py (large bytes indexed, or out of band).
#: 4: sealed data frames on a connection of their own (the group key in WELCOME and KEYS).
#: 5: the data connection's PLAIN password in WELCOME (a reader of 4 would connect without it and
#: starve); insecure=True: the control handshake is PLAIN.
#: 6: the writer's run in WELCOME and in a resuming HELLO (RESTARTED answers another run's);
#: every data frame group ends with the writer's MAC for its reader (its key in WELCOME): a
#: reader of 5 would take the MAC frame for bodies, and accept what another reader forged;
#: insecure=True: control frames are signed in a session (both sides' nonces, a counter per
#: direction), and the control, password and data keys are derived from the handle's key (HKDF).
PROTOCOL_VERSION = 6

# reader -> server
HELLO = b"H"  # json {version, name, pid, host (optional), window, resume, channel, run}
ACK = b"A"  # u64 next seq wanted (everything before it consumed); also the heartbeat
NACK = b"N"  # u64 next seq wanted: resend from there
BYE = b"B"
# server -> reader, on the control connection
WELCOME = b"W"  # json {start, policy, hb_interval, hb_timeout, window, data_port, keys, mac_key (hex), run}
KEYS = b"K"  # the keys message of seal.py (after a rekey)
HEARTBEAT = b"P"  # u64 end (next seq the server will have), u64 closed
# server -> reader, on the data connection; each group ends with the writer's MAC for its reader
# (seal.WRITER_MAC: u64 counter, 16-byte tag)
BATCH = b"M"  # header, then frames that each hold whole sealed bodies (a large one alone, small ones joined)
LAGGED = b"L"  # sealed: u64 from_seq, u64 missed
END = b"E"  # sealed: u64 final seq, then the reason
# server -> reader, on the control connection again
UNKNOWN = b"U"  # "who are you?": the server dropped this reader; say HELLO again
REFUSED = b"R"  # reason
RESTARTED = b"G"  # "gone": the HELLO names an earlier run of this channel's writer; that stream ended
#: the kinds a server may send as the answer to a frame of no session it holds (insecure mode:
#: signed without the server's nonce, echoing the counter of the frame answered)
ANSWER_KINDS = (UNKNOWN, REFUSED, RESTARTED)

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
#: the longest run id a WELCOME or HELLO may name (the server's are 16 hex digits)
MAX_RUN = 64
#: the user name of the PLAIN handshakes (the data connection; the control connection of
#: readers of protocol 5 under insecure=True): the password is what admits
PLAIN_USER = b"aiobroadcast"
#: the user name of the control connection's PLAIN handshake under insecure=True (protocol 6 on;
#: a server admits a reader of 5 too, with that protocol's password, to refuse it by name)
CONTROL_USER = b"aiobroadcast/6"
#: frames of a reader's message, the signature included: the kind and at most one argument
#: (under insecure=True counted once the signature is checked: an authentic message with more
#: drops its sender, one injected by an on-path host nobody)
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


# --- insecure mode: the keys, and the signed control connection ---------------------------------
#
# The handle's key (``hmac_key``) is used for nothing directly: HKDF-SHA256 derives from it, under
# labels of their own, the key that signs control frames, the control connection's PLAIN password,
# and the secret the data plane's keys are derived from (``seal.py``, with per-key salts).

_LABEL_MAC = b"aiobroadcast/6 control frames"
_LABEL_PASSWORD = b"aiobroadcast/6 control password"
_LABEL_DATA = b"aiobroadcast/6 data plane"


def _hkdf(secret: bytes, label: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=label).derive(secret)


def control_key(secret: bytes) -> bytes:
    """The key that signs control frames under insecure=True, from the handle's key."""
    return _hkdf(secret, _LABEL_MAC)


def control_password(secret: bytes) -> bytes:
    """The PLAIN password of the control connection under insecure=True, derived from the
    handle's key: the server refuses a peer without it at the handshake. It travels in clear
    (as everything does in that mode); it is not a key, and signs nothing."""
    return _hkdf(secret, _LABEL_PASSWORD).hex().encode()


def data_secret(secret: bytes) -> bytes:
    """The secret the data plane's keys are derived from under insecure=True (``seal.py``)."""
    return _hkdf(secret, _LABEL_DATA)


#: a session's nonces: the reader draws one, the server another (in HELLO and WELCOME)
NONCE_BYTES = 16
#: the server's nonce in what a reader sends before WELCOME, and in a server's answer to a frame
#: of no session it holds (UNKNOWN, REFUSED: then the counter is that frame's, echoed)
NO_NONCE = bytes(NONCE_BYTES)
#: the last frame of a signed frame group: reader's nonce, server's nonce, counter, then the MAC
TRAILER = struct.Struct("<16s16sQ")
SIGNATURE_BYTES = TRAILER.size + MAC_BYTES
#: what the MAC binds first: the direction (a frame cannot be sent back the other way)
TO_READER, TO_SERVER = b"server->reader", b"reader->server"


def _mac(key: bytes, direction: bytes, trailer: bytes, frames: Sequence[Any]) -> bytes:
    """HMAC-SHA256 of the direction, the session and the frames, each frame preceded by its
    length (so no two different frame groups, e.g. ``[b"ab", b"c"]`` and ``[b"a", b"bc"]``,
    have the same signature)."""
    mac = hmac.new(key, direction, digestmod=hashlib.sha256)
    mac.update(trailer)
    for f in frames:
        mac.update(U64.pack(_nbytes(f)))
        mac.update(f)
    return mac.digest()


def sign(
    key: bytes, frames: list[Any], *, to_reader: bool, reader_nonce: bytes, server_nonce: bytes, counter: int
) -> list[Any]:
    """``frames`` (bytes or any buffer, e.g. a ``zmq.Frame``) and their signature frame: the
    session and counter they belong to, and the MAC (``key``: ``control_key``)."""
    trailer = TRAILER.pack(reader_nonce, server_nonce, counter)
    return [*frames, trailer + _mac(key, TO_READER if to_reader else TO_SERVER, trailer, frames)]


@dataclass(frozen=True, slots=True)
class Signed:
    """An authentic frame group: its frames, and the session and counter it was signed in
    (whether that session is the receiver's, and the counter new, is the receiver's to check)."""

    frames: list[Any]
    reader_nonce: bytes
    server_nonce: bytes
    counter: int


def verify(key: bytes, frames: list[Any], *, to_reader: bool) -> Signed:
    """The frames without their signature, with its session, or ``FrameError`` if the MAC does
    not match (nothing of the frames is parsed before)."""
    if len(frames) < 2 or _nbytes(frames[-1]) != SIGNATURE_BYTES:
        raise FrameError("missing signature")
    body = frames[:-1]
    sig = bytes(frames[-1])
    trailer = sig[: TRAILER.size]
    if not hmac.compare_digest(_mac(key, TO_READER if to_reader else TO_SERVER, trailer, body), sig[TRAILER.size :]):
        raise FrameError("bad signature")
    reader_nonce, server_nonce, counter = TRAILER.unpack(trailer)
    return Signed(body, reader_nonce, server_nonce, counter)


@dataclass(slots=True)
class Session:
    """The server's side of one reader's signed control connection: the nonces, the counter of
    its next frame to the reader, and the last counter it accepted from the reader."""

    reader_nonce: bytes
    server_nonce: bytes
    heard: int
    sent: int = 0

    def sign(self, key: bytes, frames: list[Any]) -> list[Any]:
        self.sent += 1
        return sign(
            key,
            frames,
            to_reader=True,
            reader_nonce=self.reader_nonce,
            server_nonce=self.server_nonce,
            counter=self.sent,
        )


def sign_answer(key: bytes, frames: list[Any], asked: Signed) -> list[Any]:
    """Sign an answer to ``asked``, a frame of no session the server holds (UNKNOWN, REFUSED):
    for the reader's nonce, with no server nonce, echoing the reader's counter, so the reader
    takes it once, and only as an answer to a frame of its own."""
    return sign(
        key, frames, to_reader=True, reader_nonce=asked.reader_nonce, server_nonce=NO_NONCE, counter=asked.counter
    )


class ServerSigner:
    """The server's side of its readers' signed control connections (insecure=True): which
    session a frame from a connection belongs to (``take``), and the signatures of what goes to
    a reader (``sign`` in its session, ``answer`` outside any). ``secret``: the handle's key."""

    def __init__(self, secret: bytes, random: Callable[[int], bytes] = os.urandom) -> None:
        self._secret = secret
        self._key = control_key(secret)
        self._random = random

    def take(self, frames: list[Any], current: Session | None) -> tuple[Signed, Session | None]:
        """An authentic frame group from a connection whose reader's session is ``current`` (None:
        the server holds no reader for it), and its session: ``current`` (its counter must be
        new), or a new one for a HELLO outside any on a connection without a reader (the server's
        nonce is drawn here, and goes back in the WELCOME's signature); None for a frame to answer
        "who are you?": from a connection without a reader (one the server dropped, or served
        before it died), or of the reader's nonce before it had its WELCOME. ``FrameError`` if it
        is not authentic, a replay, or of another session on a reader's connection (a copy of
        another connection's frame, or of an older session's: a reader opens a new session only
        once the server lost its own)."""
        signed = verify(self._key, frames, to_reader=False)
        # A HELLO has no server nonce until its WELCOME came (one repeated before that has none).
        opening = bool(signed.frames) and bytes(signed.frames[0]) == HELLO and signed.server_nonce == NO_NONCE
        if current is None:
            return signed, Session(signed.reader_nonce, self._random(NONCE_BYTES), signed.counter) if opening else None
        if signed.reader_nonce != current.reader_nonce:
            raise FrameError("signed in another session than that reader's")
        if signed.server_nonce == current.server_nonce or opening:
            if signed.counter <= current.heard:
                raise FrameError(f"frame {signed.counter} of this session taken already (a replay)")
            current.heard = signed.counter
            return signed, current
        if signed.server_nonce == NO_NONCE:
            return signed, None  # its WELCOME was lost: it says HELLO again
        raise FrameError("signed in another session than that reader's")

    def sign(self, frames: list[Any], session: Session | None, asked: Signed | None) -> list[Any] | None:
        """``frames`` to a reader, signed in its ``session``, or without one as the answer to
        ``asked`` (the frame group being taken from it); None without either (nobody to answer)."""
        if session is not None:
            return session.sign(self._key, frames)
        return None if asked is None else self.answer(frames, asked)

    def answer(self, frames: list[Any], asked: Signed) -> list[Any]:
        return sign_answer(self._key, frames, asked)

    def refuse_legacy(self, frames: list[Any]) -> list[list[Any]]:
        """If ``frames`` is the HELLO of a reader of protocol 5 (signed with the handle's key
        itself), its refusal, signed as that reader checks it (it says why it cannot read); else
        nothing."""
        if legacy_verify(self._secret, frames) is None:
            return []
        reason = f"protocol version mismatch: this server speaks protocol {PROTOCOL_VERSION}, the reader 5"
        return [legacy_sign(self._secret, [REFUSED, reason.encode()])]


class ReaderSigner:
    """A reader's side of its signed control connection (insecure=True): signs what it sends
    in its session, and takes from the server only what was signed for that session, each frame
    once (a counter above the last). ``secret``: the handle's key.

    A session is the reader's nonce (drawn anew by ``new_session``) and the server's, which the
    server's WELCOME to the HELLO with the reader's nonce brings. Before WELCOME the reader signs
    with no server nonce, and takes only that WELCOME, or an answer the server signs for a frame
    of a session it does not hold (UNKNOWN, REFUSED: they echo the counter of the reader's frame,
    each taken once). So a frame recorded from another connection, another session, or earlier
    in this one is refused: a REFUSED or a BYE of old, an old KEYS, another reader's WELCOME."""

    def __init__(self, secret: bytes, random: Callable[[int], bytes] = os.urandom) -> None:
        self._key = control_key(secret)
        self._random = random
        self.reader_nonce = random(NONCE_BYTES)
        #: the server's nonce, from WELCOME (None before)
        self.server_nonce: bytes | None = None
        self._sent = 0  # the counter of the next frame sent (never goes back, across sessions)
        self._heard = -1  # the last counter taken from the server in this session
        self._echoed = -1  # the last of our counters an answer of no session echoed

    def new_session(self) -> None:
        """The server lost our session (it said UNKNOWN, ``verify`` calls this): a new nonce for
        the next HELLO. Not while the session waits for its WELCOME (a repeated HELLO keeps its
        nonce)."""
        if self.server_nonce is not None:
            self.reader_nonce = self._random(NONCE_BYTES)
            self.server_nonce = None
            self._heard = self._echoed = -1

    def sign(self, frames: list[Any]) -> list[Any]:
        counter = self._sent
        self._sent += 1
        return sign(
            self._key,
            frames,
            to_reader=False,
            reader_nonce=self.reader_nonce,
            server_nonce=self.server_nonce or NO_NONCE,
            counter=counter,
        )

    def verify(self, frames: list[Any]) -> list[Any]:
        """The frames of an authentic frame group of this session, not seen before; or
        ``FrameError``. A WELCOME for our nonce starts the session's server side."""
        signed = verify(self._key, frames, to_reader=True)
        body = signed.frames
        if signed.reader_nonce != self.reader_nonce:
            raise FrameError("signed for another session (another reader's, or an old one)")
        if signed.server_nonce == NO_NONCE:
            if not body or bytes(body[0]) not in ANSWER_KINDS:
                raise FrameError("only UNKNOWN, REFUSED and RESTARTED answer a frame of no session")
            if not self._echoed < signed.counter < self._sent:
                raise FrameError(f"an answer to frame {signed.counter}, taken already or never sent")
            self._echoed = signed.counter
            if bytes(body[0]) == UNKNOWN:
                self.new_session()  # the server holds no session of ours: the next HELLO opens one
            return body
        if self.server_nonce is None:
            if not body or body[0] != WELCOME:
                raise FrameError("a frame of a session before its WELCOME")
            self.server_nonce = signed.server_nonce
        elif signed.server_nonce != self.server_nonce:
            raise FrameError("signed for another session of the server")
        elif signed.counter <= self._heard:
            raise FrameError(f"frame {signed.counter} of this session taken already (a replay)")
        self._heard = signed.counter
        return body


def legacy_verify(secret: bytes, frames: list[Any]) -> list[Any] | None:
    """A HELLO as a reader of protocol 5 signs it under insecure=True (an HMAC of the frames under
    the handle's key, no session), or None: the server refuses such a reader by name."""
    if len(frames) != 3 or bytes(frames[0]) != HELLO or _nbytes(frames[-1]) != MAC_BYTES:
        return None
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for f in frames[:-1]:
        mac.update(U64.pack(_nbytes(f)))
        mac.update(f)
    return frames[:-1] if hmac.compare_digest(mac.digest(), bytes(frames[-1])) else None


def legacy_sign(secret: bytes, frames: list[Any]) -> list[Any]:
    """``frames`` signed as a reader of protocol 5 checks them (its refusal)."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for f in frames:
        mac.update(U64.pack(_nbytes(f)))
        mac.update(f)
    return [*frames, mac.digest()]


def legacy_password(secret: bytes) -> bytes:
    """The control connection's PLAIN password of protocol 5 (admits such a reader, to refuse it)."""
    return hmac.new(secret, b"aiobroadcast control connection", hashlib.sha256).hexdigest().encode()


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
    #: the writer's run that admitted this reader before (WELCOME's ``run``), on a HELLO that
    #: resumes: a writer restarted with the same channel id has another run, and numbers its
    #: messages anew, so the reader's stream has ended (``RESTARTED``) instead of resuming
    run: Annotated[str, Field(max_length=MAX_RUN)] | None = None


def hello(who: dict[str, Any], *, window: int, resume: int | None, channel: str, run: str | None) -> bytes:
    """A reader's HELLO body (``Hello``): ``who`` it is (name, pid, host), the credit it asks,
    where it resumes (None: a new reader), its handle's channel and the run that admitted it."""
    body = {"version": PROTOCOL_VERSION, **who, "window": window, "resume": resume, "channel": channel}
    if run is not None:
        body["run"] = run
    return encode_json(body)


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
