"""Ordinary faults inside one process: re-entrant and concurrent calls, exceptions of every kind
raised from inside pickling and at every await, bad arguments. Each test attacks one promise:
nothing is lost, duplicated or corrupted, and a user gets a ``BroadcastError`` that says what to fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest
from _interrupts import in_functions, interrupt_at_line

import aiobroadcast as ab
from aiobroadcast import blocking
from aiobroadcast._base.codec import PickleEncoder, decode_pickle
from aiobroadcast._shm import layout as _layout
from aiobroadcast._shm import segment as _segment
from aiobroadcast._shm.subscriber import ShmSource

pytestmark = pytest.mark.anyio


# --- re-entry ---------------------------------------------------------------------------------
def _run_script(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60, check=False
    )


def test_a_put_from_inside_pickling_does_not_crash_the_writer() -> None:
    """A logging handler that broadcasts, fired from ``__getstate__`` during ``put``: the inner
    publish works (it is a message of its own, sent first), and the outer one is intact. Run in a
    child process: re-entering a C pickler used to kill the interpreter (SIGSEGV)."""
    proc = _run_script(
        """
        import anyio, aiobroadcast as ab

        class Job:
            def __init__(self, n): self.n = n
            def __getstate__(self):
                W.put_nowait(f"log: pickling job {self.n}")
                return {"n": self.n, "shared": SHARED}
            def __setstate__(self, state): self.__dict__.update(state)

        SHARED = ["x", "y"]

        async def main():
            global W
            async with ab.open_writer(capacity=16, slot_bytes=4096) as W:
                async with ab.open_reader(W.handle) as r:
                    await W.put([Job(1), SHARED, Job(2), SHARED])
                    got = [await r.get() for _ in range(3)]
            assert got[0] == "log: pickling job 1" and got[1] == "log: pickling job 2", got
            jobs = got[2]
            assert jobs[0].n == 1 and jobs[2].n == 2 and jobs[1] == ["x", "y"]
            assert jobs[0].shared is jobs[1] is jobs[3], "the memo of the outer message is intact"
            print("ok")

        anyio.run(main)
        """
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == "ok"


def test_the_encoder_is_safe_to_reenter_and_to_share_between_threads() -> None:
    encoder = PickleEncoder()
    inner: list[Any] = []

    class Reenter:
        def __reduce__(self) -> Any:
            inner.append(encoder.encode(["inner", "inner"]))
            return (str, ("outer",))

    parts, _total, oob = encoder.encode([Reenter(), "a", "a"])
    assert decode_pickle(b"".join(bytes(p) for p in parts), oob) == ["outer", "a", "a"]
    assert decode_pickle(b"".join(bytes(p) for p in inner[0][0]), False) == ["inner", "inner"]

    errors: list[BaseException] = []

    def hammer(k: int) -> None:
        try:
            for i in range(2000):
                msg = [k, i, "s" * (i % 50), ("t", k)] * 2
                parts, _total, oob = encoder.encode(msg)
                assert decode_pickle(b"".join(bytes(p) for p in parts), oob) == msg
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


async def test_a_writer_used_from_several_threads_at_worst_raises_would_block() -> None:
    """``put_nowait`` from other threads while the loop's task publishes: each call publishes
    whole or raises ``WouldBlock``; the reader gets every published message once, intact."""
    sent: list[tuple[int, int]] = []
    lock = threading.Lock()
    async with ab.open_writer(capacity=16384, slot_bytes=256, policy="lag") as writer:
        async with ab.open_reader(writer.handle) as reader:

            def hammer(k: int) -> None:
                for i in range(3000):
                    try:
                        writer.put_nowait((k, i, "p" * (i % 100)))
                    except ab.WouldBlock:
                        continue
                    with lock:
                        sent.append((k, i))

            threads = [threading.Thread(target=hammer, args=(k,)) for k in range(1, 3)]
            for t in threads:
                t.start()
            for i in range(3000):
                try:
                    writer.put_nowait((0, i, "p" * (i % 100)))
                except ab.WouldBlock:
                    continue
                with lock:
                    sent.append((0, i))
            for t in threads:
                t.join()
            got = []
            while True:
                try:
                    k, i, pad = reader.get_nowait()
                except ab.WouldBlock:
                    break
                assert pad == "p" * (i % 100)
                got.append((k, i))
    # Each thread's own messages arrive in its order; nothing is missing or repeated.
    assert sorted(got) == sorted(sent) and len(set(got)) == len(got)
    for k in range(3):
        mine = [i for kk, i in got if kk == k]
        assert mine == sorted(mine)


@pytest.mark.parametrize("before", [0, 2], ids=["first", "inside-a-batch"])
async def test_a_get_from_inside_unpickling_raises_would_block_and_duplicates_nothing(before: int) -> None:
    """A ``__setstate__`` that reads from the same reader (a callback) must not be handed the
    message being decoded a second time, nor one after it. With messages ahead of it, it is
    decoded in the middle of a batch taken ahead (docs/design.md, "Taking ahead")."""
    async with ab.open_writer(capacity=8, slot_bytes=4096) as writer:
        async with ab.open_reader(writer.handle) as reader:
            seen: list[Any] = []
            _REENTRY["reader"] = reader
            _REENTRY["seen"] = seen
            try:
                for i in range(before):
                    await writer.put(f"before {i}")
                await writer.put(Peeker(1))
                await writer.put("second")
                assert [await reader.get() for _ in range(before)] == [f"before {i}" for i in range(before)]
                first = await reader.get()
                assert isinstance(first, Peeker) and first.n == 1
                assert seen == ["WouldBlock"]
                assert await reader.get() == "second"
                with pytest.raises(ab.WouldBlock):  # nothing left over, nothing handed out twice
                    reader.get_nowait()
            finally:
                _REENTRY.clear()


_REENTRY: dict[str, Any] = {}


class Peeker:
    def __init__(self, n: int) -> None:
        self.n = n

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        try:
            _REENTRY["reader"].get_nowait()
            _REENTRY["seen"].append("got a message")
        except ab.WouldBlock:
            _REENTRY["seen"].append("WouldBlock")


# --- exceptions injected inside pickling and at every await -----------------------------------
class Boom:
    """Raises ``exc`` from ``__reduce__`` (encoding) or from ``__setstate__`` (decoding) while
    ``armed``; between the two it pickles a list that references itself twice (memo work).
    ``__setstate__`` raises only for the object numbered ``armed_for`` (a reader may decode a few
    messages ahead of the get that returns them)."""

    armed: ClassVar[dict[str, BaseException | None]] = {"reduce": None, "setstate": None}
    armed_for: ClassVar[int] = -1

    def __init__(self, n: int) -> None:
        self.n = n

    def __getstate__(self) -> dict[str, Any]:
        exc = Boom.armed["reduce"]
        if exc is not None:
            Boom.armed["reduce"] = None
            raise exc
        return {"n": self.n}

    def __setstate__(self, state: dict[str, Any]) -> None:
        exc = Boom.armed["setstate"]
        if exc is not None and state["n"] == Boom.armed_for:
            Boom.armed["setstate"] = None
            raise exc
        self.n = state["n"]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Boom) and other.n == self.n

    def __hash__(self) -> int:
        return self.n


class _Cancel(BaseException):
    """Stands for a cancellation at a point that is not an await (raised from pickling)."""


INJECTED: list[Callable[[], BaseException]] = [
    lambda: RuntimeError("boom"),
    KeyboardInterrupt,
    lambda: SystemExit(3),
    _Cancel,
]
INJECTED_IDS = ["Exception", "KeyboardInterrupt", "SystemExit", "BaseException"]


def _message(i: int, big: bool) -> list[Any]:
    x, y = f"x{i}", Boom(i)
    body: list[Any] = [x, y, x, y]  # memo references: a stale memo would corrupt the next message
    if big:
        body.append(b"z" * 70_000)  # a large payload handed over by reference, across slots
    return body


@pytest.mark.parametrize("make", INJECTED, ids=INJECTED_IDS)
@pytest.mark.parametrize("where", ["reduce", "setstate"])
@pytest.mark.parametrize("big", [False, True], ids=["small", "multi-slot"])
async def test_an_exception_inside_pickling_loses_and_corrupts_nothing(
    anyio_backend: Any, make: Callable[[], BaseException], where: str, big: bool
) -> None:
    """Raised from ``__reduce__`` during ``put``: the put raises it and publishes nothing, and the
    next message is intact. Raised from ``__setstate__`` during ``get``: an ``Exception`` becomes
    ``DeserializationError`` for that message only (consumed, as documented); any other
    ``BaseException`` propagates and takes nothing, so the next ``get`` returns that message."""
    async with ab.open_writer(capacity=128, slot_bytes=4096) as writer:
        async with ab.open_reader(writer.handle) as reader:
            expected: list[Any] = []
            for i in range(6):
                if i == 2 and where == "reduce":
                    exc = Boom.armed["reduce"] = make()
                    with pytest.raises(ab.SerializationError if isinstance(exc, Exception) else type(exc)):
                        await writer.put(_message(i, big))
                    assert Boom.armed["reduce"] is None
                    continue
                await writer.put(_message(i, big))
                expected.append(_message(i, big))
            if where == "setstate":
                Boom.armed_for = 2
                Boom.armed["setstate"] = make()
            got: list[Any] = []
            errors: list[tuple[str, int]] = []  # what a get raised, and after how many messages
            while len(got) + errors.count(("consumed", 2)) < len(expected):
                try:
                    got.append(await reader.get())
                except ab.DeserializationError as exc:
                    assert exc.msg_index == 2
                    errors.append(("consumed", len(got)))
                except (KeyboardInterrupt, SystemExit, _Cancel):
                    errors.append(("kept", len(got)))
            Boom.armed.update(reduce=None, setstate=None)
            if where == "setstate" and isinstance(make(), Exception):
                # Reported in its place, after messages 0 and 1; consumed.
                assert errors == [("consumed", 2)]
                del expected[2]
            elif where == "setstate":
                # Propagated by a get no later than the one that would have returned message 2
                # (a reader may decode a few ahead), taking nothing: every message comes after.
                assert len(errors) == 1 and errors[0][0] == "kept" and errors[0][1] <= 2
            else:
                assert errors == []
            assert got == expected
            for msg in got:  # the memo still links the repeated objects
                assert msg[0] is msg[2] and msg[1] is msg[3]
            with pytest.raises(ab.WouldBlock):
                reader.get_nowait()


@pytest.mark.parametrize("make", INJECTED[:3], ids=INJECTED_IDS[:3])
async def test_an_exception_at_every_await_of_put_and_get_loses_nothing(
    anyio_backend: Any, make: Callable[[], BaseException]
) -> None:
    """Cancellation at each await of a blocked ``put`` and a parked ``get`` (deadlines of several
    lengths, on every backend), and ``make()`` thrown into the coroutine at each of its first
    awaits (asyncio: trio forbids throwing into a task behind its back): every message reaches the
    reader once, in order, and both ends stay usable."""
    throw = anyio_backend[0] == "asyncio"
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle) as reader:
            src = reader._src
            assert isinstance(src, ShmSource)
            for i in range(4):
                await writer.put(i)
            # The ring is full: put waits. Wake the writer spuriously every few ms, so that its
            # wait goes round (each round is another await to interrupt) without ever having room.
            async with anyio.create_task_group() as tg:
                tg.start_soon(_every_ms, lambda: src._outbox.wake(src.cursor.writer_sock))
                for delay in (0, 0.0001, 0.002, 0.02):
                    with anyio.move_on_after(delay):
                        await writer.put(99)
                        pytest.fail("the ring is full: put must wait")
                for n in range(1, 6) if throw else ():
                    assert await _throw_at(lambda: writer.put(98), n, make())
                tg.cancel_scope.cancel()
            assert [await reader.get() for _ in range(4)] == [0, 1, 2, 3]
            with pytest.raises(ab.WouldBlock):
                reader.get_nowait()
            # get waits now (nothing published): interrupt it the same ways.
            async with anyio.create_task_group() as tg:
                tg.start_soon(_every_ms, writer._ch.pub.wake_all_readers)
                for delay in (0, 0.0001, 0.002, 0.02):
                    with anyio.move_on_after(delay):
                        await reader.get()
                        pytest.fail("nothing was published: get must wait")
                for n in range(1, 6) if throw else ():
                    assert await _throw_at(reader.get, n, make())
                tg.cancel_scope.cancel()
            for i in range(4, 8):
                await writer.put(i)
            assert [await reader.get() for _ in range(4)] == [4, 5, 6, 7]
            with pytest.raises(ab.WouldBlock):
                reader.get_nowait()
            assert writer._ch.seg.words[_layout.W_WAIT_TARGET] == 0


async def _every_ms(poke: Callable[[], object]) -> None:
    while True:
        await anyio.sleep(0.002)
        poke()


class _Suspend:
    """Hands what an inner coroutine yielded to the event loop, and the loop's answer back."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Any:
        return (yield self.value)


