"""Request/reply over a pool of workers (docs/fan-in.md, "Calls"): real worker processes, real
shared memory."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import sys
import time
from typing import Any

import anyio
import pytest
from _interrupts import in_functions, interrupt_at_line
from _rpc_workers import answer, worker_proc
from _workers import spawn

import aiobroadcast as ab
from aiobroadcast import blocking

HERE = socket.gethostname()[:16]  #: as a ring records a reader's host

#: Generous bound for "it happens" (never a performance claim): a loaded 2-core machine.
WITHIN_S = 15.0


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def anyio_backend() -> Any:
    return ("asyncio", {"use_uvloop": False})


#: For the tests whose waits each event loop does its own way (a call's deadline, its cancellation).
EVERY_LOOP = pytest.mark.parametrize(
    "anyio_backend",
    [("asyncio", {"use_uvloop": False}), ("asyncio", {"use_uvloop": True}), "trio"],
    ids=["asyncio", "uvloop", "trio"],
)


@pytest.mark.anyio
async def test_a_call_gets_every_reply_a_handlers_error_as_text_and_a_closed_worker_as_closed() -> None:
    async with ab.open_caller(workers=["a", "b", "c"], capacity=8, slot_bytes=1024) as caller:
        h = caller.handle.to_json()
        with (
            spawn(worker_proc, h, "a", "blocking") as a,
            spawn(worker_proc, h, "b", "async") as b,
            spawn(worker_proc, h, "c", "leaver") as c,
        ):
            got = await caller.call("x", timeout=WITHIN_S)
            assert got == {w: ab.Reply(w, (w, "x")) for w in "abc"}
            assert [r.unwrap() for r in got.values()] == [("a", "x"), ("b", "x"), ("c", "x")]
            # Concurrent calls take turns, each gets its own answers.
            both: dict[str, Any] = {}

            async def one(v: str) -> None:
                both[v] = await caller.call(v, timeout=WITHIN_S)

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "x1")
                tg.start_soon(one, "x2")
            assert both == {v: {w: ab.Reply(w, (w, v)) for w in "abc"} for v in ("x1", "x2")}
            failed = await caller.call("boom", timeout=WITHIN_S)
            assert failed["a"] == ab.Failed("a", "ValueError", "a cannot do 42")
            assert failed["b"] == ab.Failed("b", "ValueError", "b cannot do 42")
            with pytest.raises(ab.WorkerError, match="worker 'a' raised ValueError: a cannot do 42") as err:
                failed["a"].unwrap()
            assert (err.value.worker, err.value.type_name) == ("a", "ValueError")
            # A reply that cannot be sent is answered as the error it raised.
            bad = await caller.call("lambda", timeout=WITHIN_S)
            assert isinstance(bad["a"], ab.Failed) and bad["a"].type_name == "SerializationError"
            # c leaves without answering: the call says so, without waiting for the deadline.
            t0 = time.monotonic()
            left = await caller.call("leave", timeout=60)
            assert time.monotonic() - t0 < WITHIN_S
            assert left["c"] == ab.NoReply("c", "closed", "worker 'c' closed")
            assert left["a"] == ab.Reply("a", ("a", "leave"))
            with pytest.raises(ab.NoReplyError, match="closed") as no:
                left["c"].unwrap()
            assert no.value.reason == "closed"
            await c.recv("ready")
            await c.recv("done")
            again = await caller.call(1, timeout=WITHIN_S)
            assert again["c"].reason == "closed"  # type: ignore[union-attr]
            assert again["b"] == ab.Reply("b", ("b", 1))
            # Waiting workers sleep: (nearly) no CPU while no call comes.
            before = [cpu_s(a.pid), cpu_s(b.pid)]
            await anyio.sleep(1.0)
            used = [cpu_s(a.pid) - before[0], cpu_s(b.pid) - before[1]]
            assert max(used) < 0.05, used
            s = caller.statistics()
            assert (s.calls, s.ready, s.ended) == (7, ("a", "b"), (("c", "closed"),))
            assert (s.late_replies, s.unknown_replies) == (0, 0)


@EVERY_LOOP
@pytest.mark.anyio
async def test_a_late_reply_is_dropped_and_counted_and_an_unknown_id_too() -> None:
    async with ab.open_caller(workers=["slow", "rogue"], capacity=8, slot_bytes=1024) as caller:
        h = caller.handle.to_json()
        with spawn(worker_proc, h, "slow", "blocking") as slow, spawn(worker_proc, h, "rogue", "rogue") as rogue:
            await slow.recv("ready")
            await rogue.recv("ready")
            first = await caller.call(("sleep", 1.5), timeout=0.3)
            late = first["slow"]
            assert isinstance(late, ab.NoReply) and late.reason == "deadline"
            # Why, as the request ring shows it: taken by now, or (a loaded machine) not yet.
            took = rf"it took the request \(pid {slow.pid} on {HERE}\) and has not replied: its handler"
            not_yet = rf"it has not taken the request: its reader 'slow' \(pid {slow.pid} on {HERE}\), "
            assert re.match(rf"worker 'slow' did not answer within 0\.3 s: ({took}|{not_yet})", late.detail), late
            assert first["rogue"].reason == "deadline"  # type: ignore[union-attr]
            # The next call is answered after the late reply to the first arrived: it is dropped.
            second = await caller.call("next", timeout=3)
            assert second["slow"] == ab.Reply("slow", ("slow", "next"))
            assert second["rogue"].reason == "deadline"  # type: ignore[union-attr]
            s = caller.statistics()
            assert (s.late_replies, s.unknown_replies) == (1, 2)


@pytest.mark.anyio
async def test_a_call_in_a_cancelled_scope_sends_nothing_and_the_next_call_is_answered() -> None:
    """A call takes its turn at once when no other call holds it (no trip through the event
    loop), but a call whose task is cancelled already still raises before its request is sent."""
    async with ab.open_caller(workers=["w"], capacity=8, slot_bytes=1024) as caller:
        with spawn(worker_proc, caller.handle.to_json(), "w", "blocking"):
            assert (await caller.call("one", timeout=WITHIN_S))["w"] == ab.Reply("w", ("w", "one"))
            with anyio.CancelScope() as scope:
                scope.cancel()
                await caller.call("never", timeout=WITHIN_S)
            assert scope.cancelled_caught
            assert caller.statistics().calls == 1
            assert caller._w.statistics().sent == 1  # "one" only
            assert (await caller.call("two", timeout=WITHIN_S))["w"] == ab.Reply("w", ("w", "two"))


def test_blocking_caller_reports_a_killed_worker_dead_and_goes_on() -> None:
    with blocking.open_caller(workers=["w0", "w1"], capacity=8, slot_bytes=1024) as caller:
        h = caller.handle.to_json()
        with spawn(worker_proc, h, "w0", "blocking"), spawn(worker_proc, h, "w1", "async") as w1:
            assert caller.call(7, timeout=WITHIN_S) == {
                "w0": ab.Reply("w0", ("w0", 7)),
                "w1": ab.Reply("w1", ("w1", 7)),
            }
            w1.sigkill()
            t0 = time.monotonic()
            got = caller.call(8, timeout=60)
            assert time.monotonic() - t0 < WITHIN_S  # about a second: the collector's liveness check
            assert got["w0"] == ab.Reply("w0", ("w0", 8))
            assert got["w1"] == ab.NoReply("w1", "dead", f"worker 'w1' (pid {w1.pid}) died")
            assert caller.call(9, timeout=WITHIN_S)["w0"] == ab.Reply("w0", ("w0", 9))
            late = caller.call(("sleep", 0.5), timeout=0.05)
            assert late["w0"].reason == "deadline"  # type: ignore[union-attr]
            assert caller.call(10, timeout=WITHIN_S)["w0"] == ab.Reply("w0", ("w0", 10))
            assert caller.statistics().late_replies == 1
            assert caller.statistics().ended == (("w1", "dead"),)


#: Where a Ctrl-C lands in a blocking call: any line of request/reply's own code and of the
#: locks it takes, and of publishing the request. Not the lines of ``BlockingCaller.call``
#: itself: its ``finally`` frees the turn, and a line event there is a place where Python raises
#: no signal's exception (no call or backward jump between the body's end and the release).
_RPC_FILES = {m.__file__ for n, m in sys.modules.items() if n.startswith("aiobroadcast._calls.")}
_PUBLISHING = in_functions(
    ("aiobroadcast._shm.publisher", "aiobroadcast._shm.fragments"),
    ("publish", "publish_many", "_write_fragments", "wake_readers", "wake_sleepers"),
)
_OWNED = in_functions(("aiobroadcast._shm.owned",), ("acquire", "try_acquire", "count", "left_before"))


def _calling(code: Any) -> bool:
    if code.co_filename in _RPC_FILES:
        return bool(code.co_qualname != "BlockingCaller.call")
    return _OWNED(code) or _PUBLISHING(code)


def test_a_ctrl_c_at_any_line_of_a_call_leaves_the_next_call_its_own_replies() -> None:
    """A Ctrl-C can land on any line of a blocking call: before its request went out, while it
    waits for replies, after some came. Whatever line it lands on, the caller is left out of
    the call (the next one begins, no lock held) and the next call returns its own replies,
    never the interrupted call's."""
    with blocking.open_caller(workers=["w0", "w1"], capacity=64, slot_bytes=1024) as caller:
        h = caller.handle.to_json()
        with spawn(worker_proc, h, "w0", "blocking"), spawn(worker_proc, h, "w1", "blocking"):
            caller.wait_ready(timeout=WITHIN_S)
            n = 0
            while True:
                n += 1
                request = ("interrupted", n)
                interrupted = interrupt_at_line(n, lambda: caller.call(request, timeout=WITHIN_S), _calling)  # noqa: B023
                got = caller.call(n, timeout=WITHIN_S)
                assert got == {w: ab.Reply(w, (w, n)) for w in ("w0", "w1")}, (n, got)
                if not interrupted:
                    break
            assert n > 30  # it went through the whole call
            # Some landed after the request went out: their replies came late and were dropped.
            assert caller.statistics().late_replies > 0


