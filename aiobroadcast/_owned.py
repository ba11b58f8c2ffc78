"""The lock each blocking role takes for a call: it knows which thread holds it, so that a
re-entrant call (from a ``__reduce__``, a signal handler) fails instead of waiting for itself,
it counts the threads waiting for it (for ``statistics``), and a Ctrl-C anywhere in a call
leaves it free.

How a caller uses it, always this way::

    lock = self._lock
    try:
        lock.acquire(deadline)   # inside the try
        ...                      # the call
    finally:
        lock.release()

A ``KeyboardInterrupt`` (a signal handler's exception) can be raised between any two bytecodes
of Python code: before ``acquire`` took the lock, after it took it but before it returned, or
anywhere in the call. With ``acquire`` inside the ``try``, every one of those runs the
``finally``; ``release`` gives the lock back if this thread holds it and does nothing otherwise,
and does it in one C call (``_atomics.release_held``), so no handler runs between its look and
its release. Re-entry is told by the ``RLock``'s own owner (``_is_owned``), then the lock is
taken once more and ``WouldBlock`` raised: the caller's ``finally`` gives back that one level,
and the outer call keeps its hold.
"""

from __future__ import annotations

import functools
import threading
from threading import get_ident
from time import monotonic

from ._exceptions import WaitTimeout, WouldBlock
from ._shm._atomics import release_held


def left_before(deadline: float | None) -> float | None:
    """Seconds left before ``deadline`` (None: no deadline); raises ``WaitTimeout`` at 0."""
    if deadline is None:
        return None
    left = deadline - monotonic()
    if left <= 0:
        raise WaitTimeout("the timeout passed")
    return left


class Owned:
    """A blocking role's lock (see the module). ``owner``: the thread holding it, 0 if none
    (read without the lock by ``statistics``, which only counts it)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._count_lock = threading.Lock()
        self.owner = 0
        self.waiting = 0
        self.release = functools.partial(release_held, self)
        self.mine = self._lock._is_owned  # type: ignore[attr-defined]

    def count(self, delta: int) -> None:
        with self._count_lock:
            self.waiting += delta

    def acquire(self, deadline: float | None, *, wait: bool = True) -> None:
        """Take the lock (raises ``WouldBlock`` on re-entry or with ``wait=False`` if taken,
        ``WaitTimeout`` when ``deadline`` passes). Call it inside the ``try`` whose ``finally``
        calls ``release``."""
        lock = self._lock
        if lock._is_owned():  # type: ignore[attr-defined]
            lock.acquire()  # the caller's finally gives this level back
            raise WouldBlock("called again from inside this object's own call on this thread")
        if not lock.acquire(False):
            if not wait:
                raise WouldBlock
            self.count(1)
            try:
                left = left_before(deadline)
                if not lock.acquire(timeout=-1 if left is None else left):
                    raise WaitTimeout("the timeout passed")
            finally:
                self.count(-1)
        self.owner = get_ident()

    def try_acquire(self) -> bool:
        """Take the lock if it is free: False if another thread holds it, or this one (then,
        as ``acquire`` does on re-entry, one level more for the ``finally`` to give back).
        Inside a ``try`` whose ``finally`` calls ``release``, as ``acquire``."""
        lock = self._lock
        if lock._is_owned():  # type: ignore[attr-defined]
            lock.acquire()
            return False
        if not lock.acquire(False):
            return False
        self.owner = get_ident()
        return True