async def _throw_at(call: Callable[[], Any], n: int, exc: BaseException) -> bool:
    """Drive ``call()`` and throw ``exc`` into it at its ``n``-th suspension. True if it raised
    ``exc`` from there; fails if it swallowed it or finished before its ``n``-th suspension."""
    it = call().__await__()
    answer: Any = None
    for _ in range(n - 1):
        answer = await _Suspend(it.send(answer))
    it.send(answer)  # the n-th suspension: its awaitable is dropped, never handed to the loop
    try:
        it.throw(exc)
    except BaseException as raised:
        return raised is exc
    it.close()
    pytest.fail(f"the call swallowed {exc!r} thrown at its suspension {n}")


#: What runs while a message is copied into the ring and published (the put's own bookkeeping
#: around it, taking and releasing its locks, is not interrupted here).
_PUBLISHING = in_functions(
    ("aiobroadcast._shm.publisher", "aiobroadcast._shm.fragments", "aiobroadcast._shm.records"),
    ("publish", "publish_many", "write", "copy_into", "wake_readers", "wake_sleepers"),
)


def _interrupt_at_line(n: int, call: Callable[[], object]) -> bool:
    """``interrupt_at_line`` while publishing."""
    return interrupt_at_line(n, call, _PUBLISHING)


@pytest.mark.parametrize("size", [100, 70_000], ids=["one-slot", "fragments"])
@pytest.mark.parametrize("policy", ["block", "lag"])
async def test_a_ctrl_c_at_any_line_of_a_publish_keeps_the_stream_whole(size: int, policy: str) -> None:
    """Ctrl-C can land between any two lines of a publish. Whatever line it lands on, the reader
    then gets that message whole or not at all (whole only if it landed after the commit), and
    every later message arrives, in order, once: the writer's counters follow the ring."""
    async with ab.open_writer(capacity=64, slot_bytes=4096, policy="lag" if policy == "lag" else "block") as writer:
        async with ab.open_reader(writer.handle) as reader:
            n = 0
            outcomes = {"not published": 0, "published": 0}
            while True:
                n += 1
                message = ("m", n, b"p" * size)
                interrupted = _interrupt_at_line(n, lambda: writer.put_nowait(message))  # noqa: B023
                writer.put_nowait(("after", n, b""))
                got = []
                while True:
                    try:
                        kind, k, payload = reader.get_nowait()
                    except ab.WouldBlock:
                        break
                    assert k == n and payload == (b"p" * size if kind == "m" else b"")
                    got.append(kind)
                if not interrupted:
                    assert got == ["m", "after"]
                    break
                assert got in (["after"], ["m", "after"]), (n, got)
                outcomes["published" if got[0] == "m" else "not published"] += 1
            # The interrupt landed before the commit on most lines, and after it on a few.
            assert outcomes["not published"] > outcomes["published"] > 0, outcomes
            assert writer.statistics().sent == n + 1 + outcomes["published"]


