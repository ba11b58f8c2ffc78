"""The sealing of the TCP data plane (aiobroadcast/_seal.py), without sockets: what opens, what
does not, and that a nonce is never used twice under one key."""

from __future__ import annotations

import os
import struct

import cryptography
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiobroadcast._tcp import seal

CHANNEL = b"0123456789abcdef0123456789abcdef"
SECRET = b"s" * 32
MODES = pytest.mark.parametrize("secret", [None, SECRET], ids=["sealed", "insecure"])
#: a small body, one at the size where the streaming path starts, and a large one
SIZES = [0, 1, 64, seal.LARGE - 1, seal.LARGE, 70_000]


def pair(secret: bytes | None, rekey_messages: int = seal.REKEY_MESSAGES) -> tuple[seal.Sealer, seal.Opener]:
    sealer = seal.Sealer(CHANNEL, secret=secret, rekey_messages=rekey_messages)
    opener = seal.Opener(CHANNEL, secret=secret)
    opener.install(sealer.keys_message())
    return sealer, opener


@MODES
@pytest.mark.parametrize("n", SIZES)
def test_a_sealed_body_opens_to_itself(secret: bytes | None, n: int) -> None:
    sealer, opener = pair(secret)
    body = os.urandom(n)
    sealed = sealer.seal(7, 1, memoryview(body))
    assert len(sealed) == n + seal.OVERHEAD
    assert bytes(opener.open(7, 1, bytes(sealed))) == body  # read-only: into a buffer of its own
    assert bytes(opener.open(7, 1, bytearray(sealed))) == body  # writable: in place, for large ones


def _open_large_writable() -> bool:
    """Open a large body from a writable frame; whether the frame now holds the body (in place)."""
    sealer, opener = pair(None)
    body = os.urandom(seal.LARGE * 3)
    frame = bytearray(sealer.seal(7, 1, memoryview(body)))
    assert bytes(opener.open(7, 1, frame)) == body
    return bytes(frame[4 : 4 + len(body)]) == body


def test_a_large_writable_body_opens_in_place_where_cryptography_allows_it() -> None:
    """In place, the body is a view of the frame; otherwise the frame is left as it came."""
    assert _open_large_writable() is seal.DECRYPTS_IN_PLACE


def test_a_large_writable_body_opens_without_decrypting_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """The way cryptography 51 and later leave: a buffer of its own (tested whatever is installed)."""
    monkeypatch.setattr(seal, "DECRYPTS_IN_PLACE", False)
    assert _open_large_writable() is False


def test_decrypting_in_place_is_known_for_the_installed_cryptography() -> None:
    """cryptography refuses ``decrypt_into`` over its own input from 51; up to 50 it allowed it."""
    major = int(cryptography.__version__.split(".")[0])
    assert seal.DECRYPTS_IN_PLACE is (major < 51)


