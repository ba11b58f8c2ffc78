"""Fan-in (docs/fan-in.md): many senders, one collector, over shared memory; async and blocking
roles, real processes, real kills."""

from __future__ import annotations

import contextlib
import glob
import inspect
import os
import shutil
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from _blocking_workers import recv
from _fanin_workers import CtrlCOnce, Undecodable, collector_proc, remote_writer_proc, sender_proc
from _interrupts import in_functions, interrupt_at_line
from _workers import Child, spawn
from pydantic import BaseModel

import aiobroadcast as ab
from aiobroadcast import blocking
from aiobroadcast._base import tuning as _tuning
from aiobroadcast._shm import segment as _segment
from aiobroadcast.blocking import BlockingSender

#: Generous bound for "it happens" (never a performance claim): a loaded 2-core machine.
WITHIN_S = 15.0


@pytest.fixture
def anyio_backend() -> Any:
    """Most tests here run on asyncio alone; the round trip runs on every backend."""
    return ("asyncio", {"use_uvloop": False})


def _sorted(deliveries: list[Any]) -> tuple[dict[str, list[Any]], list[Any]]:
    items: dict[str, list[Any]] = {}
    events = []
    for d in deliveries:
        if isinstance(d, ab.Item):
            items.setdefault(d.source, []).append(d.value)
        else:
            events.append(d)
    return items, events


@pytest.mark.parametrize(
    "anyio_backend",
    [("asyncio", {"use_uvloop": False}), ("asyncio", {"use_uvloop": True}), ("trio", {})],
    ids=["asyncio", "uvloop", "trio"],
)
@pytest.mark.anyio
async def test_items_carry_their_source_in_order_and_each_close_is_reported_once() -> None:
    async with ab.open_collector(expect=["a", "b"], capacity=8, slot_bytes=256) as collector:

        async def send(name: str, n: int) -> None:
            async with ab.open_sender(collector.handle, name=name) as sender:
                for i in range(n):
                    await sender.put(i)
                await sender.put_many([n, n + 1])

        got = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(send, "a", 300)
            tg.start_soon(send, "b", 200)
            with anyio.fail_after(WITHIN_S):
                got = [d async for d in collector]  # ends: both expected senders closed
        items, events = _sorted(got)
        assert items == {"a": list(range(302)), "b": list(range(202))}
        assert sorted(events, key=repr) == [ab.SourceClosed("a"), ab.SourceClosed("b")]
        # Each close comes after that sender's last item.
        for name in ("a", "b"):
            last = max(i for i, d in enumerate(got) if isinstance(d, ab.Item) and d.source == name)
            assert got.index(ab.SourceClosed(name)) > last
        stats = collector.statistics()
        assert (stats.received, stats.closed, stats.gone, stats.senders) == (504, 2, 0, ())
        with pytest.raises(ab.EndOfStream):
            collector.get_nowait()


@pytest.mark.anyio
async def test_a_flooding_sender_cannot_starve_a_slow_one() -> None:
    """Turns: the flooder's full ring is served at most a batch at a time before the next sender."""
    async with ab.open_collector(capacity=256, slot_bytes=128) as collector:
        async with (
            ab.open_sender(collector.handle, name="flood") as flood,
            ab.open_sender(collector.handle, name="slow") as slow,
        ):
            for round_ in range(5):
                n = 0
                while True:  # fill the flooder's ring
                    try:
                        flood.put_nowait(n)
                    except ab.WouldBlock:
                        break
                    n += 1
                assert n >= 200
                # The flooder has the turn (the slow sender had nothing); then the slow one puts.
                first = await collector.get()
                assert isinstance(first, ab.Item)
                assert first.source == "flood"
                await slow.put(f"slow-{round_}")
                taken = []
                with anyio.fail_after(WITHIN_S):
                    while True:
                        d = await collector.get()
                        taken.append(d)
                        if isinstance(d, ab.Item) and d.source == "slow":
                            break
                # Served within the flooder's turn (32 items at most), not after its 200+.
                assert len(taken) <= 32, len(taken)
                while True:  # drain the flooder before the next round
                    try:
                        collector.get_nowait()
                    except ab.WouldBlock:
                        break


