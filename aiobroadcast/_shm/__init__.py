"""The shared-memory layer: layout, segment and liveness, wake-ups, publisher, subscriber."""

from __future__ import annotations

import importlib
import importlib.machinery
import itertools
import os
import sys

_EXTENSION = f"{__name__}._atomics"


class MissingExtension(ModuleNotFoundError):
    """The package imported has no compiled ``_atomics`` (``_atomics.c``, built by installing).
    A ``ModuleNotFoundError`` (an ``ImportError``) that says why and what to do: most often a
    source tree that shadows the installed package (``python -m aiobroadcast`` run inside it)."""


def _installed_elsewhere(package_dir: str) -> str | None:
    """Another copy of the package on ``sys.path``, with its compiled part: the one installed."""
    for entry in sys.path:
        candidate = os.path.join(os.path.abspath(entry or os.curdir), "aiobroadcast")
        if os.path.realpath(candidate) == os.path.realpath(package_dir):
            continue
        shm = os.path.join(candidate, "_shm")
        if any(os.path.exists(os.path.join(shm, "_atomics" + s)) for s in importlib.machinery.EXTENSION_SUFFIXES):
            return candidate
    return None


def _missing_extension() -> MissingExtension:
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tree = os.path.dirname(package_dir)
    installed = _installed_elsewhere(package_dir)
    is_tree = os.path.exists(os.path.join(tree, "pyproject.toml"))
    if installed is not None and is_tree:
        message = (
            f"the source tree at {tree} shadows the installed package ({installed}) and has no compiled "
            "extension; run from another directory, or install with `pip install -e .`"
        )
    elif installed is not None:
        message = (
            f"the package at {package_dir} shadows the installed package ({installed}) and has no compiled "
            "extension; remove it from the path (run from another directory)"
        )
    elif is_tree:
        message = (
            f"the package at {package_dir} has no compiled extension ({_EXTENSION}); build it with "
            f"`pip install -e .` in {tree} (needs a C compiler and Python's headers)"
        )
    else:
        message = f"the package at {package_dir} has no compiled extension ({_EXTENSION}); reinstall aiobroadcast"
    return MissingExtension(message, name=_EXTENSION, path=package_dir)


def _running_as_main() -> bool:
    """Whether this import is ``python -m aiobroadcast``'s own (sys.argv[0] is "-m" while the
    module to run is being found)."""
    argv = getattr(sys, "orig_argv", [])
    return sys.argv[:1] == ["-m"] and any(
        a == "-m" and b.split(".")[0] == "aiobroadcast" for a, b in itertools.pairwise(argv)
    )


# Every module that uses the compiled part imports it through this package: a missing one is
# said once, here, with the fix (else: 12 frames ending "No module named ...").
try:
    importlib.import_module(_EXTENSION)
except ModuleNotFoundError as exc:
    if exc.name != _EXTENSION:
        raise
    _error = _missing_extension()
    if _running_as_main():
        # The command line's own error line (README, "Errors a user can fix"), and no traceback.
        print(f"aiobroadcast: error: {_error}", file=sys.stderr)
        raise SystemExit(1) from None
    raise _error from None
