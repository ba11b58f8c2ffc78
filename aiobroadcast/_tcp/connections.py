"""A remote reader's connections to the writer's server: the control connection (CurveZMQ, or
PLAIN with the HMAC key's password) and the data connection, their options, keys and endpoints,
and the watch over the control connection's handshake (a refused handshake fails open_reader at
once, with the reason).
"""

from __future__ import annotations

import os
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from .._base.errors import TransportError
from .._base.handle import Handle
from . import wire
from .errors import protocol_error, zmq_errors

#: What the handshake monitor listens to (nothing else: connects and retries are not its business).
_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
#: Handshakes the server cut short, in a row and before any succeeded, that mean a refusal. A
#: CurveZMQ server that cannot decrypt HELLO (the handle's server_key is not its key) closes the
#: connection without a word: the client only sees it closed, each time it reconnects (0.1 s).
#: One such close could be a server going away; three in a row are the server refusing.
_CLOSED_HANDSHAKES_REFUSED = 3


class _HandshakeWatch:
    """Watches the CurveZMQ handshake until it succeeds (then it stops, and the happy path
    costs nothing more): a refused handshake fails open_reader at once, with the reason,
    instead of after connect_timeout."""

    def __init__(self, dealer: zmq.Socket[bytes], where: str) -> None:
        self._dealer = dealer
        self._where = where
        self._closed_handshakes = 0
        self.socket = dealer.get_monitor_socket(_HANDSHAKE_EVENTS)
        self.socket.linger = 0
        self.done = False

    def stop(self) -> None:
        if not self.done:
            self.done = True
            self._dealer.disable_monitor()
            self.socket.close(linger=0)

    def refusal(self) -> str | None:
        """Take the monitor's events; the reason if the server refused the handshake."""
        while not self.done:
            try:
                event = recv_monitor_message(self.socket, zmq.NOBLOCK)
            except zmq.Again:
                return None
            kind, value = event["event"], event["value"]
            where = self._where
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.stop()
                return None
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return (
                    f"{where} refused this reader's keys at the handshake (ZAP status {value}): "
                    "the handle's client key pair (insecure=True: its hmac_key) is not this channel's, "
                    "or not on the writer's allow list (revoked, or not issued by 'aiobroadcast keygen --reader') "
                    f"(insecure=True: or the writer's aiobroadcast is older than protocol {wire.PROTOCOL_VERSION})"
                )
            if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                return (
                    f"{where} refused this reader's keys: the handshake failed with {protocol_error(value)} "
                    "(the handle's keys are not that server's, or only one side is insecure=True)"
                )
            # EVENT_HANDSHAKE_FAILED_NO_DETAIL: the server closed the connection mid-handshake
            self._closed_handshakes += 1
            if self._closed_handshakes >= _CLOSED_HANDSHAKES_REFUSED:
                return (
                    f"{where} refused this reader's keys: it closed {self._closed_handshakes} handshakes "
                    "in a row (the handle's server_key is not that server's key, or only one side is "
                    "insecure=True)"
                )
        return None


class Connections:
    """A remote reader's two connections to the writer's server, both DEALER sockets of one
    context: the control connection (CurveZMQ, or PLAIN with the HMAC key's password), whose
    handshake ``watch`` follows until it succeeds, and the data connection, made once WELCOME
    says where. Their options, their keys and endpoints, sending without blocking, closing."""

    def __init__(self, handle: Handle) -> None:
        assert handle.tcp is not None
        self._tcp = handle.tcp
        self._ctx = zmq.Context()
        self.dealer = self._ctx.socket(zmq.DEALER)
        # The data connection: ZeroMQ without CurveZMQ, every frame sealed. It has the control
        # connection's routing id, which is how the server knows whose it is; it connects once
        # WELCOME says where, and with which PLAIN password.
        self.data = self._ctx.socket(zmq.DEALER)
        self._data_endpoint: str | None = None
        self._data_token: str | None = None
        self.watch: _HandshakeWatch | None = None
        try:
            # Bad keys, or an endpoint ZeroMQ cannot use, fail here.
            with zmq_errors(TransportError, f"cannot connect to the writer at {handle.tcp}"):
                self._configure(handle)
        except BaseException:
            self.close()
            raise

    def _configure(self, handle: Handle) -> None:
        assert handle.tcp is not None
        d = self.dealer
        ident = os.urandom(16)
        for sock in (d, self.data):  # the control and the data connection: the same options, one identity
            sock.linger = 0
            sock.sndhwm = 0
            sock.rcvhwm = 0
            sock.maxmsgsize = wire.DEFAULT_MAX_FRAME
            sock.reconnect_ivl = 100
            sock.reconnect_ivl_max = 1000
            sock.routing_id = ident
        if not handle.insecure:
            assert handle.server_key and handle.client_public_key and handle.client_secret_key
            d.curve_serverkey = handle.server_key.encode()
            d.curve_publickey = handle.client_public_key.encode()
            d.curve_secretkey = handle.client_secret_key.encode()
        else:  # PLAIN, with the password the server derives from the same HMAC key
            assert handle.hmac_key
            d.plain_username = wire.CONTROL_USER
            d.plain_password = wire.control_password(handle.hmac_key.encode())
        self.watch = _HandshakeWatch(d, f"the writer's server at {handle.tcp}")
        d.connect(handle.tcp)

    def send(self, frames: list[Any]) -> None:
        """Send on the control connection; a frame ZeroMQ does not take now is dropped."""
        try:
            self.dealer.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def connect_data(self, port: int, token: str | None) -> None:
        """Connect the data connection to ``port`` of the writer's host, with the PLAIN password
        ``token`` (again if a restarted server took another port or password)."""
        endpoint = f"{self._tcp.rsplit(':', 1)[0]}:{port}"
        if (endpoint, token) == (self._data_endpoint, self._data_token):
            return
        if self._data_endpoint is not None:
            try:
                self.data.disconnect(self._data_endpoint)
            except zmq.ZMQError:
                pass
        # Options apply to the connections made after they are set (reconnections included);
        # without a password, the NULL mechanism (a server that asks for none).
        if token is not None:
            self.data.plain_username = wire.PLAIN_USER
            self.data.plain_password = token.encode()
        self.data.connect(endpoint)
        self._data_endpoint = endpoint
        self._data_token = token

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        self.dealer.close(linger=0)
        self.data.close(linger=0)
        self._ctx.term()