@pytest.mark.anyio
async def test_a_killed_sender_is_reported_once_with_its_name_and_the_others_go_on() -> None:
    async with ab.open_collector(expect=["k", "ok"], capacity=16, slot_bytes=256) as collector:
        h = collector.handle.to_json()
        with spawn(sender_proc, h, "k", 50, "hang") as doomed, spawn(sender_proc, h, "ok", 2000, "close") as fine:
            got: list[Any] = []
            killed_at = 0.0

            async def kill_when_sent() -> None:
                nonlocal killed_at
                await doomed.recv("attached")
                await doomed.recv("sent")
                doomed.sigkill()
                killed_at = time.monotonic()

            async with anyio.create_task_group() as tg:
                tg.start_soon(kill_when_sent)
                with anyio.fail_after(WITHIN_S):
                    got.extend([(d, time.monotonic()) async for d in collector])
            await fine.recv("attached")
            await fine.recv("closed")
        items, events = _sorted([d for d, _ in got])
        assert items == {"k": [("k", i) for i in range(50)], "ok": [("ok", i) for i in range(2000)]}
        assert sorted(events, key=repr) == [ab.SourceClosed("ok"), ab.SourceGone("k", doomed.pid)]
        gone_at = next(t for d, t in got if isinstance(d, ab.SourceGone))
        assert gone_at - killed_at < 5.0  # about a second: the collector's liveness period is 0.5 s


@pytest.mark.anyio
async def test_put_raises_collector_gone_once_the_collector_closes() -> None:
    collector = await ab.open_collector(capacity=4, slot_bytes=256)
    async with ab.open_sender(collector.handle, name="s") as sender:
        await sender.put(1)
        assert isinstance(await collector.get(), ab.Item)
        await collector.aclose()
        with pytest.raises(ab.CollectorGone, match="closed or died"):
            await sender.put(2)
        with pytest.raises(ab.CollectorGone):
            sender.put_nowait(3)


@pytest.mark.parametrize("method", ["put", "put_nowait", "put_many"])
@pytest.mark.parametrize("taken", [True, False], ids=["taken", "left"])
def test_a_put_whose_item_the_collector_took_before_it_closed_returns(method: str, taken: bool) -> None:
    """The collector takes the item just published, then closes, before the sender looks at its
    place again: the item was delivered, so the put returns (a worker's reply to the pool's last
    call, then ``Caller.aclose``, raced so). The next put raises ``CollectorGone``. A collector
    that leaves without taking the item still makes that put raise: "not taken". The close is
    made to land between the publish and the sender's look after it, where another process's
    would land by chance."""
    one: Any = ["x"] if method == "put_many" else "x"
    with blocking.open_collector(capacity=8, slot_bytes=256) as collector:
        with blocking.open_sender(collector.handle, name="s") as sender:
            publish = getattr(sender._w, method)  # the sender's writer: published once it returns
            got: list[Any] = []

            def publish_then_the_collector_leaves(*args: Any) -> None:
                publish(*args)
                if taken:
                    got.append(collector.get(timeout=WITHIN_S))
                collector.close()

            setattr(sender._w, method, publish_then_the_collector_leaves)
            if taken:
                getattr(sender, method)(one)
                assert got == [ab.Item("s", "x")]
            else:
                with pytest.raises(ab.CollectorGone, match="closed or died"):
                    getattr(sender, method)(one)
            with pytest.raises(ab.CollectorGone):
                getattr(sender, method)(one)


@pytest.mark.parametrize("method", ["put", "put_nowait", "put_many"])
@pytest.mark.parametrize("taken", [True, False], ids=["taken", "left"])
@pytest.mark.anyio
async def test_an_async_put_whose_item_the_collector_took_before_it_closed_returns(method: str, taken: bool) -> None:
    """As the blocking test above, for ``Sender``."""
    one: Any = ["x"] if method == "put_many" else "x"
    collector = await ab.open_collector(capacity=8, slot_bytes=256)
    async with ab.open_sender(collector.handle, name="s") as sender:
        # put publishes through the writer's publish_now (no coroutine of the writer's between).
        target = "publish_now" if method == "put" else method
        publish = getattr(sender._w, target)
        got: list[Any] = []

        async def leave() -> None:
            if taken:
                got.append(collector.get_nowait())
            await collector.aclose()

        if method != "put_many":

            def publish_now(obj: Any) -> Any:
                res = publish(obj)
                # A method without an await: the collector leaves in one step of its coroutine
                # (aclose waits for nothing here; the test fails if it ever does).
                with pytest.raises(StopIteration):
                    leave().send(None)
                return res

            setattr(sender._w, target, publish_now)
        else:

            async def publish_then_leave(obj: Any) -> None:
                await publish(obj)
                await leave()

            setattr(sender._w, method, publish_then_leave)
        call = getattr(sender, method)
        if taken:
            res = call(one)
            if method != "put_nowait":
                await res
            assert got == [ab.Item("s", "x")]
        else:
            with pytest.raises(ab.CollectorGone, match="closed or died"):
                res = call(one)
                if method != "put_nowait":
                    await res
        with pytest.raises(ab.CollectorGone):
            res = call(one)
            if method != "put_nowait":
                await res


