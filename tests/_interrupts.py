"""A Ctrl-C at a chosen line: raise ``KeyboardInterrupt`` (as a signal handler would) at the
n-th line executed inside chosen functions, to walk an interrupt through every line of a call."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

#: Which frames count: ``where(code)`` is true for the code objects whose lines are counted.
Where = Callable[[Any], bool]


def in_functions(modules: Iterable[str], names: Iterable[str]) -> Where:
    """The functions called ``names`` (``co_name``) in the files of ``modules`` (imported)."""
    files = {sys.modules[m].__file__ for m in modules}
    wanted = set(names)
    return lambda code: code.co_filename in files and code.co_name in wanted


def interrupt_at_line(n: int, call: Callable[[], object], where: Where) -> bool:
    """Run ``call()`` and raise ``KeyboardInterrupt`` at the ``n``-th line it executes in the
    frames ``where`` picks. True if it was interrupted (``n`` lines were reached)."""
    count = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
            if count == n:
                raise KeyboardInterrupt
        return local

    def start(frame: Any, event: str, arg: Any) -> Any:
        return local if where(frame.f_code) else None

    sys.settrace(start)
    try:
        call()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False
