"""aiobroadcast: broadcast Python objects from one async writer to many async readers.

Readers on the same host read a shared-memory ring; every reader sees every message, in order,
or gets an error that says what it missed. ``aiobroadcast.blocking`` has the same roles for code
without an event loop, and ``aiobroadcast.vllm`` a drop-in for vLLM's ``MessageQueue``.
"""

from importlib import metadata as _metadata

from ._exceptions import BroadcastError as BroadcastError
from ._exceptions import ClosedResourceError as ClosedResourceError
from ._exceptions import CollectorGone as CollectorGone
from ._exceptions import DeserializationError as DeserializationError
from ._exceptions import EndOfStream as EndOfStream
from ._exceptions import InsufficientSharedMemory as InsufficientSharedMemory
from ._exceptions import InvalidArgument as InvalidArgument
from ._exceptions import InvalidHandle as InvalidHandle
from ._exceptions import MessageTooLarge as MessageTooLarge
from ._exceptions import NoReplyError as NoReplyError
from ._exceptions import ReaderLagged as ReaderLagged
from ._exceptions import SchemaViolation as SchemaViolation
from ._exceptions import SerializationError as SerializationError
from ._exceptions import TooManyReaders as TooManyReaders
from ._exceptions import TransportError as TransportError
from ._exceptions import WaitTimeout as WaitTimeout
from ._exceptions import WorkerError as WorkerError
from ._exceptions import WouldBlock as WouldBlock
from ._exceptions import WriterGone as WriterGone
from ._fanin import Collector as Collector
from ._fanin import CollectorHandle as CollectorHandle
from ._fanin import CollectorStatistics as CollectorStatistics
from ._fanin import Delivery as Delivery
from ._fanin import Item as Item
from ._fanin import Sender as Sender
from ._fanin import SenderInfo as SenderInfo
from ._fanin import SourceClosed as SourceClosed
from ._fanin import SourceGone as SourceGone
from ._fanin import SourceLagged as SourceLagged
from ._fanin import open_collector as open_collector
from ._fanin import open_sender as open_sender
from ._handle import CurveKeys as CurveKeys
from ._handle import Handle as Handle
from ._open import open_reader as open_reader
from ._open import open_writer as open_writer
from ._reader import Reader as Reader
from ._relay import relay as relay
from ._rpc import Caller as Caller
from ._rpc import CallerStatistics as CallerStatistics
from ._rpc import Failed as Failed
from ._rpc import NoReply as NoReply
from ._rpc import Outcome as Outcome
from ._rpc import PoolHandle as PoolHandle
from ._rpc import Reply as Reply
from ._rpc import Request as Request
from ._rpc import Worker as Worker
from ._rpc import open_caller as open_caller
from ._rpc import open_worker as open_worker
from ._shm.segment import sweep_stale as sweep_stale
from ._stats import ReaderInfo as ReaderInfo
from ._stats import ReaderStatistics as ReaderStatistics
from ._stats import WriterStatistics as WriterStatistics
from ._writer import Writer as Writer

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