@contextlib.contextmanager
def _collector_process() -> Iterator[tuple[Child, str, BlockingSender[Any]]]:
    """A collector in a child process (``collector_proc``), its handle, and a blocking sender to
    it whose first item the collector took; the child is killed and its rendezvous removed at
    the end."""
    with spawn(collector_proc, 4) as child:
        h = recv(child, "handle")
        try:
            with blocking.open_sender(h, name="s") as sender:
                child.send("go")
                sender.put("first")
                recv(child, "took")
                yield child, h, sender
        finally:
            child.cleanup()
            shutil.rmtree(ab.CollectorHandle.parse(h).path, ignore_errors=True)


def test_a_put_blocked_on_a_killed_collector_raises_instead_of_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    with _collector_process() as (child, h, sender):
        for i in range(4):  # fill the ring: the collector takes no more
            sender.put(i)
        failure: list[BaseException] = []

        def put_blocked() -> None:
            try:
                sender.put("more", timeout=WITHIN_S)  # this very put must not succeed
            except BaseException as exc:
                failure.append(exc)

        t = threading.Thread(target=put_blocked, daemon=True)
        t.start()
        time.sleep(0.1)
        assert t.is_alive()  # blocked on the full ring
        os.kill(child.pid, 9)
        killed = time.monotonic()
        t.join(WITHIN_S)
        assert not t.is_alive()
        assert isinstance(failure[0], ab.CollectorGone), failure
        assert time.monotonic() - killed < 5.0
        sender.close()
        # The killed collector's rendezvous is left behind; the next collector opened sweeps it.
        rendezvous = ab.CollectorHandle.parse(h).path
        assert os.path.isdir(rendezvous)
        monkeypatch.setattr(_tuning, "STALE_MIN_AGE_S", 0.0)
        with blocking.open_collector():
            assert not os.path.exists(rendezvous)


@pytest.mark.parametrize("method", ["put", "put_nowait"])
def test_put_and_put_nowait_see_a_collector_killed_with_its_place_active_alike(method: str) -> None:
    """A collector killed while its place in the ring is active (the ring had room) is seen by
    the next put's look at its lock, before that put publishes: it raises ``CollectorGone``,
    nothing published. The put that published before the look was due returns, as any put
    before a death does. ``put_nowait`` as ``put``, on the blocking front end as on the async
    one (it used to look again after publishing, and raise for the item it had published)."""
    with _collector_process() as (child, _, sender):
        publish = getattr(sender._w, method)

        def publish_then_the_collector_dies(*args: Any) -> None:
            publish(*args)
            child.sigkill()
            child.proc.join(WITHIN_S)
            sender._watch.next = 0.0  # the sender's next look at the lock is due now

        setattr(sender._w, method, publish_then_the_collector_dies)
        getattr(sender, method)("second")
        delattr(sender._w, method)
        published = sender._pub.head
        with pytest.raises(ab.CollectorGone, match="closed or died"):
            getattr(sender, method)("third")
        assert sender._pub.head == published  # raised before publishing


