"""Sealing of the TCP data plane: every message sealed once, for every remote reader.

No sockets, no clocks: bytes in, bytes out (docs/security.md has the threat model).

The writer's TCP server holds a *group key* (256 bits, drawn at random per server process and per
rekey, named by a 32-bit key id) and hands it to each admitted reader over the CurveZMQ control
connection. Each message body is sealed once with AES-256-GCM under it, and the sealed bytes go
to every reader (and again after a loss): N readers cost one encryption, not N as with a
CurveZMQ connection each.

- **Nonce**: ``key id (u32) || counter (u64)``, little endian. A message's counter is its
  sequence number (below 2**63); frames that are not messages (``LAGGED``, ``END``) take counters
  from 2**63 up, one per frame. ``Sealer`` refuses a message counter that is not above the last
  one it sealed under that key, so a nonce is never used twice under one key.
- **Associated data**: a version tag, the frame kind, the message's flags, the key id, the
  counter and the channel id (the handle's token). A sealed body moved to another place in the
  stream, to another channel, or shown with other flags does not open.
- **Sealed body**: ``key id (u32) || ciphertext || tag (16 bytes)``. Frames that are not
  messages carry their counter too: ``key id || counter (u64) || ciphertext || tag``.
- **Insecure mode** (``secret`` given: the handle's shared key, no CurveZMQ): nothing is encrypted,
  but every body is authenticated with GMAC (AES-GCM with the body as associated data), under a key
  derived from the shared secret and a per-key salt that the server announces (HKDF-SHA256). Pickle
  is never decoded unauthenticated.
- **Writer-only** (``WriterMac``): every admitted reader holds the group key, so a frame sealed
  by one of them opens at every other. So each data frame group also carries a MAC of the
  writer's server for the one reader it goes to, under a key of that reader alone (drawn by the
  server at its admission, given in its WELCOME): GMAC over the whole group (kind, header,
  every sealed byte), one pass at GMAC's speed per reader. Not over the GCM tags alone: whoever
  holds the group key can make another body with the same tag (GHASH is linear in its key).
- **Rekey**: after ``rekey_messages`` messages or ``rekey_bytes`` bytes under one key, or on
  demand. The next key is always announced before it is used (``keys_message`` holds the keys in
  use and the next one), so a reader that has the latest key message opens the first frame under
  the new key; one that missed it fetches the keys again (``UnknownKey``). A reader is given
  only the old keys of messages from where it starts (``keys_message(start)``).
- **Revocation** (``exclude``): a rekey past the current key and the announced next one, which
  a revoked reader holds: nothing sealed after it opens with any key that reader was given.
"""

from __future__ import annotations

import collections
import hmac
import os
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .._base import constants as _constants

KEY_BYTES = 32
TAG_BYTES = 16
KEY_ID = struct.Struct("<I")
COUNTER = struct.Struct("<Q")
NONCE = struct.Struct("<IQ")  # key id, counter: the 12 bytes GCM wants
#: what a sealed message adds to its body: the key id before, the tag after
OVERHEAD = KEY_ID.size + TAG_BYTES
#: what a sealed control frame adds to its payload: the key id and the counter before, the tag after
CONTROL_OVERHEAD = KEY_ID.size + COUNTER.size + TAG_BYTES
#: counters of frames that are not messages start here (message seqs stay below it)
CONTROL_BASE = 1 << 63
MAX_MESSAGE_SEQ = CONTROL_BASE - 1
#: the default rekey policy: a new key after this many messages or bytes under one key (far
#: below AES-GCM's limits; a rekey costs one small control frame per reader), and the largest
#: values ``open_writer`` accepts
REKEY_MESSAGES = _constants.REKEY_MESSAGES
REKEY_BYTES = _constants.REKEY_BYTES
#: keys a keys message may hold (in use by what the server still holds, and the next one)
MAX_KEYS = 16
#: bodies at least this large are sealed with the streaming API (authenticated in place in
#: insecure mode, without joining associated data and body into one buffer)
LARGE = 4096


def _decrypts_in_place() -> bool:
    """Whether this ``cryptography`` lets ``decrypt_into`` write a body over its own ciphertext.
    Up to 50 it does; from 51 it refuses buffers that overlap (``ValueError``). Asked once, with
    a fixed key and nonce that seal nothing of a channel."""
    aead = AESGCM(bytes(32))
    sealed = memoryview(bytearray(aead.encrypt(bytes(12), bytes(16), None)))
    try:
        aead.decrypt_into(bytes(12), sealed, None, sealed[:16])
    except ValueError:
        return False
    return bytes(sealed[:16]) == bytes(16)


