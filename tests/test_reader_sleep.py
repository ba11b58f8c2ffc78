"""A reader's sleep on its source (``_reader.sleep_steps``), as each front end drives it: the order
that loses no wake-up (announce, re-check, wait, end), and an end on every way out of the wait."""

from __future__ import annotations

import os
import socket
from collections import deque
from typing import Any

import anyio
import pytest

from aiobroadcast._broadcast.reader import sleep_async, sleep_blocking

pytestmark = pytest.mark.anyio


class _Source:
    """A source that logs the sleep protocol. ``queued``: what ``begin_sleep``'s re-check finds;
    ``datagram``: a wake-up is in the inbox when the sleep begins (a blocking wait returns at
    once and takes it); ``outcome``: what a task's wait does (True or False: returns it; an
    exception: raises it; None: waits for up to its limit)."""

    def __init__(self, *, queued: bool = False, datagram: bool = False, outcome: Any = None) -> None:
        self.ahead: deque[Any] = deque()
        self.log: list[str] = []
        self.queued = queued
        self.outcome = outcome
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        if datagram:
            self._w.send(b"\0")

    def begin_sleep(self) -> bool:
        self.log.append("begin")
        return self.queued

    def end_sleep(self, woken: bool) -> None:
        self.log.append(f"end woken={woken}")

    async def sleep(self, limit_s: float) -> bool:
        self.log.append(f"wait {limit_s}")
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        if self.outcome is None:
            await anyio.sleep(limit_s)
            return False
        return bool(self.outcome)

    @property
    def inbox_fd(self) -> int:
        self.log.append("wait fd")
        return self._r.fileno()

    def drain_inbox(self) -> bool:
        try:
            return bool(self._r.recv(64))
        except BlockingIOError:
            return False

    def close(self) -> None:
        self._r.close()
        self._w.close()


async def test_both_front_ends_announce_recheck_wait_and_end_in_that_order() -> None:
    src = _Source(outcome=True)
    try:
        assert await sleep_async(src, 0.5)  # type: ignore[arg-type]
        assert src.log == ["begin", "wait 0.5", "end woken=True"]
    finally:
        src.close()
    src = _Source(datagram=True)
    try:
        assert sleep_blocking(src, 30.0)  # type: ignore[arg-type]
        assert src.log == ["begin", "wait fd", "end woken=True"]
        src.log.clear()
        assert not sleep_blocking(src, 0.01)  # type: ignore[arg-type]  # nothing left: the limit ends it
        assert src.log == ["begin", "wait fd", "end woken=False"]
    finally:
        src.close()


async def test_something_found_by_the_recheck_means_no_sleep() -> None:
    for driver in ("async", "blocking"):
        src = _Source(queued=True, outcome=AssertionError("no wait"))
        try:
            if driver == "async":
                assert not await sleep_async(src, 30.0)  # type: ignore[arg-type]
            else:
                assert not sleep_blocking(src, 30.0)  # type: ignore[arg-type]
            assert src.log == ["begin"], driver  # begin_sleep retracted the announcement itself
        finally:
            src.close()


async def test_a_cancelled_sleep_is_ended_before_the_cancellation_goes_on() -> None:
    src = _Source()
    try:
        with anyio.move_on_after(0.05) as scope:
            await sleep_async(src, 30.0)  # type: ignore[arg-type]
        assert scope.cancelled_caught
        assert src.log == ["begin", "wait 30.0", "end woken=False"]
    finally:
        src.close()


async def test_a_close_during_the_wait_ends_the_sleep_quietly_and_other_errors_propagate() -> None:
    src = _Source(outcome=anyio.ClosedResourceError())
    try:
        assert not await sleep_async(src, 30.0)  # type: ignore[arg-type]
        assert src.log == ["begin", "wait 30.0", "end woken=False"]
    finally:
        src.close()
    src = _Source(outcome=OSError(os.strerror(9)))
    try:
        with pytest.raises(OSError):
            await sleep_async(src, 30.0)  # type: ignore[arg-type]
        assert src.log == ["begin", "wait 30.0", "end woken=False"]
    finally:
        src.close()
