"""Fan-in remote senders (docs/fan-in.md, "Remote senders (TCP)"): a ``Sender`` on another host.

Its ring is an ordinary channel of this host whose only reader is its TCP server, started with
``sole_reader`` (``_tcp.protocol.ServerConfig``): the server keeps everything it takes until the
collector attaches (``Collector.attach(sender.remote_handle, name=...)``) and hands it over from
the stream's first message, so nothing put before the collector came is lost, and a full server
buffer and ring hold the sender back (bounded memory). Once the collector has left (it closed:
BYE; it died: silent for the server's timeout; refused), the server leaves its ring place, so
the sender's ``put`` raises ``CollectorGone`` as it does when a local collector leaves its place.
The broadcast side's security holds unchanged: CurveZMQ admission, sealed data, nothing decoded
before it is authenticated, a hostile frame drops only its client.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from .._base.errors import InvalidHandle
from .._base.handle import CurveKeys, check_directory
from .._broadcast.channel import WriterChannel
from .._broadcast.writer_open import DEFAULT_DIRECTORY, _WriterSpec
from .._shm.layout import R_ACTIVE, R_PID
from .handle import sender_schema


@dataclass(frozen=True, slots=True)
class RemoteOptions:
    """``open_sender``'s TCP options (as ``open_writer``'s of the same names)."""

    tcp: str
    advertise: str | None = None
    keys: CurveKeys | None = None
    heartbeat_s: float = 0.5
    data_port: int = 0


def remote_spec(
    handle: Any,
    schema: type[BaseModel] | None,
    capacity: int | None,
    slot_bytes: int | None,
    opts: RemoteOptions,
) -> _WriterSpec:
    """The ring of a remote sender of the collector ``handle`` (a ``CollectorHandle``): its codec,
    schema, policy and size limit are the collector's. The ring lives in the collector's directory
    if this host has it, else in ``/dev/shm``."""
    h = handle
    schema = sender_schema(h, schema)
    directory = h.directory if check_directory(h.directory, 2) is None and os.path.isdir(h.directory) else None
    # Keyword arguments, one a line, as cli/_relay.py's call of relay(): alike only in shape.
    return _WriterSpec(
        capacity=h.capacity if capacity is None else capacity,
        slot_bytes=h.slot_bytes if slot_bytes is None else slot_bytes,
        max_readers=1,
        policy=h.policy,
        schema=schema,
        codec="json" if h.codec == "json" else "pickle",
        max_message_bytes=h.max_message_bytes,
        directory=directory or DEFAULT_DIRECTORY,
        tcp=opts.tcp,
        advertise=opts.advertise,
        keys=opts.keys,
        heartbeat_s=opts.heartbeat_s,
        data_port=opts.data_port,
        sole_reader=True,
    )


def server_place(ch: WriterChannel) -> int:
    """The ring place of ``ch``'s TCP server (the collector's, for a remote sender): the active
    place that one of its server processes holds. The server joined before ``open_writer``
    returned, so it is there."""
    server = ch.serving.server
    assert server is not None
    lay = ch.seg.layout
    w = ch.seg.words
    for i in range(lay.max_readers):
        if w[lay.record_word(i, R_ACTIVE)] and w[lay.record_word(i, R_PID)] in server.pids:
            return i
    raise InvalidHandle("the remote sender's TCP server holds no place in its ring")  # pragma: no cover


def blocking_channel(spec: _WriterSpec) -> WriterChannel:
    """The channel and its TCP server, for ``aiobroadcast.blocking.open_sender(tcp=...)``."""
    from .._broadcast.blocking import _blocking_channel

    return _blocking_channel(spec)


class NoWatch:
    """A remote sender's collector is watched by its TCP server, which leaves the ring when the
    collector is gone: no lock of this host to look at."""

    __slots__ = ()

    #: when a look is due (``CollectorWatch.next``, read on the put path): never
    next: float = float("inf")

    def dead(self) -> bool:
        return False