#: a writable large body is opened in place (no buffer to allocate and fill) where this is true
DECRYPTS_IN_PLACE = _decrypts_in_place()
#: a body at least this large (a frame of its own) is opened in one pass with the check of the
#: writer's MAC (``Opener.open(mac=)``), in parts of ``FUSED_CHUNK`` bytes that stay in the cache
#: between the two: two passes over a 4 MiB body out of the cache cost 1.2-1.5 ms more than
#: the opening alone here, one 0.3 ms
FUSED_BYTES = 1 << 20
FUSED_CHUNK = 256 << 10

# version tag, kind, key id, then the channel id, then flags and counter (a fixed-size tail, so
# the head is computed once per key and kind)
_AAD_HEAD = struct.Struct("<4scI")
_AAD_TAIL = struct.Struct("<BQ")
_AAD_TAG = b"abs1"
_KEYS_HEAD = struct.Struct("<BBIB")  # format version, mode, current key id, count
_KEYS_ENTRY = struct.Struct("<I32s")  # key id, key (or, insecure, the salt it is derived with)
_KEYS_VERSION = 1
_MODE_KEY, _MODE_SALT = 0, 1
_HKDF_INFO = b"aiobroadcast data plane key v1"

#: the frame kinds a sealed frame can be (bound in the associated data)
KIND_MESSAGE = b"M"


class SealError(ValueError):
    """A sealed frame that is refused; ``reason`` is a short word for the counters."""

    reason = "rejected"


class NotAuthentic(SealError):
    """It does not open: changed in transit, forged, or sealed for another place or channel."""

    reason = "not_authentic"


class UnknownKey(SealError):
    """Sealed under a key id this reader does not hold: it fetches the keys again."""

    reason = "unknown_key"


class Replayed(SealError):
    """Everything in it was received already (a copy of an old frame)."""

    reason = "replayed"


class OutOfWindow(SealError):
    """Beyond what the reader asked for (its credit), or a counter that went back."""

    reason = "out_of_window"


def _aad(channel: bytes, kind: bytes, flags: int, key_id: int, counter: int) -> bytes:
    return _AAD_HEAD.pack(_AAD_TAG, kind, key_id) + channel + _AAD_TAIL.pack(flags & 0xFF, counter)


def _derive(secret: bytes, salt: bytes, key_id: int) -> bytes:
    hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=salt, info=_HKDF_INFO + KEY_ID.pack(key_id))
    return hkdf.derive(secret)


@dataclass
class _Key:
    key_id: int
    material: bytes  # the key, or in insecure mode the salt it is derived from
    key: bytes
    aead: AESGCM = field(repr=False)
    kid: bytes = b""  # the key id as it leads a sealed body
    msg_aad_head: bytes = b""  # the associated data of a message, up to its flags and number
    #: the last message counter sealed (Sealer) or opened (Opener) under it; -1: none yet
    last_seq: int = -1
    #: the last control counter sealed or accepted under it
    last_control: int = CONTROL_BASE - 1
    messages: int = 0
    nbytes: int = 0

    @classmethod
    def make(cls, key_id: int, material: bytes, secret: bytes | None, channel: bytes) -> _Key:
        key = material if secret is None else _derive(secret, material, key_id)
        head = _AAD_HEAD.pack(_AAD_TAG, KIND_MESSAGE, key_id) + channel
        return cls(key_id, material, key, AESGCM(key), KEY_ID.pack(key_id), head)


def _gmac_stream(key: bytes, nonce: bytes, parts: tuple[Any, ...]) -> Any:
    """A GCM encryptor fed ``parts`` as associated data (no plaintext): GMAC, with no copy."""
    enc = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
    for p in parts:
        enc.authenticate_additional_data(p)
    return enc


class _Keyed:
    def __init__(self, channel: bytes, secret: bytes | None) -> None:
        self._channel = bytes(channel)
        self._secret = secret
        #: True: bodies are encrypted (CurveZMQ delivers the key); False: only authenticated
        self.encrypting = secret is None


#: references to a pooled buffer that nobody uses: the pool's deque, and ``sys.getrefcount``'s
#: own argument and the caller's name for it
_IDLE_REFS = 3


