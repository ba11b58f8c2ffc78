"""A fork child inherits no role (docs/design.md, "Fork").

``fork()`` copies into the child every descriptor and mapping of the parent. A liveness lock
rides on an open file description, which the child's copy of the descriptor keeps alive: a child
that kept it would keep its parent's lock held after the parent's death. Every object that holds
such a resource registers here (``track``); right after a fork, in the child, each lets go of its
copy, touching nothing the parent still uses (no store to the ring, no file removed, no wake-up
sent).

And every role object (``role``: a writer, a reader, a collector, a sender, a caller, a worker,
vLLM's queues; async and blocking) becomes, in the child, an inherited one: an instance of a
subclass made once per role class, whose ``close``/``aclose`` (and leaving a ``with`` block,
and being collected) do nothing, and whose every other public method, ``statistics()``
included, raises ``ClosedResourceError`` saying whose the role is and what to do instead. Its
properties (``handle``, ``name``) still answer: they are what a child needs to open a role of its
own. The role's own code never runs in the child, so no lock a thread of the parent held at the
fork is taken, and nothing of the parent's is reached; nor does it cost the parent anything: no
check is added to any method but the ending ones (for a ``close`` bound before the fork, which
runs the role class's own function: it looks at the class it runs for).
"""

from __future__ import annotations

import functools
import inspect
import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NoReturn, Protocol, TypeVar

from .errors import ClosedResourceError


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


def refusal(role: str, owner: int, fix: str | None = None) -> str:
    """What a fork child's use of an inherited ``role`` ("writer", "reader", ...) raises;
    ``fix``: what to do instead (default: open a reader of one's own)."""
    if fix is None:
        fix = f"open your own reader with open_reader({role}.handle)"
    return f"this {role} belongs to process {owner}; a fork child inherits no role: {fix}"


# --- role objects -----------------------------------------------------------------------------
C = TypeVar("C", bound=type)

#: The role objects of this process (``role``), each made an inherited one in a fork child.
_roles: weakref.WeakSet[Any] = weakref.WeakSet()
#: role class -> the class its instances take in a fork child
_inherited: dict[type, type] = {}
#: The process the tracked roles belong to: this one (updated in each fork child).
_pid = os.getpid()
#: What leaving a ``with`` block and being collected do, and ``__next__``/``__anext__``.
_SPECIAL = ("__exit__", "__aexit__", "__del__", "__next__", "__anext__")


def role(
    kind: str, fix: str | None = None, *, ends: Iterable[str] = ("close", "aclose"), keep: Iterable[str] = ()
) -> Callable[[C], C]:
    """Class decorator for a role class: its instances are inherited ones in a fork child (see
    the module). ``kind`` and ``fix``: what the refusal says (``refusal``); ``ends``: the
    public methods that end the role, which do nothing in a child (``close``, ``aclose``,
    vLLM's ``shutdown``); ``keep``: methods that only answer, as properties do (vLLM's
    ``export_handle``)."""
    ending = frozenset(ends)
    kept = frozenset(keep)

    def decorate(cls: C) -> C:
        made: dict[str, Any] = {"__slots__": (), "__module__": cls.__module__}
        for name in [*dir(cls), *_SPECIAL]:
            if name.startswith("_") and name not in _SPECIAL:
                continue
            attr = inspect.getattr_static(cls, name, None)
            if name in kept or attr is None or isinstance(attr, property | staticmethod | classmethod):
                continue  # properties answer (a handle, a name); factories stay factories
            if not callable(attr):
                continue
            is_async = inspect.iscoroutinefunction(attr)
            nothing = name in ending or name in ("__exit__", "__aexit__", "__del__")
            made[name] = _does_nothing(is_async) if nothing else _refuses(is_async)
        made["__repr__"] = _repr
        made["_fork_refusal"] = _refusal_of(kind, fix)
        _inherited[cls] = inherited = type(cls)(f"Inherited{cls.__name__}", (cls,), made)
        # A bound method taken before the fork runs the role class's own function, not the
        # inherited one's: ``atexit.register(writer.close)``, ``ExitStack.callback``. The ending
        # methods (never on a hot path) look at the class they run for.
        for name in ending:
            end = inspect.getattr_static(cls, name, None)
            if end is not None and callable(end):
                type.__setattr__(cls, name, _ends_here_only(end, inherited))
        init = vars(cls)["__init__"]  # every role class has its own

        @functools.wraps(init)
        def tracked_init(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            _roles.add(self)

        type.__setattr__(cls, "__init__", tracked_init)
        return cls

    return decorate


def _refusal_of(kind: str, fix: str | None) -> Callable[[Any], str]:
    def message(self: Any) -> str:
        return refusal(kind, self._fork_owner, fix)

    return message


def _does_nothing(is_async: bool) -> Callable[..., Any]:
    if is_async:

        async def nothing_async(self: Any, *args: Any, **kwargs: Any) -> None:
            return None

        return nothing_async

    def nothing(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    return nothing


def _ends_here_only(end: Callable[..., Any], inherited: type) -> Callable[..., Any]:
    """``end`` (a role's ``close``), doing nothing for a role made an inherited one by a fork."""
    if inspect.iscoroutinefunction(end):

        @functools.wraps(end)
        async def end_async(self: Any, *args: Any, **kwargs: Any) -> Any:
            if type(self) is inherited:
                return None
            return await end(self, *args, **kwargs)

        return end_async

    @functools.wraps(end)
    def end_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        if type(self) is inherited:
            return None
        return end(self, *args, **kwargs)

    return end_sync


def _refuses(is_async: bool) -> Callable[..., Any]:
    if is_async:

        async def refuse_async(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
            raise ClosedResourceError(self._fork_refusal())

        return refuse_async

    def refuse(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise ClosedResourceError(self._fork_refusal())

    return refuse


def _repr(self: Any) -> str:
    role = type(self).__bases__[0]  # its module as the user sees it (blocking's roles are set after the fact)
    return f"<{role.__module__}.{role.__qualname__} of process {self._fork_owner}, inherited by a fork child>"


def _after_fork_in_child() -> None:
    global _pid
    owner, _pid = _pid, os.getpid()
    roles = list(_roles)
    _roles.clear()
    for obj in roles:
        # Every tracked role was made in the process that just forked (the set starts empty in
        # each child): that process is its owner.
        vars(obj)["_fork_owner"] = owner
        obj.__class__ = _inherited[type(obj)]
    inherited = list(_live)
    _live.clear()
    for res in inherited:
        res._forget_in_child()  # noqa: SLF001 (the hook of Tracked, defined by every tracked resource)


os.register_at_fork(after_in_child=_after_fork_in_child)
