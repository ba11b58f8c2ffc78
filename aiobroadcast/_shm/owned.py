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
``finally``. The lock is ``_atomics.Held`` (C): its ``take`` records the holder as it takes the
lock, and its ``release`` gives back a level only if this thread holds one, each in one C call,
so no handler runs between a look and what it decides. A re-entrant call takes the lock once
more (``take`` says so) and raises ``WouldBlock``: the caller's ``finally`` gives back that one
level, and the outer call keeps its hold.
"""

from __future__ import annotations

import threading
from time import monotonic

from .._base.errors import WaitTimeout, WouldBlock
from ._atomics import Held


def left_before(deadline: float | None) -> float | None:
    """Seconds left before ``deadline`` (None: no deadline); raises ``WaitTimeout`` at 0."""
    if deadline is None:
        return None
    left = deadline - monotonic()
    if left <= 0:
        raise WaitTimeout("the timeout passed")
    return left


_AGAIN = "called again from inside this object's own call on this thread"


class Owned:
    """A blocking role's lock (see the module). ``owner``: the thread holding it, 0 if none
    (read without the lock by ``statistics``, which only counts it); ``mine()``: whether this
    thread holds it."""

    def __init__(self) -> None:
        self._held = held = Held()
        self._take = held.take
        self._count_lock = threading.Lock()
        self.waiting = 0
        self.release = held.release
        self.mine = held.mine

    @property
    def owner(self) -> int:
        return self._held.owner

    def count(self, delta: int) -> None:
        with self._count_lock:
            self.waiting += delta

    def acquire(self, deadline: float | None, *, wait: bool = True) -> None:
        """Take the lock (raises ``WouldBlock`` on re-entry or with ``wait=False`` if taken,
        ``WaitTimeout`` when ``deadline`` passes). Call it inside the ``try`` whose ``finally``
        calls ``release``."""
        took = self._take(0.0)
        if took > 0:
            return
        if took < 0:
            raise WouldBlock(_AGAIN)  # the caller's finally gives this level back
        if not wait:
            raise WouldBlock
        self.count(1)
        try:
            left = left_before(deadline)
            if not self._take(-1.0 if left is None else left):
                raise WaitTimeout("the timeout passed")
        finally:
            self.count(-1)

    def try_acquire(self) -> bool:
        """Take the lock if it is free: False if another thread holds it, or this one (then,
        as ``acquire`` does on re-entry, one level more for the ``finally`` to give back).
        Inside a ``try`` whose ``finally`` calls ``release``, as ``acquire``."""
        return self._take(0.0) > 0
