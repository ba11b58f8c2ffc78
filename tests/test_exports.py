"""``__all__`` is honest, public names live in private modules and are re-exported."""

from __future__ import annotations

from types import FunctionType, ModuleType

import aiobroadcast as ab
import aiobroadcast.blocking
import aiobroadcast.vllm


def test_all_names_exist_and_nothing_public_is_missing() -> None:
    for name in ab.__all__:
        assert hasattr(ab, name), name
    # Submodules (``aiobroadcast.blocking``) are attributes once imported, not names of __all__.
    public = {n for n, v in vars(ab).items() if not n.startswith("_") and not isinstance(v, ModuleType)}
    assert public - {"annotations"} == set(ab.__all__)


def test_public_submodules_export_what_they_define() -> None:
    for module in (aiobroadcast.blocking, aiobroadcast.vllm):
        for name in module.__all__:
            assert hasattr(module, name), name
        defined = {
            n
            for n, v in vars(module).items()
            if not n.startswith("_") and isinstance(v, type | FunctionType) and v.__module__ == module.__name__
        }
        assert defined == set(module.__all__)


def test_every_error_derives_from_broadcast_error() -> None:
    errors = [getattr(ab, n) for n in ab.__all__ if isinstance(getattr(ab, n), type)]
    errors = [e for e in errors if issubclass(e, Exception)]
    assert len(errors) >= 12
    for err in errors:
        assert issubclass(err, ab.BroadcastError), err
        assert err.__doc__, f"{err.__name__} needs a docstring saying who raises it and when"