# --- errors a user can fix are BroadcastErrors -------------------------------------------------
@pytest.mark.parametrize(
    ("update", "match"),
    [
        ({"directory": "/dev/shm\0x"}, "directory"),
        ({"directory": "relative/dir"}, "directory"),
        ({"directory": "/" + "d" * 200}, "directory"),
        ({"tcp": "tcp://127.0.0.1"}, "tcp"),
        ({"tcp": "tcp://127.0.0.1:99999"}, "tcp"),
        ({"tcp": "udp://127.0.0.1:5555"}, "tcp"),
        ({"tcp": "tcp://:5555"}, "tcp"),
    ],
)
async def test_a_bad_handle_is_an_invalid_handle(update: dict[str, Any], match: str) -> None:
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        data = writer.handle.model_dump()
        data.update(update)
        with pytest.raises(ab.InvalidHandle, match=match):
            ab.Handle.parse(data)
        with pytest.raises(ab.InvalidHandle, match=match):
            async with ab.open_reader(ab.Handle.model_construct(**data)):
                pass


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"directory": "/dev/shm\0x"}, "directory"),
        ({"directory": "/" + "d" * 200}, "directory"),
        ({"directory": "/nonexistent-aiobroadcast-dir"}, "nonexistent"),
        ({"tcp": "tcp://127.0.0.1"}, "port"),
        ({"tcp": "tcp://127.0.0.1:70000"}, "port"),
        ({"capacity": 1}, "capacity"),
    ],
)
async def test_bad_writer_arguments_are_broadcast_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ab.BroadcastError, match=match) as info:
        async with ab.open_writer(**kwargs):
            pass
    assert info.value.__class__.__module__.startswith("aiobroadcast")


