"""``__all__`` is honest, public names live in private modules and are re-exported."""

from __future__ import annotations

import aiobroadcast as ab


def test_all_names_exist_and_nothing_public_is_missing() -> None:
    for name in ab.__all__:
        assert hasattr(ab, name), name
    public = {n for n in vars(ab) if not n.startswith("_")} - {"annotations"}
    assert public == set(ab.__all__)


def test_every_error_derives_from_broadcast_error() -> None:
    errors = [getattr(ab, n) for n in ab.__all__ if isinstance(getattr(ab, n), type)]
    errors = [e for e in errors if issubclass(e, Exception)]
    assert len(errors) >= 12
    for err in errors:
        assert issubclass(err, ab.BroadcastError), err
        assert err.__doc__, f"{err.__name__} needs a docstring saying who raises it and when"