@pytest.mark.parametrize("n", [s for s in SIZES if s >= 16])
def test_sealed_bodies_hide_the_plaintext_and_insecure_ones_do_not(n: int) -> None:
    body = b"PLAINTEXT-MARKER" * (n // 16)
    assert body in bytes(seal.Sealer(CHANNEL, secret=SECRET).seal(0, 0, body))
    sealed = bytes(seal.Sealer(CHANNEL).seal(0, 0, body))
    assert b"PLAINTEXT-MARKER" not in sealed


@MODES
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_bit_flipped_anywhere_is_refused(secret: bytes | None, data: st.DataObject) -> None:
    """Key id, body or tag: one bit changed and the frame does not open (and nothing of it is
    handed out)."""
    n = data.draw(st.sampled_from(SIZES))
    sealer, opener = pair(secret)
    sealed = bytearray(sealer.seal(3, 0, os.urandom(n)))
    bit = data.draw(st.integers(0, len(sealed) * 8 - 1))
    sealed[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises((seal.NotAuthentic, seal.UnknownKey)):
        opener.open(3, 0, sealed)


@MODES
@pytest.mark.parametrize(
    ("seq", "flags", "channel"),
    [(4, 0, CHANNEL), (3, 1, CHANNEL), (3, 0, b"another channel id..............")],
    ids=["other-seq", "other-flags", "other-channel"],
)
def test_a_body_moved_elsewhere_does_not_open(secret: bytes | None, seq: int, flags: int, channel: bytes) -> None:
    """The associated data binds the place in the stream, the flags and the channel."""
    sealer, _ = pair(secret)
    opener = seal.Opener(channel, secret=secret)
    opener.install(sealer.keys_message())
    sealed = sealer.seal(3, 0, b"body")
    with pytest.raises(seal.NotAuthentic):
        opener.open(seq, flags, sealed)


@MODES
def test_a_control_frame_opens_once_and_not_as_another_kind(secret: bytes | None) -> None:
    sealer, opener = pair(secret)
    lagged = sealer.seal_control(b"L", b"payload")
    with pytest.raises(seal.NotAuthentic):
        opener.open_control(b"E", lagged)
    assert opener.open_control(b"L", lagged) == b"payload"
    with pytest.raises(seal.Replayed):
        opener.open_control(b"L", lagged)
    later = sealer.seal_control(b"L", b"more")
    flipped = bytearray(later)
    flipped[-1] ^= 0x80
    with pytest.raises(seal.NotAuthentic):
        opener.open_control(b"L", flipped)
    assert opener.open_control(b"L", later) == b"more"  # a forgery did not move the mark


@MODES
def test_a_message_cannot_pass_for_a_control_frame(secret: bytes | None) -> None:
    sealer, opener = pair(secret)
    sealed = sealer.seal(5, 0, b"\0" * 16)
    with pytest.raises(seal.SealError):
        opener.open_control(b"M", sealed)


def test_the_sealer_refuses_to_seal_a_number_twice_under_one_key() -> None:
    sealer = seal.Sealer(CHANNEL)
    sealer.seal(5, 0, b"a")
    for seq in (5, 4):
        with pytest.raises(ValueError, match="sealed again"):
            sealer.seal(seq, 0, b"b")
    with pytest.raises(ValueError, match="out of range"):
        sealer.seal(seal.CONTROL_BASE, 0, b"c")


@settings(max_examples=50, deadline=None)
@given(
    seqs=st.lists(st.integers(0, 2**20), min_size=1, max_size=60, unique=True).map(sorted),
    controls=st.integers(0, 20),
    rekey_every=st.integers(1, 10),
)
def test_nonces_never_repeat_under_one_key(seqs: list[int], controls: int, rekey_every: int) -> None:
    """Whatever the mix of messages, control frames and rekeys, each (key id, counter) pair is
    used once; the key id and counter travel in clear, so this reads them off the frames."""
    sealer = seal.Sealer(CHANNEL, rekey_messages=rekey_every)
    used: set[tuple[bytes, int]] = set()
    for i, seq in enumerate(seqs):
        sealed = sealer.seal(seq, 0, b"x")
        key = sealer._keys.get(struct.unpack_from("<I", sealed)[0]) or sealer._current
        nonce = (key.key, seq)
        assert nonce not in used
        used.add(nonce)
        if i < controls:
            frame = sealer.seal_control(b"L", b"")
            (key_id, counter) = struct.unpack_from("<IQ", frame)
            assert key_id == sealer.key_id and counter >= seal.CONTROL_BASE
            nonce = (sealer._current.key, counter)
            assert nonce not in used
            used.add(nonce)


@MODES
def test_rekey_after_n_messages_and_readers_with_the_announced_key_follow(secret: bytes | None) -> None:
    """The next key is announced before it is used: a reader that has the keys message from
    before the rekey opens what follows it; one without the next key gets UnknownKey."""
    sealer, opener = pair(secret, rekey_messages=3)
    stale = seal.Opener(CHANNEL, secret=secret)
    stale.install(sealer.keys_message())
    first_key = sealer.key_id
    ids = []
    for seq in range(10):
        sealed = sealer.seal(seq, 0, b"m%d" % seq)
        ids.append(struct.unpack_from("<I", sealed)[0])
        assert bytes(opener.open(seq, 0, sealed)) == b"m%d" % seq
        opener.install(sealer.keys_message())  # what KEYS brings after each rekey
    assert ids == [first_key] * 3 + [first_key + 1] * 3 + [first_key + 2] * 3 + [first_key + 3]
    assert sealer.epoch == 3
    with pytest.raises(seal.UnknownKey):
        stale.open(9, 0, sealed)


def test_rekey_after_n_bytes() -> None:
    sealer = seal.Sealer(CHANNEL, rekey_bytes=100)
    k0 = sealer.key_id
    sealer.seal(0, 0, b"x" * 60)
    assert sealer.key_id == k0
    sealer.seal(1, 0, b"x" * 60)  # 120 bytes would be over: this one goes under the next key
    assert sealer.key_id == k0 + 1
    sealer.seal(2, 0, b"x" * 500)  # over the limit alone: a key of its own
    assert sealer.key_id == k0 + 2
    sealer.seal(3, 0, b"x")
    assert sealer.key_id == k0 + 3


def test_old_keys_are_kept_while_something_sealed_under_them_is_held() -> None:
    sealer = seal.Sealer(CHANNEL, rekey_messages=2)
    for seq in range(6):
        sealer.seal(seq, 0, b"x")
    # keys: seqs 0-1 under k0, 2-3 under k1, 4-5 under k2 (current), and the next one
    assert len(sealer._keys) == 2
    sealer.retire(2)
    assert len(sealer._keys) == 1
    opener = seal.Opener(CHANNEL)
    opener.install(sealer.keys_message())
    assert len(opener.key_ids) == 3  # k1, the current one and the next


@MODES
def test_a_rekey_waits_while_a_keys_message_would_not_hold_the_keys_in_use(secret: bytes | None) -> None:
    """A key per message, and 40 messages held (a slow reader): the server never holds more old
    keys than a keys message carries, so a reader that installs the latest one opens every
    message held; once the held messages move on (retire), the rekeys resume."""
    sealer = seal.Sealer(CHANNEL, secret=secret, rekey_messages=1)
    sealed = [sealer.seal(seq, 0, b"m%d" % seq) for seq in range(40)]
    assert len(sealer._keys) <= seal.MAX_KEYS - 2
    epoch = sealer.epoch
    assert not sealer.rekey()  # on demand too: it waits, and the next message takes it
    assert sealer.epoch == epoch
    opener = seal.Opener(CHANNEL, secret=secret)
    opener.install(sealer.keys_message())
    assert [bytes(opener.open(seq, 0, body)) for seq, body in enumerate(sealed)] == [b"m%d" % s for s in range(40)]
    sealer.retire(39)  # all but the last message were acknowledged by every reader
    current = sealer.key_id
    body = sealer.seal(40, 0, b"m40")
    assert sealer.key_id != current and sealer.epoch == epoch + 1  # the waiting rekey, taken now
    opener.install(sealer.keys_message())
    assert bytes(opener.open(40, 0, body)) == b"m40" and bytes(opener.open(39, 0, sealed[39])) == b"m39"
    for seq in range(41, 60):  # a key per message again, up to the bound
        sealer.seal(seq, 0, b"x")
        assert len(sealer._keys) <= seal.MAX_KEYS - 2
    opener.install(sealer.keys_message())


@MODES
def test_keys_messages_are_checked(secret: bytes | None) -> None:
    sealer, opener = pair(secret)
    msg = sealer.keys_message()
    other = seal.Opener(CHANNEL, secret=None if secret else SECRET)
    with pytest.raises(seal.SealError, match="other security mode"):
        other.install(msg)
    for bad in (b"", msg[:-1], msg + b"\0", b"\x09" + msg[1:]):
        with pytest.raises(seal.SealError):
            opener.install(bad)


def test_insecure_keys_come_from_the_shared_secret_not_from_the_keys_message() -> None:
    """In insecure mode the keys message travels in clear: it holds salts. Someone who has it
    but not the handle's secret cannot seal anything the reader accepts."""
    sealer = seal.Sealer(CHANNEL, secret=SECRET)
    forger = seal.Opener(CHANNEL, secret=b"guess" * 7)
    forger.install(sealer.keys_message())
    reader = seal.Opener(CHANNEL, secret=SECRET)
    reader.install(sealer.keys_message())
    # The forger builds a frame with the keys it derived (wrong) and the real key id.
    key = next(iter(forger._keys.values()))
    nonce = seal.NONCE.pack(key.key_id, 0)
    aad = seal._aad(CHANNEL, seal.KIND_MESSAGE, 0, key.key_id, 0)
    kid = seal.KEY_ID.pack(key.key_id)
    forged = kid + b"evil" + key.aead.encrypt(nonce, b"", aad + kid + b"evil")
    with pytest.raises(seal.NotAuthentic):
        reader.open(0, 0, forged)


@MODES
@pytest.mark.parametrize("n", [10, 100_000])
def test_streaming_and_one_shot_gmac_agree(secret: bytes | None, n: int) -> None:
    """Large insecure bodies are authenticated piecewise (no join of associated data and body):
    the tag is the same as over the joined bytes, so either side may use either path."""
    sealer = seal.Sealer(CHANNEL, secret=secret)
    body = os.urandom(n)
    sealed = sealer.seal(1, 0, body)
    key = sealer._current
    nonce = seal.NONCE.pack(key.key_id, 1)
    aad = seal._aad(CHANNEL, seal.KIND_MESSAGE, 0, key.key_id, 1)
    if secret is None:
        assert bytes(sealed[4:]) == key.aead.encrypt(nonce, body, aad)
    else:
        assert bytes(sealed[-16:]) == key.aead.encrypt(nonce, b"", aad + bytes(sealed[:-16]))


def test_accept_range() -> None:
    assert seal.accept_range(10, 5, 10, 100) == 0
    assert seal.accept_range(8, 5, 10, 100) == 2  # a resend overlapping what it has
    with pytest.raises(seal.Replayed):
        seal.accept_range(5, 5, 10, 100)
    with pytest.raises(seal.OutOfWindow):
        seal.accept_range(11, 1, 10, 100)  # a gap before it
    with pytest.raises(seal.OutOfWindow):
        seal.accept_range(10, 91, 10, 100)  # beyond the credit
    with pytest.raises(seal.OutOfWindow):
        seal.accept_range(10, 0, 10, 100)


@settings(max_examples=100, deadline=None)
@given(
    first=st.integers(0, 1000),
    count=st.integers(1, 50),
    next_seq=st.integers(0, 1000),
    credit=st.integers(1, 100),
)
def test_accept_range_hands_out_each_message_once_and_only_within_credit(
    first: int, count: int, next_seq: int, credit: int
) -> None:
    limit = next_seq + credit
    try:
        skip = seal.accept_range(first, count, next_seq, limit)
    except (seal.Replayed, seal.OutOfWindow):
        assert first + count <= next_seq or first > next_seq or first + count > limit
        return
    taken = range(first + skip, first + count)
    assert taken.start == next_seq and taken.stop <= limit and len(taken) > 0


def test_the_rekey_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="rekey policy"):
        seal.Sealer(CHANNEL, rekey_messages=0)


def test_random_key_ids_and_keys() -> None:
    """Two servers (a restart) draw different keys: a reader of the first cannot open the second."""
    a, b = seal.Sealer(CHANNEL), seal.Sealer(CHANNEL)
    opener = seal.Opener(CHANNEL)
    opener.install(a.keys_message())
    with pytest.raises(seal.SealError):
        opener.open(0, 0, b.seal(0, 0, b"x"))
    assert a.keys_message() != b.keys_message()


@pytest.mark.parametrize("secret", [None, b"k" * 32], ids=["sealed", "insecure"])
def test_the_writers_mac_covers_every_byte_of_a_group_and_is_checked_in_the_pass_that_opens_a_large_body(
    secret: bytes | None,
) -> None:
    """A group of a kind, a header and one large body (``FUSED_BYTES`` and up: opened and checked
    in one pass), or small ones: it opens with the MAC of its reader, and with no other; a
    changed header, body or MAC frame, or a frame of another reader, does not check; nothing
    is returned unless it checks."""
    from aiobroadcast._tcp import wire

    sealer, opener = seal.Sealer(CHANNEL, secret=secret), seal.Opener(CHANNEL, secret=secret)
    opener.install(sealer.keys_message())
    mac, other = sealer.writer_mac(), sealer.writer_mac()
    assert mac.key != other.key
    mine = seal.WriterMac(mac.key)  # the reader's, from its WELCOME
    large = os.urandom(seal.FUSED_BYTES + 12345)
    sealed = bytes(sealer.seal(0, 0, large))
    group = mac.sign(wire.encode_batch(0, [(sealed, 0)]))
    assert len(group) == 4 and group[2] is sealed
    assert bytes(opener.open(0, 0, group[2], mine.begin(group))) == large
    assert mine.check(group) == group[:-1]  # the same MAC, checked in a pass of its own
    flipped = bytearray(sealed)
    flipped[len(flipped) // 2] ^= 1
    bad_head = bytearray(group[1])
    bad_head[-1] ^= 1  # the flags of the body
    bad_mac = bytearray(group[-1])
    bad_mac[-1] ^= 1
    for frames in (
        [*group[:3], other.sign(group[:3])[-1]],  # another reader's MAC
        [group[0], group[1], bytes(flipped), group[3]],
        [group[0], bytes(bad_head), group[2], group[3]],
        [*group[:3], bytes(bad_mac)],
        group[:3],  # no MAC at all
    ):
        with pytest.raises(seal.NotAuthentic):
            mine.check(frames)
        with pytest.raises(seal.NotAuthentic):
            opener.open(0, 0, frames[2], mine.begin(frames if len(frames) == 4 else [*frames, b"\0" * 24]))
    small = [bytes(sealer.seal(seq, 0, b"%d" % seq)) for seq in (1, 2)]
    group = mac.sign(wire.encode_batch(1, [(b, 0) for b in small]))
    assert mine.check(group) == group[:-1]
    with pytest.raises(seal.NotAuthentic):
        seal.WriterMac(other.key).check(group)
    assert mac.sign([wire.END, b"x"])[-1] != mac.sign([wire.END, b"x"])[-1]  # a counter each: never one nonce twice


@settings(max_examples=200, deadline=None)
@given(
    bodies=st.lists(st.binary(min_size=1, max_size=300), min_size=2, max_size=6),
    change=st.sampled_from(["flip", "swap", "shift", "drop", "repeat", "header"]),
    data=st.data(),
)
def test_the_writers_mac_of_a_group_of_several_body_frames_covers_each_frame_and_its_place(
    bodies: list[bytes], change: str, data: st.DataObject
) -> None:
    """A group of a kind, a header and several body frames (each frame tagged on its own, the
    group's MAC over those tags): it checks as sent; a byte changed in any frame, two frames
    swapped, a byte moved from one frame to the next, a frame dropped or repeated, or a header
    changed, does not."""
    mac = seal.WriterMac(os.urandom(seal.KEY_BYTES))
    reader = seal.WriterMac(mac.key)
    group = mac.sign([b"B", b"header", *bodies])
    assert reader.check(group) == group[:-1]
    frames = list(group[:-1])
    i = data.draw(st.integers(2, len(frames) - 1))
    if change == "flip":
        f = bytearray(frames[i])
        f[data.draw(st.integers(0, len(f) - 1))] ^= 1 << data.draw(st.integers(0, 7))
        frames[i] = bytes(f)
    elif change == "swap":
        j = 2 if i != 2 else 3
        if frames[i] == frames[j]:
            frames[i] += b"\0"  # two equal frames swapped are the same group
        frames[i], frames[j] = frames[j], frames[i]
    elif change == "shift":
        j = i + 1 if i + 1 < len(frames) else i - 1
        frames[i], frames[j] = frames[i][:-1], frames[i][-1:] + frames[j]
    elif change == "drop":
        del frames[i]
    elif change == "repeat":
        frames.insert(i, frames[i])
    else:
        frames[1] = b"Header"
    with pytest.raises(seal.NotAuthentic):
        reader.check([*frames, group[-1]])
