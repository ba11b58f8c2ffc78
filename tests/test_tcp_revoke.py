"""Revoking a remote reader, and the keys a reader is given (docs/security.md, "Revoking a
reader"): the sans-IO part, over the frames the server protocol sends. The same over real
sockets and processes is tests/test_tcp_revoke_wire.py."""

from __future__ import annotations

from typing import Any

import pytest
from test_tcp_protocol import CHANNEL, Net, publish, server

from aiobroadcast._tcp import seal, wire
from aiobroadcast._tcp.readers import REVOKED
from aiobroadcast._tcp.serving import Admitted, ServerProtocol


def hello(window: int = 4, resume: int | None = None) -> list[bytes]:
    """A HELLO of CurveZMQ mode (no signature: the connection authenticates it)."""
    body = {"version": wire.PROTOCOL_VERSION, "name": "r", "pid": 7, "host": "h", "window": window}
    return [wire.HELLO, wire.encode_json({**body, "resume": resume, "channel": CHANNEL})]


def admit(srv: ServerProtocol, net: Net, ident: bytes, **kw: Any) -> None:
    assert isinstance(net.receive(srv, ident, hello(**kw), now=0.0, published=srv.end), Admitted)


def keys_of(net: Net, ident: bytes) -> list[bytes]:
    """The keys messages ``ident`` was sent (WELCOME's and KEYS), in order; the rest is dropped."""
    out = []
    for data, frames in net.take(ident):
        if data:
            continue
        if frames[0] == wire.WELCOME:
            out.append(bytes.fromhex(wire.decode_json(frames[1])["keys"]))
        elif frames[0] == wire.KEYS:
            out.append(frames[1])
    return out


def bodies_of(net: Net, ident: bytes) -> list[tuple[int, int, Any]]:
    """The sealed bodies sent to ``ident`` since the last take: (seq, flags, sealed)."""
    out = []
    for data, frames in net.take(ident):
        if data and frames[0] == wire.BATCH:
            first, items = wire.decode_batch(frames[1], frames[2:-1])
            out += [(first + k, flags, body) for k, (body, flags) in enumerate(items)]
    return out


def holder_of(*keys_messages: bytes) -> list[seal.Opener]:
    """An opener per keys message: between them, every key those messages gave."""
    openers = []
    for message in keys_messages:
        opener = seal.Opener(CHANNEL.encode())
        opener.install(message)
        openers.append(opener)
    return openers


def opens(openers: list[seal.Opener], seq: int, flags: int, sealed: Any) -> bool:
    for opener in openers:
        try:
            opener.open(seq, flags, bytes(sealed))
        except seal.SealError:
            continue
        return True
    return False


def test_a_joining_reader_is_given_no_key_that_opens_a_message_sealed_before_its_start() -> None:
    """Messages 0-9 under one key, 10-19 under the next, 20-29 under a third, all still held
    (policy "block", nobody acknowledged them): a reader that joins at 30 gets the keys of
    nothing before 30, so none of them opens with what its WELCOME gave."""
    srv, net = server("block", key=None, window=64, buffer_max=64), Net(key=None)
    admit(srv, net, b"early", window=64)
    for block in range(3):
        publish(srv, *range(10 * block, 10 * block + 10))
        srv.rekey()
    net.transmit(srv)
    sealed = bodies_of(net, b"early")
    assert [s for s, _, _ in sealed] == list(range(30))
    admit(srv, net, b"late", window=64)  # at 30: the next message published
    (welcome_keys,) = keys_of(net, b"late")
    late = holder_of(welcome_keys)
    assert not any(opens(late, seq, flags, body) for seq, flags, body in sealed)
    # ... and what it reads from its start opens
    publish(srv, *range(30, 33))
    net.transmit(srv)
    mine = bodies_of(net, b"late")
    assert [s for s, _, _ in mine] == [30, 31, 32] and all(opens(late, *m) for m in mine)
    # A reader that resumes at 15 gets the key of 10-19 (and later ones), not that of 0-9.
    admit(srv, net, b"back", window=64, resume=15)
    back = holder_of(*keys_of(net, b"back"))
    assert [seq for seq, flags, body in sealed if opens(back, seq, flags, body)] == list(range(10, 30))