@pytest.mark.anyio
async def test_wrong_handle_kinds_and_duplicate_names_are_clear_errors() -> None:
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer, ab.open_collector() as collector:
        with pytest.raises(ab.InvalidHandle, match="broadcast channel's handle"):
            await ab.open_sender(writer.handle, name="s")  # type: ignore[call-overload]
        with pytest.raises(ab.InvalidHandle, match="broadcast channel's handle"):
            await ab.open_sender(writer.handle.to_json(), name="s")
        with pytest.raises(ab.InvalidHandle, match="open_sender"):
            await ab.open_reader(collector.handle)  # type: ignore[call-overload]
        with pytest.raises(ab.InvalidHandle, match="open_sender"):
            await ab.open_reader(collector.handle.to_json())
        with pytest.raises(ab.InvalidHandle, match="open_sender"):
            blocking.open_reader(collector.handle.to_json())
        with pytest.raises(ab.InvalidArgument, match="sender name"):
            await ab.open_sender(collector.handle, name="../x")
        async with ab.open_sender(collector.handle, name="twin"):
            with pytest.raises(ab.InvalidArgument, match="already attached"):
                await ab.open_sender(collector.handle, name="twin")
            with pytest.raises(ab.InvalidArgument, match="already attached"):
                blocking.open_sender(collector.handle, name="twin")
        # Once the first one is reported closed, the name is free again.
        with anyio.fail_after(WITHIN_S):
            assert await collector.get() == ab.SourceClosed("twin")
        async with ab.open_sender(collector.handle, name="twin") as again:
            await again.put("hello")
            assert await collector.get() == ab.Item("twin", "hello")


@pytest.mark.anyio
async def test_roles_have_no_foreign_methods_at_run_time() -> None:
    async with ab.open_collector() as collector, ab.open_sender(collector.handle, name="s") as sender:
        for attr in ("get", "get_nowait", "get_many"):
            with pytest.raises(AttributeError, match="only the collector receives"):
                getattr(sender, attr)
            assert not hasattr(sender, attr)
        for attr in ("put", "put_nowait", "put_many"):
            with pytest.raises(AttributeError, match="open_sender"):
                getattr(collector, attr)
    with blocking.open_collector() as bc, blocking.open_sender(bc.handle, name="s") as bs:
        with pytest.raises(AttributeError, match="only the collector receives"):
            bs.get  # type: ignore[attr-defined]  # noqa: B018
        with pytest.raises(AttributeError, match="only the collector receives"):
            bs.get_many  # type: ignore[attr-defined]  # noqa: B018
        with pytest.raises(AttributeError, match="open_sender"):
            bc.put  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(TypeError, match="open_collector"):
        ab.Collector(object(), None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="open_sender"):
        ab.Sender(object(), None, "s", None)  # type: ignore[arg-type]


class Tick(BaseModel):
    price: float


def test_blocking_roles_threads_and_a_schema() -> None:
    with blocking.open_collector(expect=[f"t{i}" for i in range(3)], schema=Tick, capacity=8) as collector:

        def send(i: int) -> None:
            with blocking.open_sender(collector.handle, name=f"t{i}") as sender:
                for k in range(100):
                    sender.put(Tick(price=i * 1000 + k))
                with pytest.raises(ab.SchemaViolation):  # a schema violation, as open_writer(schema=) has it
                    sender.put("not a tick")
                sender.put_many([Tick(price=-1.0)])

        threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        got = list(collector)  # ends once all three closed
        for t in threads:
            t.join()
        items, events = _sorted(got)
        assert {k: [t.price for t in v] for k, v in items.items()} == {
            f"t{i}": [float(i * 1000 + k) for k in range(100)] + [-1.0] for i in range(3)
        }
        assert sorted(events, key=repr) == [ab.SourceClosed(f"t{i}") for i in range(3)]
        with pytest.raises(ab.EndOfStream):
            collector.get(timeout=0.01)


# --- the reliability classes of the broadcast side, on a sender's ring ---------------------------
@pytest.mark.anyio
async def test_memory_per_sender_is_its_ring_and_nothing_put_before_the_collector_attaches_is_lost() -> None:
    async with ab.open_collector(capacity=8, slot_bytes=128) as collector:
        async with ab.open_sender(collector.handle, name="s") as sender:
            for i in range(8):  # the collector has not attached yet: its reserved place holds them
                sender.put_nowait(i)
            with pytest.raises(ab.WouldBlock):
                sender.put_nowait(8)
            blocked_done = anyio.Event()

            async def put_more() -> None:
                await sender.put(8)
                await sender.put(9)
                blocked_done.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(put_more)
                await anyio.sleep(0.05)
                assert not blocked_done.is_set()  # waits: memory stays bounded by the ring
                got = [await collector.get() for _ in range(10)]
            assert got == [ab.Item("s", i) for i in range(10)]
            assert collector.statistics().senders[0].lag == 0