@EVERY_LOOP
@pytest.mark.anyio
async def test_a_call_waits_for_room_until_its_deadline_and_then_sends_nothing() -> None:
    """A worker busy with a long request reads no more: the request ring fills, and a call that
    finds it full waits for room within its own timeout only, then answers "deadline" for
    every worker, its request not sent."""
    async with ab.open_caller(workers=["busy"], capacity=2, slot_bytes=1024) as caller:
        h = caller.handle.to_json()
        with spawn(worker_proc, h, "busy", "blocking") as busy:
            await busy.recv("ready")
            assert (await caller.call("hello", timeout=WITHIN_S))["busy"] == ab.Reply("busy", ("busy", "hello"))
            first = await caller.call(("sleep", 3.0), timeout=0.2)  # taken: the worker sleeps on it
            assert first["busy"].reason == "deadline"  # type: ignore[union-attr]
            sent = caller._w.statistics().sent
            for _ in range(caller._w.statistics().capacity):  # fill the ring the worker does not read
                assert (await caller.call("queued", timeout=0.05))["busy"].reason == "deadline"  # type: ignore[union-attr]
            assert caller._w.statistics().sent == sent + 2
            start = time.monotonic()
            full = await caller.call("no room", timeout=0.3)
            assert 0.25 <= time.monotonic() - start < WITHIN_S
            assert full == {
                "busy": ab.NoReply(
                    "busy",
                    "deadline",
                    "worker 'busy' did not answer within 0.3 s: the request was not sent; put: the timeout passed "
                    "waiting for room for 1 ring slot (the ring has 2); the writer waits for: reader 'busy' "
                    f"(pid {busy.pid} on {HERE}), 2 ring entries (2 messages) behind: it is alive but not reading "
                    "(busy, stopped, or not calling get)",
                )
            }
            assert caller._w.statistics().sent == sent + 2  # "no room" was not sent
            # Once the worker is back, it answers what was sent, in order; then the next call.
            assert (await caller.call("after", timeout=WITHIN_S))["busy"] == ab.Reply("busy", ("busy", "after"))
            assert caller.statistics().late_replies == 3  # the sleep and the two queued


