"""Child-process entry points for tests/test_processes.py, and the parent's side of talking to them.

``multiprocessing`` with the spawn start method needs importable targets: every ``*_proc`` function
below runs in a fresh interpreter. pytest puts ``tests/`` on ``sys.path`` (no ``__init__.py``, the
default "prepend" import mode) and spawn hands the parent's ``sys.path`` to the child, so
``import _workers`` works on both sides.

A child talks to the test over a ``Pipe``: it sends ``(tag, payload)`` tuples, and
``("error", traceback)`` if it fails, so the test fails with the child's traceback. It receives
plain strings as commands ("go", "close", "exit").
"""

from __future__ import annotations

import gc
import hashlib
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import traceback
import warnings
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

import aiobroadcast as ab
from aiobroadcast._base import tuning as _tuning
from aiobroadcast._base.handle import Policy

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

Backend = tuple[str, dict[str, Any]]
Conn = multiprocessing.connection.Connection
Event = tuple[Any, ...]

CTX = multiprocessing.get_context("spawn")


# --- things that cross the process boundary ----------------------------------------------------
def _explode_unless(pid: int, payload: bytes) -> Bomb:
    if os.getpid() != pid:
        raise RuntimeError(f"a Bomb pickled in pid {pid} refuses to be unpickled in pid {os.getpid()}")
    return Bomb(payload)


class Bomb:
    """Pickles fine; unpickling raises in any process other than the one that pickled it."""

    def __init__(self, payload: bytes = b"") -> None:
        self.payload = payload

    def __reduce__(self) -> tuple[Callable[[int, bytes], Bomb], tuple[int, bytes]]:
        return (_explode_unless, (os.getpid(), self.payload))


def stress_array(rng: np.random.Generator) -> npt.NDArray[np.int64]:
    """The next array of the stress test: 1 to 9,999 random int64 (up to 80 KB)."""
    import numpy as np  # only where needed: every child imports this module, most need no numpy

    n = int(rng.integers(1, 10_000))
    return rng.integers(-(2**62), 2**62, size=n, dtype=np.int64)


def numbered_array(i: int, size: int) -> npt.NDArray[np.int64]:
    """A distinct, recognisable array for message ``i``."""
    import numpy as np

    return np.arange(size, dtype=np.int64) + i * 1_000_003


def digest(obj: object) -> tuple[int, str]:
    """Length and SHA-256 of a bytes message (to report big messages without sending them back)."""
    assert isinstance(obj, bytes | bytearray), type(obj)
    return len(obj), hashlib.sha256(obj).hexdigest()


@dataclass(frozen=True)
class ReaderOpts:
    """How ``collect_proc`` reads."""

    name: str = "collector"
    gate: bool = False  #: attach, report, then wait for "go" before reading
    stop_after: int | None = None  #: after that many messages report "stalled" and obey commands
    delay_s: float = 0.0  #: sleep after each message (a slow reader)
    liveness_s: float | None = None  #: override the reader's liveness period (None: library default)
    digest: bool = False  #: report (len, sha256) of each message instead of the message
    use_async_for: bool = False  #: read with ``async for`` (ends on EndOfStream)


@dataclass(frozen=True)
class WriterSpec:
    """What ``writer_proc`` does."""

    capacity: int = 4
    slot_bytes: int = 256
    policy: Policy = "block"
    count: int = 10  #: puts the ints 0 .. count-1
    gate: bool = True  #: wait for "go" after sending the handle
    sleep_prob: float = 0.0  #: probability of a 0-1 ms sleep after a put
    report_block: bool = False  #: send ("blocking", i) before the first put that has to wait
    then: str = "close"  #: "close": aclose and exit; "hang": sleep until killed


# --- the child side -----------------------------------------------------------------------------
def set_reader_liveness(seconds: float) -> None:
    """How long a parked reader of this process sleeps before re-checking on its own."""
    _tuning.LIVENESS_S = seconds
    _tuning.WATCHED_LIVENESS_S = seconds


def _child(
    conn: Conn,
    backend: Backend,
    main: Callable[..., Awaitable[None]],
    *args: Any,
    setup: Callable[[], None] | None = None,
) -> None:
    """Run ``main(conn, *args)`` on ``backend``; report any failure to the parent over ``conn``.
    ``setup`` runs first, inside the same error reporting (e.g. entering a network namespace)."""

    def run() -> None:
        if setup is not None:
            setup()
        anyio.run(main, conn, *args, backend=backend[0], backend_options=backend[1])

    reporting(conn, run)


def reporting(conn: Conn, run: Callable[[], None]) -> None:
    """Run ``run()`` in a child; send ``("error", traceback)`` if it fails; close ``conn``."""
    try:
        run()
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise
    finally:
        conn.close()


def _expect(conn: Conn, command: str) -> None:
    got = conn.recv()
    if got != command:
        raise AssertionError(f"expected command {command!r}, got {got!r}")


