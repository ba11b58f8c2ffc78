"""The TCP server's two sockets and who gets in (docs/tcp.md, docs/security.md, "Peers without
the keys"): the control socket (CurveZMQ, or PLAIN and signed frames under ``insecure=True``)
and the data socket (PLAIN with the password WELCOME gives), each admitting a connection at its
handshake through a ZAP handler. ``Listener`` binds them, hands frame groups to ZeroMQ for one
reader (saying whether it took them), takes what readers send, and closes it all. What is sent,
and to whom, is the protocol's; the server's loop (server.py) moves frames between the two.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any, cast

import zmq
import zmq.auth.thread

from .._base.errors import TransportError
from . import wire
from .errors import zmq_errors
from .serving import Outgoing, Transmission
from .settings import ServerSettings
from .sockets import send_parts

#: ZeroMQ's queue of frame groups for one remote reader (ZMQ_SNDHWM). The server never queues
#: more for a reader: a batch ZeroMQ refuses stays in the server's buffer and goes later. With
#: protocol.BATCH_BYTES this bounds what a reader that does not read (or asks for everything again and
#: again) costs the server: docs/design.md, "Remote readers".
SEND_HWM = 16
#: frame groups ZeroMQ takes in from one reader before it stops reading that connection
RECV_HWM = 64
#: a connection to either port that has not finished its handshake (the ZMTP greeting, then
#: CurveZMQ, or PLAIN and its password) this long after it was accepted is closed: a peer without
#: the keys holds a descriptor no longer than this (docs/security.md, "Peers without the keys")
HANDSHAKE_S = 5.0
#: frame groups taken off the data socket, and dropped, per turn of the loop: readers send nothing
#: there, and one left unread would stop ZeroMQ reading that connection, even its end
DATA_DRAIN = 64
#: messages (of at most 1 KiB) ZeroMQ queues from one data connection before the server drops them
DATA_RECV_HWM = 16
#: the ZAP domains of the two sockets
CONTROL_DOMAIN = "aiobroadcast"
DATA_DOMAIN = "aiobroadcast-data"


class _Allow:
    """ZAP credentials check: only the readers' public key gets in, or, with an allow list, only
    the keys on it (``keys``: replaced whole when the list changes; the ZAP thread reads it)."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class _Zap(zmq.auth.thread.ThreadAuthenticator):
    """The ZAP handler of both sockets (a thread): CurveZMQ keys through ``_Allow``, PLAIN
    passwords compared in constant time (pyzmq's own compare with ``==``)."""

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        expected = self.passwords.get(domain, {}).get(username)
        if expected is not None and hmac.compare_digest(password.encode(), expected.encode()):
            return True, b"OK"
        return False, b"Invalid password"