@pytest.mark.parametrize(
    ("anyio_backend", "how"),
    [
        (("asyncio", {"use_uvloop": False}), "anyio"),
        (("asyncio", {"use_uvloop": True}), "anyio"),
        ("trio", "anyio"),
        (("asyncio", {"use_uvloop": False}), "asyncio"),
        (("asyncio", {"use_uvloop": True}), "asyncio"),
    ],
    ids=["asyncio-scope", "uvloop-scope", "trio-scope", "asyncio-timeout", "uvloop-timeout"],
)
@pytest.mark.anyio
async def test_a_call_cancelled_while_it_waits_for_replies_leaves_the_next_call_its_own(
    anyio_backend: Any, how: str
) -> None:
    """A call's deadline is not a cancel scope any more, so a cancellation from outside (an anyio
    scope, or asyncio's own ``asyncio.timeout``: ``task.cancel()``) must still end it mid-wait,
    free its turn, and leave nothing behind: the reply it was waiting for arrives later and is
    dropped as late, never returned by the next call."""
    async with ab.open_caller(workers=["w"], capacity=8, slot_bytes=1024) as caller:
        with spawn(worker_proc, caller.handle.to_json(), "w", "blocking") as w:
            await w.recv("ready")
            if how == "anyio":
                with anyio.move_on_after(0.2) as scope:
                    await caller.call(("sleep", 1.0), timeout=WITHIN_S)
                assert scope.cancelled_caught
            else:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.2):
                        await caller.call(("sleep", 1.0), timeout=WITHIN_S)
            got = await caller.call("next", timeout=WITHIN_S)
            assert got == {"w": ab.Reply("w", ("w", "next"))}
            s = caller.statistics()
            assert (s.calls, s.late_replies, s.unknown_replies) == (2, 1, 0)