class Buffers:
    """The buffers large bodies are sealed or opened into, used again once nothing refers to them.

    The server's (``Sealer``): a sealed body is held (``_tcp.serving``) and shared with ZeroMQ (a
    ``zmq.Frame`` made without a copy keeps a reference to its buffer until ZeroMQ has sent it to
    every reader); once the readers acknowledged it and ZeroMQ let go, only this pool refers to
    it, and the next body of the same size is sealed into it. A reader's (``Opener``): an opened
    body is queued, then decoded; once the decoded object keeps no view of it (a copying decode),
    the next body is opened into it; a body the user still holds a view of (zero-copy reads,
    out-of-band pickle buffers) is never handed out again. A new ``bytearray`` per body would
    cost a zero-fill, and fresh pages from the kernel, each faulted in and cleared (half the
    server's CPU at 4 MiB; 8-18 % of a remote reader's throughput at 64 KiB). Bodies are
    released in about the order they were taken, so the oldest buffer is the one to look at. At
    most ``keep_bytes`` are pooled; ``clear`` gives back the idle ones. The pool itself is used
    by one thread; the references it counts may be dropped by any."""

    def __init__(self, keep_bytes: int) -> None:
        self._bufs: collections.deque[bytearray] = collections.deque()
        self._bytes = 0
        self._keep = keep_bytes

    def take(self, n: int) -> bytearray:
        bufs = self._bufs
        while bufs:
            buf = bufs[0]
            if sys.getrefcount(buf) > _IDLE_REFS:
                break  # still held or still being sent
            if len(buf) == n:
                bufs.rotate(-1)
                return buf
            bufs.popleft()  # idle, of another size
            self._bytes -= len(buf)
        buf = bytearray(n)
        if self._bytes + n <= self._keep:
            bufs.append(buf)
            self._bytes += n
        return buf

    def clear(self) -> None:
        """Forget the idle buffers (the stream paused: give the memory back)."""
        bufs = self._bufs
        for _ in range(len(bufs)):
            buf = bufs.popleft()
            if sys.getrefcount(buf) > _IDLE_REFS:
                bufs.append(buf)
            else:
                self._bytes -= len(buf)


