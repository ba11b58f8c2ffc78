"""A fork child inherits no role (docs/design.md, "Fork").

``fork()`` copies into the child every descriptor and mapping of the parent. A liveness lock
rides on an open file description, which the child's copy of the descriptor keeps alive: a child
that kept it would keep its parent's lock held after the parent's death. Every object that holds
such a resource registers here; right after a fork, in the child, each lets go of its copy,
touching nothing the parent still uses (no store to the ring, no file removed, no wake-up sent),
and a role object refuses any further use with ``ClosedResourceError``.
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol


class Inherited(Protocol):
    def _forget_in_child(self) -> None:
        """Called in a fork child, once: drop this process's copies; never raise."""


_live: weakref.WeakSet[Inherited] = weakref.WeakSet()


def track(obj: Inherited) -> None:
    """Let go of ``obj``'s resources in any fork child, from now on."""
    _live.add(obj)


def untrack(obj: Inherited) -> None:
    """``obj`` was closed: there is nothing left for a child to let go of."""
    _live.discard(obj)


def refusal(role: str, owner: int) -> str:
    """What a fork child's use of an inherited ``role`` ("writer", "reader") raises."""
    return (
        f"this {role} belongs to process {owner}; a fork child inherits no role: "
        f"open your own reader with open_reader({role}.handle)"
    )


def _after_fork_in_child() -> None:
    inherited = list(_live)
    _live.clear()
    for obj in inherited:
        obj._forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
