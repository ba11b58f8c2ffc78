"""aiobroadcast: broadcast Python objects from one async writer to many async readers.

Readers on the same host read a shared-memory ring; every reader sees every message, in order,
or gets an error that says what it missed. ``aiobroadcast.blocking`` has the same roles for code
without an event loop, and ``aiobroadcast.vllm`` a drop-in for vLLM's ``MessageQueue``.
"""

from importlib import metadata as _metadata

from ._base.errors import BroadcastError as BroadcastError
from ._base.errors import ClosedResourceError as ClosedResourceError
from ._base.errors import CollectorGone as CollectorGone
from ._base.errors import DeserializationError as DeserializationError
from ._base.errors import EndOfStream as EndOfStream
from ._base.errors import InsufficientSharedMemory as InsufficientSharedMemory
from ._base.errors import InvalidArgument as InvalidArgument
from ._base.errors import InvalidHandle as InvalidHandle
from ._base.errors import MessageTooLarge as MessageTooLarge
from ._base.errors import NoReplyError as NoReplyError
from ._base.errors import ReaderLagged as ReaderLagged
from ._base.errors import SchemaViolation as SchemaViolation
from ._base.errors import SerializationError as SerializationError
from ._base.errors import TooManyReaders as TooManyReaders
from ._base.errors import TransportError as TransportError
from ._base.errors import WaitTimeout as WaitTimeout
from ._base.errors import WorkerError as WorkerError
from ._base.errors import WouldBlock as WouldBlock
from ._base.errors import WriterGone as WriterGone
from ._base.handle import CurveKeys as CurveKeys
from ._base.handle import Handle as Handle
from ._base.stats import ReaderInfo as ReaderInfo
from ._base.stats import ReaderStatistics as ReaderStatistics
from ._base.stats import WriterStatistics as WriterStatistics
from ._broadcast.open import open_reader as open_reader
from ._broadcast.open import open_writer as open_writer
from ._broadcast.reader import Reader as Reader
from ._broadcast.relay import relay as relay
from ._broadcast.writer import Writer as Writer
from ._calls.open import open_caller as open_caller
from ._calls.open import open_worker as open_worker
from ._calls.roles import Caller as Caller
from ._calls.roles import Request as Request
from ._calls.roles import Worker as Worker
from ._calls.types import CallerStatistics as CallerStatistics
from ._calls.types import Failed as Failed
from ._calls.types import NoReply as NoReply
from ._calls.types import Outcome as Outcome
from ._calls.types import PoolHandle as PoolHandle
from ._calls.types import Reply as Reply
from ._fanin.collector import Collector as Collector
from ._fanin.handle import CollectorHandle as CollectorHandle
from ._fanin.items import CollectorStatistics as CollectorStatistics
from ._fanin.items import Delivery as Delivery
from ._fanin.items import Item as Item
from ._fanin.items import SenderInfo as SenderInfo
from ._fanin.items import SourceClosed as SourceClosed
from ._fanin.items import SourceGone as SourceGone
from ._fanin.items import SourceLagged as SourceLagged
from ._fanin.open import open_collector as open_collector
from ._fanin.open import open_sender as open_sender
from ._fanin.sender import Sender as Sender
from ._shm.segment import sweep_stale as sweep_stale

__all__ = [
    "BroadcastError",
    "Caller",
    "CallerStatistics",
    "ClosedResourceError",
    "Collector",
    "CollectorGone",
    "CollectorHandle",
    "CollectorStatistics",
    "CurveKeys",
    "Delivery",
    "DeserializationError",
    "EndOfStream",
    "Failed",
    "Handle",
    "InsufficientSharedMemory",
    "InvalidArgument",
    "InvalidHandle",
    "Item",
    "MessageTooLarge",
    "NoReply",
    "NoReplyError",
    "Outcome",
    "PoolHandle",
    "Reader",
    "ReaderInfo",
    "ReaderLagged",
    "ReaderStatistics",
    "Reply",
    "Request",
    "SchemaViolation",
    "Sender",
    "SenderInfo",
    "SerializationError",
    "SourceClosed",
    "SourceGone",
    "SourceLagged",
    "TooManyReaders",
    "TransportError",
    "WaitTimeout",
    "Worker",
    "WorkerError",
    "WouldBlock",
    "Writer",
    "WriterGone",
    "WriterStatistics",
    "open_caller",
    "open_collector",
    "open_reader",
    "open_sender",
    "open_worker",
    "open_writer",
    "relay",
    "sweep_stale",
]

try:
    # One place for the version: pyproject.toml, as the installed package's metadata has it.
    __version__: str = _metadata.version("aiobroadcast")
except _metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"
