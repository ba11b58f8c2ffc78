from __future__ import annotations

import compileall
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

import aiobroadcast
from aiobroadcast._base import tuning as _tuning

# torch's CPU ops run on an OpenMP thread pool, which does not survive fork: a process forked after
# the pool started hangs in its first parallel op. The suite is one process that both runs torch
# ops (the arena tests) and forks vLLM-style ranks, so torch runs on one thread here. Set before
# anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")


#: How many pytest-xdist workers run the whole suite, each with a /dev/shm of its own.
TEST_WORKERS = 2
_PRIVATE_SHM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_private_shm.py")
#: Why this run is serial (None: it runs on TEST_WORKERS workers), for the report's header.
_serial_because: str | None = "the run has not been configured yet"


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Run the whole suite (no paths given, as the README's test command does) on
    ``TEST_WORKERS`` pytest-xdist workers, a test file to a worker, each worker started by
    ``_private_shm.py`` in a mount namespace with a /dev/shm of its own: the tests wait more than
    they compute (serially, 70 % of one CPU), and a private /dev/shm keeps each test's leftover
    check (``_no_leftover_segments``) as exact as in a serial run. Serial where that cannot be
    done (not root), when the command line chooses (``-n``, ``--dist``, ``--tx``, paths given,
    ``--pdb``), or with ``AIOBROADCAST_TEST_SERIAL=1``."""
    global _serial_because
    if hasattr(config, "workerinput"):
        _serial_because = "a worker of the run"
        return  # a worker runs this hook too, with its options parsed again: it must not start workers
    _serial_because = _why_serial(config)
    if _serial_because is None:
        python = shlex.join([sys.executable, _PRIVATE_SHM])
        config.option.tx = [f"popen//python={python}"] * TEST_WORKERS
        config.option.dist = "loadfile"


def _why_serial(config: pytest.Config) -> str | None:
    if not config.pluginmanager.hasplugin("xdist"):
        return "pytest-xdist is not installed"
    if config.option.numprocesses is not None or config.option.tx or config.option.dist != "no":
        return "the command line sets -n, --dist or --tx"
    if config.args_source is not pytest.Config.ArgsSource.TESTPATHS:
        return "paths were given"
    if config.option.usepdb or config.option.collectonly:
        return "--pdb or --collect-only"
    if os.environ.get("AIOBROADCAST_TEST_SERIAL"):
        return "AIOBROADCAST_TEST_SERIAL is set"
    if (os.cpu_count() or 1) < TEST_WORKERS:
        return f"fewer than {TEST_WORKERS} CPUs"
    probe = subprocess.run(
        [sys.executable, _PRIVATE_SHM, "-c", "pass"], capture_output=True, text=True, timeout=60, check=False
    )
    if probe.returncode != 0:
        return probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else f"exit code {probe.returncode}"
    return None


def pytest_report_header(config: pytest.Config) -> str:
    if _serial_because is None:
        return f"test workers: {TEST_WORKERS}, each with a /dev/shm of its own (tests/_private_shm.py)"
    return f"test workers: none, serial ({_serial_because})"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Byte-compile the package before the tests start the processes that import it. Where
    PYTHONDONTWRITEBYTECODE is set (as on this project's machines), no import writes a ``.pyc``,
    so each worker, server and CLI process a test started compiled the package from source
    again, about 0.1 s each (the suite took 868-889 s before, 710 s after, docs/performance.md).
    ``compile_dir`` writes only what is missing or older than its source, into ``__pycache__``
    (ignored by git)."""
    if hasattr(session.config, "workerinput"):
        return  # a worker: the run's first process compiled it before starting the workers
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
