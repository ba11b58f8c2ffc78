"""Handles as text: ``from_json`` mirrors ``to_json`` for every kind of handle, and a file path
passed where a handle's JSON belongs is named as one, with the way to read it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import aiobroadcast as ab
from aiobroadcast import blocking

pytestmark = pytest.mark.anyio


@pytest.fixture
def handle_file(tmp_path: Path) -> tuple[ab.Handle, Path]:
    with blocking.open_writer(codec="json") as w:
        path = tmp_path / "handle.json"
        w.handle.save(path)
        return w.handle, path


def _paths(saved: Path, tmp_path: Path) -> list[str | Path]:
    """What users pass: an existing file, a name ending in .json, a path that is not JSON."""
    return [str(saved), saved, "handle.json", str(tmp_path / "nowhere" / "h.json"), "/run/aiobroadcast/handle"]


def test_handle_from_json_mirrors_to_json() -> None:
    with blocking.open_writer(codec="json", tcp="tcp://127.0.0.1:0") as w:
        h = w.handle
        assert ab.Handle.from_json(h.to_json()) == h
        assert ab.Handle.from_json(h.to_json().encode()) == h
        with pytest.raises(ab.InvalidHandle, match="not an aiobroadcast handle"):
            ab.Handle.from_json('{"version": 1}')


async def test_open_reader_given_a_path_says_to_load_it(handle_file: tuple[ab.Handle, Path], tmp_path: Path) -> None:
    _handle, saved = handle_file
    for given in _paths(saved, tmp_path):
        with pytest.raises(ab.InvalidHandle) as info:
            await ab.open_reader(given)  # type: ignore[arg-type]
        message = str(info.value)
        assert "looks like a file path" in message and "Handle.load(path)" in message, (given, message)
        assert "Invalid JSON" not in message, message
        assert "\n" not in message


def test_the_blocking_front_end_given_a_path_says_to_load_it(
    handle_file: tuple[ab.Handle, Path], tmp_path: Path
) -> None:
    _handle, saved = handle_file
    for given in _paths(saved, tmp_path):
        with pytest.raises(ab.InvalidHandle, match=r"looks like a file path.*Handle\.load\(path\)"):
            blocking.open_reader(given)  # type: ignore[arg-type]
        with pytest.raises(ab.InvalidHandle, match=r"looks like a file path.*Handle\.load\(path\)"):
            ab.Handle.parse(given)  # type: ignore[arg-type]


def test_json_text_is_not_taken_for_a_path(handle_file: tuple[ab.Handle, Path]) -> None:
    """Handle JSON holds paths ("/dev/shm"): it is parsed, and a broken one is reported as JSON."""
    handle, saved = handle_file
    assert ab.Handle.parse(saved.read_text()) == handle
    with pytest.raises(ab.InvalidHandle) as info:
        ab.Handle.parse(saved.read_text()[:-1])  # truncated
    assert "looks like a file path" not in str(info.value)


async def test_collector_handles_mirror_to_json_and_name_a_path(tmp_path: Path) -> None:
    async with ab.open_collector(codec="json") as collector:
        h = collector.handle
        assert ab.CollectorHandle.from_json(h.to_json()) == h
        path = tmp_path / "collector.json"
        path.write_text(h.to_json())
        for given in (str(path), path, "collector.json"):
            with pytest.raises(ab.InvalidHandle) as info:
                await ab.open_sender(given, name="s")  # type: ignore[arg-type]
            message = str(info.value)
            assert "looks like a file path" in message and "CollectorHandle.from_json" in message, message
            assert "broadcast channel" not in message, message


async def test_pool_handles_mirror_to_json_and_name_a_path(tmp_path: Path) -> None:
    async with ab.open_caller(workers=["w0"]) as caller:
        h = caller.handle
        assert ab.PoolHandle.from_json(h.to_json()) == h
        path = tmp_path / "pool.json"
        path.write_text(h.to_json())
        for given in (str(path), path, os.fspath(path).encode()):
            with pytest.raises(ab.InvalidHandle) as info:
                await ab.open_worker(given, name="w0")  # type: ignore[arg-type]
            message = str(info.value)
            assert "looks like a file path" in message and "PoolHandle.from_json" in message, message