async def test_a_directory_without_write_permission_is_a_broadcast_error() -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as short:  # socket paths must fit
        if os.geteuid() == 0:
            # root writes anywhere: use a directory that is a file instead
            target = Path(short) / "f"
            target.write_text("")
        else:
            target = Path(short) / "ro"
            target.mkdir(mode=0o500)
        with pytest.raises(ab.BroadcastError, match="cannot create the channel's segment"):
            async with ab.open_writer(directory=str(target)):
                pass


async def test_an_unreachable_tcp_endpoint_in_a_handle_is_a_transport_error() -> None:
    async with ab.open_writer(capacity=4, slot_bytes=256, tcp="tcp://127.0.0.1:0") as writer:
        data = writer.handle.model_dump()
        data["tcp"] = "tcp://no-such-host.invalid:5555"
        with pytest.raises(ab.TransportError):
            async with ab.open_reader(ab.Handle.parse(data), transport="tcp", connect_timeout=1.0):
                pass


# --- statistics: one definition of whom the writer waits for -----------------------------------
async def test_waiting_for_is_the_readers_below_the_writers_wait_target(one_slot_per_get: None) -> None:
    """The blocked writer waits for the slack it asked for (a quarter of the ring), not for one
    slot: a reader that freed one slot is still listed, as `aiobroadcast stats` lists it."""
    async with ab.open_writer(capacity=16, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle, name="slow") as slow:
            for i in range(16):
                await writer.put(i)
            async with anyio.create_task_group() as tg:
                tg.start_soon(writer.put, 16)
                await _until(lambda: writer.statistics().tasks_waiting == 1)
                await anyio.sleep(0.05)
                assert slow.get_nowait() == 0  # one slot free: the writer still waits (for 4)
                stats = writer.statistics()
                assert [r.name for r in stats.waiting_for] == ["slow"]
                target = writer._ch.seg.words[_layout.W_WAIT_TARGET]
                assert target == stats.head + 1 + 16 // 4 - 16
                for _ in range(4):
                    slow.get_nowait()
            assert writer.statistics().waiting_for == ()