class Sealer(_Keyed):
    """The server's side: seals each message once, and the frames that are not messages.

    ``channel``: the channel id bound into every frame. ``secret``: None (encrypt; the group
    key goes to readers over CurveZMQ) or the shared secret of an insecure channel (authenticate
    only; keys are derived from it and announced salts). ``rekey_messages``/``rekey_bytes``:
    the rekey policy. ``random``: where keys and key ids come from. ``buffer``: where a large
    sealed body is written (``buffer(n)`` returns a writable buffer of exactly ``n`` bytes; by
    default a new bytearray): the server passes buffers it uses again, which spares a new
    allocation per message (zero-filled by Python, and for bodies of megabytes fresh pages from
    the kernel).
    """

    def __init__(
        self,
        channel: bytes,
        *,
        secret: bytes | None = None,
        rekey_messages: int = REKEY_MESSAGES,
        rekey_bytes: int = REKEY_BYTES,
        random: Callable[[int], bytes] = os.urandom,
        buffer: Callable[[int], bytearray] = bytearray,
    ) -> None:
        super().__init__(channel, secret)
        self._buffer = buffer
        if rekey_messages < 1 or rekey_bytes < 1:
            raise ValueError("the rekey policy needs at least one message and one byte per key")
        self._random = random
        self.rekey_messages = rekey_messages
        self.rekey_bytes = rekey_bytes
        first = KEY_ID.unpack(random(4))[0]
        self._keys: dict[int, _Key] = {}
        self._current = self._new_key(first)
        self._next = self._new_key((first + 1) & 0xFFFFFFFF)
        #: bumped by each rekey: the server sends the keys message again when it changes
        self.epoch = 0

    def writer_mac(self) -> WriterMac:
        """The MAC of a newly admitted reader, under a fresh key of its own (its WELCOME says it)."""
        return WriterMac(self._random(KEY_BYTES))

    def _new_key(self, key_id: int) -> _Key:
        return _Key.make(key_id, self._random(KEY_BYTES), self._secret, self._channel)

    @property
    def key_id(self) -> int:
        return self._current.key_id

    def rekey(self) -> bool:
        """Seal from now on under the announced next key, and announce a new next one. The old
        key stays until ``retire`` says nothing sealed under it is held any more.

        Not while ``MAX_KEYS - 2`` old keys are held (a keys message holds them all, the current
        key and the next: a reader refuses a longer one, and could then open neither what is held
        nor what follows): the rekey waits (False), the current key counts as used up, and the
        first message sealed once ``retire`` made room takes the new key. Messages sealed
        meanwhile are past the policy's count, never past a nonce: AES-GCM allows far more."""
        if len(self._keys) >= MAX_KEYS - 2:
            self._current.messages = max(self._current.messages, self.rekey_messages)
            return False
        self._keys[self._current.key_id] = self._current
        self._current = self._next
        self._next = self._new_key((self._current.key_id + 1) & 0xFFFFFFFF)
        self._keys.pop(self._next.key_id, None)  # a wrapped-around id, long retired
        self.epoch += 1
        return True

    def exclude(self) -> None:
        """A rekey that shuts out whoever holds the keys given so far (a reader revoked): from
        now on nothing is sealed under the current key nor under the announced next one, which
        every reader admitted until now holds; a fresh key seals, and a fresh next one is
        announced. The next key is dropped (nothing was sealed under it); the current one is kept
        while messages sealed under it are held (``retire``), unless it sealed nothing. Readers
        still admitted get the new keys in a keys message (``keys_message``); a frame under the
        new key that overtakes it makes them fetch the keys (``UnknownKey``): the new key cannot
        be announced in advance without giving it to the reader shut out.

        Not held back by ``MAX_KEYS`` as ``rekey`` is (nothing may be sealed under a key the
        revoked reader holds): while the server holds messages under ``MAX_KEYS - 1`` old keys
        the keys message leaves out the next key (``keys_message``)."""
        cur = self._current
        if cur.last_seq >= 0 or cur.last_control >= CONTROL_BASE:
            self._keys[cur.key_id] = cur
        first = (self._next.key_id + 1) & 0xFFFFFFFF  # the withheld next key's id is never used
        self._current = self._new_key(first)
        self._next = self._new_key((first + 1) & 0xFFFFFFFF)
        for key_id in (self._current.key_id, self._next.key_id):
            self._keys.pop(key_id, None)  # a wrapped-around id, long retired
        self.epoch += 1

    def retire(self, oldest_held: int) -> None:
        """Forget the old keys under which nothing from ``oldest_held`` on was sealed."""
        for key_id in [k for k, v in self._keys.items() if v.last_seq < oldest_held]:
            del self._keys[key_id]

    def keys_message(self, start: int = 0) -> bytes:
        """The keys a reader that needs the messages from ``start`` on needs: the old keys still
        held that sealed one of them (not those that sealed only messages before it: a reader
        joining now cannot open what was sealed before it came), the current one and the next
        one (left out if a keys message would then hold more than ``MAX_KEYS``: ``exclude``).
        Confidential in secure mode: send it over CurveZMQ only."""
        old = [k for k in self._keys.values() if k.last_seq >= start]
        keys = [*old[-(MAX_KEYS - 1) :], self._current, self._next][:MAX_KEYS]
        mode = _MODE_KEY if self._secret is None else _MODE_SALT
        out = bytearray(_KEYS_HEAD.pack(_KEYS_VERSION, mode, self._current.key_id, len(keys)))
        for k in keys:
            out += _KEYS_ENTRY.pack(k.key_id, k.material)
        return bytes(out)

    def _take(self, seq: int, n: int) -> _Key:
        if not 0 <= seq <= MAX_MESSAGE_SEQ:
            raise ValueError(f"message seq {seq} out of range")
        key = self._current
        if (
            key.messages >= self.rekey_messages or (key.messages and key.nbytes + n > self.rekey_bytes)
        ) and self.rekey():
            key = self._current
        if seq <= key.last_seq:
            # The nonce would repeat: a message is sealed once, and its sealed bytes resent.
            raise ValueError(f"message {seq} sealed again under key {key.key_id} (last {key.last_seq})")
        key.last_seq = seq
        key.messages += 1
        key.nbytes += n
        return key

    def seal(self, seq: int, flags: int, body: Any) -> bytes | bytearray:
        """Seal message ``seq`` (``body``: bytes or any buffer, e.g. a view of a ring slot). The
        result is ``key id || sealed body || tag``; a large one is a bytearray written in place
        (the one copy out of the ring), to be handed to ZeroMQ without another copy."""
        key = self._current
        n = body.nbytes if isinstance(body, memoryview) else len(body)
        if (
            n < LARGE
            and self.encrypting
            and key.last_seq < seq <= MAX_MESSAGE_SEQ
            and key.messages < self.rekey_messages
            and key.nbytes + n <= self.rekey_bytes
        ):
            # The common case of small messages, kept short: it runs once per message.
            key.last_seq = seq
            key.messages += 1
            key.nbytes += n
            aad = key.msg_aad_head + _AAD_TAIL.pack(flags & 0xFF, seq)
            return key.kid + key.aead.encrypt(NONCE.pack(key.key_id, seq), body, aad)
        mv = memoryview(body).cast("B")
        n = mv.nbytes
        key = self._take(seq, n)
        nonce = NONCE.pack(key.key_id, seq)
        aad = _aad(self._channel, KIND_MESSAGE, flags, key.key_id, seq)
        kid = KEY_ID.pack(key.key_id)
        if n < LARGE:
            if self.encrypting:
                return kid + key.aead.encrypt(nonce, mv, aad)
            return kid + mv.tobytes() + key.aead.encrypt(nonce, b"", aad + kid + mv.tobytes())
        out = self._buffer(n + OVERHEAD)
        out[:4] = kid
        view = memoryview(out)
        if self.encrypting:
            key.aead.encrypt_into(nonce, mv, aad, view[4:])
        else:
            view[4 : 4 + n] = mv
            enc = _gmac_stream(key.key, nonce, (aad, kid, mv))
            enc.finalize()
            view[4 + n :] = enc.tag
        return out

    def seal_control(self, kind: bytes, payload: bytes) -> bytes:
        """Seal a frame that is not a message (``kind``: its frame kind), under a fresh counter."""
        key = self._current
        key.last_control += 1
        counter = key.last_control
        head = KEY_ID.pack(key.key_id) + COUNTER.pack(counter)
        nonce = NONCE.pack(key.key_id, counter)
        aad = _aad(self._channel, kind, 0, key.key_id, counter)
        if self.encrypting:
            return head + key.aead.encrypt(nonce, payload, aad)
        return head + payload + key.aead.encrypt(nonce, b"", aad + head + payload)


