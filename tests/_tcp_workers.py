"""Child-process entry points for tests/test_tcp.py and tests/test_netns.py, and the parent's side.

``multiprocessing`` with the spawn start method needs importable targets: every ``*_proc``
function below runs in a fresh interpreter. pytest puts ``tests/`` on ``sys.path`` (no
``__init__.py``, the default "prepend" import mode) and spawn hands the parent's ``sys.path`` to
the child, so ``import _tcp_workers`` works on both sides.

Each child may first move into a network namespace (``netns``, see ``_netns.enter``); it then
talks to the test over a ``Pipe`` (an AF_UNIX socketpair, which no network namespace affects):
it sends ``(tag, payload)`` tuples, and ``("error", traceback)`` if it fails, so the test fails
with the child's traceback. It receives plain strings as commands ("go", "close").

Messages are ``(seq, pad)``: ``seq`` is the message's number, ``pad`` is ``bytes([seq % 256]) *
n`` (large for every ``big_every``-th message, so that it spans several slots). Readers check the
pad and report only the numbers.
"""

from __future__ import annotations

import errno
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import _netns
import _workers
import anyio
import psutil
from _mountns import private_tmpfs

import aiobroadcast as ab
from aiobroadcast._base.handle import Policy
from aiobroadcast._tcp.report import STALE_HEARTBEATS

Backend = tuple[str, dict[str, Any]]
Conn = multiprocessing.connection.Connection
Event = tuple[Any, ...]

CTX = multiprocessing.get_context("spawn")
ASYNCIO: Backend = ("asyncio", {"use_uvloop": False})
UVLOOP: Backend = ("asyncio", {"use_uvloop": True})
TRIO: Backend = ("trio", {})

BIG = 3000  #: bytes of the pad of a big message (larger than the tests' 256-byte slots)


# --- the stream -------------------------------------------------------------------------------
def message(seq: int, big_every: int = 0) -> tuple[int, bytes]:
    size = BIG if big_every and seq % big_every == 0 else 3
    return seq, bytes([seq % 256]) * size


def check_message(obj: object, big_every: int = 0) -> int:
    """The number of a message built by ``message``; raises if it is not intact."""
    assert isinstance(obj, tuple) and len(obj) == 2, repr(obj)[:200]
    seq, pad = obj
    assert isinstance(seq, int)
    assert pad == message(seq, big_every)[1], f"message {seq} arrived damaged"
    return seq


def account(events: list[Event], total: int, *, start: int = 0) -> tuple[list[int], list[int]]:
    """Check that ``events`` say exactly what happened to messages ``start .. total-1``: every
    message is either received, in order, or counted by a ``("lagged", n)`` at the place where it
    is missing; nothing is received twice and there is no silent gap. Returns (received numbers,
    lag counts)."""
    expected = start
    got: list[int] = []
    lags: list[int] = []
    for e in events:
        if e[0] == "msg":
            assert e[1] == expected, f"expected message {expected}, got {e[1]} (events: {summary(events)})"
            got.append(e[1])
            expected += 1
        elif e[0] == "lagged":
            assert e[1] > 0, e
            lags.append(e[1])
            expected += e[1]
    assert expected == total, f"accounted for {expected - start} of {total - start} messages: {summary(events)}"
    return got, lags


def summary(events: list[Event]) -> str:
    """Events as runs: ``0..41 lagged(7) 49..99 end``."""
    out: list[str] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            out.append(f"{run[0]}..{run[-1]}" if len(run) > 1 else str(run[0]))
            run.clear()

    for e in events:
        if e[0] == "msg" and (not run or e[1] == run[-1] + 1):
            run.append(e[1])
            continue
        flush()
        if e[0] == "msg":
            run.append(e[1])
        else:
            out.append(e[0] if len(e) == 1 else f"{e[0]}({', '.join(map(str, e[1:]))})")
    flush()
    return " ".join(out)


# --- the child side ---------------------------------------------------------------------------
def _child(conn: Conn, backend: Backend, netns: str | None, main: Callable[..., Awaitable[None]], *args: Any) -> None:
    """``_workers._child``, first entering ``netns`` (before any socket exists)."""
    setup = None if netns is None else (lambda: _netns.enter(netns))
    _workers._child(conn, backend, main, *args, setup=setup)


_expect = _workers._expect


