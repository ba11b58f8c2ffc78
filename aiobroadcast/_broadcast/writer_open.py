"""Opening a writer: ``open_writer``'s arguments checked (``_WriterSpec``), the channel created,
and its TCP server started (``channel_steps``), written once for the async and the blocking
factories (``open.py``, ``blocking.py``)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

import anyio
import anyio.to_thread
from pydantic import BaseModel

from .._base.codec import JsonCodec, PickleEncoder, SchemaCodec, schema_path
from .._base.constants import REKEY_BYTES, REKEY_BYTES_MAX, REKEY_MESSAGES, REKEY_MESSAGES_MAX
from .._base.errors import BroadcastError, InvalidArgument
from .._base.files import unlink_quietly
from .._base.handle import AllowList, CurveKeys, Handle, Policy, check_directory, check_endpoint, require
from .._base.steps import drive
from .._shm import layout as _layout
from .._shm import segment as _segment
from .._shm.arena import arena_path
from .._tcp.settings import ServerSettings
from .._tcp.supervisor import SERVER_START_S, ServerProcess, read_answer
from .channel import WriterChannel

log = logging.getLogger("aiobroadcast")

DEFAULT_DIRECTORY = "/dev/shm"

#: ``open_writer(channel=...)``: a name that stays the channel's across writer restarts
_CHANNEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True, kw_only=True)
class _WriterSpec:
    """``open_writer``'s arguments, checked, and the channel's creation: shared by the async and
    the blocking factories (``aiobroadcast.blocking``). The defaults are written here only:
    ``open_writer``'s signature reads them from this class."""

    capacity: int = 64
    slot_bytes: int = 1 << 16
    max_readers: int = 16
    policy: Policy = "block"
    schema: type[BaseModel] | None = None
    codec: Literal["pickle", "json"] = "pickle"
    max_message_bytes: int | None = None
    directory: str = DEFAULT_DIRECTORY
    tcp: str | None = None
    insecure: bool = False
    advertise: str | None = None
    keys: CurveKeys | None = None
    heartbeat_s: float = 0.5
    tcp_window: int = 256
    rekey_messages: int = REKEY_MESSAGES
    rekey_bytes: int = REKEY_BYTES
    data_port: int = 0
    allow_list: str | None = None
    channel: str | None = None
    #: a fan-in remote sender's ring: its TCP server serves one reader, the collector
    #: (``ServerConfig.sole_reader``); set by ``open_sender(tcp=...)``, not an ``open_writer`` option
    sole_reader: bool = field(default=False, metadata={"internal": True})
    arena_bytes: int = 0

    def __post_init__(self) -> None:
        if self.capacity < 2:
            raise InvalidArgument("capacity must be at least 2")
        if self.max_readers < 1:
            raise InvalidArgument("max_readers must be at least 1")
        if self.slot_bytes < 64:
            raise InvalidArgument("slot_bytes must be at least 64")
        if self.policy not in _layout.POLICIES:
            raise InvalidArgument(f"policy must be one of {_layout.POLICIES}, not {self.policy!r}")
        if self.codec not in ("pickle", "json"):
            raise InvalidArgument(f"codec must be 'pickle' or 'json', not {self.codec!r}")
        if self.tcp is not None:
            require(check_endpoint(self.tcp, bind=True))
        for name, value, most in (
            ("rekey_messages", self.rekey_messages, REKEY_MESSAGES_MAX),
            ("rekey_bytes", self.rekey_bytes, REKEY_BYTES_MAX),
        ):
            if type(value) is not int or not 1 <= value <= most:
                raise InvalidArgument(f"{name} must be an integer from 1 to {most}, not {value!r}")
        if type(self.data_port) is not int or not 0 <= self.data_port <= 65535:
            raise InvalidArgument(f"data_port must be a port number (0: any free port), not {self.data_port!r}")
        if self.allow_list is not None:
            if self.tcp is None or self.insecure:
                raise InvalidArgument("allow_list needs tcp= and CurveZMQ, not insecure=True")
            AllowList.load(self.allow_list)  # readable, and a list: said here rather than by the server
            object.__setattr__(self, "allow_list", os.path.abspath(os.fspath(self.allow_list)))
        if type(self.arena_bytes) is not int or self.arena_bytes < 0:
            raise InvalidArgument(f"arena_bytes must be 0 (no arena) or a size in bytes, not {self.arena_bytes!r}")
        if self.arena_bytes and (self.policy != "block" or self.codec != "pickle" or self.schema is not None):
            raise InvalidArgument('an arena (arena_bytes) needs policy "block" and the pickle codec without schema')
        if self.channel is not None and (type(self.channel) is not str or not _CHANNEL_RE.fullmatch(self.channel)):
            raise InvalidArgument(
                "channel must be a name of 1 to 128 letters, digits, '.', '_' or '-' (not starting with "
                f"'.', '_' or '-'), not {self.channel!r}"
            )
        require(check_directory(self.directory, self.ring_readers))
        object.__setattr__(self, "slot_bytes", (self.slot_bytes + 63) // 64 * 64)

    @property
    def ring_readers(self) -> int:
        return self.max_readers + (1 if self.tcp else 0)  # a place for the TCP server

    def fixed_token(self) -> str | None:
        """The channel id (the handle's token, which names the segment) when it is to be the same
        at every run of this writer, so that the handles of earlier runs open readers on this
        one: with a ``channel`` name, or serving TCP on a fixed port with fixed keys (the handle
        carries the keys and the endpoint, and they would work again). Derived from what names
        the channel: the directory, the name, the endpoint and the public keys (another name,
        endpoint or key pair is another channel, whose handles are refused). None: a random id,
        as for a channel that can never be reached again once its writer is gone (fresh keys, a
        free port), and for a fan-in sender's ring (its collector may still drain the last one)."""
        if self.sole_reader:
            return None
        keys = self.keys if self.tcp is not None and not self.insecure else None
        keyed = keys is not None and self.tcp is not None and not self.tcp.endswith(":0")
        if self.channel is None and not keyed:
            return None
        parts = {
            "directory": os.path.normpath(self.directory),
            "channel": self.channel,
            "tcp": self.tcp,
            "advertise": self.advertise,
            "server_public": keys.server_public if keys else None,
            "client_public": keys.client_public if keys else None,
        }
        text = json.dumps(parts, sort_keys=True).encode()
        return hashlib.sha256(b"aiobroadcast channel id\0" + text).hexdigest()[:32]

    def create(self) -> WriterChannel:
        """Create the segment and the channel's writing side (without the TCP server). A fixed
        channel id takes its segment's path over from a dead earlier run (``take_over_dead``)."""
        _segment.sweep_stale(self.directory)
        token = self.fixed_token()
        if token is None:
            token = secrets.token_hex(16)
        else:
            _segment.take_over_dead(self.directory, token)
        encoder: PickleEncoder | SchemaCodec | JsonCodec
        if self.schema is not None:
            encoder, channel_codec = SchemaCodec(self.schema), "pydantic-json"
        elif self.codec == "json":
            encoder, channel_codec = JsonCodec(), "json"
        else:
            encoder, channel_codec = PickleEncoder(arena=self.arena_bytes > 0), "pickle"
        seg = _segment.create_segment(
            self.directory,
            token,
            self.capacity,
            self.slot_bytes,
            self.ring_readers,
            _layout.POLICIES.index(self.policy),
            _layout.CODECS.index(channel_codec),
        )
        try:
            handle = Handle(
                directory=self.directory,
                name=f"aiobroadcast-{token}",
                capacity=self.capacity,
                slot_bytes=self.slot_bytes,
                max_readers=self.ring_readers,
                policy=self.policy,
                codec=channel_codec,  # type: ignore[arg-type]
                schema_path=schema_path(self.schema) if self.schema is not None else None,
                writer_pid=os.getpid(),
                arena_bytes=(self.arena_bytes + 63) // 64 * 64,
            )
            return WriterChannel(seg, handle, encoder, self.max_message_bytes, handle.arena_bytes)
        except BaseException:
            seg.close()
            unlink_quietly(seg.path)
            unlink_quietly(arena_path(seg.path))
            raise


#: Opening a channel (``channel_steps``): yields the TCP server's start, whose answer the front
#: end waits for (in a worker thread, or here) and sends in, or throws what stopped the wait.
ChannelSteps = Generator["_ServerStart", dict[str, Any], WriterChannel]


def channel_steps(spec: _WriterSpec) -> ChannelSteps:
    """Create the channel, and start its TCP server if ``spec`` asks for one: the logic of both
    factories, which differ only in how they wait for the server's answer. On failure (an error
    or a cancellation thrown in) nothing is left open: the server killed, the channel closed
    (it has no server yet, so closing it does not wait)."""
    channel = spec.create()
    try:
        if spec.tcp is not None:
            start = _ServerStart(channel, spec)
            try:
                answer = yield start
            except BaseException:
                start.kill()
                raise
            start.finish(answer)
    except BaseException:
        channel.close_blocking()
        raise
    return channel


async def _open_channel(spec: _WriterSpec) -> WriterChannel:
    """``channel_steps`` in a task (``_base.steps.drive``): the server's answer is waited for in a
    worker thread, which a cancellation abandons (the steps then kill the server)."""

    async def answer(start: _ServerStart) -> dict[str, Any]:
        return await anyio.to_thread.run_sync(start.answer, abandon_on_cancel=True)

    return await drive(channel_steps(spec), answer)


class WriterOptions(TypedDict, total=False):
    """``open_writer``'s keyword arguments but ``schema`` (the blocking factory takes them so)."""

    capacity: int
    slot_bytes: int
    max_readers: int
    policy: Policy
    codec: Literal["pickle", "json"]
    max_message_bytes: int | None
    directory: str
    tcp: str | None
    insecure: bool
    advertise: str | None
    keys: CurveKeys | None
    heartbeat_s: float
    tcp_window: int
    rekey_messages: int
    rekey_bytes: int
    data_port: int
    allow_list: str | None
    arena_bytes: int
    channel: str | None


class _ServerStart:
    """Starting the TCP server process for a writer: the parts before and after waiting for its
    answer (``answer``, within ``SERVER_START_S``), shared by the async and blocking factories."""

    def __init__(self, channel: WriterChannel, spec: _WriterSpec) -> None:
        assert spec.tcp is not None
        self._channel = channel
        self._spec = spec
        handle = channel.handle
        if spec.insecure:
            log.warning(
                "aiobroadcast: serving %s WITHOUT encryption (insecure=True); use only on a closed network", spec.tcp
            )
            self._keys = None
            self._hmac_key: str | None = secrets.token_hex(32)
        else:
            self._keys = spec.keys or CurveKeys.generate()
            self._hmac_key = None
        settings = ServerSettings.for_writer(spec, handle, spec.tcp, self._keys, self._hmac_key)
        self._server = ServerProcess(settings)
        self.proc = self._server.spawn()

    def answer(self) -> dict[str, Any]:
        """Wait (blocking) for the server's answer: its endpoint, or why it could not serve."""
        return read_answer(self.proc, SERVER_START_S)

    def kill(self) -> None:
        proc = self.proc
        proc.kill()
        proc.wait()
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        proc.stdout.close()

    def finish(self, answer: dict[str, Any]) -> None:
        """Give the writer the full handle and its server; ``BroadcastError`` (and the process
        killed) if the server could not serve."""
        spec = self._spec
        if "error" in answer:
            self.kill()
            raise BroadcastError(f"cannot serve {spec.tcp}: {answer['error']}")
        self._server.serve(self.proc, answer["endpoint"])
        k = self._keys
        full = self._channel.handle.model_copy(
            update={
                "tcp": _advertised(answer["endpoint"], spec.advertise),
                "insecure": spec.insecure,
                "server_key": k.server_public if k else None,
                "client_public_key": k.client_public if k else None,
                "client_secret_key": k.client_secret if k else None,
                "hmac_key": self._hmac_key,
            }
        )
        self._channel.serve_tcp(self._server, Handle.model_validate(full.model_dump()))


def _advertised(endpoint: str, host: str | None) -> str:
    if host is None:
        return endpoint
    port = endpoint.rsplit(":", 1)[1]
    return f"tcp://{host}:{port}"