@pytest.mark.anyio
async def test_a_call_from_another_thread_is_refused_before_anything_is_sent() -> None:
    async with ab.open_caller(workers=["w"]) as caller:

        async def elsewhere() -> None:
            await caller.call("x", timeout=1)

        with pytest.raises(ab.BroadcastError, match=r"caller's call\(\) belongs to the thread"):
            await anyio.to_thread.run_sync(anyio.run, elsewhere)
        assert caller._w.statistics().sent == 0
        assert caller.statistics().calls == 0


@pytest.mark.anyio
async def test_bad_input_gets_clear_errors_and_nothing_accepted_is_lost() -> None:
    with pytest.raises(ab.InvalidArgument, match="not one string"):
        ab.open_caller(workers="ab")
    with pytest.raises(ab.InvalidArgument, match="unique"):
        ab.open_caller(workers=["a", "a"])
    with pytest.raises(ab.InvalidArgument, match="at least one"):
        blocking.open_caller(workers=[])
    async with ab.open_caller(workers=["me"], max_request_bytes=1000) as caller:
        async with ab.open_writer() as w, ab.open_collector() as c:
            for wrong in (w.handle, c.handle, w.handle.to_json(), c.handle.to_json()):
                with pytest.raises(ab.InvalidHandle, match=r"open_worker takes caller\.handle"):
                    await ab.open_worker(wrong, name="me")  # type: ignore[arg-type]
                with pytest.raises(ab.InvalidHandle, match=r"open_worker takes caller\.handle"):
                    blocking.open_worker(wrong, name="me")  # type: ignore[arg-type]
        with pytest.raises(ab.InvalidHandle):
            await ab.open_worker("{}", name="me")
        with pytest.raises(ab.InvalidArgument, match="not one of this pool's workers"):
            await ab.open_worker(caller.handle, name="stranger")
        async with ab.open_worker(caller.handle, name="me") as worker:
            with pytest.raises(ab.InvalidArgument, match="already attached"):
                await ab.open_worker(caller.handle, name="me")
            with pytest.raises(AttributeError, match="only the caller calls"):
                worker.call  # type: ignore[attr-defined]  # noqa: B018
            with pytest.raises(AttributeError, match="workers serve"):
                caller.serve  # type: ignore[attr-defined]  # noqa: B018
            with pytest.raises(ab.SerializationError):
                await caller.call(lambda: None, timeout=WITHIN_S)
            with pytest.raises(ab.MessageTooLarge):
                await caller.call(b"x" * 2000, timeout=WITHIN_S)
            with pytest.raises(ab.InvalidArgument, match="timeout"):
                await caller.call(1, timeout=-1)

            async def serve_one() -> None:
                request = await anext(aiter(worker))
                await request.reply(answer("me", request.value))
                with pytest.raises(ab.InvalidArgument, match="already answered"):
                    await request.reply("twice")

            async with anyio.create_task_group() as tg:
                tg.start_soon(serve_one)
                got = await caller.call("ok", timeout=WITHIN_S)
            assert got == {"me": ab.Reply("me", ("me", "ok"))}  # the refused requests took no id's reply
            assert caller.statistics().unknown_replies == 0