@dataclass(frozen=True)
class ReaderOpts:
    """How ``reader_proc`` reads."""

    name: str = "remote"
    transport: Literal["tcp", "shm", "auto"] = "tcp"
    big_every: int = 0  #: the stream's ``big_every`` (to check the pads)
    gate: bool = False  #: attach, report, then wait for "go" before reading
    stop_after: int | None = None  #: after that many messages report ("stalled", n), wait for "go"
    delay_s: float = 0.0  #: sleep after each message (a slow reader)
    live: bool = False  #: also send each event as it happens: ("event", e)


def reader_proc(conn: Conn, backend: Backend, netns: str | None, handle: str, opts: ReaderOpts) -> None:
    """Attach, read until the end (``EndOfStream``, ``WriterGone`` or ``TransportError``),
    report ("events", {...}) with every event: ("msg", seq), ("lagged", n), ("end",), ("gone",),
    ("error", text)."""
    _child(conn, backend, netns, _read, handle, opts)


async def _read(conn: Conn, handle: str, opts: ReaderOpts) -> None:
    events: list[Event] = []

    def note(e: Event) -> None:
        events.append(e)
        if opts.live:
            conn.send(("event", e))

    async with ab.open_reader(handle, name=opts.name, transport=opts.transport) as reader:
        conn.send(("attached", {"pid": os.getpid()}))
        if opts.gate:
            _expect(conn, "go")
        n = 0
        stalled = False
        while True:
            if opts.stop_after is not None and n == opts.stop_after and not stalled:
                stalled = True
                conn.send(("stalled", n))
                _expect(conn, "go")  # blocks the event loop: this reader reads nothing meanwhile
            try:
                obj = await reader.get()
            except ab.ReaderLagged as exc:
                note(("lagged", exc.missed))
                continue
            except ab.EndOfStream:
                note(("end",))
                break
            except ab.WriterGone:
                note(("gone",))
                break
            except ab.TransportError as exc:
                note(("error", str(exc)))
                break
            note(("msg", check_message(obj, opts.big_every)))
            n += 1
            if opts.delay_s:
                await anyio.sleep(opts.delay_s)
        stats = reader.statistics()
    conn.send(("events", {"events": events, "received": stats.received, "lagged": stats.lagged}))


@dataclass(frozen=True)
class WriterSpec:
    """What ``writer_proc`` does."""

    tcp: str | None = "tcp://127.0.0.1:0"  #: None: shared memory only
    insecure: bool = False  #: plain TCP, HMAC-signed, instead of CurveZMQ
    policy: Policy = "block"
    capacity: int = 8
    slot_bytes: int = 256
    tcp_window: int = 16
    heartbeat_s: float = 0.1
    count: int = 100  #: puts ``message(0 .. count-1)``
    big_every: int = 0
    interval_s: float = 0.0  #: sleep between puts
    then: Literal["close", "wait", "hang"] = "close"  #: after the puts: close; wait for "close"; hang
    report_drop: bool = False  #: send ("dropped", seq) once statistics() shows a dropped reader


def writer_proc(conn: Conn, backend: Backend, netns: str | None, spec: WriterSpec) -> None:
    """Serve a channel on ``spec.tcp``, send ("handle", json), wait for "go", put the stream, send
    ("sent", {...}), then close (sending ("closed", {...})), or hang until killed."""
    _child(conn, backend, netns, _write, spec)


async def _write(conn: Conn, spec: WriterSpec) -> None:
    writer = await ab.open_writer(
        tcp=spec.tcp,
        insecure=spec.insecure,
        policy=spec.policy,
        capacity=spec.capacity,
        slot_bytes=spec.slot_bytes,
        tcp_window=spec.tcp_window,
        heartbeat_s=spec.heartbeat_s,
    )
    try:
        conn.send(("handle", writer.handle.to_json()))
        _expect(conn, "go")
        longest = 0.0
        report_drop = spec.report_drop
        for seq in range(spec.count):
            t0 = time.monotonic()
            await writer.put(message(seq, spec.big_every))
            longest = max(longest, time.monotonic() - t0)
            if report_drop and writer.statistics().dropped_readers:
                conn.send(("dropped", seq))
                report_drop = False
            if spec.interval_s:
                await anyio.sleep(spec.interval_s)
        stats = writer.statistics()
        conn.send(
            (
                "sent",
                {
                    "count": spec.count,
                    "longest_put_s": longest,
                    "dropped": stats.dropped_readers,
                    "readers": [(r.name, r.transport) for r in stats.readers],
                    "restarts": stats.tcp_server_restarts,
                },
            )
        )
        if spec.then == "hang":
            while True:
                signal.pause()  # until SIGKILL: no clean-up of any kind
        if spec.then == "wait":
            _expect(conn, "close")
        t0 = time.monotonic()
    finally:
        if spec.then != "hang":
            await writer.aclose()
    conn.send(("closed", {"aclose_s": time.monotonic() - t0}))