class Listener:
    """The server's two ROUTER sockets, bound, their connections admitted at the handshake."""

    def __init__(self, settings: ServerSettings) -> None:
        """Bind ``settings.endpoint`` (control) and ``settings.data_port`` beside it (data); the
        ports bound are ``endpoint`` and ``data_port``. Raises ``TransportError`` if either cannot
        be bound (nothing is left open)."""
        insecure, hmac_key, data_port = settings.insecure, settings.key("hmac_key"), settings.data_port
        self._ctx = zmq.Context()
        self._auth: _Zap | None = None
        self._allow: _Allow | None = None
        #: the CurveZMQ public key (Z85) of the connection the last frame group ``receive``
        #: returned came on, where an allow list is in use (None otherwise)
        self.peer_key: bytes | None = None
        self._peer_keys = settings.allow_list is not None
        self.data_token = settings.data_token
        self.router = self._ctx.socket(zmq.ROUTER)
        # Sealed data frames (BATCH, LAGGED, END) go on a second socket without CurveZMQ: each
        # message is sealed once for every reader (seal.py), instead of CurveZMQ encrypting it
        # again for each connection. Admission and key delivery stay on the CurveZMQ socket;
        # docs/security.md says why this split is safe.
        self.data = self._ctx.socket(zmq.ROUTER)
        try:
            r = self.router
            r.linger = 0
            r.sndhwm = SEND_HWM
            r.rcvhwm = RECV_HWM
            r.maxmsgsize = wire.MAX_CONTROL_FRAME
            # A full queue raises Again, an unknown peer EHOSTUNREACH: nothing is dropped silently,
            # so the protocol knows what was sent.
            r.router_mandatory = True
            r.handshake_ivl = int(HANDSHAKE_S * 1000)
            # Every connection to either port is admitted at its handshake, by the ZAP handler:
            # a peer without the credentials is closed there (and one that says nothing, or
            # dribbles, after HANDSHAKE_S), before it costs more than a descriptor for that long.
            self._auth = _Zap(self._ctx, log=logging.getLogger("aiobroadcast.zap"))
            self._auth.start()
            if not insecure:
                server_secret, client_public = settings.key("server_secret"), settings.key("client_public")
                assert server_secret is not None and client_public is not None
                # An allow list (set_allowed) admits the keys on it, not the handle's shared one.
                self._allow = _Allow(frozenset() if self._peer_keys else frozenset([client_public]))
                self._auth.configure_curve_callback(CONTROL_DOMAIN, credentials_provider=self._allow)
                r.zap_domain = CONTROL_DOMAIN.encode()
                r.curve_server = True
                r.curve_secretkey = server_secret
            else:
                # No CurveZMQ: PLAIN, with a password derived from the HMAC key. A reader of
                # protocol 5 (its own user name and password) is admitted too, to be told by name
                # that it cannot read here (its HELLO is refused: readers.py).
                assert hmac_key is not None
                passwords = {
                    wire.CONTROL_USER.decode(): wire.control_password(hmac_key).decode(),
                    wire.PLAIN_USER.decode(): wire.legacy_password(hmac_key).decode(),
                }
                self._auth.configure_plain(CONTROL_DOMAIN, passwords)
                r.zap_domain = CONTROL_DOMAIN.encode()
                r.plain_server = True
            with zmq_errors(TransportError, f"cannot bind {settings.endpoint}"):
                r.bind(_port_star(settings.endpoint))
            self.endpoint = r.getsockopt_string(zmq.LAST_ENDPOINT)
            d = self.data
            d.linger = 0
            d.sndhwm = SEND_HWM
            # Readers send nothing here; what a peer sends anyway is read and dropped (a message
            # left unread would stop ZeroMQ reading that connection, and noticing its end). A
            # message over 1 KiB closes the connection (the bound also applies to the handshake,
            # hence not 0). Not a queue of 1: behind a ZAP handshake, ZeroMQ 4.3 then delivers
            # nothing from the connection, and stops reading it.
            d.rcvhwm = DATA_RECV_HWM
            d.maxmsgsize = 1024
            d.router_mandatory = True
            d.handshake_ivl = int(HANDSHAKE_S * 1000)
            # PLAIN: the password is data_token, which admitted readers get in WELCOME (over
            # CurveZMQ). Not secret from the path (it travels in clear, as the bodies do, sealed),
            # but a peer that was never admitted does not have it.
            self._auth.configure_plain(DATA_DOMAIN, {wire.PLAIN_USER.decode(): self.data_token})
            d.zap_domain = DATA_DOMAIN.encode()
            d.plain_server = True
            with zmq_errors(TransportError, f"cannot bind the data port {data_port or '(any)'} beside {self.endpoint}"):
                d.bind(_data_endpoint(self.endpoint, data_port))
            self.data_port = int(d.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        except BaseException:
            self.close()
            raise

    def set_allowed(self, keys: frozenset[bytes]) -> None:
        """The allow list changed: from now on a handshake gets in with one of ``keys`` only
        (connections made already stay: the server refuses their frames, ``peer_key``)."""
        assert self._allow is not None and self._peer_keys
        self._allow.keys = keys

    def close(self) -> None:
        self.router.close(linger=0)
        self.data.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def send_on(self, sock: zmq.Socket[Any], ident: bytes, frames: list[Any]) -> bool:
        """Hand ``frames`` to ZeroMQ for ``ident``; False if it refused: the reader's queue is
        full (SEND_HWM: it is not reading) or it is not connected now. Not copied: large
        bodies are ZeroMQ messages shared by every send."""
        try:
            send_parts(sock, [ident, *frames])
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            return False
        return True

    def send_control(self, out: list[Outgoing]) -> None:
        """Send the control frame groups the protocol queued (signed already). One that ZeroMQ
        refuses is lost, and the protocol does not need to know: a timer repeats what matters."""
        router, send_on = self.router, self.send_on
        for ident, frames in out:
            send_on(router, ident, frames)

    def send_data(self, steps: Transmission) -> int:
        """Send the data frame groups ``steps`` yields (sealed already), telling it at once
        whether ZeroMQ took each (a refused batch was not sent: that reader's place stays); the
        number of messages taken, as ``steps`` returns it."""
        data, send_on = self.data, self.send_on
        try:
            ident, frames = next(steps)
            while True:
                ident, frames = steps.send(send_on(data, ident, frames))
        except StopIteration as done:
            sent: int = done.value
            return sent

    def receive(self) -> list[bytes] | None:
        """A frame group a reader sent on the control socket (its routing id first), or None."""
        router = self.router
        if not cast(int, router.get(_EVENTS)) & _POLLIN:
            return None  # asked first: an exception per turn of the loop costs more
        try:
            if not self._peer_keys:
                return router.recv_multipart(zmq.NOBLOCK)
            # Which key the connection was admitted with (ZAP's user id: the Z85 key): a key
            # revoked since is refused on the connection it opened before (control frames only).
            parts = router.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        user = parts[-1].get("User-Id")
        self.peer_key = user.encode() if isinstance(user, str) else None
        return [p.bytes for p in parts]

    def readable(self) -> bool:
        """Whether a peer sent something on either socket (without taking it)."""
        return bool(cast(int, self.router.get(_EVENTS)) & _POLLIN or cast(int, self.data.get(_EVENTS)) & _POLLIN)

    def drain_data(self) -> None:
        """Take what peers sent on the data socket and drop it (readers send nothing there)."""
        data = self.data
        for _ in range(DATA_DRAIN):
            if not cast(int, data.get(_EVENTS)) & _POLLIN:
                return
            try:
                data.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return


def _data_endpoint(endpoint: str, port: int) -> str:
    """The data socket binds where the control socket did, on a port of its own (0: any)."""
    return f"{endpoint.rsplit(':', 1)[0]}:{port or '*'}"


def _port_star(endpoint: str) -> str:
    """``tcp://host:0`` binds an ephemeral port; the real one is read back from the socket."""
    if endpoint.endswith(":0"):
        return endpoint[:-2] + ":*"
    return endpoint


#: ZMQ_EVENTS and POLLIN as plain ints (pyzmq's enums cost microseconds per use)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
