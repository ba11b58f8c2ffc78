"""The blocking API (``aiobroadcast.blocking``): the same channel and guarantees without an event
loop, mixed with async roles, shared by threads, over shared memory and TCP."""

from __future__ import annotations

import dataclasses
import inspect
import os
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import pytest
from _blocking_workers import collect_proc, wait_until, writer_proc
from _workers import Backend, ReaderOpts, WriterSpec, spawn
from _workers import collect_proc as async_collect_proc
from _workers import writer_proc as async_writer_proc
from pydantic import BaseModel

import aiobroadcast as ab
from aiobroadcast import blocking
from aiobroadcast._base import tuning as _tuning
from aiobroadcast._broadcast.reader_open import ReaderOptions, _ReaderSpec
from aiobroadcast._broadcast.writer_open import WriterOptions, _WriterSpec

#: Generous bound for "it happens" (never a performance claim): a loaded 2-core CI machine.
WITHIN_S = 15.0


class Call(threading.Thread):
    """Run ``fn()`` in a thread; ``result()`` returns what it returned or raises what it raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self._fn = fn
        self._out: tuple[bool, Any] | None = None
        self.start()

    def run(self) -> None:
        try:
            self._out = (True, self._fn())
        except BaseException as exc:
            self._out = (False, exc)

    def result(self, within_s: float = WITHIN_S) -> Any:
        self.join(within_s)
        assert not self.is_alive(), f"the call did not return within {within_s} s"
        assert self._out is not None
        ok, value = self._out
        if not ok:
            raise value
        return value


def test_roundtrip_nowait_iteration_and_end() -> None:
    with blocking.open_writer(capacity=4, slot_bytes=256) as writer:
        with blocking.open_reader(writer.handle, name="r") as reader:
            with pytest.raises(ab.WouldBlock):
                reader.get_nowait()
            writer.put({"step": 1})
            writer.put_nowait("two")
            assert reader.get() == {"step": 1}
            assert reader.get_nowait() == "two"
            for i in range(4):
                writer.put_nowait(i)
            with pytest.raises(ab.WouldBlock):  # the ring is full and the reader is alive
                writer.put_nowait(99)
            assert writer.statistics().sent == 6
            assert reader.statistics().received == 2
            writer.close()
            assert list(reader) == [0, 1, 2, 3]  # drains, then ends cleanly
            with pytest.raises(ab.EndOfStream):
                reader.get()
        with pytest.raises(ab.ClosedResourceError):
            reader.get_nowait()
    with pytest.raises(ab.ClosedResourceError):
        writer.put(1)


def test_get_timeout_is_a_timeout_error_and_takes_nothing() -> None:
    with blocking.open_writer(capacity=4, slot_bytes=256) as writer, blocking.open_reader(writer.handle) as reader:
        start = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            reader.get(timeout=0.05)
        assert time.monotonic() - start >= 0.05
        assert isinstance(info.value, ab.WaitTimeout) and isinstance(info.value, ab.WouldBlock)
        # Field note 4 (vLLM #41357): a negative timeout is "now", never "forever".
        late = Call(lambda: reader.get(timeout=-1.0))
        with pytest.raises(ab.WaitTimeout):
            late.result()
        with pytest.raises(ab.WaitTimeout):
            reader.get(timeout=0)
        writer.put("kept")
        assert reader.get(timeout=0) == "kept"  # a ready message is taken even with no time left
        assert reader.statistics().received == 1


def test_put_timeout_publishes_nothing() -> None:
    with blocking.open_writer(capacity=2, slot_bytes=256) as writer, blocking.open_reader(writer.handle) as reader:
        writer.put(0)
        writer.put(1)
        with pytest.raises(ab.WaitTimeout):
            writer.put(2, timeout=0.05)
        with pytest.raises(TimeoutError):
            writer.put(b"x" * 5000, timeout=-5)  # larger than the ring: nothing of it is published
        assert writer.statistics().sent == 2
        assert [reader.get(), reader.get()] == [0, 1]
        writer.put(3, timeout=1)
        assert reader.get(timeout=WITHIN_S) == 3


@pytest.mark.anyio
async def test_a_blocking_writer_feeds_async_and_blocking_readers_in_other_processes(
    anyio_backend: Backend,
) -> None:
    """One channel, a blocking writer (in a process with no event loop), and readers of both
    kinds: an async one here, an async one and a blocking one in processes of their own. Every
    reader gets every message in order, then the end."""
    count = 300
    with spawn(writer_proc, count, 4, 256) as writer:
        handle = await writer.recv("handle")
        async with ab.open_reader(handle, name="async-here") as here:
            with (
                spawn(async_collect_proc, anyio_backend, handle, ReaderOpts(name="async-child")) as async_child,
                spawn(collect_proc, handle, "blocking-child") as blocking_child,
            ):
                await async_child.recv("attached")
                await blocking_child.recv("attached")
                writer.send("go")
                got = [obj async for obj in here]
                assert await writer.recv("sent") == count
                expected = [("msg", i) for i in range(count)]
                assert (await async_child.recv("events"))["events"] == [*expected, ("end",)]
                assert await blocking_child.recv("events") == [*expected, ("end",)]
        assert got == list(range(count))
        assert await writer.recv("closed")


@pytest.mark.anyio
async def test_an_async_writer_feeds_blocking_readers_in_threads_and_processes(anyio_backend: Backend) -> None:
    """The other way round: an async writer on this event loop, blocking readers parked in
    threads of this process (they sleep in poll() on the same sockets) and in another process."""
    count = 300
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        handle = writer.handle
        readers = [blocking.open_reader(handle, name=f"thread-{k}") for k in range(2)]
        try:
            calls = [Call(lambda r=r: list(r)) for r in readers]  # type: ignore[misc]
            with spawn(collect_proc, handle.to_json(), "blocking-child") as child:
                await child.recv("attached")
                for i in range(count):
                    await writer.put(i)
                await writer.aclose()
                assert await child.recv("events") == [*[("msg", i) for i in range(count)], ("end",)]
            for call in calls:
                assert await anyio.to_thread.run_sync(call.result) == list(range(count))
        finally:
            for r in readers:
                r.close()


def test_threads_share_one_reader_and_each_message_goes_to_one_of_them() -> None:
    """Field note 6 (vLLM #50398, #50548): several threads on one reader. Each message is taken
    by exactly one thread, none is lost, and each thread sees its messages in order."""
    count, threads = 3000, 4
    with blocking.open_writer(capacity=8, slot_bytes=256) as writer:
        with blocking.open_reader(writer.handle) as reader:
            calls = [Call(lambda: list(reader)) for _ in range(threads)]
            for i in range(count):
                writer.put(i)
            writer.close()
            parts = [call.result() for call in calls]
    assert sorted(x for part in parts for x in part) == list(range(count))
    for part in parts:
        assert part == sorted(part)


def test_threads_share_one_writer_and_messages_stay_whole() -> None:
    """Several threads put on one writer (some messages larger than the ring): every message
    arrives whole, once, and each thread's messages in its order."""
    per_thread, threads = 300, 4
    with blocking.open_writer(capacity=4, slot_bytes=256) as writer:
        with blocking.open_reader(writer.handle) as reader:

            def produce(t: int) -> None:
                for i in range(per_thread):
                    writer.put((t, i, bytes([t]) * (i % 7 * 300)))

            calls = [Call(lambda t=t: produce(t)) for t in range(threads)]  # type: ignore[misc]
            got = [reader.get(timeout=WITHIN_S) for _ in range(per_thread * threads)]
            for call in calls:
                call.result()
    for t in range(threads):
        mine = [(i, body) for (tt, i, body) in got if tt == t]
        assert mine == [(i, bytes([t]) * (i % 7 * 300)) for i in range(per_thread)]


def test_two_threads_parked_on_one_reader_both_get_a_message() -> None:
    """vLLM #50398: two threads wait on one reader; two messages wake both."""
    with blocking.open_writer(capacity=4, slot_bytes=256) as writer, blocking.open_reader(writer.handle) as reader:
        calls = [Call(reader.get) for _ in range(2)]
        wait_until(lambda: reader.statistics().tasks_waiting == 2)
        wait_until(lambda: writer.statistics().readers[0].sleeping)  # parked on its socket
        writer.put("a")
        writer.put("b")
        assert sorted(call.result() for call in calls) == ["a", "b"]


def test_a_parked_reader_sleeps_on_its_socket_and_wakes_for_the_next_message() -> None:
    with blocking.open_writer(capacity=4, slot_bytes=256) as writer:
        with blocking.open_reader(writer.handle, name="parked") as reader:
            call = Call(reader.get)
            wait_until(lambda: writer.statistics().readers[0].sleeping)
            time.sleep(0.2)
            assert call.is_alive()
            writer.put("wake")
            assert call.result() == "wake"


def test_close_wakes_a_parked_get_and_a_blocked_put() -> None:
    with blocking.open_writer(capacity=2, slot_bytes=256) as writer:
        reader = blocking.open_reader(writer.handle)
        parked = Call(reader.get)
        wait_until(lambda: reader.statistics().tasks_waiting == 1)
        reader.close()
        with pytest.raises(ab.ClosedResourceError):
            parked.result()
        with blocking.open_reader(writer.handle, name="stuck") as stuck:
            writer.put(0)
            writer.put(1)
            blocked = Call(lambda: writer.put(2))
            wait_until(lambda: [r.name for r in writer.statistics().waiting_for] == ["stuck"])
            assert writer.statistics().tasks_waiting == 1
            writer.close()
            with pytest.raises(ab.ClosedResourceError):
                blocked.result()
            assert list(stuck) == [0, 1]  # what was published, then the end; nothing of the put


class Reentrant:
    """Pickling it publishes on the writer it is being published on."""

    def __init__(self, writer: blocking.BlockingWriter[Any], how: str) -> None:
        self.writer = writer
        self.how = how
        self.outcome = ""

    def __getstate__(self) -> dict[str, str]:
        try:
            if self.how == "put_nowait":
                self.writer.put_nowait("inner")
            elif self.how == "put":
                self.writer.put("inner")
            else:
                self.writer.close()
            self.outcome = "published"
        except ab.WouldBlock as exc:
            self.outcome = f"WouldBlock: {exc}"
        return {"how": self.how, "outcome": self.outcome}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__dict__.update(state)


@pytest.mark.parametrize("how", ["put_nowait", "put", "close"])
def test_a_reentrant_call_from_pickling_raises_would_block_not_deadlock(how: str) -> None:
    """Field notes, "Liveness and fork": a ``__getstate__`` that publishes on the writer that is
    pickling it. The inner call raises WouldBlock (never a deadlock or a crash); the outer put
    publishes the object."""
    with blocking.open_writer(capacity=4, slot_bytes=1024) as writer, blocking.open_reader(writer.handle) as reader:
        obj = Reentrant(writer, how)
        Call(lambda: writer.put(obj)).result()
        got = reader.get(timeout=WITHIN_S)
        assert got.how == how and got.outcome.startswith("WouldBlock")
        writer.put("after")  # the writer is still usable
        assert reader.get(timeout=WITHIN_S) == "after"


ASYNCIO_ONLY = pytest.mark.parametrize("anyio_backend", [("asyncio", {"use_uvloop": False})], ids=["asyncio"])


@pytest.mark.anyio
@ASYNCIO_ONLY
async def test_a_dead_writer_gives_writer_gone_after_its_messages(anyio_backend: Backend) -> None:
    n = 5
    with spawn(async_writer_proc, anyio_backend, WriterSpec(capacity=8, count=n, then="hang")) as writer:
        handle = await writer.recv("handle")
        with blocking.open_reader(handle, name="survivor") as reader:
            writer.send("go")
            assert await writer.recv("sent") == n
            got = [reader.get(timeout=WITHIN_S) for _ in range(n)]
            parked = Call(reader.get)
            await anyio.sleep(0.1)
            writer.sigkill()
            with pytest.raises(ab.WriterGone) as info:
                await anyio.to_thread.run_sync(parked.result)
    assert got == list(range(n))
    assert info.value.pid == writer.pid
    path = ab.Handle.parse(handle).path
    age = time.time() - os.stat(path).st_mtime
    await anyio.sleep(max(0.0, _tuning.STALE_MIN_AGE_S + 0.2 - age))
    assert path in ab.sweep_stale(os.path.dirname(path))  # the dead writer's files go


@pytest.mark.anyio
@ASYNCIO_ONLY
async def test_a_dead_reader_does_not_hold_a_blocking_writer(anyio_backend: Backend) -> None:
    """Field note 7 (vLLM #45644): a reader process dies while the blocking writer waits for
    it; the put goes on once the reader is found dead, and the writer names it."""
    with blocking.open_writer(capacity=2, slot_bytes=256) as writer:
        opts = ReaderOpts(name="doomed", stop_after=1)
        with spawn(async_collect_proc, anyio_backend, writer.handle.to_json(), opts) as doomed:
            await doomed.recv("attached")
            writer.put(0)
            assert await doomed.recv("stalled") == 1
            writer.put(1)
            writer.put(2)
            blocked = Call(lambda: writer.put(3))
            await anyio.to_thread.run_sync(
                lambda: wait_until(lambda: [r.name for r in writer.statistics().waiting_for] == ["doomed"])
            )
            doomed.sigkill()
            await anyio.to_thread.run_sync(blocked.result)
        stats = writer.statistics()
        assert stats.dropped_readers == 1 and stats.readers == ()


class Tick(BaseModel):
    price: float


def test_schema_zero_copy_and_lag_policy_behave_as_in_the_async_api() -> None:
    with blocking.open_writer(schema=Tick) as ticks, blocking.open_reader(ticks.handle, schema=Tick) as tick_reader:
        ticks.put(Tick(price=1.5))
        tick: Tick = tick_reader.get()
        assert tick == Tick(price=1.5)
    with blocking.open_writer(capacity=4, slot_bytes=1 << 18) as writer:
        with blocking.open_reader(writer.handle, zero_copy=True) as reader:
            writer.put(b"z" * (1 << 17))
            view = reader.get()
            assert isinstance(view, memoryview) and view.readonly and bytes(view[:3]) == b"zzz"
            del view
    with blocking.open_writer(capacity=2, slot_bytes=256, policy="lag") as writer:
        with blocking.open_reader(writer.handle) as reader:
            for i in range(5):
                writer.put(i)  # never waits under "lag"
            with pytest.raises(ab.ReaderLagged) as info:
                reader.get()
            assert info.value.missed == 3
            assert [reader.get(), reader.get()] == [3, 4]


@pytest.mark.parametrize("insecure", [False, True], ids=["curve", "hmac"])
def test_over_tcp_a_blocking_reader_waits_on_its_transports_socket(insecure: bool) -> None:
    with blocking.open_writer(capacity=8, slot_bytes=256, tcp="tcp://127.0.0.1:0", insecure=insecure) as writer:
        with blocking.open_reader(writer.handle, transport="tcp", name="remote") as reader:
            wait_until(lambda: any(r.transport == "tcp" for r in writer.statistics().readers))
            parked = Call(reader.get)
            time.sleep(0.1)
            writer.put("first")
            assert parked.result() == "first"
            for i in range(200):
                writer.put(i)
            assert [reader.get(timeout=WITHIN_S) for _ in range(200)] == list(range(200))
            with pytest.raises(ab.WaitTimeout):
                reader.get(timeout=0.05)
            writer.close()
            with pytest.raises(ab.EndOfStream):
                reader.get(timeout=WITHIN_S)


def test_over_tcp_close_wakes_a_parked_get() -> None:
    with blocking.open_writer(capacity=8, slot_bytes=256, tcp="tcp://127.0.0.1:0", insecure=True) as writer:
        reader = blocking.open_reader(writer.handle, transport="tcp")
        parked = Call(reader.get)
        wait_until(lambda: reader.statistics().tasks_waiting == 1)
        reader.close()
        with pytest.raises(ab.ClosedResourceError):
            parked.result()


@pytest.mark.anyio
async def test_an_async_tcp_writer_and_a_blocking_tcp_reader(anyio_backend: Backend) -> None:
    async with ab.open_writer(capacity=8, slot_bytes=256, tcp="tcp://127.0.0.1:0") as writer:
        reader = await anyio.to_thread.run_sync(lambda: blocking.open_reader(writer.handle, transport="tcp"))
        try:
            call = Call(lambda: [reader.get() for _ in range(50)])
            for i in range(50):
                await writer.put(i)
            assert await anyio.to_thread.run_sync(call.result) == list(range(50))
        finally:
            reader.close()


def test_roles_have_no_foreign_methods_and_cannot_be_built_directly() -> None:
    with blocking.open_writer(capacity=4, slot_bytes=256) as writer, blocking.open_reader(writer.handle) as reader:
        for attr in ("get", "get_nowait", "__iter__", "__next__"):
            assert not hasattr(writer, attr)
        for attr in ("put", "put_nowait"):
            assert not hasattr(reader, attr)
    with pytest.raises(TypeError, match="open_writer"):
        blocking.BlockingWriter(object(), None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="open_reader"):
        blocking.BlockingReader(object(), None, None, "x")  # type: ignore[arg-type]
    for cls in (blocking.BlockingWriter, blocking.BlockingReader):
        assert getattr(cls, "__final__", False) is True


def test_no_role_of_either_front_end_can_be_pickled() -> None:
    """A role is this process's: pickling one (to send it to another process) raises the
    package's own error, saying what to send instead, for the blocking roles as for the async."""

    async def async_roles() -> None:
        async with ab.open_writer(capacity=4, slot_bytes=256) as writer, ab.open_reader(writer.handle) as reader:
            for role, kind in ((writer, "Writer"), (reader, "Reader")):
                with pytest.raises(ab.BroadcastError, match=f"a {kind} cannot be pickled.*send {kind.lower()}.handle"):
                    pickle.dumps(role)

    anyio.run(async_roles)
    with blocking.open_writer(capacity=4, slot_bytes=256) as writer, blocking.open_reader(writer.handle) as reader:
        for role, kind in ((writer, "Writer"), (reader, "Reader")):
            match = f"a Blocking{kind} cannot be pickled.*send {kind.lower()}.handle"
            with pytest.raises(ab.BroadcastError, match=match):
                pickle.dumps(role)
        writer.put(1)
        assert reader.get(timeout=10) == 1  # nothing was touched


def test_the_blocking_factories_take_the_async_ones_arguments_and_defaults() -> None:
    """``blocking.open_writer(**options)`` is ``open_writer``'s signature, defaults included."""
    pairs = ((ab.open_writer, _WriterSpec, WriterOptions), (ab.open_reader, _ReaderSpec, ReaderOptions))
    for factory, spec, options in pairs:
        params = inspect.signature(factory).parameters.values()
        keyword = {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
        public = [f for f in dataclasses.fields(spec) if not f.metadata.get("internal")]
        assert {f.name: f.default for f in public} == keyword
        assert set(options.__annotations__) == set(keyword) - {"schema"}


def test_bad_arguments_and_handles_fail_as_in_the_async_api(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="capacity"):
        blocking.open_writer(capacity=1)
    with pytest.raises(ab.InvalidHandle):
        blocking.open_reader("not a handle")
    with blocking.open_writer(capacity=4, slot_bytes=256) as writer:
        with pytest.raises(ValueError, match="transport"):
            blocking.open_reader(writer.handle, transport="udp")  # type: ignore[call-overload]
        with pytest.raises(ab.InvalidHandle, match="trust_pickle"):
            blocking.open_reader(writer.handle, trust_pickle=False)
        with pytest.raises(ab.InvalidHandle, match="no TCP endpoint"):
            blocking.open_reader(writer.handle, transport="tcp")
        with pytest.raises(ab.SerializationError):
            writer.put(lambda: None)
        assert pickle.loads(pickle.dumps(writer.handle)) == writer.handle
    assert not os.path.exists(writer.handle.path)
