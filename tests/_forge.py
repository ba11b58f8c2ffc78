"""What an admitted reader can make with the group key it holds (docs/security.md, "Who can
write"): data frames sealed for the channel as the writer's server seals them, and a body other
than the one sealed that has the same GCM tag (GHASH is linear in its key, which the group key
gives). Used by the tests that attack the writer's MAC, sans-IO and over sockets."""

from __future__ import annotations

import os
import pickle
from typing import Any

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from aiobroadcast._tcp import seal

#: a counter for forged LAGGED and END frames, above anything a server of a test seals
FORGED_COUNTER = seal.CONTROL_BASE + (1 << 40)


class Exploit:
    """Pickles into a payload that, when unpickled anywhere, creates the directory ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.mkdir, (self.path,))


def exploit(path: str) -> bytes:
    return pickle.dumps(Exploit(path))


def group_key(opener: seal.Opener, key_id: int | None = None) -> Any:
    """The group key ``key_id`` (default: the current one) as a reader's opener holds it."""
    key_id = opener.current_key_id if key_id is None else key_id
    assert key_id is not None, "a reader before its WELCOME holds no key"
    return opener._keys[key_id]


def seal_body(
    opener: seal.Opener, channel: bytes, seq: int, flags: int, body: bytes, key_id: int | None = None
) -> bytes:
    """Message ``seq`` sealed under the group key, as the server seals it (CurveZMQ mode)."""
    key = group_key(opener, key_id)
    aad = seal._aad(channel, seal.KIND_MESSAGE, flags, key.key_id, seq)
    return bytes(key.kid + key.aead.encrypt(seal.NONCE.pack(key.key_id, seq), body, aad))


def seal_control(opener: seal.Opener, channel: bytes, kind: bytes, payload: bytes) -> bytes:
    """A LAGGED or END sealed under the current group key, with a counter of its own."""
    key = group_key(opener)
    head = key.kid + seal.COUNTER.pack(FORGED_COUNTER)
    aad = seal._aad(channel, kind, 0, key.key_id, FORGED_COUNTER)
    return bytes(head + key.aead.encrypt(seal.NONCE.pack(key.key_id, FORGED_COUNTER), payload, aad))


# GF(2^128) as GCM uses it: a block is a big-endian integer, bit 127 the coefficient of x^0.
_R = 0xE1 << 120


def _mul(x: int, y: int) -> int:
    z = 0
    for i in range(127, -1, -1):
        if (x >> i) & 1:
            z ^= y
        y = (y >> 1) ^ _R if y & 1 else y >> 1
    return z


def _pow(x: int, n: int) -> int:
    out = 1 << 127  # the field's one
    while n:
        if n & 1:
            out = _mul(out, x)
        x = _mul(x, x)
        n >>= 1
    return out


def _block(data: bytes, i: int) -> int:
    return int.from_bytes(data[16 * i : 16 * i + 16].ljust(16, b"\0"), "big")


def same_tag(opener: seal.Opener, seq: int, flags: int, sealed: bytes, payload: bytes) -> bytes:
    """Another sealed body for message ``seq`` with the same key id and the same GCM tag as
    ``sealed``, which opens to ``payload`` (a pickle) followed by bytes pickle ignores (it
    stops at STOP): the first whole block after it is what makes the tag match. Whoever holds
    the group key can make it: so a MAC over the tags alone would not make the writer the only
    one who can write."""
    key = group_key(opener, seal.KEY_ID.unpack_from(sealed)[0])
    cipher = sealed[4 : -seal.TAG_BYTES]
    n = len(cipher)
    plaintext = payload.ljust(n, b"\0")
    assert len(plaintext) == n, "the body is shorter than the payload"
    genuine = bytes(opener.open(seq, flags, sealed))
    stream = bytes(a ^ b for a, b in zip(cipher, genuine, strict=True))
    forged = bytearray(a ^ b for a, b in zip(plaintext, stream, strict=True))
    fixer = (len(payload) + 15) // 16  # the first whole block after the payload
    assert (fixer + 1) * 16 <= n, "the body is too short to hide a block after the pickle"
    h = int.from_bytes(Cipher(algorithms.AES(key.key), modes.ECB()).encryptor().update(bytes(16)), "big")
    blocks = (n + 15) // 16
    # GHASH sums block i of the ciphertext times H^(blocks - i + 1) (the length block is last,
    # times H): the changes of the other blocks, cancelled by the fixer's.
    total = 0
    for i in range(blocks):
        if i != fixer:
            total ^= _mul(_block(bytes(forged), i) ^ _block(cipher, i), _pow(h, blocks - i + 1))
    delta = _mul(total, _pow(_pow(h, blocks - fixer + 1), 2**128 - 2))
    forged[16 * fixer : 16 * fixer + 16] = (_block(cipher, fixer) ^ delta).to_bytes(16, "big")
    out = sealed[:4] + bytes(forged) + sealed[-seal.TAG_BYTES :]
    assert out[-seal.TAG_BYTES :] == sealed[-seal.TAG_BYTES :] and out != sealed
    return out