def test_the_keys_of_a_rekey_leave_out_those_a_reader_no_longer_needs() -> None:
    """A KEYS message to a reader holds the keys of what it may still be sent (from what it
    acknowledged on), not every old key the server holds for slower readers."""
    srv, net = server("block", key=None, window=64, buffer_max=64), Net(key=None)
    admit(srv, net, b"slow", window=64)
    admit(srv, net, b"fast", window=64)
    publish(srv, *range(10))
    srv.rekey()
    publish(srv, *range(10, 20))
    net.transmit(srv)
    sealed = bodies_of(net, b"fast")
    net.take(b"slow")
    net.receive(srv, b"fast", [wire.ACK, wire.U64.pack(20)], now=0.1, published=20)
    srv.rekey()  # the server still holds 0-19 for "slow"
    net.send_keys(srv)
    (fast_keys,) = keys_of(net, b"fast")
    assert not any(opens(holder_of(fast_keys), *s) for s in sealed)
    (slow_keys,) = keys_of(net, b"slow")
    assert all(opens(holder_of(slow_keys), *s) for s in sealed)


@pytest.mark.parametrize("rekeys_before", [0, 1, 13])
def test_after_a_revocation_nothing_is_sealed_under_a_key_the_revoked_reader_was_given(rekeys_before: int) -> None:
    """The revoked reader held the current key and the next one (announced in advance). After
    the revocation nothing, messages nor LAGGED nor END, is sealed under either, nor under any
    key it was ever given; the other reader reads on, without a loss, with the keys it is sent."""
    srv, net = server("lag", key=None, window=64, buffer_max=64), Net(key=None)
    admit(srv, net, b"gone", window=64)
    admit(srv, net, b"stays", window=64)
    seq = 0
    for _ in range(rekeys_before):
        publish(srv, seq)
        seq += 1
        srv.rekey()
        srv.send_keys()
        net.flush(srv)
    net.transmit(srv)
    gone_keys = keys_of(net, b"gone")
    stays_keys = keys_of(net, b"stays")
    net.take(b"stays")
    revoked = holder_of(*gone_keys)
    assert [info.name for info in srv.revoke([b"gone"])] == ["r"]
    net.send_keys(srv)
    out = net.take(b"gone")
    assert [frames for _, frames in out] == [[wire.REFUSED, REVOKED]]  # told, and nothing else
    publish(srv, *range(seq, seq + 20))
    net.transmit(srv)
    srv.lost(seq + 25)  # a LAGGED, sealed after the revocation
    net.transmit(srv)
    srv.stream_ended("closed")
    net.transmit(srv)
    after: list[tuple[bool, list[Any]]] = net.take(b"stays")
    assert net.take(b"gone") == []  # the revoked reader is sent nothing more
    stays_keys += [f[1] for data, f in after if not data and f[0] == wire.KEYS]
    stays = holder_of(*stays_keys)
    opened, controls = [], 0
    for data, frames in after:
        if not data:
            continue
        frames = frames[:-1]  # the writer's MAC (checked for "stays" in test_tcp_protocol)
        if frames[0] == wire.BATCH:
            first, items = wire.decode_batch(frames[1], frames[2:])
            for k, (body, flags) in enumerate(items):
                assert not opens(revoked, first + k, flags, body)
                assert opens(stays, first + k, flags, body)
                opened.append(first + k)
        else:
            controls += 1
            for opener in revoked:
                with pytest.raises(seal.SealError):
                    opener.open_control(frames[0], frames[1])
            assert any(_opens_control(o, frames[0], frames[1]) for o in holder_of(*stays_keys))
    assert opened == list(range(seq, seq + 20)) and controls == 2  # LAGGED, END


def _opens_control(opener: seal.Opener, kind: bytes, sealed: bytes) -> bool:
    try:
        opener.open_control(kind, sealed)
    except seal.SealError:
        return False
    return True


def test_a_revoked_readers_hello_on_its_open_connection_is_answered_by_the_pump_not_here() -> None:
    """The protocol forgets a revoked reader like any other: a HELLO it sends again on its
    connection would admit it, which is why the server's pump refuses every frame from a key
    no longer on the allow list before the protocol sees it (tests/test_tcp_revoke_wire.py)."""
    srv, net = server("lag", key=None), Net(key=None)
    admit(srv, net, b"gone")
    srv.revoke([b"gone"])
    assert srv.readers.clients == {}
    assert net.receive(srv, b"gone", hello(), now=1.0, published=0) is not None


def test_revocations_in_a_row_keep_the_keys_message_within_its_bound() -> None:
    sealer = seal.Sealer(CHANNEL.encode())
    for seq in range(40):
        sealer.seal(seq, 0, b"x")
        sealer.exclude()
        opener = seal.Opener(CHANNEL.encode())
        opener.install(sealer.keys_message())  # a reader refuses more than MAX_KEYS
    assert sealer.key_id in opener.key_ids