#: the last frame of every data frame group: the counter of the writer's MAC, then its tag
WRITER_MAC = struct.Struct("<Q16s")
_WRITER_NONCE = struct.Struct("<4sQ")
_WRITER_TAG = b"abw1"  # in the nonce (the key is the MAC's own) and, with the kind, in what it covers
_FRAME_COUNT = struct.Struct("<I")
_WRITER_META3 = struct.Struct("<4sIQQQ")  # what a group of three frames starts with: tag, count, lengths
#: the nonce of the tag of one frame of a group of more than three: ``_BODY_MARK | the frame's
#: index``, then the group's counter. The first word never equals the group's own (``_WRITER_TAG``
#: read as a little-endian u32 is below ``_BODY_MARK``), so no nonce is used for two things.
_BODY_NONCE = struct.Struct("<IQ")
_BODY_MARK = 1 << 31
_MAX_FRAMES = 1 << 20


class WriterMac:
    """Proof that a data frame group comes from the writer's server, for one reader: the group
    key proves only that it comes from a holder of the group key, which every admitted reader is.

    ``key``: 32 bytes, drawn by the server for one reader at its admission (``Sealer.
    writer_mac``) and given to that reader only, in its WELCOME (over CurveZMQ; in insecure mode
    in clear, like everything there). The server ``sign``s every group it sends that reader
    (``kind``, then its arguments: a batch's header and body frames, a sealed LAGGED or END),
    each under a fresh counter, which travels in the MAC frame: the nonce of GCM under this
    key never repeats. The reader ``check``s the group before anything in it is opened, let alone
    decoded. What the MAC covers: the kind, the length of each frame, the first argument (the
    header, or the sealed payload of a LAGGED or END) and every byte of the others (the sealed
    bodies). A group of one body frame: AES-GCM with the small part as plaintext and the body
    as associated data, of which only the tag is kept. More body frames: a GMAC tag of each
    (nonce: the frame's index and the counter), then AES-GCM over the small part and those
    tags. Either way one pass at GMAC's speed over the bodies, per reader, in one call per frame
    (a streaming GCM object costs ~4 µs to make)."""

    __slots__ = ("_aead", "counter", "key")

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise SealError(f"a writer MAC key has {KEY_BYTES} bytes, not {len(key)}")
        self.key = bytes(key)
        self._aead = AESGCM(self.key)
        #: the last counter signed under this key (server side)
        self.counter = 0

    def _tag(self, counter: int, frames: Sequence[Any]) -> bytes:
        nonce = _WRITER_NONCE.pack(_WRITER_TAG, counter)
        if len(frames) == 3:
            # The common case, kept short (it runs once per batch per reader): a header and one
            # frame of bodies.
            kind, head, bodies = frames
            if type(bodies) is not bytes:
                bodies = memoryview(bodies)
            small = _WRITER_META3.pack(_WRITER_TAG, 3, len(kind), len(head), len(bodies)) + kind + head
            return self._aead.encrypt(nonce, small, bodies)[-TAG_BYTES:]
        # Any other shape: the first two frames whole, and of each further frame its own tag (one
        # call each, under a nonce of its own), which the group's tag then covers. A frame cannot
        # be changed without changing its tag, which nobody without the key can match.
        aead = self._aead
        n = len(frames)
        if n > _MAX_FRAMES:
            raise NotAuthentic(f"a data frame group of {n} frames")
        tags = [
            aead.encrypt(_BODY_NONCE.pack(_BODY_MARK | i, counter), b"", f if type(f) is bytes else memoryview(f))
            for i, f in enumerate(frames[2:], 2)
        ]
        lengths = [len(f) if type(f) is bytes else memoryview(f).nbytes for f in frames]
        small = b"".join((_WRITER_TAG, _FRAME_COUNT.pack(n), struct.pack(f"<{n}Q", *lengths), *frames[:2], *tags))
        return aead.encrypt(nonce, small, None)[-TAG_BYTES:]

    def sign(self, frames: list[Any]) -> list[Any]:
        """``frames`` (kind first) with the MAC frame added, under the next counter."""
        self.counter += 1
        return [*frames, WRITER_MAC.pack(self.counter, self._tag(self.counter, frames))]

    def check(self, frames: list[Any]) -> list[Any]:
        """``frames`` without the MAC frame, or ``NotAuthentic``: not signed by the writer's
        server for this reader (forged by another holder of the group key, changed, or sent to
        another reader)."""
        if len(frames) < 3 or len(frames[-1]) != WRITER_MAC.size or len(frames[0]) != 1:
            raise NotAuthentic("a data frame group without the writer's MAC")
        counter, tag = WRITER_MAC.unpack(frames[-1])
        body = frames[:-1]
        if not hmac.compare_digest(self._tag(counter, body), tag):
            raise NotAuthentic(f"{bytes(body[0])!r} frame not signed by the writer for this reader")
        return body

    def begin(self, frames: list[Any]) -> WriterCheck:
        """The check of a group of a kind, a header and one frame (then the MAC frame), made
        in the pass that opens that frame (``Opener.open(mac=)``), not in a pass of its own:
        once a body of megabytes is out of the cache, a second pass over it costs as much as
        the opening. ``NotAuthentic`` if the group has no MAC frame."""
        if len(frames) != 4 or len(frames[-1]) != WRITER_MAC.size or len(frames[0]) != 1:
            raise NotAuthentic("a data frame group without the writer's MAC")
        counter, tag = WRITER_MAC.unpack(frames[-1])
        kind, head, bodies = frames[:3]
        small = _WRITER_META3.pack(_WRITER_TAG, 3, len(kind), len(head), memoryview(bodies).nbytes) + kind + head
        enc = Cipher(algorithms.AES(self.key), modes.GCM(_WRITER_NONCE.pack(_WRITER_TAG, counter))).encryptor()
        return WriterCheck(enc, small, tag)


