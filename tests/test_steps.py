"""The two drivers of step generators (``aiobroadcast._base.steps``) run one generator alike."""

from __future__ import annotations

import anyio
import pytest

from aiobroadcast._base.steps import (
    CHECKPOINT,
    Sleep,
    Steps,
    never_sleep,
    never_sleep_async,
    poll_steps,
    run,
    run_blocking,
)

pytestmark = pytest.mark.anyio


def _steps(log: list[str]) -> Steps[int]:
    try:
        yield CHECKPOINT
        woken = yield Sleep(0.5)
        log.append(f"woken={woken}")
        woken = yield Sleep(0.25)
        log.append(f"woken={woken}")
        return 7
    finally:
        log.append("closed")


async def test_async_and_blocking_drivers_send_the_same_answers_and_return_the_result() -> None:
    asked: list[float] = []

    def sleep(limit: float) -> bool:
        asked.append(limit)
        return limit > 0.3

    async def asleep(limit: float) -> bool:
        return sleep(limit)

    log_a: list[str] = []
    log_b: list[str] = []
    assert await run(_steps(log_a), asleep) == 7
    assert run_blocking(_steps(log_b), sleep) == 7
    assert log_a == log_b == ["woken=True", "woken=False", "closed"]
    assert asked == [0.5, 0.25, 0.5, 0.25]


async def test_an_error_from_sleep_closes_the_generator_and_propagates() -> None:
    def sleep(limit: float) -> bool:
        raise TimeoutError("deadline")

    async def asleep(limit: float) -> bool:
        return sleep(limit)

    for driver in ("async", "blocking"):
        log: list[str] = []
        with pytest.raises(TimeoutError, match="deadline"):
            if driver == "async":
                await run(_steps(log), asleep)
            else:
                run_blocking(_steps(log), sleep)
        assert log == ["closed"], driver


async def test_a_cancelled_async_driver_closes_the_generator_at_its_checkpoint() -> None:
    log: list[str] = []

    async def asleep(limit: float) -> bool:
        await anyio.sleep(limit)
        return False

    with anyio.CancelScope() as scope:
        scope.cancel()
        await run(_steps(log), asleep)
    assert scope.cancelled_caught
    assert log == ["closed"]


async def test_poll_steps_returns_true_once_ready_and_false_when_time_is_up() -> None:
    calls = iter([False, False, True])
    assert run_blocking(poll_steps(lambda: next(calls), 10**9), never_sleep) is True
    assert await run(poll_steps(lambda: False, 1_000_000), never_sleep_async) is False