def relay_proc(conn: Conn, backend: Backend, netns: str | None, upstream: str, name: str, capacity: int) -> None:
    """Run ``ab.relay`` on ``upstream``; send ("handle", json) of the local channel when ready,
    ("done", None) when the relay returns."""
    _child(conn, backend, netns, _relay, upstream, name, capacity)


async def _relay(conn: Conn, upstream: str, name: str, capacity: int) -> None:
    def ready(h: ab.Handle) -> None:
        conn.send(("handle", h.to_json()))

    await ab.relay(upstream, name=name, capacity=capacity, on_ready=ready)
    conn.send(("done", None))


@dataclass(frozen=True)
class FullShmSpec:
    """What ``full_shm_writer_proc`` does."""

    directory: str  #: where to mount the small tmpfs (created; removed by the parent)
    count: int = 40  #: messages published while it is full
    heartbeat_s: float = 0.2
    size: str = "1m"  #: the tmpfs's size


def _fill(directory: str) -> str:
    """Write a file into ``directory`` until its file system is full; returns its path."""
    path = os.path.join(directory, "filler")
    with open(path, "wb", buffering=0) as f:
        chunk = b"\0" * 4096
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return path


def full_shm_writer_proc(conn: Conn, backend: Backend, netns: str | None, spec: FullShmSpec) -> None:
    """A writer whose directory is a private tmpfs that it fills on "fill" (first it sends
    ("unavailable", reason) if it cannot mount one, or ("handle", json)). Its TCP server's log
    goes to a file, to count what it says. Sends ("full", {...}), publishes ``message(0 ..
    count-1)``, frees the room again and sends ("report", {...}); closes on "close"."""
    _child(conn, backend, netns, _full_shm_write, spec)


async def _full_shm_write(conn: Conn, spec: FullShmSpec) -> None:
    os.makedirs(spec.directory)
    try:
        private_tmpfs(spec.directory, spec.size)
    except OSError as exc:
        conn.send(("unavailable", str(exc)))
        return
    log_path = spec.directory + ".log"  # outside the tmpfs
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)  # the server process inherits it as its stderr, where it logs
    os.close(fd)
    hb = spec.heartbeat_s
    writer = await ab.open_writer(
        directory=spec.directory, tcp="tcp://127.0.0.1:0", heartbeat_s=hb, capacity=8, slot_bytes=1024
    )

    def received() -> int:
        return sum(r.received for r in writer.statistics().readers if r.transport == "tcp")

    try:
        conn.send(("handle", writer.handle.to_json()))
        _expect(conn, "fill")
        filler = _fill(spec.directory)
        await anyio.sleep(4 * hb)  # reports fail meanwhile
        listed = [r.name for r in writer.statistics().readers if r.transport == "tcp"]
        conn.send(("full", {"listed": listed}))
        for seq in range(spec.count):
            await writer.put(message(seq))
        # The reader acknowledges them; no report can say so, and the last one the server wrote
        # (or renewed, while nothing had changed) goes stale.
        await anyio.sleep(STALE_HEARTBEATS * hb + 1.0)
        # A failing report exists for an instant as a temporary file before it is removed; a
        # leftover is one still there in every one of several looks, spread over two heartbeats.
        looks = []
        for _ in range(8):
            looks.append({n for n in os.listdir(spec.directory) if "tmp" in n})
            await anyio.sleep(hb / 4)
        leftovers = sorted(set.intersection(*looks))
        while_full = received()
        health_while_full = writer.statistics().tcp_server_health
        os.unlink(filler)
        with anyio.fail_after(30):
            while True:
                if received() == spec.count:
                    break
                await anyio.sleep(hb / 4)
        stats = writer.statistics()
        log_text = await anyio.Path(log_path).read_text()
        complaints = sum("cannot write its report" in line for line in log_text.splitlines())
        report = {
            "tcp_server": stats.tcp_server,
            "restarts": stats.tcp_server_restarts,
            "leftovers": leftovers,
            "received_while_full": while_full,
            "received_again": received(),
            "complaints": complaints,
            "health_while_full": health_while_full,
            "health_again": stats.tcp_server_health,
        }
        conn.send(("report", report))
        _expect(conn, "close")
    finally:
        await writer.aclose()


# --- the parent side ----------------------------------------------------------------------------
class ChildExited(AssertionError):
    """The child closed its pipe (exited) where the test expected a message."""


