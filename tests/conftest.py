from __future__ import annotations

import compileall
import os
from collections.abc import Iterator
from typing import Any

import pytest

import aiobroadcast
from aiobroadcast import _tuning

# torch's CPU ops run on an OpenMP thread pool, which does not survive fork: a process forked after
# the pool started hangs in its first parallel op. The suite is one process that both runs torch
# ops (the arena tests) and forks vLLM-style ranks, so torch runs on one thread here. Set before
# anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Byte-compile the package before the tests start the processes that import it. Where
    PYTHONDONTWRITEBYTECODE is set (as on this project's machines), no import writes a ``.pyc``,
    so each worker, server and CLI process a test started compiled the package from source
    again, about 0.1 s each (the suite took 868-889 s before, 710 s after, docs/performance.md).
    ``compile_dir`` writes only what is missing or older than its source, into ``__pycache__``
    (ignored by git)."""
    compileall.compile_dir(os.path.dirname(aiobroadcast.__file__), quiet=2)


BACKENDS = [
    pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    """Every async test runs on asyncio, asyncio with uvloop, and trio."""
    return request.param


@pytest.fixture
def one_slot_per_get(monkeypatch: pytest.MonkeyPatch) -> None:
    """Readers take one message out of the ring per get (no taking ahead): for tests that step a
    reader slot by slot to put a writer in a given wait."""
    monkeypatch.setattr(_tuning, "AHEAD_MESSAGES", 1)


@pytest.fixture(autouse=True)
def _no_leftover_segments() -> Iterator[None]:
    """Every test must leave /dev/shm as it found it (no segment, no socket)."""
    before = _ours()
    yield
    left = _ours() - before
    assert not left, f"left behind in /dev/shm: {sorted(left)}"


def _ours() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("aiobroadcast-")}
