"""The handle: everything a reader needs to attach to a channel."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import InvalidArgument, InvalidHandle, plural

Policy = Literal["block", "lag"]
Codec = Literal["pickle", "json", "pydantic-json"]


#: The longest name of a file the package creates beside a channel's segment, for a reader place
#: ``i``: ``aiobroadcast-<32 hex>-r<i>.sock`` (the stats file and its temporary are shorter).
_NAME_LEN = len("aiobroadcast-") + 32
#: Unix socket paths hold at most 107 bytes (sun_path is 108, with its terminating NUL).
_UNIX_PATH_MAX = 107
#: ``tcp://HOST:PORT``: HOST a DNS name, an IPv4 address, an IPv6 address in brackets, or (to
#: bind) ``*``; the port is checked apart.
_TCP_RE = re.compile(r"^tcp://(\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?):([0-9]{1,5})$")


def check_directory(directory: str, max_readers: int) -> str | None:
    """What is wrong with ``directory`` as a channel's directory, or None. It must be an absolute
    path without NUL, short enough that the wake-up sockets beside the segment can be bound."""
    if "\0" in directory:
        return f"directory {directory!r} contains a NUL byte"
    if not os.path.isabs(directory):
        return f"directory {directory!r} is not an absolute path"
    longest = len(os.fsencode(directory)) + 1 + _NAME_LEN + len(f"-r{max(0, max_readers - 1)}.sock")
    if longest > _UNIX_PATH_MAX:
        room = _UNIX_PATH_MAX - (longest - len(os.fsencode(directory)))
        return (
            f"directory {directory!r} is too long: the wake-up sockets beside the segment need paths "
            f"of at most {_UNIX_PATH_MAX} bytes (use a directory of at most {room} bytes)"
        )
    return None


def check_endpoint(endpoint: str, *, bind: bool) -> str | None:
    """What is wrong with a ``tcp://host:port`` endpoint, or None. Port 0 (a free port) and
    host ``*`` are for binding only."""
    m = _TCP_RE.match(endpoint)
    if m is None:
        return f"{endpoint!r} is not a tcp:// endpoint of the form tcp://host:port"
    port = int(m.group(3))
    if port > 65535 or (port == 0 and not bind):
        return f"tcp endpoint {endpoint!r} has no valid port (1-65535{', or 0 for any' if bind else ''})"
    if m.group(1) == "*" and not bind:
        return f"tcp endpoint {endpoint!r} names no host to connect to"
    return None


def require(problem: str | None) -> None:
    """Raise ``InvalidArgument`` for a problem found by a ``check_*`` function."""
    if problem is not None:
        raise InvalidArgument(problem)


class Handle(BaseModel):
    """Names a channel. Frozen, picklable, and round-trips through JSON
    (``Handle.from_json(handle.to_json()) == handle``; ``save`` and ``load`` for files). Pass it
    to ``open_reader`` in any process on the host, or on another host when the writer serves TCP.

    A handle of a TCP channel holds the readers' keys: treat it as a secret. ``repr`` hides
    the key material and ``save`` writes it readable by its owner only."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = 1
    directory: str = Field(description="directory of the shared-memory file, normally /dev/shm")
    name: str = Field(pattern=r"^aiobroadcast-[0-9a-f]{32}$")
    capacity: int = Field(gt=0)
    slot_bytes: int = Field(gt=0)
    max_readers: int = Field(gt=0)
    policy: Policy
    codec: Codec
    schema_path: str | None = Field(
        default=None, description="'module:QualName' of the pydantic model, for codec pydantic-json"
    )
    writer_pid: int
    arena_bytes: int = Field(default=0, ge=0, description="the size of the channel's arena (0: none)")
    tcp: str | None = Field(default=None, description="the TCP endpoint the writer bound for remote readers")
    insecure: bool = Field(default=False, description="plain TCP (messages still HMAC-signed)")
    server_key: str | None = Field(default=None, description="the writer's CurveZMQ public key (Z85)")
    client_public_key: str | None = Field(default=None, description="readers' CurveZMQ public key (Z85)")
    # Secrets: never shown by repr(); a saved handle is written with mode 0600.
    client_secret_key: str | None = Field(default=None, repr=False)
    hmac_key: str | None = Field(default=None, repr=False)

    @field_validator("tcp")
    @classmethod
    def _tcp_endpoint(cls, value: str | None) -> str | None:
        problem = None if value is None else check_endpoint(value, bind=False)
        if problem is not None:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _paths(self) -> Handle:
        problem = check_directory(self.directory, self.max_readers)
        if problem is not None:
            raise ValueError(problem)
        return self

    @property
    def token(self) -> str:
        return self.name.removeprefix("aiobroadcast-")

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.name)

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> Handle:
        """The handle ``to_json`` wrote. Raises ``InvalidHandle`` (a file's path gets one that
        says to read it with ``Handle.load``)."""
        return cls.parse(text)

    @classmethod
    def parse(cls, data: str | bytes | dict[str, Any] | Handle) -> Handle:
        """Build a handle from its JSON text or dict. Raises ``InvalidHandle``. A ``Handle`` is
        checked again (``model_construct`` or ``model_copy`` skip validation)."""
        if handle_kind(data) == "collector":
            raise InvalidHandle(
                "this is a fan-in collector's handle, not a broadcast channel's: senders attach to it with "
                "open_sender(collector.handle, name=...); open_reader takes a writer's handle (writer.handle)"
            )
        return validated(cls, data, "handle", "read it with Handle.load(path)")

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the handle as JSON, readable by its owner only (mode 0600)."""
        _write_private(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Handle:
        """Read a handle saved with ``save``. Raises ``InvalidHandle``."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise InvalidHandle(f"cannot read handle file {os.fspath(path)!r}: {exc}") from exc
        return cls.parse(text)


