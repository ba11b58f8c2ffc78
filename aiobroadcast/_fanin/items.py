"""What a collector hands out (``Collector.get``), and what it tells of itself (``statistics``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

T_co = TypeVar("T_co", covariant=True)


@dataclass(slots=True)
class Item(Generic[T_co]):
    """One item a sender put: ``source`` is the sender's name (``match`` it as
    ``case Item(source, value)``)."""

    source: str
    value: T_co


@dataclass(frozen=True, slots=True)
class SourceClosed:
    """The sender ``source`` closed; every item it put was delivered before this. Once per sender."""

    source: str


@dataclass(frozen=True, slots=True)
class SourceGone:
    """The sender ``source`` (process ``pid``) died without closing (SIGKILL, OOM); every item it
    had put in its ring was delivered before this. Once per sender, within about a second."""

    source: str
    pid: int


@dataclass(frozen=True, slots=True)
class SourceLagged:
    """Policy ``"lag"`` only: the sender ``source`` overwrote ``missed`` items the collector had
    not taken yet. The next item of that sender is the oldest it still holds."""

    source: str
    missed: int


#: Everything ``Collector.get`` returns.
Delivery = Item[T_co] | SourceClosed | SourceGone | SourceLagged


class SenderInfo(NamedTuple):
    """One attached sender, as the collector sees it."""

    name: str
    pid: int
    received: int  #: items the collector took from it
    lag: int  #: ring entries it has put that the collector has not taken yet


class CollectorStatistics(NamedTuple):
    received: int  #: items delivered (``Item`` only)
    senders: tuple[SenderInfo, ...]  #: the senders attached now
    closed: int  #: senders reported closed (``SourceClosed``)
    gone: int  #: senders reported dead (``SourceGone``)
    tasks_waiting: int  #: ``get`` calls parked