def collect_proc(conn: Conn, backend: Backend, handle: str, opts: ReaderOpts) -> None:
    """Attach, read until the end, report every event. Keeps every exception it caught until after
    ``aclose`` (a kept exception must not keep the ring mapped or break closing)."""
    _child(conn, backend, _collect, handle, opts)


async def _collect(conn: Conn, handle: str, opts: ReaderOpts) -> None:
    if opts.liveness_s is not None:
        set_reader_liveness(opts.liveness_s)
    events: list[Event] = []
    kept: list[BaseException] = []
    reader = await ab.open_reader(handle, name=opts.name)
    try:
        conn.send(("attached", {"pid": os.getpid(), "place": reader.statistics().place}))
        if opts.gate:
            _expect(conn, "go")
        if opts.use_async_for:
            async for obj in reader:
                events.append(("msg", obj))
                if opts.delay_s:
                    await anyio.sleep(opts.delay_s)
            events.append(("end-of-iteration",))
        n = 0
        while not opts.use_async_for:
            if opts.stop_after is not None and n == opts.stop_after:
                conn.send(("stalled", n))
                command = conn.recv()  # blocks: this reader reads nothing any more
                if command == "close":
                    await reader.aclose()
                    conn.send(("closed", None))
                    _expect(conn, "exit")
                return
            try:
                obj = await reader.get()
            except ab.DeserializationError as exc:
                events.append(("deser", exc.msg_index, type(exc.__cause__).__name__))
                kept.append(exc)
                continue
            except ab.ReaderLagged as exc:
                events.append(("lagged", exc.missed))
                kept.append(exc)
                continue
            except ab.EndOfStream:
                events.append(("end",))
                break
            except ab.WriterGone as exc:
                events.append(("gone", exc.pid))
                kept.append(exc)
                break
            events.append(("msg", digest(obj) if opts.digest else obj))
            n += 1
            if opts.delay_s:
                await anyio.sleep(opts.delay_s)
        stats = reader.statistics()
    finally:
        await reader.aclose()
    conn.send(("events", {"events": events, "received": stats.received, "lagged": stats.lagged}))
    del kept


def writer_proc(conn: Conn, backend: Backend, spec: WriterSpec) -> None:
    """Create a channel, send its handle, put the ints 0 .. count-1, then close or hang."""
    _child(conn, backend, _write, spec)


async def _write(conn: Conn, spec: WriterSpec) -> None:
    rnd = random.Random(os.getpid())
    writer = await ab.open_writer(capacity=spec.capacity, slot_bytes=spec.slot_bytes, policy=spec.policy)
    try:
        conn.send(("handle", writer.handle.to_json()))
        if spec.gate:
            _expect(conn, "go")
        report_block = spec.report_block
        for i in range(spec.count):
            if report_block:
                try:
                    writer.put_nowait(i)
                    continue
                except ab.WouldBlock:
                    conn.send(("blocking", i))
                    report_block = False
            await writer.put(i)
            if spec.sleep_prob and rnd.random() < spec.sleep_prob:
                await anyio.sleep(rnd.random() / 1000)
        conn.send(("sent", spec.count))
        if spec.then == "hang":
            await anyio.sleep_forever()  # until SIGKILL: no clean-up of any kind
        stats = writer.statistics()
    finally:
        if spec.then != "hang":
            await writer.aclose()
    conn.send(("closed", {"sent": stats.sent, "dropped": stats.dropped_readers}))


def stress_proc(conn: Conn, backend: Backend, handle: str, seed: int, count: int, liveness_s: float) -> None:
    """The stress reader: regenerate the writer's arrays from its seed and compare each one."""
    _child(conn, backend, _stress, handle, seed, count, liveness_s)


async def _stress(conn: Conn, handle: str, seed: int, count: int, liveness_s: float) -> None:
    import numpy as np

    set_reader_liveness(liveness_s)
    rng = np.random.default_rng(seed)
    naps = random.Random(os.getpid())
    bad: list[str] = []
    received = 0
    async with ab.open_reader(handle, name=f"stress-{os.getpid()}") as reader:
        conn.send(("attached", {"pid": os.getpid()}))
        for i in range(count):
            index, arr = await reader.get()
            expected = stress_array(rng)
            if index != i or arr.dtype != np.int64 or not np.array_equal(arr, expected):
                bad.append(f"message {i}: got #{index}, {arr.dtype}, {arr.shape} expected {expected.shape}")
                if len(bad) > 5:
                    break
            received += 1
            if naps.random() < 0.1:
                await anyio.sleep(naps.random() / 1000)
        try:
            extra: object = await reader.get()
        except ab.EndOfStream:
            extra = None
    conn.send(("done", {"received": received, "bad": bad, "extra": repr(extra) if extra is not None else None}))