async def _until(cond: Callable[[], bool]) -> None:
    with anyio.fail_after(10):
        while not cond():  # noqa: ASYNC110 - polls another object's state
            await anyio.sleep(0.005)


# --- sweep_stale touches only what it owns ---------------------------------------------------
def test_sweep_follows_no_symlink_and_opens_no_foreign_file(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    d = tmp_path / "shm"
    d.mkdir()
    name = "aiobroadcast-" + "a" * 32
    (d / name).symlink_to(victim)
    fifo = d / ("aiobroadcast-" + "b" * 32)
    os.mkfifo(fifo)  # opening a FIFO read-write would succeed; a sweep must not even try
    old = 1_000_000_000
    os.utime(d / name, (old, old), follow_symlinks=False)
    os.utime(fifo, (old, old))
    assert _segment.sweep_stale(str(d)) == []
    assert victim.read_bytes() == b"precious"
    assert (d / name).is_symlink() and fifo.exists()


@pytest.mark.parametrize("policy", ["block", "lag"])
def test_a_ctrl_c_at_any_line_of_a_put_many_publishes_whole_messages_in_order(policy: str) -> None:
    """Ctrl-C can land between any two lines of a ``put_many``'s copy into the ring. The reader
    then gets a prefix of the batch, each message whole (those committed before the interrupt),
    and every later message in order, once."""
    sizes = [100, 9_000, 100]  # one slot, three slots, one slot
    with (
        blocking.open_writer(capacity=64, slot_bytes=4096, policy=policy) as writer,  # type: ignore[call-overload]
        blocking.open_reader(writer.handle) as reader,
    ):
        n = 0
        prefixes: dict[int, int] = {}
        while True:
            n += 1
            batch = [("m", n, k, b"p" * size) for k, size in enumerate(sizes)]
            interrupted = _interrupt_at_line(n, lambda: writer.put_many(batch))  # noqa: B023
            writer.put_nowait(("after", n, 0, b""))
            got = []
            while True:
                try:
                    kind, k, i, payload = reader.get_nowait()
                except ab.WouldBlock:
                    break
                assert k == n and payload == (b"p" * sizes[i] if kind == "m" else b"")
                got.append(i if kind == "m" else "after")
            assert got[-1] == "after" and got[:-1] == list(range(len(got) - 1)), (n, got)
            if not interrupted:
                assert got == [0, 1, 2, "after"]
                break
            prefixes[len(got) - 1] = prefixes.get(len(got) - 1, 0) + 1
        # Interrupts landed before any commit, and between the messages' commits.
        assert prefixes.get(0, 0) > 0 and sum(v for p, v in prefixes.items() if p > 0) > 0, prefixes