class CurveKeys(BaseModel):
    """CurveZMQ key pairs for a TCP channel (Z85 text): the writer's server pair and the pair
    every reader presents. Made by ``CurveKeys.generate()`` (or ``aiobroadcast keygen``);
    pass to ``open_writer(tcp=..., keys=...)`` to keep the same keys across writer restarts (with
    a fixed port, the restarted writer is the same channel: it accepts the handles of its
    earlier runs; docs/tcp.md, "Restarts").
    Secret: ``repr`` hides the secret keys and ``save`` writes mode 0600."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    server_public: str
    server_secret: str = Field(repr=False)
    client_public: str
    client_secret: str = Field(repr=False)

    @classmethod
    def generate(cls) -> CurveKeys:
        import zmq

        sp, ss = zmq.curve_keypair()
        cp, cs = zmq.curve_keypair()
        return cls(
            server_public=sp.decode(), server_secret=ss.decode(), client_public=cp.decode(), client_secret=cs.decode()
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the keys as JSON, readable by their owner only (mode 0600)."""
        _write_private(Path(path), self.model_dump_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CurveKeys:
        """Read keys saved with ``save``. Raises ``InvalidHandle`` if the file is not a key file."""
        try:
            return cls.model_validate_json(Path(path).read_text())
        except (OSError, ValidationError) as exc:
            reason = _first_problem(exc) if isinstance(exc, ValidationError) else str(exc)
            raise InvalidHandle(f"not an aiobroadcast key file: {os.fspath(path)!r}: {reason}") from exc


#: a reader's name in an allow list: what ``keygen --reader`` and ``--revoke`` take
_READER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")


class AllowList(BaseModel):
    """The remote readers a writer admits, each by its own CurveZMQ public key (Z85), by name:
    ``open_writer(allow_list=FILE)`` (``publish --allow-list FILE``) serves only these, not the
    handle's shared client key, and reads the file again when it changes (docs/security.md,
    "Revoking a reader"). Made and changed by ``aiobroadcast keygen --reader NAME`` and
    ``--revoke NAME``; the file is this model's JSON, written atomically with mode 0600 (the
    writer never reads a half-written one)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    readers: dict[str, str] = Field(default_factory=dict)

    @field_validator("readers")
    @classmethod
    def _keys(cls, value: dict[str, str]) -> dict[str, str]:
        for name, key in value.items():
            if not _READER_NAME_RE.fullmatch(name):
                raise ValueError(f"reader name {name!r} is not 1 to 128 letters, digits, '.', '_', '@' or '-'")
            if len(key) != 40:
                raise ValueError(f"reader {name!r}: a CurveZMQ public key is 40 characters of Z85, not {len(key)}")
        return value

    def public_keys(self) -> frozenset[bytes]:
        """The keys admitted, as the ZAP handler compares them (Z85 bytes)."""
        return frozenset(key.encode() for key in self.readers.values())

    def with_reader(self, name: str, public_key: str) -> AllowList:
        if name in self.readers:
            raise InvalidArgument(f"reader {name!r} is on the allow list already; revoke it first")
        return AllowList(readers={**self.readers, name: public_key})

    def without(self, name: str) -> AllowList:
        """The list without reader ``name`` (matched by name, or by its public key)."""
        gone = [n for n, key in self.readers.items() if name in (n, key)]
        if not gone:
            known = ", ".join(sorted(self.readers)) or "none"
            raise InvalidArgument(f"no reader {name!r} on the allow list (readers: {known})")
        return AllowList(readers={n: k for n, k in self.readers.items() if n not in gone})

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the list as JSON (mode 0600), atomically: a writer reading it meanwhile reads
        the old list or the new one."""
        _write_private(Path(path), self.model_dump_json(indent=2))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> AllowList:
        """Read a list saved with ``save``. Raises ``InvalidArgument`` if the file cannot be read
        or is not an allow list."""
        try:
            return cls.model_validate_json(Path(path).read_text())
        except (OSError, ValidationError) as exc:
            reason = _first_problem(exc) if isinstance(exc, ValidationError) else (exc.strerror or str(exc))
            raise InvalidArgument(f"not a readable aiobroadcast allow list: {os.fspath(path)!r}: {reason}") from exc


def handle_kind(data: object) -> str | None:
    """The ``kind`` a handle (a model, a dict or JSON text) says it is, if any: a fan-in
    collector's handle says ``"collector"``; a broadcast channel's says nothing."""
    if isinstance(data, BaseModel) or not isinstance(data, str | bytes | dict):
        kind = getattr(data, "kind", None)
    elif isinstance(data, dict):
        kind = data.get("kind")
    else:
        try:
            parsed = json.loads(data)
        except ValueError:
            return None
        kind = parsed.get("kind") if isinstance(parsed, dict) else None
    return kind if isinstance(kind, str) else None


def path_problem(data: object, todo: str) -> str | None:
    """If ``data``, given where a handle's JSON belongs, looks like a file's path instead (a
    path object; the name of an existing file; text without a "{" that ends in ".json" or holds
    a path separator): one line that says so and ``todo``."""
    if isinstance(data, os.PathLike):
        text = os.fsdecode(os.fspath(data))
    elif isinstance(data, bytes | bytearray):
        text = bytes(data).decode("utf-8", "replace")
    elif isinstance(data, str):
        text = data
    else:
        return None
    stripped = text.strip()
    if not (
        isinstance(data, os.PathLike)
        or ("{" not in stripped and (stripped.endswith(".json") or os.sep in stripped))
        or os.path.isfile(stripped)
    ):
        return None
    shown = text if len(text) <= 200 else text[:200] + "..."
    return f"this looks like a file path ({shown!r}), not a handle's JSON; {todo}"


_M = TypeVar("_M", bound=BaseModel)


def validated(cls: type[_M], data: object, what: str, todo: str) -> _M:
    """``data`` (an instance of ``cls``, checked again; a dict; or JSON text) validated as a
    ``cls``. Raises ``InvalidHandle`` "not an aiobroadcast WHAT", with ``path_problem``'s line
    (ending in ``todo``) where ``data`` looks like a file's path, else pydantic's first problem."""
    try:
        if isinstance(data, cls):
            return cls.model_validate(data.model_dump())
        if isinstance(data, dict):
            return cls.model_validate(data)
        return cls.model_validate_json(data)  # type: ignore[arg-type]
    except ValidationError as exc:
        path = path_problem(data, todo)
        raise InvalidHandle(f"not an aiobroadcast {what}: {path or _first_problem(exc)}") from exc


def _write_private(target: Path, text: str) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, target)


def _first_problem(exc: ValidationError) -> str:
    """One line for an error message (pydantic's own text spans several)."""
    errors = exc.errors()
    if not errors:
        return str(exc).splitlines()[0]
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"]) or "input"
    more = f" (and {plural(len(errors) - 1, 'more problem')})" if len(errors) > 1 else ""
    return f"{where}: {first['msg']}{more}"
