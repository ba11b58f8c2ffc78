"""A real Ctrl-C in dense blocking loops: a signal sent by another thread, turned into
``KeyboardInterrupt`` by a Python handler, as Python's own SIGINT handler does. Python runs the
handler between two bytecodes of the main thread, wherever it is: after a lock's ``acquire``
returned but before the ``try`` that would release it, between a cursor's store and the queue
it fills. tests/test_faults.py walks an interrupt through every line of a publish; this one
lands between bytecodes, many times, in puts and takes, and then asks the roles to go on.

What may be lost is what the interrupted call itself was doing: its message not published, or
the item (``get_nowait``) or batch (``get_many``) it took and was returning. Nothing else: no
later message is lost or delivered twice, and no lock is left held (the next call would raise
``WouldBlock`` or wait for good)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import aiobroadcast as ab
from aiobroadcast import blocking
from aiobroadcast._base import tuning as _tuning

pytestmark = [
    pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="needs POSIX signals"),
    # A lock left held can leave the main thread where the usual timeout's SIGALRM is not acted
    # on (on the code before the fix, a put retrying for good): end the run from a thread then.
    pytest.mark.timeout(120, method="thread"),
]

TRIALS = 150
WITHIN_S = 10.0


class Interrupts:
    """Sends one SIGUSR1 at a random moment of a loop (``during``), whose handler raises
    ``KeyboardInterrupt``; counts where it landed."""

    def __init__(self) -> None:
        self.fired = False
        self.landed = 0  # interrupts raised inside the loop
        self.swallowed = 0  # raised where Python drops exceptions (a weakref callback, __del__)

    def handler(self, signum: int, frame: Any) -> None:
        self.fired = True
        raise KeyboardInterrupt

    def unraisable(self, u: Any) -> None:
        # An exception raised in a weakref callback or a __del__ is printed and dropped by
        # Python, a Ctrl-C's too: it never reaches the loop. Anything else is a failure.
        if isinstance(u.exc_value, KeyboardInterrupt):
            self.swallowed += 1
            return
        self.previous_hook(u)

    def during(self, loop: Callable[[], object]) -> None:
        go = threading.Event()
        delay = random.uniform(0.0, 0.001)

        def fire() -> None:
            go.wait()
            time.sleep(delay)
            os.kill(os.getpid(), signal.SIGUSR1)

        self.fired = False
        sender = threading.Thread(target=fire)
        sender.start()
        try:
            running = True
            try:
                go.set()
                loop()
                running = False
                while not self.fired:  # the loop ended first: the interrupt comes here
                    time.sleep(0.001)
            except KeyboardInterrupt:
                self.landed += running
        finally:
            # Whatever ended the loop (an assertion too), the signal is taken here, not later.
            while not self.fired:
                with contextlib.suppress(KeyboardInterrupt):
                    time.sleep(0.001)
            sender.join()

    previous_hook: Callable[[Any], object] = sys.unraisablehook


@contextlib.contextmanager
def interrupts() -> Iterator[Interrupts]:
    it = Interrupts()
    old_handler = signal.signal(signal.SIGUSR1, it.handler)
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the sending thread runs soon after its sleep
    it.previous_hook = sys.unraisablehook
    sys.unraisablehook = it.unraisable
    try:
        yield it
    finally:
        sys.unraisablehook = it.previous_hook
        sys.setswitchinterval(old_interval)
        signal.signal(signal.SIGUSR1, old_handler)


def _in_order(last: int, value: object, *, lost: int) -> int:
    """``value`` comes after ``last``: never again, and at most ``lost`` numbers skipped (one
    put interrupted, or what one interrupted take was returning)."""
    assert isinstance(value, int)
    assert last < value <= last + 1 + lost, (last, value, lost)
    return value


def _attack(
    put_nowait: Callable[[int], object],
    take_nowait: Callable[[], list[object]],
    put: Callable[[int], object],
    get: Callable[[], object],
    *,
    lost: int,
) -> None:
    """Interrupt dense loops of ``put_nowait`` and of ``take_nowait`` (``WouldBlock`` or
    ``WaitTimeout`` once nothing is ready) again and again; after each round, everything left is
    taken in order and one more ``put``/``get`` must go through (a lock left held would raise
    ``WouldBlock`` there, or wait)."""
    with interrupts() as ctrl_c:
        n = last = 0

        def puts() -> None:
            nonlocal n
            for _ in range(2000):
                n += 1
                try:
                    put_nowait(n)
                except ab.WouldBlock:  # the ring is full
                    return

        def takes() -> None:
            nonlocal last
            while True:
                try:
                    batch = take_nowait()
                except (ab.WouldBlock, ab.WaitTimeout):
                    return
                for value in batch:
                    last = _in_order(last, value, lost=lost)

        def still_usable() -> None:
            nonlocal n, last
            takes()
            n += 1
            put(n)
            last = _in_order(last, get(), lost=lost)
            assert last == n

        for _ in range(TRIALS // 2):
            ctrl_c.during(puts)
            still_usable()
            ctrl_c.during(puts)
            ctrl_c.during(takes)
            still_usable()
        # Interrupts did land inside the loops, not only after them.
        assert ctrl_c.landed > TRIALS // 4, ctrl_c.landed


def test_a_ctrl_c_in_dense_put_and_get_loops_leaves_the_writer_and_the_reader_usable() -> None:
    with (
        blocking.open_writer(capacity=4096, slot_bytes=256) as writer,
        blocking.open_reader(writer.handle, name="r") as reader,
    ):
        # A put interrupted may have published or not, a take may lose what it returned.
        _attack(
            writer.put_nowait,
            lambda: [reader.get_nowait()],
            lambda n: writer.put(n, timeout=WITHIN_S),
            lambda: reader.get(timeout=WITHIN_S),
            lost=2,
        )


def _value(d: object) -> object:
    assert isinstance(d, ab.Item), d
    return d.value


@pytest.mark.parametrize("take", ["get_nowait", "get_many"])
def test_a_ctrl_c_in_dense_put_and_take_loops_leaves_the_sender_and_the_collector_usable(take: str) -> None:
    with (
        blocking.open_collector(capacity=4096, slot_bytes=256) as collector,
        blocking.open_sender(collector.handle, name="s") as sender,
    ):

        def take_nowait() -> list[object]:
            if take == "get_nowait":
                return [_value(collector.get_nowait())]
            return [_value(d) for d in collector.get_many(timeout=0)]

        # What an interrupted take loses: its own result, one item or one batch; one more if a
        # put was interrupted.
        _attack(
            sender.put_nowait,
            take_nowait,
            lambda n: sender.put(n, timeout=WITHIN_S),
            lambda: _value(collector.get(timeout=WITHIN_S)),
            lost=2 if take == "get_nowait" else _tuning.AHEAD_MESSAGES + 1,
        )