class WriterCheck:
    """A writer's MAC being checked over a frame read in parts (``WriterMac.begin``): ``feed``
    it every byte of the frame, in order, then ``done`` says (``NotAuthentic``) whether it
    checks. Nothing of the frame is to be used before ``done`` returns."""

    __slots__ = ("_enc", "_small", "_tag")

    def __init__(self, enc: Any, small: bytes, tag: bytes) -> None:
        self._enc, self._small, self._tag = enc, small, tag

    def feed(self, part: Any) -> None:
        self._enc.authenticate_additional_data(part)

    def done(self) -> None:
        enc = self._enc
        enc.update(self._small)
        enc.finalize()
        if not hmac.compare_digest(enc.tag, self._tag):
            raise NotAuthentic("frame not signed by the writer for this reader")


class Opener(_Keyed):
    """A reader's side: opens what ``Sealer`` sealed, with the keys of the latest keys message.

    Counts what it refuses in ``rejected`` (by reason: ``SealError.reason``). ``buffer``: where a
    large body is opened when it cannot be opened in place (``buffer(n)``: a writable buffer of
    exactly ``n`` bytes; by default a new bytearray): a reader passes ``Buffers.take``."""

    def __init__(
        self, channel: bytes, *, secret: bytes | None = None, buffer: Callable[[int], bytearray] = bytearray
    ) -> None:
        super().__init__(channel, secret)
        self._buffer = buffer
        self._keys: dict[int, _Key] = {}
        self.current_key_id: int | None = None
        self.rejected: dict[str, int] = {}

    @property
    def key_ids(self) -> set[int]:
        return set(self._keys)

    def count(self, exc: SealError) -> None:
        self.rejected[exc.reason] = self.rejected.get(exc.reason, 0) + 1

    def install(self, message: bytes) -> None:
        """Take the keys of a keys message (``Sealer.keys_message``), in place of those held.
        Raises ``SealError`` if it is malformed or of the other mode."""
        if len(message) < _KEYS_HEAD.size:
            raise SealError("truncated keys message")
        version, mode, current, count = _KEYS_HEAD.unpack_from(message)
        if version != _KEYS_VERSION:
            raise SealError(f"keys message version {version}")
        if mode != (_MODE_KEY if self._secret is None else _MODE_SALT):
            raise SealError("keys message of the other security mode")
        if not 0 < count <= MAX_KEYS or len(message) != _KEYS_HEAD.size + count * _KEYS_ENTRY.size:
            raise SealError("keys message length does not match its count")
        keys: dict[int, _Key] = {}
        for i in range(count):
            key_id, material = _KEYS_ENTRY.unpack_from(message, _KEYS_HEAD.size + i * _KEYS_ENTRY.size)
            old = self._keys.get(key_id)
            if old is not None and old.material == material:
                keys[key_id] = old  # keeps its replay state
            else:
                keys[key_id] = _Key.make(key_id, material, self._secret, self._channel)
        if current not in keys:
            raise SealError("keys message without its current key")
        self._keys = keys
        self.current_key_id = current

    def _key(self, sealed: memoryview) -> _Key:
        if sealed.nbytes < KEY_ID.size + TAG_BYTES:
            raise NotAuthentic("sealed frame shorter than its key id and tag")
        (key_id,) = KEY_ID.unpack_from(sealed)
        key = self._keys.get(key_id)
        if key is None:
            raise UnknownKey(f"sealed under key id {key_id:#x}, which this reader does not hold")
        return key

    def open(self, seq: int, flags: int, sealed: Any, mac: WriterCheck | None = None) -> Any:
        """The body of message ``seq`` (bytes, a bytearray, or a view of ``sealed``), or
        ``SealError``. Nothing of it is to be used before this returns. A large writable
        ``sealed`` is decrypted in place where ``cryptography`` allows it (``DECRYPTS_IN_PLACE``):
        afterwards it holds the body (or, if it did not open, garbage), not the sealed bytes.
        ``mac``: the writer's MAC of the frame that is ``sealed`` (all of it), checked in the
        pass that opens a large body (``FUSED_BYTES``), before anything else otherwise; this
        returns only if it checks."""
        mv = sealed if type(sealed) is memoryview and sealed.format == "B" else memoryview(sealed).cast("B")
        if mac is not None:
            if self.encrypting and mv.nbytes >= FUSED_BYTES and not (DECRYPTS_IN_PLACE and not mv.readonly):
                return self._open_checked(seq, flags, mv, mac)
            mac.feed(mv)
            mac.done()
        if self.encrypting and OVERHEAD <= mv.nbytes < LARGE + OVERHEAD and 0 <= seq <= MAX_MESSAGE_SEQ:
            # The common case of small messages, kept short: it runs once per message.
            small = self._keys.get(KEY_ID.unpack_from(mv)[0])
            if small is not None:
                aad = small.msg_aad_head + _AAD_TAIL.pack(flags & 0xFF, seq)
                try:
                    opened = small.aead.decrypt(NONCE.pack(small.key_id, seq), mv[4:], aad)
                except InvalidTag:
                    raise NotAuthentic(f"message {seq} does not open under key id {small.key_id:#x}") from None
                if seq > small.last_seq:
                    small.last_seq = seq
                return opened
        key = self._key(mv)
        if not 0 <= seq <= MAX_MESSAGE_SEQ:
            raise OutOfWindow(f"message seq {seq} out of range")
        nonce = NONCE.pack(key.key_id, seq)
        aad = _aad(self._channel, KIND_MESSAGE, flags, key.key_id, seq)
        n = mv.nbytes - OVERHEAD
        try:
            if self.encrypting:
                if n < LARGE:
                    out: Any = key.aead.decrypt(nonce, mv[4:], aad)
                elif DECRYPTS_IN_PLACE and not mv.readonly:
                    # In place (a received ZeroMQ frame is writable): no buffer to allocate and
                    # fill, and the body is a view of the frame, as it was without sealing.
                    out = mv[4 : 4 + n]
                    key.aead.decrypt_into(nonce, mv[4:], aad, out)
                else:
                    out = self._buffer(n)
                    key.aead.decrypt_into(nonce, mv[4:], aad, out)
            else:
                body = mv[4 : 4 + n]
                tag = mv[4 + n :]
                if n < LARGE:
                    key.aead.decrypt(nonce, tag, aad + mv[: 4 + n].tobytes())
                else:
                    dec = Cipher(algorithms.AES(key.key), modes.GCM(nonce, tag.tobytes())).decryptor()
                    dec.authenticate_additional_data(aad)
                    dec.authenticate_additional_data(mv[:4])
                    dec.authenticate_additional_data(body)
                    dec.finalize()
                out = body
        except InvalidTag:
            raise NotAuthentic(f"message {seq} does not open under key id {key.key_id:#x}") from None
        if seq > key.last_seq:
            key.last_seq = seq
        return out

    def _open_checked(self, seq: int, flags: int, mv: memoryview, mac: WriterCheck) -> Any:
        """A large body opened, and the writer's MAC of its frame checked, in one pass of
        ``FUSED_CHUNK`` parts (each read once from memory, then again from the cache)."""
        key = self._key(mv)
        if not 0 <= seq <= MAX_MESSAGE_SEQ:
            raise OutOfWindow(f"message seq {seq} out of range")
        n = mv.nbytes - OVERHEAD
        out = self._buffer(n)
        dec = Cipher(
            algorithms.AES(key.key), modes.GCM(NONCE.pack(key.key_id, seq), mv[-TAG_BYTES:].tobytes())
        ).decryptor()
        dec.authenticate_additional_data(_aad(self._channel, KIND_MESSAGE, flags, key.key_id, seq))
        mac.feed(mv[:4])
        view = memoryview(out)
        for at in range(0, n, FUSED_CHUNK):
            part = mv[4 + at : 4 + min(at + FUSED_CHUNK, n)]
            mac.feed(part)
            dec.update_into(part, view[at : at + FUSED_CHUNK])
        mac.feed(mv[-TAG_BYTES:])
        try:
            dec.finalize()
        except InvalidTag:
            raise NotAuthentic(f"message {seq} does not open under key id {key.key_id:#x}") from None
        mac.done()
        if seq > key.last_seq:
            key.last_seq = seq
        return out

    def open_control(self, kind: bytes, sealed: Any) -> bytes:
        """The payload of a frame that is not a message, or ``SealError`` (a counter not above
        the last one accepted under its key is a replay)."""
        mv = memoryview(sealed).cast("B")
        if mv.nbytes < CONTROL_OVERHEAD:
            raise NotAuthentic("sealed control frame too short")
        key = self._key(mv)
        (counter,) = COUNTER.unpack_from(mv, KEY_ID.size)
        if counter < CONTROL_BASE:
            raise OutOfWindow("control frame with a message counter")
        nonce = NONCE.pack(key.key_id, counter)
        aad = _aad(self._channel, kind, 0, key.key_id, counter)
        head = KEY_ID.size + COUNTER.size
        try:
            if self.encrypting:
                payload = key.aead.decrypt(nonce, mv[head:], aad)
            else:
                payload = mv[head:-TAG_BYTES].tobytes()
                key.aead.decrypt(nonce, mv[-TAG_BYTES:], aad + mv[:-TAG_BYTES].tobytes())
        except InvalidTag:
            raise NotAuthentic(f"control frame {kind!r} does not open") from None
        # Checked once authentic: a forged counter must not move the mark.
        if counter <= key.last_control:
            raise Replayed(f"control frame counter {counter - CONTROL_BASE} already seen")
        key.last_control = counter
        return payload


def accept_range(first: int, count: int, next_seq: int, limit: int) -> int:
    """Which messages of a frame holding ``first .. first+count-1`` a reader takes, when it
    expects ``next_seq`` and may hold no message at or beyond ``limit`` (its credit). Returns
    how many to skip at the front (received already: a resend overlapping what it has), or
    raises ``Replayed`` (it has all of them) or ``OutOfWindow`` (a gap before it, or beyond the
    credit). The frame still has to open: this only says which part of it is wanted."""
    if count <= 0:
        raise OutOfWindow("empty frame")
    if first + count <= next_seq:
        raise Replayed(f"messages {first}..{first + count - 1} were received already")
    if first > next_seq:
        raise OutOfWindow(f"frame starts at {first}, message {next_seq} is expected")
    if first + count > limit:
        raise OutOfWindow(f"frame ends at {first + count - 1}, beyond the credit ({limit - 1})")
    return next_seq - first