class Reentrant:
    """Pickling it sends another item first, from inside the sender's own put."""

    def __init__(self, sender: Any) -> None:
        self.sender = sender

    def __reduce__(self) -> Any:
        self.sender.put_nowait("inner")
        return (str, ("outer",))


class CtrlCPickling:
    def __reduce__(self) -> Any:
        raise KeyboardInterrupt


@pytest.mark.anyio
async def test_bad_items_raise_in_the_sender_and_nothing_accepted_is_lost() -> None:
    CtrlCOnce.fired = False
    async with (
        ab.open_collector(capacity=8, slot_bytes=256, max_message_bytes=1000) as collector,
        ab.open_sender(collector.handle, name="s") as sender,
    ):
        await sender.put(1)
        with pytest.raises(ab.MessageTooLarge):
            await sender.put(b"x" * 2000)
        with pytest.raises(ab.SerializationError):
            await sender.put(lambda: None)
        with pytest.raises(KeyboardInterrupt):
            await sender.put(CtrlCPickling())
        await sender.put(Reentrant(sender))  # the inner item is a message of its own, sent first
        await sender.put(CtrlCOnce())
        await sender.put(2)
        # A Ctrl-C while the collector decodes (the batch it takes ahead): nothing is taken, the
        # next get decodes the same items again.
        with pytest.raises(KeyboardInterrupt):
            await collector.get()
        got = [await collector.get() for _ in range(5)]
        assert got == [ab.Item("s", v) for v in (1, "inner", "outer", "decoded", 2)]
        await sender.put(Undecodable())
        await sender.put(3)
        with pytest.raises(ab.DeserializationError) as caught:  # consumed; says whose it was
            await collector.get()
        assert caught.value.source == "s"
        assert await collector.get() == ab.Item("s", 3)
        with pytest.raises(ab.WouldBlock):
            collector.get_nowait()


#: What runs while a sender's item is checked, copied into its ring and published (the put's own
#: locks are left alone, as tests/test_faults.py does for a writer).
_PUBLISHING = in_functions(
    (
        "aiobroadcast._fanin.sender",
        "aiobroadcast._fanin.rendezvous",
        "aiobroadcast._shm.publisher",
        "aiobroadcast._shm.fragments",
        "aiobroadcast._shm.records",
    ),
    ("_check", "publish", "publish_many", "_write_fragments", "copy_into", "wake_readers", "wake_sleepers"),
)


def test_a_ctrl_c_at_any_line_of_a_put_keeps_the_senders_stream_whole() -> None:
    with (
        blocking.open_collector(capacity=64, slot_bytes=4096) as collector,
        blocking.open_sender(collector.handle, name="s") as sender,
    ):
        n = 0
        while True:
            n += 1
            interrupted = interrupt_at_line(n, lambda: sender.put_nowait(("m", n)), _PUBLISHING)  # noqa: B023
            sender.put_nowait(("after", n))
            got = []
            while True:
                d = collector.get(timeout=WITHIN_S)
                assert isinstance(d, ab.Item)
                got.append(d.value)
                if d.value == ("after", n):
                    break
            assert got in ([("m", n), ("after", n)], [("after", n)]), got
            assert interrupted or got == [("m", n), ("after", n)]
            if not interrupted:
                break
        assert n > 10  # it went through the whole publish


def test_a_fork_child_inherits_no_role_and_may_open_its_own_sender() -> None:
    with blocking.open_collector(capacity=8, slot_bytes=256) as collector:
        with blocking.open_sender(collector.handle, name="parent") as sender:
            sender.put("before")
            pid = os.fork()
            if pid == 0:  # the child: exit code says what went wrong
                code = 0
                try:
                    try:
                        sender.put("from the child")
                        code = 1
                    except ab.ClosedResourceError as exc:
                        code = 0 if "open_sender" in str(exc) else 2
                    try:
                        collector.get_nowait()
                        code = code or 3
                    except ab.ClosedResourceError as exc:
                        code = code or (0 if "open_sender" in str(exc) else 4)
                    try:
                        collector.get_many(timeout=0.01)
                        code = code or 5
                    except ab.ClosedResourceError as exc:
                        code = code or (0 if "open_sender" in str(exc) else 6)
                    with blocking.open_sender(collector.handle, name="child") as own:
                        own.put("child's own")
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
            sender.put("after")
            got = [collector.get(timeout=WITHIN_S) for _ in range(4)]
            assert sorted(got, key=repr) == sorted(
                [
                    ab.Item("parent", "before"),
                    ab.Item("parent", "after"),
                    ab.Item("child", "child's own"),
                    ab.SourceClosed("child"),
                ],
                key=repr,
            )


