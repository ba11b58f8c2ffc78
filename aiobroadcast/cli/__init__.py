"""The ``aiobroadcast`` command line: one module per command, on top of the public library.

Nothing in the library imports this package; ``python -m aiobroadcast`` and the ``aiobroadcast``
console script enter it through ``run``.
"""

from ._main import build_parser as build_parser
from ._main import run as run

__all__ = ["build_parser", "run"]
