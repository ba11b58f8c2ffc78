"""Step generators: a role's waiting logic written once, run by an async or a blocking driver.

A role's behaviour while it waits (for room in the ring, for a message, for a welcome), or while
it opens or serves (a pool's roles: ``aiobroadcast._calls``), is a generator. It yields events,
small frozen objects that say what to do, and is sent what came of each:

- ``CHECKPOINT`` (``Checkpoint``): let others run once. The async driver awaits
  ``anyio.lowlevel.checkpoint()`` (a cancellation point); the blocking driver does nothing (the
  thread goes on). Sent ``True``.
- ``Sleep(seconds)``, ``seconds >= 0``: sleep on the role's wake-up source for up to that long.
  The driver calls the ``sleep`` it was given (``await sleep(s)`` or ``sleep(s)``) and sends its
  result: whether a wake-up came. ``sleep`` may raise instead (a deadline passed, the role was
  closed): the error is thrown into the generator at its ``yield`` (its ``finally`` blocks run)
  and propagates unless the generator catches it.

Other vocabularies (a family's own events) go through the same two drivers, ``drive`` and
``drive_blocking``, with a ``do`` that handles them by ``match``; ``run`` and ``run_blocking``
are those drivers with the ``do`` of the two events above. The generator's return value is the
driver's. Everything the two front ends share (checks, accounting, when to poll and when to
sleep) lives in the generator; the drivers are the few lines below, so a fix or a new role
touches one place. A driver always closes its generator, so cleanup in a ``finally`` runs on
every way out (cancellation included).

This module imports ``anyio.lowlevel`` for the checkpoint alone: no event loop runs here.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any, Final, TypeVar

import anyio.lowlevel

R = TypeVar("R")
S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Let other tasks run once (see the module docstring); sent ``True``."""


@dataclass(frozen=True, slots=True)
class Sleep:
    """Sleep on the role's wake-up source for up to ``seconds``; sent whether a wake-up came."""

    seconds: float


#: The one ``Checkpoint`` (it holds nothing).
CHECKPOINT: Final = Checkpoint()

#: What waiting logic yields.
Step = Checkpoint | Sleep

#: A role's waiting logic: yields ``Step``s, is sent what came of each, returns the result.
Steps = Generator[Step, bool, R]


# drive and drive_blocking: one loop, with and without await. Neither can call the other (a
# coroutine cannot run in a thread without a loop, nor a blocking do in a task), so it is twice.
async def drive(steps: Generator[S, Any, R], do: Callable[[S], Awaitable[object]]) -> R:
    """Run steps in a task: ``await do(step)`` for each step, its result sent in, what it raised
    thrown in (the steps may catch it and go on). Closes the generator on every way out."""
    try:
        step = next(steps)
        while True:
            try:
                done = await do(step)
            except BaseException as exc:
                step = steps.throw(exc)
            else:
                step = steps.send(done)
    except StopIteration as end:
        return end.value  # type: ignore[no-any-return]
    finally:
        steps.close()


def drive_blocking(steps: Generator[S, Any, R], do: Callable[[S], object]) -> R:
    """``drive`` in a thread: ``do(step)`` for each step."""
    try:
        step = next(steps)
        while True:
            try:
                done = do(step)
            except BaseException as exc:
                step = steps.throw(exc)
            else:
                step = steps.send(done)
    except StopIteration as end:
        return end.value  # type: ignore[no-any-return]
    finally:
        steps.close()


async def run(steps: Steps[R], sleep: Callable[[float], Awaitable[bool]]) -> R:
    """Run waiting logic in a task: a ``Checkpoint`` is a checkpoint, ``Sleep(s)`` is
    ``await sleep(s)``."""

    async def do(step: Step) -> bool:
        match step:
            case Sleep(seconds):
                return await sleep(seconds)
            case Checkpoint():
                await anyio.lowlevel.checkpoint()
                return True

    return await drive(steps, do)


def run_blocking(steps: Steps[R], sleep: Callable[[float], bool]) -> R:
    """Run waiting logic in a thread: a ``Checkpoint`` goes on at once, ``Sleep(s)`` blocks in
    ``sleep(s)``."""

    def do(step: Step) -> bool:
        match step:
            case Sleep(seconds):
                return sleep(seconds)
            case Checkpoint():
                return True

    return drive_blocking(steps, do)


def never_sleep(limit_s: float) -> bool:
    """The ``sleep`` of steps that only poll: they never yield a sleep."""
    raise AssertionError(f"these steps do not sleep (asked for {limit_s} s)")


async def never_sleep_async(limit_s: float) -> bool:
    """``never_sleep`` for the async driver."""
    return never_sleep(limit_s)


def poll_steps(ready: Callable[[], bool], limit_ns: int) -> Steps[bool]:
    """Re-check ``ready`` for up to ``limit_ns`` instead of sleeping: one checkpoint per round
    (in a task, the loop's other tasks run meanwhile), yielding the CPU between rounds (so
    pollers on a busy host leave it to the process they wait for). Returns True once ``ready()``
    is, False when time is up. ``ready`` may raise to end the poll."""
    deadline = perf_counter_ns() + limit_ns
    while True:
        yield CHECKPOINT
        if ready():
            return True
        if perf_counter_ns() >= deadline:
            return False
        os.sched_yield()
