"""Every error aiobroadcast raises derives from :class:`BroadcastError`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from .stats import ReaderInfo


class BroadcastError(Exception):
    """Base class of every error raised by aiobroadcast."""


class InvalidArgument(BroadcastError, ValueError):
    """Raised by ``open_writer``/``open_reader`` (and the blocking and CLI front ends) for an
    argument out of its range or of the wrong form; the message names the argument and what it
    accepts. Also a ``ValueError``."""


class WouldBlock(BroadcastError):
    """Raised by ``put_nowait`` when the message would overrun a reader (policy ``"block"``),
    and by ``get_nowait`` when no message is ready yet."""


class WaitTimeout(WouldBlock, TimeoutError):
    """Raised by the blocking API's ``put(obj, timeout=...)`` and ``get(timeout=...)`` when the
    time passed first: nothing was published or taken. It is a ``WouldBlock`` and a built-in
    ``TimeoutError``, so either ``except`` catches it.

    A put's (``put``, ``put_many``, a blocking sender's, ``vllm`` ``enqueue``) names what held it
    back when the time passed, in its message and in ``holders``: the readers it waited for, as
    ``ReaderInfo`` (``statistics()``'s: name, pid, host, ``lag`` in ring entries, ``transport``);
    behind a writer's TCP server (``transport="tcp-server"``), the remote readers holding the
    server back (``transport="tcp"``, ``lag`` in messages not acknowledged), slowest first. The
    message adds how many messages each is behind and whether its process is alive. ``holders``
    is empty for a get, and when the readers moved on just as the time passed. Read from the ring
    when the time passes, never before."""

    def __init__(self, *args: object, holders: tuple[ReaderInfo, ...] = ()) -> None:
        super().__init__(*args)
        self.holders = holders


class EndOfStream(BroadcastError):
    """Raised by ``Reader.get`` once the writer has closed the channel and the reader has
    received every message published before the close."""


class ClosedResourceError(BroadcastError):
    """Raised when a role (a ``Writer``, ``Reader``, collector, sender, caller, worker, async or
    blocking) is used after its own ``aclose()``/``close()``, and when a fork child uses one it
    inherited from its parent, ``statistics()`` included (a child inherits no role: it opens its
    own, a reader from the handle say)."""


class WriterGone(BroadcastError):
    """Raised by ``Reader.get`` when the writer's process died without closing the channel,
    after the reader has received everything that was published; and by a remote reader's
    ``get`` when the writer was restarted under it (``restarted``: its TCP server died with it,
    and a new run now serves the same channel)."""

    def __init__(self, pid: int, *, restarted: bool = False) -> None:
        self.pid = pid
        #: a remote reader found a new run of the writer serving the channel (it was restarted
        #: with the same keys and endpoint): what the old run held for this reader may be lost
        self.restarted = restarted
        if restarted:
            message = (
                f"the writer (pid {pid}) was restarted: a new run serves this channel, its messages numbered "
                "anew; what the old run had not delivered here may be lost (open the handle again to read on)"
            )
        else:
            message = (
                f"the writer (pid {pid}) died without closing the channel; every message it published has been "
                "delivered"
            )
        super().__init__(message)


# Each error below keeps its data as attributes and words its own message in __init__: alike in
# shape, but a shared constructor would hide what each message names.
class CollectorGone(BroadcastError):
    """Raised by a fan-in sender's ``put``/``put_nowait``/``put_many`` when its collector has
    closed or died: nothing it sends can be delivered any more. The sender's counterpart of
    ``WriterGone``. A ``put`` that raises it may have left its item in the ring, never read."""

    def __init__(self, pid: int, name: str) -> None:
        self.pid = pid
        self.name = name
        super().__init__(
            f"the collector (pid {pid}) of sender {name!r} has closed or died: nothing sent now can be delivered; "
            "close this sender"
        )


class WorkerError(BroadcastError):
    """A pool worker's handler raised while answering a call (``Failed.unwrap()``). Carries the
    worker's name and the exception's type name and message, as text: the foreign exception is
    never unpickled or re-raised in the caller."""

    def __init__(self, worker: str, type_name: str, message: str) -> None:
        self.worker = worker
        self.type_name = type_name
        self.message = message
        super().__init__(f"worker {worker!r} raised {type_name}: {message}")


class NoReplyError(BroadcastError):
    """A pool worker gave no reply to a call (``NoReply.unwrap()``): ``reason`` is ``"dead"``
    (its process died), ``"closed"`` (it left the pool) or ``"deadline"`` (the call's timeout
    passed first)."""

    def __init__(self, worker: str, reason: str, detail: str) -> None:
        self.worker = worker
        self.reason = reason
        super().__init__(detail)


class ReaderLagged(BroadcastError):
    """Raised once by ``Reader.get`` under policy ``"lag"`` when the writer overwrote
    messages this reader had not read yet. ``missed`` says how many; the next ``get``
    returns the oldest message still held."""

    def __init__(self, missed: int) -> None:
        self.missed = missed
        super().__init__(f"reader fell behind and missed {plural(missed, 'message')}")


class TooManyReaders(BroadcastError):
    """Raised by ``open_reader`` when ``max_readers`` readers are already attached."""

    def __init__(self, max_readers: int) -> None:
        self.max_readers = max_readers
        super().__init__(
            f"all {max_readers} reader places of this channel are taken (raise max_readers in open_writer)"
        )


class InvalidHandle(BroadcastError):
    """Raised by ``open_reader`` and ``Handle.parse`` for a handle that does not parse, or
    that names a segment which is gone or which has another layout or identity."""


class MessageTooLarge(BroadcastError):
    """Raised by ``put``/``put_nowait`` when the encoded message exceeds the channel's
    ``max_message_bytes``. Nothing is published."""

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(f"message of {size} bytes exceeds max_message_bytes={limit}")


class SerializationError(BroadcastError):
    """Raised by ``put``/``put_nowait`` when the object cannot be encoded (for example it
    cannot be pickled). Nothing is published."""


class SchemaViolation(SerializationError, ValueError):
    """Raised by ``put``/``put_nowait``/``put_many`` of a channel or collector with a ``schema``
    (every sending role: ``Writer``, ``Sender``, their blocking roles) when the object does not
    validate against the model. Nothing is published. ``errors`` holds pydantic's list of
    problems (``ValidationError.errors()``), and the ``ValidationError`` is its ``__cause__``.
    Also a ``SerializationError`` and a ``ValueError``."""

    def __init__(self, schema: str, errors: list[Any]) -> None:
        self.schema = schema
        self.errors = errors
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())) or '(the object)'}: {e.get('msg', '?')}" for e in errors[:3]
        )
        more = f" and {len(errors) - 3} more" if len(errors) > 3 else ""
        super().__init__(f"the object does not validate as {schema}: {problems}{more}")


class DeserializationError(BroadcastError):
    """Raised by ``get``/``get_nowait`` when a received message cannot be decoded in this
    process (for example its class cannot be imported here). The message is consumed: the
    next ``get`` returns the next message, and the writer is not held up."""

    #: From a fan-in collector's ``get``: the name of the sender whose item it was (else None).
    source: str | None = None

    def __init__(self, msg_index: int, cause: BaseException) -> None:
        self.msg_index = msg_index
        super().__init__(f"message #{msg_index} could not be decoded: {cause!r}")


class InsufficientSharedMemory(BroadcastError):
    """Raised by ``open_writer`` when the shared-memory filesystem cannot hold the ring.
    Raised at creation, never later as a ``SIGBUS``."""

    def __init__(self, needed: int, available: int, directory: str) -> None:
        self.needed = needed
        self.available = available
        super().__init__(
            f"the ring needs {needed} bytes but {directory} has {available} bytes free; "
            "lower capacity or slot_bytes, or give the container a larger /dev/shm"
        )


class TransportError(BroadcastError):
    """Raised by ``open_reader`` when a remote writer cannot be reached or refuses the reader
    (wrong keys, not listening), and by ``get`` when the writer's server refuses it later or the
    remote reader's I/O thread fails (the stream ends)."""


E = TypeVar("E", bound=BroadcastError)


def os_error(kind: type[E], what: str, exc: OSError) -> E:
    """The one translation of an ``OSError`` at the operating-system boundary (files, mappings,
    sockets): what the library tried, and the system's reason. Raise it ``from exc``."""
    return kind(f"{what}: {exc.strerror or exc}")


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``n`` and the form of ``noun`` that agrees with it: "1 reader", "0 readers", "2 replies"
    (``nouns``: the plural where it is not ``noun`` + "s")."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"
