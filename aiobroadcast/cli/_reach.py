"""What ``subscribe`` can tell about a writer it cannot open: whether anything listens at the
handle's TCP endpoint. It decides whether a writer is known to be gone (its ring is not on this
host and its endpoint refuses connections: no use waiting ``--connect-timeout`` for TCP) and
whether ``--wait`` could help (a writer may still start only where nothing answers yet)."""

from __future__ import annotations

import socket
from typing import Literal

import anyio
import anyio.to_thread

from .._base.errors import TransportError
from .._base.handle import Handle
from ._common import MissingHandleFile

#: How long a look at the endpoint may take: a host that drops packets gives no answer, and is
#: then "unknown" (the reader's own connect waits ``--connect-timeout`` as before).
PROBE_S = 2.0

Listening = Literal["refused", "listening", "unknown"]


async def endpoint_state(endpoint: str, limit_s: float = PROBE_S) -> Listening:
    """``"refused"``: every address of ``tcp://host:port`` refuses a connection (nothing listens
    there); ``"listening"``: one accepts; ``"unknown"``: no answer in time, or the name does not
    resolve. A plain TCP connection, closed at once (the server sees a peer that said nothing)."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    host = host.removeprefix("[").removesuffix("]")

    def probe() -> Listening:
        try:
            addresses = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError):
            return "unknown"
        refused = 0
        for family, kind, proto, _name, address in addresses:
            with socket.socket(family, kind, proto) as s:
                s.settimeout(limit_s)
                try:
                    s.connect(address)
                except ConnectionRefusedError:
                    refused += 1
                    continue
                except OSError:
                    return "unknown"
                return "listening"
        return "refused" if refused else "unknown"

    return await anyio.to_thread.run_sync(probe, abandon_on_cancel=True)


async def known_gone(handle: Handle) -> str | None:
    """Why the writer of ``handle`` is known to be gone, for ``--transport auto``: its ring is not
    here and nothing listens at its endpoint. ``None`` if that is not known (the ring is here:
    opening it says what became of the writer; or the endpoint answers, or cannot be reached)."""
    if handle.tcp is None or await anyio.Path(handle.path).exists():
        return None
    if await endpoint_state(handle.tcp) != "refused":
        return None
    return (
        f"the writer of {handle.name} has closed or exited: its segment {handle.path} is gone (or on "
        f"another host) and nothing listens at {handle.tcp} (connection refused)"
    )


async def may_still_start(exc: Exception, handle: Handle | None) -> bool:
    """Whether waiting (``--wait``) could turn ``exc`` into an open reader: the handle file does
    not exist yet, or nothing answers at its endpoint yet. Not for a channel that is known to be
    gone (its ring removed, its writer exited) nor for a writer that answers but not to this
    handle (other keys, another channel)."""
    if isinstance(exc, MissingHandleFile):
        return True
    if not isinstance(exc, TransportError) or handle is None or handle.tcp is None:
        return False
    return await endpoint_state(handle.tcp) != "listening"
