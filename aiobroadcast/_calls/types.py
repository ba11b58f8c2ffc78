"""The calls' public types: what a call returns per worker (``Reply``, ``Failed``,
``NoReply``), the caller's statistics, the pool's handle, and the checks of the arguments
that name workers. On the wire a request is ``(call_id, obj)``; a reply ``(call_id, True,
value)`` or, when the handler raised, ``(call_id, False, (type_name, message))``; a worker's
first item, ``(0, True, pid)``, says its reader is attached (a request broadcast after it
reaches it)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Generic, Literal, NamedTuple, NoReturn, TypeVar

from pydantic import BaseModel, ConfigDict

from .._base.errors import InvalidArgument, InvalidHandle, NoReplyError, WorkerError
from .._base.handle import Handle, handle_kind, validated
from .._fanin.handle import CollectorHandle, looks_like_channel, name_problem

Q = TypeVar("Q")  #: what a call sends
R = TypeVar("R")  #: what a worker answers
R_co = TypeVar("R_co", covariant=True)

_private = object()
_HELLO = 0
#: What a fork child may do instead of using an inherited caller, or worker (``_fork.role``).
CALLER_FIX = "a pool has one caller; open a pool of your own with open_caller(workers=...)"
WORKER_FIX = "open your own with open_worker(pool handle, name=...) under a name no live worker holds"


# --- what a call returns, per worker ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Reply(Generic[R_co]):
    """The worker ``worker`` answered ``value``."""

    worker: str
    value: R_co

    def unwrap(self) -> R_co:
        return self.value


@dataclass(frozen=True, slots=True)
class Failed:
    """The worker's handler raised ``type_name: message`` (text only: nothing foreign is
    unpickled or raised here). ``unwrap()`` raises ``WorkerError``."""

    worker: str
    type_name: str
    message: str

    def unwrap(self) -> NoReturn:
        raise WorkerError(self.worker, self.type_name, self.message)


@dataclass(frozen=True, slots=True)
class NoReply:
    """No answer from ``worker``: ``reason`` is ``"dead"`` (its process died), ``"closed"`` (it
    left the pool) or ``"deadline"`` (the call's timeout passed first). ``unwrap()`` raises
    ``NoReplyError``."""

    worker: str
    reason: Literal["dead", "closed", "deadline"]
    detail: str

    def unwrap(self) -> NoReturn:
        raise NoReplyError(self.worker, self.reason, self.detail)


#: One worker's outcome of a call.
Outcome = Reply[R_co] | Failed | NoReply


class CallerStatistics(NamedTuple):
    calls: int  #: calls made
    ready: tuple[str, ...]  #: workers attached and not ended
    ended: tuple[tuple[str, str], ...]  #: (worker, "dead" | "closed")
    late_replies: int  #: replies to an earlier call that arrived after it returned: dropped
    unknown_replies: int  #: items with an id no call issued, or not a reply at all: dropped


# --- the handle -------------------------------------------------------------------------------------
class PoolHandle(BaseModel):
    """Names a pool: its request channel, its reply collector and its workers' names. Frozen,
    picklable, JSON round-trips. Pass it to ``open_worker``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["pool"] = "pool"
    requests: Handle
    replies: CollectorHandle
    workers: tuple[str, ...]

    # to_json and from_json as Handle's and CollectorHandle's: each from_json is typed to its own
    # class and says its own fix (the parsing itself is _base.handle.validated).
    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> PoolHandle:
        """The pool handle ``to_json`` wrote. Raises ``InvalidHandle``."""
        return cls.parse(text)

    @classmethod
    def parse(cls, data: str | bytes | dict[str, Any] | PoolHandle | Handle | CollectorHandle) -> PoolHandle:
        if isinstance(data, PoolHandle):
            return data
        if isinstance(data, Handle | CollectorHandle) or (
            handle_kind(data) != "pool" and (handle_kind(data) == "collector" or looks_like_channel(data))
        ):
            raise InvalidHandle(
                "this is a broadcast channel's or a collector's handle, not a pool's: open_worker takes "
                "caller.handle (made by open_caller)"
            )
        # PoolHandle instances were returned above: validated's re-check of one never runs here.
        return validated(cls, data, "pool handle", "pass the file's text: PoolHandle.from_json(Path(path).read_text())")


def _check_workers(workers: Iterable[str]) -> tuple[str, ...]:
    if isinstance(workers, str):
        raise InvalidArgument("workers must be a collection of worker names, not one string")
    names = tuple(workers)
    if not names:
        raise InvalidArgument("workers must name at least one worker")
    for n in names:
        problem = name_problem(n)
        if problem is not None:
            raise InvalidArgument(problem)
    if len(set(names)) != len(names):
        raise InvalidArgument(f"worker names must be unique: {names}")
    return names


def _check_timeout(timeout: float) -> None:
    if not timeout >= 0:
        raise InvalidArgument(f"timeout must be a number of seconds >= 0, not {timeout!r}")


def _error_reply(cid: int, exc: BaseException) -> tuple[int, bool, tuple[str, str]]:
    return (cid, False, (type(exc).__name__, str(exc)))
