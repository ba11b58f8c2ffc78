"""Step generators: a role's waiting logic written once, run by an async or a blocking driver.

A role's behaviour while it waits (for room in the ring, for a message, for a welcome) is a
generator. It yields what to wait for and is sent what came of it:

- ``CHECKPOINT``: let others run once. The async driver awaits ``anyio.lowlevel.checkpoint()``
  (a cancellation point); the blocking driver does nothing (the thread goes on). Sent ``True``.
- a number of seconds ``s >= 0``: sleep on the role's wake-up source for up to ``s``. The driver
  calls the ``sleep`` it was given (``await sleep(s)`` or ``sleep(s)``) and sends its result:
  whether a wake-up came. ``sleep`` may raise instead (a deadline passed, the role was closed):
  the driver closes the generator (its ``finally`` blocks run) and the error propagates.

The generator's return value is the driver's. Everything the two front ends share (checks,
accounting, when to poll and when to sleep) lives in the generator; the drivers are the few
lines below, so a fix or a new role touches one place. A driver always closes its generator,
so cleanup in a ``finally`` runs on every way out (cancellation included).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Generator
from time import perf_counter_ns
from typing import Any, Final, TypeVar

import anyio.lowlevel

R = TypeVar("R")

#: Yielded to let other tasks run once (see the module docstring).
CHECKPOINT: Final = -1.0

#: A role's waiting logic: yields ``CHECKPOINT`` or seconds to sleep, is sent whether a wake-up
#: came, returns the result.
Steps = Generator[float, bool, R]


async def run(steps: Steps[R], sleep: Callable[[float], Awaitable[bool]]) -> R:
    """Run ``steps`` in a task: ``CHECKPOINT`` is a checkpoint, a number ``await sleep(s)``."""
    try:
        step = next(steps)
        while True:
            if step == CHECKPOINT:
                await anyio.lowlevel.checkpoint()
                step = steps.send(True)
            else:
                step = steps.send(await sleep(step))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    finally:
        steps.close()


def run_blocking(steps: Steps[R], sleep: Callable[[float], bool]) -> R:
    """Run ``steps`` in a thread: ``CHECKPOINT`` goes on at once, a number blocks in ``sleep(s)``."""
    try:
        step = next(steps)
        while True:
            step = steps.send(True if step == CHECKPOINT else sleep(step))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    finally:
        steps.close()


S = TypeVar("S")


async def drive(steps: Generator[S, Any, R], do: Callable[[S], Awaitable[object]]) -> R:
    """Run steps that ask for operations rather than sleeps (a worker's serve loop, opening a
    pool's role) in a task: ``await do(step)`` for each step, its result sent in, what it
    raised thrown in (the steps may catch it and go on). Closes the generator on every way out."""
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
