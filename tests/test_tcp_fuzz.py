"""Fuzzing the TCP server as a client that holds the keys.

A real writer process (its real server process) publishes a paced stream; an honest remote
reader process reads it; meanwhile this process, holding the handle's keys (CurveZMQ, or the
HMAC key under ``insecure=True``, signing correctly), sends the server frame groups hypothesis
makes up: every kind (the reader's and the server's, and unknown ones), argument frames too short,
too long, too many, numbers at the edges (0, 2**63, 2**64-1, ...), JSON bodies with Infinity, NaN,
2**64, -2**63, long strings and deep nesting. After each example the attacker says BYE (so that,
under policy "block", it does not hold the writer between examples) and goes.

Checked at the end: the server process is the one that started (it never died or restarted),
the honest reader got every message in order and then the end, and the server's memory grew by
less than a bound. Bounded: ~80 examples each, the whole test well under 60 s.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from _peers import KeyedPeer, server_processes
from _tcp_workers import ASYNCIO, ReaderOpts, WriterSpec, reader_proc, spawn, writer_proc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import aiobroadcast as ab
from aiobroadcast._tcp import wire

pytestmark = pytest.mark.anyio

MIB = 1 << 20
#: how much the server's RSS may grow over the whole attack: the per-reader queue bound is about
#: 2.3 MiB (docs/design.md), the rest is slack for the allocator and ZeroMQ's own buffers
RSS_GROWTH_MAX = 48 * MIB
COUNT = 400  #: messages in the stream
INTERVAL_S = 0.01  #: between them: the stream goes on while the attack does

EDGE_INTS = [0, 1, 2, 255, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70]
numbers = st.one_of(
    st.sampled_from(EDGE_INTS),
    st.sampled_from(EDGE_INTS).map(lambda n: -n),
    st.integers(-(2**66), 2**66),
)
#: JSON values as text (so that Infinity and NaN, which json.dumps refuses, can be sent)
json_scalars = st.one_of(
    numbers.map(str),
    st.sampled_from(["Infinity", "-Infinity", "NaN", "1e400", "-0.0", "0.5", "true", "false", "null", '"3"']),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.text(max_size=40).map(json.dumps),
    st.integers(0, 5000).map(lambda n: json.dumps("x" * n)),  # long names, some over the frame cap
)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


json_values = st.one_of(json_scalars, st.integers(1, 4000).map(nested))


@st.composite
def json_bodies(draw: st.DrawFn) -> bytes:
    """A HELLO body: mostly an object with the right version (so that the other fields are
    what is tried), each field left out or any value; sometimes not an object, or not JSON."""
    fields: dict[str, str] = {}
    if draw(st.integers(0, 9)):
        fields["version"] = str(wire.PROTOCOL_VERSION)
    for key in ("name", "pid", "window", "resume", "extra"):
        if draw(st.booleans()):
            fields[key] = draw(json_values)
    text = "{" + ",".join(f'"{k}":{v}' for k, v in fields.items()) + "}"
    return draw(
        st.one_of(st.just(text.encode()), st.just(text.encode()), st.binary(max_size=64), json_values.map(str.encode))
    )


u64s = st.one_of(
    st.integers(0, 2**64 - 1).map(wire.U64.pack),
    st.sampled_from([0, 1, 2**63, 2**64 - 1]).map(wire.U64.pack),
    st.binary(max_size=16),  # truncated or extended
)
kinds = st.one_of(
    st.sampled_from(
        [
            *(wire.HELLO, wire.ACK, wire.NACK, wire.BYE),  # the reader's
            *(wire.WELCOME, wire.BATCH, wire.HEARTBEAT, wire.LAGGED, wire.END, wire.UNKNOWN, wire.REFUSED),
        ]
    ),
    st.binary(max_size=3),
)
extra_frames = st.lists(st.binary(max_size=5000), max_size=3)
any_frame = st.one_of(u64s, json_bodies(), st.binary())
frame_groups = st.one_of(
    st.builds(lambda body, extra: [wire.HELLO, body, *extra], json_bodies(), st.just([]) | extra_frames),
    st.builds(lambda kind, n: [kind, n], st.sampled_from([wire.ACK, wire.NACK]), u64s),
    st.builds(lambda kind, args: [kind, *args], kinds, st.lists(any_frame, max_size=4)),
)
attacks = st.lists(frame_groups, min_size=1, max_size=8)
#: what stopped the server before: a HELLO with Infinity, deep nesting, a huge negative resume
KNOWN_KILLERS = [
    [[wire.HELLO, b'{"version":%d,"window":Infinity}' % wire.PROTOCOL_VERSION]],
    [[wire.HELLO, b'{"version":%d,"window":4,"x":%s}' % (wire.PROTOCOL_VERSION, nested(1500).encode())]],
    [[wire.HELLO, b'{"version":%d,"window":4,"resume":-100000000000000000000}' % wire.PROTOCOL_VERSION]],
]


F = TypeVar("F", bound=Callable[..., None])


def example_each(attacks: list[list[list[bytes]]]) -> Callable[[F], F]:
    """``@example(attack=a)`` for each of ``attacks``: always tried, before the generated ones."""

    def decorate(f: F) -> F:
        for a in attacks:
            f = example(attack=a)(f)
        return f

    return decorate


def rss(proc: Any) -> int:
    return int(proc.memory_info().rss)


@pytest.mark.parametrize("insecure", [False, True], ids=["curve", "insecure"])
@pytest.mark.parametrize("anyio_backend", [pytest.param(ASYNCIO, id="asyncio")])
async def test_fuzzed_frames_from_a_keyed_client_never_disturb_the_server_or_an_honest_reader(
    insecure: bool,
) -> None:
    spec = WriterSpec(
        count=COUNT, interval_s=INTERVAL_S, heartbeat_s=0.5, tcp_window=64, then="wait", insecure=insecure
    )
    with spawn(writer_proc, ASYNCIO, None, spec) as wproc:
        h = ab.Handle.parse(await wproc.recv("handle"))
        (server,) = server_processes(wproc.pid)
        with spawn(reader_proc, ASYNCIO, None, h.to_json(), ReaderOpts(name="honest")) as honest:
            await honest.recv("attached")
            wproc.send("go")
            before = rss(server)

            @settings(
                max_examples=80,
                deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            )
            @given(attack=attacks)
            @example_each(KNOWN_KILLERS)
            def attack_once(attack: list[list[bytes]]) -> None:
                peer = KeyedPeer(h)
                try:
                    for frames in attack:
                        peer.send(frames)
                    peer.send([wire.BYE])
                    time.sleep(0.005)  # let the server take them before the socket goes
                finally:
                    peer.close()

            attack_once()
            grown = rss(server) - before
            sent = await wproc.recv("sent", within_s=60)
            assert sent["count"] == COUNT and sent["restarts"] == 0
            wproc.send("close")
            result = await honest.recv("events", within_s=60)
            assert result["events"] == [("msg", i) for i in range(COUNT)] + [("end",)]
            assert server_processes(wproc.pid) in ([server], [])  # the same process, or gone after close
            assert grown < RSS_GROWTH_MAX, f"the server grew {grown / MIB:.1f} MiB"
        await wproc.recv("closed")
