"""``Caller.wait_ready``: a worker restarted under an ended worker's name (a new process) is
called again once the caller waited for it; real worker processes, real kills."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from _blocking_workers import recv
from _rpc_workers import worker_proc
from _workers import spawn

import aiobroadcast as ab
from aiobroadcast import blocking

#: Generous bound for "it happens" (never a performance claim): a loaded 2-core machine.
WITHIN_S = 15.0


@pytest.fixture
def anyio_backend() -> Any:
    return ("asyncio", {"use_uvloop": False})


@pytest.mark.anyio
async def test_a_restarted_worker_is_called_again_after_wait_ready() -> None:
    """w1 is killed and a new process attaches under its name. Its ``open_worker`` waits until
    the caller has reported the dead one (which frees the name): ``wait_ready`` takes that report,
    then the new hello, and the next call gets the new worker's reply."""
    async with ab.open_caller(workers=["w0", "w1"], capacity=8, slot_bytes=1024) as caller:
        h = caller.handle.to_json()
        with spawn(worker_proc, h, "w0", "blocking"), spawn(worker_proc, h, "w1", "blocking") as w1:
            with anyio.fail_after(WITHIN_S):
                await caller.wait_ready()
            assert caller.statistics().ready == ("w0", "w1")
            assert (await caller.call(1, timeout=WITHIN_S))["w1"] == ab.Reply("w1", ("w1", 1))
            w1.sigkill()
            w1.proc.join(WITHIN_S)  # as a supervisor restarts a worker: once it has ended
            with spawn(worker_proc, h, "w1", "async") as again:
                with anyio.fail_after(WITHIN_S):
                    await caller.wait_ready(["w1"], timeout=WITHIN_S)
                assert await again.recv("ready") == again.pid
                got = await caller.call(2, timeout=WITHIN_S)
                assert got == {"w0": ab.Reply("w0", ("w0", 2)), "w1": ab.Reply("w1", ("w1", 2))}
        with pytest.raises(ab.InvalidArgument, match="not one of this pool's workers"):
            await caller.wait_ready(["w9"], timeout=1)
        with pytest.raises(ab.InvalidArgument):
            await caller.wait_ready(timeout=-1)


@pytest.mark.anyio
async def test_wait_ready_for_a_worker_that_never_comes_raises_wait_timeout_naming_it() -> None:
    async with ab.open_caller(workers=["here", "never"], capacity=8, slot_bytes=1024) as caller:
        with spawn(worker_proc, caller.handle.to_json(), "here", "blocking"):
            await caller.wait_ready(["here"], timeout=WITHIN_S)
            with pytest.raises(ab.WaitTimeout, match="'never'"):
                await caller.wait_ready(timeout=0.3)
            assert caller.statistics().ready == ("here",)


def test_a_blocking_caller_calls_a_restarted_worker_after_wait_ready() -> None:
    with blocking.open_caller(workers=["w0", "w1"], capacity=8, slot_bytes=1024) as caller:
        h = caller.handle.to_json()
        with spawn(worker_proc, h, "w0", "async"), spawn(worker_proc, h, "w1", "blocking") as w1:
            caller.wait_ready(timeout=WITHIN_S)
            assert caller.call(1, timeout=WITHIN_S)["w1"] == ab.Reply("w1", ("w1", 1))
            w1.sigkill()
            w1.proc.join(WITHIN_S)
            with spawn(worker_proc, h, "w1", "blocking") as again:
                caller.wait_ready(["w1"], timeout=WITHIN_S)
                assert recv(again, "ready") == again.pid
                assert caller.call(2, timeout=WITHIN_S) == {
                    "w0": ab.Reply("w0", ("w0", 2)),
                    "w1": ab.Reply("w1", ("w1", 2)),
                }
            with pytest.raises(ab.WaitTimeout, match="'w1'"):
                caller.wait_ready(timeout=0.3)  # the second w1 closed: it is not coming back
