"""ZeroMQ's errors and codes, translated at the TCP layer's boundary: no caller of the library
sees a raw ``zmq.ZMQError``, and a refused handshake is named the way ZeroMQ names it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import zmq

from .._base.errors import BroadcastError

#: ZMTP and ZAP protocol errors by code, as ``zmq.Event`` names them
_PROTOCOL_ERRORS = {
    int(code): name.removeprefix("PROTOCOL_ERROR_")
    for name, code in zmq.Event.__members__.items()
    if name.startswith("PROTOCOL_ERROR_")
}


@contextmanager
def zmq_errors(error: type[BroadcastError], what: str) -> Iterator[None]:
    """Raise ``error("<what>: <ZeroMQ's reason>")`` for a ``zmq.ZMQError`` in the block."""
    try:
        yield
    except zmq.ZMQError as exc:
        raise error(f"{what}: {exc}") from exc


def protocol_error(code: int) -> str:
    """A ZMTP/ZAP protocol error's name, e.g. ``ZMTP_MECHANISM_MISMATCH``."""
    return _PROTOCOL_ERRORS.get(code, f"protocol error {code:#x}")
