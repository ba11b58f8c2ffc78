"""What the writer tells its TCP server process: ``ServerSettings``, one JSON line on the process's
stdin (the keys included: never on its command line, never in its environment).

The values the server derives from ``open_writer``'s options (its buffer, the silence timeout, how
long a stop may take) are computed here and nowhere else; the server process parses the line with
``ServerSettings.model_validate_json`` and refuses one it does not know (an unknown or missing
field, a wrong type). This module imports neither ZeroMQ nor the protocol: the writer's process
builds the settings without loading them.
"""

from __future__ import annotations

import secrets
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from .._base.handle import CurveKeys, Handle
from .report import report_path

#: a remote reader silent for this many heartbeats is dropped
SILENT_HEARTBEATS = 6
#: how many heartbeats a stop waits for remote readers to drain before the server is killed
STOP_HEARTBEATS = 12


# One property per option: how a Protocol asks for read-only attributes (a plain annotation asks
# for writable ones, which the frozen _WriterSpec does not have).
class WriterOptions(Protocol):
    """The writer's options the server's settings come from (``_broadcast.writer_open._WriterSpec``)."""

    @property
    def insecure(self) -> bool: ...
    @property
    def tcp_window(self) -> int: ...
    @property
    def heartbeat_s(self) -> float: ...
    @property
    def max_readers(self) -> int: ...
    @property
    def sole_reader(self) -> bool: ...
    @property
    def rekey_messages(self) -> int: ...
    @property
    def rekey_bytes(self) -> int: ...
    @property
    def data_port(self) -> int: ...
    @property
    def allow_list(self) -> str | None: ...


class ServerSettings(BaseModel):
    """Everything the TCP server process needs, as the writer's process sends it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: the channel's handle (without its TCP part: the server is what makes that)
    handle: Handle
    #: where to bind: ``open_writer(tcp=...)``, then the endpoint the first server bound (a server
    #: started again binds the same port)
    endpoint: str
    insecure: bool
    #: Z85 CurveZMQ keys (None under ``insecure``)
    server_secret: str | None = Field(default=None, repr=False)
    client_public: str | None = None
    #: hex, the HMAC key under ``insecure`` (None under CurveZMQ)
    hmac_key: str | None = Field(default=None, repr=False)
    #: the most credit a remote reader gets
    window: int
    #: messages held for remote readers
    buffer_max: int
    hb_interval: float
    hb_timeout: float
    max_remote: int
    sole_reader: bool
    rekey_messages: int
    rekey_bytes: int
    #: the data socket's port (0: a free one)
    data_port: int
    #: the allow list's file (an absolute path; None: the handle's client key is admitted): the
    #: server admits only the keys on it, and reads it again when it changes
    allow_list: str | None = None
    #: the data socket's PLAIN password: kept for the servers started again, so a reader's data
    #: connection, which reconnects by itself, gets in at once
    data_token: str = Field(default_factory=lambda: secrets.token_hex(16), repr=False)
    #: this run of the writer (drawn once per ``open_writer``, kept for the servers started again):
    #: readers learn it in WELCOME and name it when they come back, so a writer restarted with
    #: the same channel id (fixed keys and endpoint, or a channel name), whose messages are
    #: numbered anew, ends their stream instead of resuming it (docs/tcp.md, "Restarts")
    run: str = Field(default_factory=lambda: secrets.token_hex(8))
    #: the report file (``report.report_path``)
    report_path: str
    #: a server started again: the pid of the one that died, whose ring place it takes over
    take_over: int | None = None
    #: ... and how many remote readers that one served (what it keeps for them to come back)
    returning: int = 0

    @classmethod
    def for_writer(
        cls,
        options: WriterOptions,
        handle: Handle,
        endpoint: str,
        keys: CurveKeys | None,
        hmac_key: str | None,
    ) -> ServerSettings:
        """The settings of the server of a writer opened with ``options``, on ``handle``'s ring."""
        return cls(
            handle=handle,
            endpoint=endpoint,
            insecure=options.insecure,
            server_secret=keys.server_secret if keys else None,
            client_public=keys.client_public if keys else None,
            hmac_key=hmac_key,
            window=options.tcp_window,
            buffer_max=2 * max(options.tcp_window, handle.capacity),
            hb_interval=options.heartbeat_s,
            hb_timeout=SILENT_HEARTBEATS * options.heartbeat_s,
            max_remote=options.max_readers,
            sole_reader=options.sole_reader,
            rekey_messages=options.rekey_messages,
            rekey_bytes=options.rekey_bytes,
            data_port=options.data_port,
            allow_list=options.allow_list,
            report_path=report_path(handle.path),
        )

    @property
    def stop_s(self) -> float:
        """How long a stop waits for remote readers to drain before it kills the server."""
        return STOP_HEARTBEATS * self.hb_interval

    def key(self, name: Literal["server_secret", "client_public", "hmac_key"]) -> bytes | None:
        """The key ``name``, as the sockets and the sealer take it (None if there is none)."""
        value: str | None = getattr(self, name)
        return value.encode() if value else None