def test_a_ring_larger_than_dev_shm_is_refused_at_open_sender_and_leaves_nothing() -> None:
    with blocking.open_collector() as collector:
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
        before = set(os.listdir("/dev/shm"))
        with pytest.raises(ab.InsufficientSharedMemory):
            blocking.open_sender(collector.handle, name="big", capacity=2, slot_bytes=free // 2 + (64 << 20))
        assert set(os.listdir("/dev/shm")) == before
        assert sorted(os.listdir(collector.handle.path)) == ["collector", "inbox.sock"]
        with blocking.open_sender(collector.handle, name="big") as sender:  # the name is free
            sender.put(1)
            assert collector.get(timeout=WITHIN_S) == ab.Item("big", 1)
    with pytest.raises(ab.CollectorGone):
        blocking.open_sender(collector.handle, name="late")


class TakesWhileDecoded:
    """Unpickling it calls the collector's get_nowait (a __setstate__ that reads)."""

    collector: Any = None
    seen: list[str] = []  # noqa: RUF012

    def __reduce__(self) -> Any:
        return (_take_inside, ())


def _take_inside() -> str:
    try:
        TakesWhileDecoded.collector.get_nowait()
        TakesWhileDecoded.seen.append("took")
    except ab.WouldBlock:
        TakesWhileDecoded.seen.append("WouldBlock")
    return "decoded"


@pytest.mark.anyio
async def test_a_get_from_inside_decoding_raises_would_block_and_takes_nothing_twice() -> None:
    async with ab.open_collector() as collector, ab.open_sender(collector.handle, name="s") as sender:
        TakesWhileDecoded.collector = collector
        await sender.put(TakesWhileDecoded())
        await sender.put("next")
        assert [await collector.get() for _ in range(2)] == [ab.Item("s", "decoded"), ab.Item("s", "next")]
        assert TakesWhileDecoded.seen == ["WouldBlock"]


@pytest.mark.anyio
async def test_policy_lag_reports_exactly_what_a_sender_overwrote() -> None:
    async with ab.open_collector(policy="lag", capacity=4, slot_bytes=128) as collector:
        async with ab.open_sender(collector.handle, name="s") as sender:
            for rnd in range(2):  # before the collector attached, and after
                for i in range(10):
                    await sender.put(rnd * 10 + i)  # never waits under "lag"
                got = []
                while True:
                    try:
                        got.append(collector.get_nowait())
                    except ab.WouldBlock:
                        break
                assert got == [ab.SourceLagged("s", 6)] + [ab.Item("s", rnd * 10 + i) for i in range(6, 10)]
        assert await collector.get() == ab.SourceClosed("s")


@pytest.mark.anyio
async def test_an_idle_collector_sleeps() -> None:
    """Parked with an idle sender, the collector wakes only for its liveness checks (2 a second)."""
    async with ab.open_collector() as collector, ab.open_sender(collector.handle, name="idle"):
        with anyio.move_on_after(0.2):
            await collector.get()  # attaches the sender
        cpu = time.process_time()
        with anyio.move_on_after(1.0):
            await collector.get()
        assert time.process_time() - cpu < 0.05


def test_a_closed_senders_ring_waits_for_its_collector_through_a_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sender that closes before its collector attached leaves its ring to the collector; a
    sweep of stale files meanwhile (any open_writer here, 2 s later) must not remove it."""
    directory = f"/dev/shm/abtest-{os.getpid()}"
    os.mkdir(directory)
    try:
        with blocking.open_collector(directory=directory) as collector:
            with blocking.open_sender(collector.handle, name="early") as sender:
                sender.put(1)
                sender.put(2)
            monkeypatch.setattr(_tuning, "STALE_MIN_AGE_S", 0.0)
            ab.sweep_stale(directory)
            got = [collector.get(timeout=WITHIN_S) for _ in range(3)]
            assert got == [ab.Item("early", 1), ab.Item("early", 2), ab.SourceClosed("early")]
        assert os.listdir(directory) == []
    finally:
        shutil.rmtree(directory)


@pytest.mark.anyio
async def test_remote_senders_over_tcp_take_turns_with_local_ones_and_their_end_is_reported() -> None:
    async with ab.open_collector(expect=["near", "far", "doomed"], capacity=8, slot_bytes=512) as collector:
        with spawn(remote_writer_proc, 50, "close") as far, spawn(remote_writer_proc, 30, "die") as doomed:
            await collector.attach(await far.recv("handle"), name="far")
            doomed_handle = ab.Handle.parse(await doomed.recv("handle"))
            await collector.attach(doomed_handle, name="doomed")
            with pytest.raises(ab.InvalidArgument, match="already attached"):  # refused before connecting
                await collector.attach(await _writer_handle(), name="far")
            got: list[Any] = []
            async with ab.open_sender(collector.handle, name="near") as near:
                for i in range(8):  # its ring's capacity: nobody takes yet
                    await near.put(i)
            with anyio.fail_after(WITHIN_S):
                while sum(isinstance(d, ab.Item) and d.source == "doomed" for d in got) < 30:
                    got.append(await collector.get())
                doomed.send("die")
                got.extend([d async for d in collector])
        items, events = _sorted(got)
        assert items == {"near": list(range(8)), "far": list(range(50)), "doomed": list(range(30))}
        assert sorted(events, key=repr) == [
            ab.SourceClosed("far"),
            ab.SourceClosed("near"),
            ab.SourceGone("doomed", doomed.pid),
        ]
        # The killed writer could not remove its files: once its TCP server (a ring reader) has
        # seen it gone and exited, remove them.
        fd = os.open(doomed_handle.path, os.O_RDONLY)
        try:
            for _ in range(int(WITHIN_S / 0.05)):
                if not _segment.is_locked(fd, _segment.reader_lock_byte(0)):
                    break
                await anyio.sleep(0.05)
        finally:
            os.close(fd)
        for leftover in glob.glob(doomed_handle.path + "*"):
            # The server process removes its own report as it exits: it may beat us to it.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)


async def _writer_handle() -> str:
    async with ab.open_writer(tcp="tcp://127.0.0.1:0", max_readers=1) as writer:
        return writer.handle.to_json()


@pytest.mark.anyio
async def test_a_remote_sender_must_serve_tcp_and_send_what_the_collector_takes() -> None:
    async with ab.open_collector(codec="json") as collector, ab.open_writer(capacity=4, slot_bytes=256) as local:
        with pytest.raises(ab.InvalidHandle, match="no TCP endpoint"):
            await collector.attach(local.handle, name="x")
        async with ab.open_writer(tcp="tcp://127.0.0.1:0", max_readers=1) as pickling:
            with pytest.raises(ab.InvalidHandle, match="sends pickle"):  # never unpickled here
                await collector.attach(pickling.handle, name="x")
        with pytest.raises(ab.InvalidHandle, match="collector's handle"):
            await collector.attach(collector.handle.to_json(), name="x")


@pytest.mark.anyio
async def test_a_parked_collector_is_woken_by_a_remote_senders_item(monkeypatch: pytest.MonkeyPatch) -> None:
    """The remote reader's I/O thread wakes the collector's one inbox: with the liveness period
    made a minute long, only that wake-up can end the collector's sleep in time."""
    monkeypatch.setattr(_tuning, "LIVENESS_S", 60.0)
    async with (
        ab.open_writer(tcp="tcp://127.0.0.1:0", max_readers=1, capacity=4, slot_bytes=256) as writer,
        ab.open_collector(capacity=4, slot_bytes=256) as collector,
    ):
        await collector.attach(writer.handle, name="far")

        async def put_later() -> None:
            await anyio.sleep(0.3)  # the collector is parked by then
            await writer.put("wake up")

        async with anyio.create_task_group() as tg:
            tg.start_soon(put_later)
            with anyio.fail_after(WITHIN_S):
                assert await collector.get() == ab.Item("far", "wake up")


@pytest.mark.parametrize("api", ["async", "blocking"])
def test_a_sender_with_room_learns_of_its_killed_collector_before_publishing_more(api: str) -> None:
    """A collector killed while its sender's ring has plenty of room clears nothing in the ring:
    the sender still finds out, within ``SENDER_WATCH_S`` of puts, and its put raises
    ``CollectorGone`` with the item not taken, instead of filling a ring nobody will read."""
    with spawn(collector_proc, 4096) as child:
        h = recv(child, "handle")
        try:
            accepted_after_kill = 0

            def keep_putting(put: Any) -> BaseException:
                nonlocal accepted_after_kill
                deadline = time.monotonic() + WITHIN_S
                while time.monotonic() < deadline:
                    try:
                        put(accepted_after_kill)
                    except BaseException as exc:
                        return exc
                    accepted_after_kill += 1
                    time.sleep(0.005)
                raise AssertionError(f"{accepted_after_kill} puts accepted after the collector was killed")

            if api == "blocking":
                with blocking.open_sender(h, name="s", capacity=4096) as bsender:
                    child.send("go")
                    bsender.put("first")
                    recv(child, "took")
                    os.kill(child.pid, 9)
                    failure = keep_putting(bsender.put)
            else:

                async def main() -> BaseException:
                    async with ab.open_sender(h, name="s", capacity=4096) as sender:
                        child.send("go")
                        await sender.put("first")
                        recv(child, "took")
                        os.kill(child.pid, 9)
                        return await anyio.to_thread.run_sync(
                            keep_putting, lambda i: anyio.from_thread.run(sender.put, i)
                        )

                failure = anyio.run(main)
            assert isinstance(failure, ab.CollectorGone), failure
            # A ring of 4096 would have taken every put of the whole WITHIN_S; the watch looks every
            # SENDER_WATCH_S (0.25 s: about 50 puts here), with room to spare for a loaded machine.
            assert accepted_after_kill < 1000
        finally:
            child.cleanup()
            shutil.rmtree(ab.CollectorHandle.parse(h).path, ignore_errors=True)


def test_both_front_ends_take_one_set_of_options_and_refuse_others() -> None:
    """The four factories take their keyword options as one typed set each (``CollectorOptions``,
    ``SenderOptions``), whose defaults are written once (``CollectorSpec``, ``sender_plan``); a
    keyword none of them takes is refused, as a written-out signature refused it."""
    from aiobroadcast._fanin.open import CollectorOptions, CollectorSpec

    spec = set(inspect.signature(CollectorSpec).parameters) - {"schema"}
    assert set(CollectorOptions.__annotations__) == spec
    for open_collector in (ab.open_collector, blocking.open_collector):
        with pytest.raises(TypeError, match="capcity"):
            open_collector(capcity=4)  # type: ignore[call-overload]
    for open_sender in (ab.open_sender, blocking.open_sender):
        with pytest.raises(TypeError, match="heartbeat"):
            open_sender("{}", name="a", heartbeat=1.0)  # type: ignore[call-overload]


@pytest.mark.anyio
async def test_cancelling_the_task_asleep_for_a_collector_hands_the_sleep_to_another() -> None:
    """Three tasks parked in one collector's ``get``: the first sleeps on its inbox, the others
    follow it (the readers' own ``TaskWaits``). Cancelling the sleeper must wake a follower to
    sleep in its place, so the next items still reach the two left, none lost."""
    async with ab.open_collector(capacity=8, slot_bytes=256) as collector:
        async with ab.open_sender(collector.handle, name="s") as sender:
            got: list[object] = []
            scopes: list[anyio.CancelScope] = []

            async def park() -> None:
                with anyio.CancelScope() as scope:
                    scopes.append(scope)
                    got.append(await collector.get())

            async def waiting(n: int) -> None:
                # polling: the count is another task's state
                while collector.statistics().tasks_waiting != n:  # noqa: ASYNC110
                    await anyio.sleep(0.001)

            with anyio.fail_after(WITHIN_S):
                async with anyio.create_task_group() as tg:
                    for _ in range(3):
                        tg.start_soon(park)
                    await waiting(3)
                    await anyio.sleep(0.05)  # the first is asleep on the inbox by now (or soon)
                    scopes[0].cancel()
                    await waiting(2)
                    await sender.put(1)
                    await sender.put(2)
            assert sorted(got, key=repr) == [ab.Item("s", 1), ab.Item("s", 2)]
