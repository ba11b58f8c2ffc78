"""The allow list of a TCP server that uses one (docs/security.md, "Revoking a reader"): the
reader keys it admits, read again when its file changes, and the key each reader's control
connection was admitted with (a connection made before its key was revoked stays open: ZeroMQ
cannot close it by its routing id, so every frame group on it is checked against the list)."""

from __future__ import annotations

import logging
import os
from collections.abc import Container
from typing import TYPE_CHECKING

from .._base.errors import InvalidArgument
from .._base.handle import AllowList
from . import wire
from .readers import REVOKED, ClientInfo

if TYPE_CHECKING:
    from .listener import Listener
    from .serving import ServerProtocol

log = logging.getLogger("aiobroadcast")


class AllowGate:
    """The keys on the allow list at ``path`` (Z85), and who was admitted with which. Raises
    ``InvalidArgument`` if the list cannot be read at the start (the writer says why); a list
    that cannot be read later changes nothing (logged): a reader is revoked by a list that says
    so, not by a file being replaced."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._seen: tuple[int, int, int] | None = None  # the file's (inode, mtime, size) read
        #: the keys the server admits now
        self.allowed: frozenset[bytes] = self._read(must=True) or frozenset()
        self._peer_keys: dict[bytes, bytes] = {}  # routing id -> the key it was admitted with

    def _read(self, *, must: bool = False) -> frozenset[bytes] | None:
        """The keys on the list if its file changed since it was last read (None if not;
        ``must``: read it at any rate)."""
        try:
            st = os.stat(self._path)
            seen = (st.st_ino, st.st_mtime_ns, st.st_size)
            if seen == self._seen and not must:
                return None
            keys = AllowList.load(self._path).public_keys()
        except (OSError, InvalidArgument) as exc:
            if must:
                raise InvalidArgument(f"cannot read the allow list {self._path!r}: {exc}") from exc
            if self._seen is not None:
                log.error(
                    "aiobroadcast: cannot read the allow list %r (%s); keeping the readers it allowed", self._path, exc
                )
                self._seen = None  # said once, until it can be read again
            return None
        self._seen = seen
        return keys

    def reload(self) -> frozenset[bytes] | None:
        """Read the list again if its file changed: the keys taken off it (perhaps none), or
        None if the keys admitted did not change."""
        keys = self._read()
        if keys is None or keys == self.allowed:
            return None
        removed, self.allowed = self.allowed - keys, keys
        return removed

    def apply(self, proto: ServerProtocol, net: Listener) -> list[ClientInfo] | None:
        """Read the list again if its file changed: ``net`` admits only its keys from then on,
        and the readers of keys taken off it are revoked (``ServerProtocol.revoke``: dropped and
        told, and the group key changes past every key they were given, whether connected now
        or not; the others get the new keys at once). Who was dropped; None: nothing changed."""
        removed = self.reload()
        if removed is None:
            return None
        net.set_allowed(self.allowed)
        if not removed:
            return []
        dropped = proto.revoke(self.holders(removed, proto.readers.clients))
        proto.send_keys()
        return dropped

    def admits(self, ident: bytes, net: Listener) -> bool:
        """Whether the frame group ``net`` just took from ``ident`` came on a connection admitted
        with a key still on the list (remembered for ``holders``). If not, it is answered
        REFUSED "revoked" and the protocol must never see it: a revoked reader's HELLO on a
        connection it still has admits nothing."""
        key = net.peer_key
        if key is not None and key in self.allowed:
            self._peer_keys[ident] = key
            return True
        self._peer_keys.pop(ident, None)
        net.send_control([(ident, [wire.REFUSED, REVOKED])])
        return False

    def holders(self, removed: Container[bytes], admitted: Container[bytes]) -> list[bytes]:
        """The routing ids of the ``admitted`` readers whose keys were ``removed``."""
        return [ident for ident, key in self._peer_keys.items() if key in removed and ident in admitted]

    def forget_others(self, admitted: Container[bytes]) -> None:
        """Forget the keys of connections whose readers are not ``admitted`` any more."""
        self._peer_keys = {i: k for i, k in self._peer_keys.items() if i in admitted}
