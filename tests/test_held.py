"""``_atomics.Held``, the blocking roles' lock and the ring's mutex (aiobroadcast/_owned.py):
its holder, its levels, a ``release`` from a thread that does not hold it, its timed wait, and
a signal during that wait."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from aiobroadcast._shm._atomics import Held


def test_take_records_its_holder_counts_its_levels_and_release_gives_back_only_its_own() -> None:
    held = Held()
    assert (held.owner, held.mine()) == (0, False)
    assert held.take(0.0) == 1
    assert (held.owner, held.mine()) == (threading.get_ident(), True)
    assert held.take(0.0) == -1  # its holder again: one level more
    held.release()
    assert held.mine()  # the outer level still holds it
    seen: list[object] = []

    def other() -> None:
        seen.append(held.take(0.0))  # held elsewhere: not taken
        held.release()  # not its own: nothing
        seen.append(held.take(0.05))  # the timeout passes
        seen.append(held.take(-1.0))  # waits for good, until the holder lets go
        seen.append(held.owner == threading.get_ident())
        held.release()

    t = threading.Thread(target=other)
    t.start()
    while len(seen) < 2:
        time.sleep(0.001)
    assert held.mine()  # the other thread's release gave back nothing
    held.release()
    t.join(10)
    assert seen == [0, 0, 1, True]
    assert held.owner == 0
    held.release()  # free: nothing
    assert held.take(0.0) == 1
    held.release()


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="needs POSIX signals")
def test_a_signal_during_a_wait_runs_its_handler_and_an_exception_from_it_leaves_the_lock_untaken() -> None:
    held = Held()
    go, done = threading.Event(), threading.Event()
    calls = []

    def hold() -> None:
        assert held.take(0.0) == 1
        go.set()
        done.wait(10)
        held.release()

    def handler(signum: int, frame: object) -> None:
        calls.append(signum)
        if len(calls) == 2:
            raise KeyboardInterrupt

    t = threading.Thread(target=hold)
    t.start()
    go.wait(10)
    old = signal.signal(signal.SIGUSR1, handler)
    # To the waiting thread itself, so that its wait is the one interrupted.
    main = threading.get_ident()
    kill = threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGUSR1))
    again = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGUSR1))
    try:
        kill.start()
        again.start()
        with pytest.raises(KeyboardInterrupt):
            held.take(-1.0)  # the first handler returns: the wait goes on; the second raises
        assert calls == [signal.SIGUSR1, signal.SIGUSR1]
        assert not held.mine()
    finally:
        kill.join()
        again.join()
        signal.signal(signal.SIGUSR1, old)
        done.set()
        t.join(10)
    assert held.take(0.0) == 1
    held.release()
