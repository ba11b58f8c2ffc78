"""``python -m aiobroadcast COMMAND`` and the ``aiobroadcast`` console script (aiobroadcast.cli)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from .cli import run

    return run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