class Child:
    """A spawned process and its end of the pipe."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        self.conn, child_conn = CTX.Pipe()
        self.proc = CTX.Process(target=target, args=(child_conn, *args), daemon=True)
        self.proc.start()
        child_conn.close()
        self.events: list[Event] = []  #: live events received so far (``ReaderOpts.live``)
        self._pending: list[tuple[str, Any]] = []  #: other messages that ``collect`` took

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def send(self, command: str) -> None:
        self.conn.send(command)

    async def next(self, within_s: float | None = 30.0) -> tuple[str, Any]:
        """The next message from the child."""
        if self._pending:
            return self._pending.pop(0)
        return await self._from_pipe(within_s)

    async def _from_pipe(self, within_s: float | None) -> tuple[str, Any]:
        with anyio.fail_after(within_s):
            await anyio.wait_readable(self.conn.fileno())
        try:
            got, payload = self.conn.recv()
        except EOFError:
            raise ChildExited(f"child {self.pid} exited (code {self.proc.exitcode})") from None
        if got == "error":
            raise AssertionError(f"child {self.pid} failed:\n{payload}")
        return got, payload

    async def recv(self, tag: str, within_s: float = 30.0) -> Any:
        """The next message that is not a live event; it must carry ``tag``."""
        with anyio.fail_after(within_s):
            while True:
                got, payload = await self.next(None)
                if got == "event":
                    self.events.append(payload)
                    continue
                assert got == tag, f"expected {tag!r} from child {self.pid}, got {got!r}: {payload!r}"
                return payload

    async def collect(self) -> None:
        """Take live events as they come, until cancelled: a child that reports every message
        must never block on a full pipe while the test waits for something else."""
        while True:
            try:
                got, payload = await self._from_pipe(None)
            except ChildExited:
                return  # it said everything it had to say
            if got == "event":
                self.events.append(payload)
            else:
                self._pending.append((got, payload))

    async def collected(self, tag: str, within_s: float = 30.0) -> Any:
        """While ``collect`` runs in another task: wait for it to take a message with ``tag``."""
        with anyio.fail_after(within_s):
            while True:
                for k, (got, payload) in enumerate(self._pending):
                    if got == "error":
                        raise AssertionError(f"child {self.pid} failed:\n{payload}")
                    if got == tag:
                        del self._pending[k]
                        return payload
                await anyio.sleep(0.05)

    async def until(self, predicate: Callable[[list[Event]], bool], within_s: float = 30.0) -> None:
        """Collect live events until ``predicate(events)`` holds."""
        with anyio.fail_after(within_s):
            while not predicate(self.events):
                got, payload = await self.next(None)
                assert got == "event", f"expected a live event from child {self.pid}, got {got!r}: {payload!r}"
                self.events.append(payload)

    async def join(self, within_s: float = 30.0) -> int:
        """Wait for the child to exit and return its exit code."""
        with anyio.fail_after(within_s):
            await anyio.wait_readable(self.proc.sentinel)
        self.proc.join()
        code = self.proc.exitcode
        assert code is not None
        return code

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.pid, sig)

    def cleanup(self) -> None:
        """Kill the child and what it started (a writer's TCP server process), and reap them."""
        descendants: list[psutil.Process] = []
        if self.proc.is_alive():
            try:
                descendants = psutil.Process(self.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
            self.proc.kill()  # SIGKILL works on a stopped process too
        self.proc.join(30)
        for p in descendants:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(descendants, timeout=30)
        self.conn.close()


@contextmanager
def spawn(target: Callable[..., None], *args: Any) -> Iterator[Child]:
    """Start ``target(conn, *args)`` in a spawned process; kill and reap it on the way out."""
    child = Child(target, *args)
    try:
        yield child
    finally:
        child.cleanup()


async def fill_until_blocked(writer: ab.Writer[Any], seq: int, still_s: float = 1.0) -> int:
    """``put_nowait`` consecutive messages until ``WouldBlock`` has persisted for ``still_s``
    (the writer is really held back, not just waiting for the server to take from the ring).
    Returns the number of the first message not published."""
    blocked_since: float | None = None
    with anyio.fail_after(60):
        while True:
            try:
                writer.put_nowait(message(seq))
            except ab.WouldBlock:
                now = time.monotonic()
                if blocked_since is None:
                    blocked_since = now
                elif now - blocked_since >= still_s:
                    return seq
                await anyio.sleep(0.02)
                continue
            seq += 1
            blocked_since = None


def received(events: list[Event]) -> list[int]:
    return [e[1] for e in events if e[0] == "msg"]


def terminal(events: list[Event]) -> Event | None:
    for e in events:
        if e[0] in ("end", "gone", "error"):
            return e
    return None