def numpy_proc(conn: Conn, backend: Backend, handle: str, sizes: list[int]) -> None:
    """Receive ``numbered_array(i, sizes[i])``, check it is a writable copy, scribble on it, keep
    it, and at the end check that every kept array still holds exactly what this process wrote."""
    _child(conn, backend, _numpy, handle, sizes)


async def _numpy(conn: Conn, handle: str, sizes: list[int]) -> None:
    import numpy as np

    problems: list[str] = []
    kept: list[npt.NDArray[np.int64]] = []
    async with ab.open_reader(handle, name="numpy") as reader:
        conn.send(("attached", {"pid": os.getpid()}))
        for i, size in enumerate(sizes):
            index, arr = await reader.get()
            if index != i or not np.array_equal(arr, numbered_array(i, size)):
                problems.append(f"message {i} (#{index}) arrived with the wrong contents")
            if not arr.flags.writeable:
                problems.append(f"message {i}: array is read-only")
                continue
            arr[:] = -i - 1  # would corrupt later messages if it aliased the ring
            kept.append(arr)
        try:
            await reader.get()
            problems.append("a message after the last one")
        except ab.EndOfStream:
            pass
    for i, arr in enumerate(kept):
        if not (arr == -i - 1).all():
            problems.append(f"message {i}: kept array changed after later messages arrived")
    conn.send(("done", {"problems": problems, "kept": len(kept)}))


def huge_proc(conn: Conn, backend: Backend, handle: str, n: int) -> None:
    """Receive one ``np.arange(n, dtype=uint64)`` and compare it chunk by chunk."""
    _child(conn, backend, _huge, handle, n)


async def _huge(conn: Conn, handle: str, n: int) -> None:
    import numpy as np

    async with ab.open_reader(handle, name="huge") as reader:
        conn.send(("attached", {"pid": os.getpid()}))
        arr = await reader.get()
        ok = arr.dtype == np.uint64 and arr.shape == (n,) and bool(arr.flags.writeable)
        chunk = 1 << 22
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            ok = ok and np.array_equal(arr[start:stop], np.arange(start, stop, dtype=np.uint64))
        del arr
        try:
            await reader.get()
            end = False
        except ab.EndOfStream:
            end = True
    conn.send(("done", {"ok": ok, "end": end}))


def forget_proc(conn: Conn, backend: Backend, handle: str) -> None:
    """Attach, then drop the reader without ``aclose`` and report the warnings; then exit."""
    _child(conn, backend, _forget, handle)


async def _forget(conn: Conn, handle: str) -> None:
    reader = await ab.open_reader(handle, name="forgetful")
    conn.send(("attached", {"pid": os.getpid(), "place": reader.statistics().place}))
    _expect(conn, "forget")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del reader
        gc.collect()
    conn.send(("forgot", [(w.category.__name__, str(w.message)) for w in caught]))
    _expect(conn, "exit")


# --- the parent side ------------------------------------------------------------------------------
class Child:
    """A spawned process and its end of the pipe."""

    def __init__(self, target: Callable[..., None], *args: Any, daemon: bool = True) -> None:
        self.conn, child_conn = CTX.Pipe()
        self.proc = CTX.Process(target=target, args=(child_conn, *args), daemon=daemon)
        self.proc.start()
        child_conn.close()

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def send(self, command: str) -> None:
        self.conn.send(command)

    async def recv(self, tag: str, within_s: float = 30.0) -> Any:
        """The next message from the child, which must carry ``tag``."""
        with anyio.fail_after(within_s):
            await anyio.wait_readable(self.conn.fileno())
        try:
            got, payload = self.conn.recv()
        except EOFError:
            code = self.proc.exitcode
            raise AssertionError(f"child {self.pid} exited (code {code}) before sending {tag!r}") from None
        if got == "error":
            raise AssertionError(f"child {self.pid} failed:\n{payload}")
        assert got == tag, f"expected {tag!r} from child {self.pid}, got {got!r}: {payload!r}"
        return payload

    async def join(self, within_s: float = 30.0) -> int:
        """Wait for the child to exit and return its exit code."""
        with anyio.fail_after(within_s):
            await anyio.wait_readable(self.proc.sentinel)
        self.proc.join()
        code = self.proc.exitcode
        assert code is not None
        return code

    def sigkill(self) -> None:
        """SIGKILL, without reaping: the child stays a zombie until ``cleanup``."""
        os.kill(self.pid, signal.SIGKILL)

    def cleanup(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(30)
        self.conn.close()


@contextmanager
def spawn(target: Callable[..., None], *args: Any, daemon: bool = True) -> Iterator[Child]:
    """Start ``target(conn, *args)`` in a spawned process; kill and reap it on the way out.
    ``daemon=False``: it may start multiprocessing children of its own."""
    child = Child(target, *args, daemon=daemon)
    try:
        yield child
    finally:
        child.cleanup()
