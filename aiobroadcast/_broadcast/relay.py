"""Relays: a remote reader on host B that republishes into a shared-memory ring on B, so that
N readers on B cost the writer one TCP stream. Order, backpressure (policy "block"), lag
reports (policy "lag") and liveness carry through end to end."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

from .._base.errors import EndOfStream, ReaderLagged, TransportError, WriterGone
from .._base.handle import Handle
from .open import _open_raw_reader
from .reader_open import Transport
from .writer_open import DEFAULT_DIRECTORY, _open_channel, _WriterSpec


class RelayEnd(NamedTuple):
    """How a relay ended (what ``relay`` returns)."""

    #: "closed": the upstream writer closed its channel (local readers get ``EndOfStream``);
    #: "writer gone": it died without closing it (local readers get ``WriterGone``)
    how: Literal["closed", "writer gone"]
    relayed: int  #: messages republished into the local channel


async def relay(
    upstream: Handle | str,
    *,
    name: str | None = None,
    capacity: int | None = None,
    slot_bytes: int | None = None,
    max_readers: int = 16,
    directory: str = DEFAULT_DIRECTORY,
    transport: Transport = "tcp",
    tcp: str | None = None,
    insecure: bool = False,
    on_ready: Callable[[Handle], Any] | None = None,
) -> RelayEnd:
    """Read ``upstream`` (over TCP by default) and republish every message, unchanged and
    undecoded, into a new local channel. ``on_ready`` receives the local channel's handle.
    ``name``: the relay's reader name upstream, unique there (default ``reader-<pid>-<n>``, as
    ``open_reader``'s).

    Returns (a ``RelayEnd``: how, and how many messages it relayed) when the upstream writer
    closes (local readers then get ``EndOfStream``) or dies (local readers get ``WriterGone``);
    messages lost upstream (policy "lag") reach local readers as ``ReaderLagged`` with the same
    count. If the upstream stream breaks (``TransportError``: refused, or its I/O failed), local
    readers get ``WriterGone`` too (never an ``EndOfStream`` they would take for a clean end) and
    the error propagates.
    """
    up = Handle.parse(upstream)
    async with _open_raw_reader(up, name=name, transport=transport) as source:
        spec = _WriterSpec(
            capacity=capacity or up.capacity,
            slot_bytes=slot_bytes or up.slot_bytes,
            max_readers=max_readers,
            policy=up.policy,
            directory=directory,
            tcp=tcp,
            insecure=insecure,
        )
        down = await _open_channel(spec)
        try:
            # The bodies go on as they are, encoded upstream: readers decode them as upstream's.
            down.set_codec(up.codec, up.schema_path)
            if on_ready is not None:
                on_ready(down.handle)
            publishing = down.publishing
            relayed = 0
            while True:
                try:
                    body, oob = await source.get()
                except ReaderLagged as exc:
                    await publishing.put_gap(exc.missed)
                    continue
                except EndOfStream:
                    return RelayEnd("closed", relayed)
                except WriterGone:
                    await down.abandon()
                    return RelayEnd("writer gone", relayed)
                except TransportError:
                    await down.abandon()
                    raise
                # No await after the publish: source.get() already yields to the loop once in
                # YIELD_EVERY messages, before it takes one.
                await publishing.put_encoded((body,), len(body), oob, publishing.entries_for(len(body)))
                relayed += 1
        finally:
            await down.aclose()
