"""What ``with`` and ``async with`` do for a role of either front end: close it at the end.
Written once for the broadcast roles (``Writer``, ``Reader``: ``AsyncClosable``;
``BlockingWriter``, ``BlockingReader``: ``Closable``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType
from typing import Self


class AsyncClosable(ABC):
    """``async with`` closes (``aclose``) at the end."""

    @abstractmethod
    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class Closable(ABC):
    """``with`` closes (``close``) at the end. ``_closed``: whether it is closed, True until the
    role's ``__init__`` says otherwise (an object whose building failed does not warn as
    unclosed: ``WriterBase``, ``ReaderBase``)."""

    _closed = True

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
