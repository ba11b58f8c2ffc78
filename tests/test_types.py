"""The roles are enforced by the type checker and at run time."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import aiobroadcast as ab

TYPE_TESTS = Path(__file__).parent / "type_tests"


def _expected(path: Path) -> set[tuple[int, str]]:
    out = set()
    for no, line in enumerate(path.read_text().splitlines(), 1):
        m = re.search(r"# error: ([\w-]+)$", line)
        if m:
            out.add((no, m.group(1)))
    return out


FILES = {"roles.py": 9, "blocking_roles.py": 9, "vllm_roles.py": 3, "fanin_roles.py": 12}


@pytest.fixture(scope="module")
def mypy_output() -> str:
    """mypy --strict over every file of type_tests at once (one run: about 5 s, not 5 s each)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--hide-error-context",
            "--show-error-codes",
            "--no-pretty",
            *(str(TYPE_TESTS / name) for name in FILES),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # 1: type errors found (2 would be a crash)
    return proc.stdout


@pytest.mark.parametrize(("name", "errors"), FILES.items())
def test_role_misuse_fails_to_type_check_exactly_where_marked(name: str, errors: int, mypy_output: str) -> None:
    path = TYPE_TESTS / name
    got = {
        (int(m.group(1)), m.group(2))
        for m in re.finditer(rf"(?:^|/){re.escape(name)}:(\d+): error: .*\[([\w-]+)\]$", mypy_output, re.M)
    }
    expected = _expected(path)
    assert len(expected) == errors
    assert got == expected, mypy_output


@pytest.mark.anyio
async def test_roles_have_no_foreign_methods_at_run_time() -> None:
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        for attr in ("get", "get_nowait", "__aiter__", "__anext__"):
            with pytest.raises(AttributeError):
                getattr(writer, attr)
        async with ab.open_reader(writer.handle) as reader:
            for attr in ("put", "put_nowait"):
                with pytest.raises(AttributeError):
                    getattr(reader, attr)


def test_roles_cannot_be_built_directly() -> None:
    with pytest.raises(TypeError, match="open_writer"):
        ab.Writer(object(), None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="open_reader"):
        ab.Reader(object(), None, None, "x")  # type: ignore[arg-type]


def test_roles_are_final() -> None:
    for cls in (ab.Writer, ab.Reader):
        assert getattr(cls, "__final__", False) is True
