"""Small file helpers shared by the shared-memory and TCP sides (no other project imports)."""

from __future__ import annotations

import os


def unlink_quietly(path: str) -> None:
    """Remove ``path`` if it is there: a file someone else removed first is no error."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
