"""A collector's handle (``CollectorHandle``), and the names and files it stands for: the
rendezvous directory, a sender's name, the collector's liveness lock."""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .._base.codec import import_schema
from .._base.errors import (
    InvalidArgument,
    InvalidHandle,
)
from .._base.handle import (
    _UNIX_PATH_MAX,
    Codec,
    Handle,
    Policy,
    check_directory,
    handle_kind,
    validated,
)
from .._shm import segment as _segment

#: A sender's name: a file name in the rendezvous directory, and the reader-visible ``source``.
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:@+-]{0,63}$")
DIR_RE = r"^aiobroadcast-fanin-[0-9a-f]{32}$"
#: What a fork child may do instead of using an inherited collector, or sender (``_fork.role``).
COLLECTOR_FIX = "open a sender with open_sender(collector.handle, name=...)"
SENDER_FIX = "open your own with open_sender(sender.handle, name=...) under a name of its own"


class CollectorHandle(BaseModel):
    """Names a collector (fan-in). Frozen, picklable, JSON round-trips. Pass it to
    ``open_sender`` in any process on the host. Not a broadcast channel's ``Handle``: each
    factory refuses the other's handle with an ``InvalidHandle`` that says which to use."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["collector"] = "collector"
    version: Literal[1] = 1
    directory: str = Field(description="where the rendezvous directory and the senders' rings are")
    name: str = Field(pattern=DIR_RE)
    capacity: int = Field(gt=1, description="slots of each sender's ring")
    slot_bytes: int = Field(ge=64, description="bytes per slot of each sender's ring")
    policy: Policy
    codec: Codec
    schema_path: str | None = None
    max_message_bytes: int | None = Field(default=None, gt=0)
    collector_pid: int

    @model_validator(mode="after")
    def _paths(self) -> CollectorHandle:
        problem = directory_problem(self.directory)
        if problem is not None:
            raise ValueError(problem)
        return self

    @property
    def path(self) -> str:
        """The rendezvous directory."""
        return os.path.join(self.directory, self.name)

    @property
    def inbox_path(self) -> str:
        return os.path.join(self.path, "inbox.sock")

    @property
    def lock_path(self) -> str:
        return os.path.join(self.path, "collector")

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> CollectorHandle:
        """The collector handle ``to_json`` wrote. Raises ``InvalidHandle``."""
        return cls.parse(text)

    @classmethod
    def parse(cls, data: str | bytes | dict[str, Any] | CollectorHandle | Handle) -> CollectorHandle:
        """Build a collector handle from its JSON text or dict. Raises ``InvalidHandle`` (a
        broadcast channel's handle gets one that says so)."""
        if isinstance(data, Handle) or (handle_kind(data) != "collector" and looks_like_channel(data)):
            raise InvalidHandle(
                "this is a broadcast channel's handle (open_reader takes it), not a collector's: "
                "a sender needs the handle of a collector made by open_collector() (collector.handle)"
            )
        return validated(
            cls, data, "collector handle", "pass the file's text: CollectorHandle.from_json(Path(path).read_text())"
        )


def looks_like_channel(data: object) -> bool:
    try:
        Handle.parse(data)  # type: ignore[arg-type]
    except (InvalidHandle, TypeError, AttributeError):
        return False
    return True


def directory_problem(directory: str) -> str | None:
    problem = check_directory(directory, 1)  # the senders' rings are channels in it
    if problem is not None:
        return problem
    inbox = len(os.fsencode(directory)) + len("/aiobroadcast-fanin-") + 32 + len("/inbox.sock")
    if inbox > _UNIX_PATH_MAX:
        return (
            f"directory {directory!r} is too long for the collector's wake-up socket (at most {_UNIX_PATH_MAX} bytes)"
        )
    return None


def name_problem(name: object) -> str | None:
    if not isinstance(name, str) or not NAME_RE.match(name):
        return (
            f"sender name {name!r} must be 1-64 characters of letters, digits and _.:@+- "
            "(not starting with a punctuation mark)"
        )
    return None


def collector_alive(handle: CollectorHandle) -> bool:
    try:
        fd = os.open(handle.lock_path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        return _segment.is_locked(fd, 0)
    finally:
        os.close(fd)


def sender_schema(h: CollectorHandle, schema: type[BaseModel] | None) -> type[BaseModel] | None:
    """The model a sender of the collector ``h`` sends: ``schema``, or for a schema collector
    opened without it, the one its handle names (imported here). Raises ``InvalidHandle`` (it
    cannot be imported), ``InvalidArgument`` (a schema for a collector that takes none)."""
    if h.codec == "pydantic-json" and schema is None:
        if h.schema_path is None:
            raise InvalidHandle("schema collector without schema_path: pass schema=")
        try:
            return import_schema(h.schema_path)
        except (ImportError, AttributeError, TypeError, ValueError) as exc:
            raise InvalidHandle(f"cannot import the collector's schema {h.schema_path!r} here: {exc}") from exc
    if h.codec != "pydantic-json" and schema is not None:
        raise InvalidArgument(f"this collector takes {h.codec}, not a schema: open it with schema= to send models")
    return schema
