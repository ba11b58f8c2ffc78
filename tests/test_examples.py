"""Every program in examples/ runs here, as a user would run it."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import AsyncExitStack, aclosing
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.to_thread
import httpx
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


class Program:
    """An example running in its own process; its output lines arrive on a queue."""

    def __init__(self, name: str, *args: str) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, str(EXAMPLES / name), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def next_line(self, timeout: float = 30.0) -> str:
        line = self._queue.get(timeout=timeout)
        if line is None:
            raise AssertionError(f"the program ended (code {self.popen.wait()}): {self.lines}")
        return line

    def wait_for(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            line = self.next_line(max(0.01, deadline - time.monotonic()))
            m = re.search(pattern, line)
            if m:
                return m

    def finish(self, timeout: float = 60.0) -> int:
        """Wait for the program to end and for every line it (and its children) wrote to be read."""
        code = self.popen.wait(timeout)
        # The pipe ends when the last process holding it does; a loaded machine may leave the
        # reading thread any number of lines behind the program's exit.
        self._pump_thread.join(timeout)
        return code

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        if self.popen.stdout is not None:
            self.popen.stdout.close()


@pytest.fixture
def programs() -> Iterator[list[Program]]:
    started: list[Program] = []
    yield started
    for p in started:
        p.stop()


def test_quickstart(programs: list[Program]) -> None:
    p = Program("quickstart.py")
    programs.append(p)
    assert p.finish() == 0, p.lines
    assert p.lines == ["{'step': 1, 'weights': b'...'}", "no wait"]


def test_typed_messages(programs: list[Program]) -> None:
    p = Program("typed_messages.py")
    programs.append(p)
    assert p.finish() == 0, p.lines
    out = "\n".join(p.lines)
    assert "writer: put() refused a bad order (side, qty); nothing was published" in out
    assert "writer: 3 messages published" in out
    assert [line for line in p.lines if line.startswith("desk:")] == [
        "desk: buy 10 ACME @ 12.5",
        "desk: sell 500 INIT @ 3.0",
        "desk: sell 7 ACME @ 13.0",
    ]
    assert [line for line in p.lines if line.startswith("small-orders:")] == [
        "small-orders: buy 10 ACME",
        "small-orders: message #1 does not fit SmallOrder: skipped, reading on",
        "small-orders: sell 7 ACME",
    ]


def test_worker_pool_goes_on_when_a_worker_is_killed(programs: list[Program]) -> None:
    p = Program("worker_pool.py", "--workers", "3", "--jobs", "300", "--rate", "150")
    programs.append(p)
    pids = {}
    for _ in range(3):
        m = p.wait_for(r"^(worker-\d) pid (\d+) ready$")
        pids[m.group(1)] = int(m.group(2))
    p.wait_for(r"^published 100 jobs")
    os.kill(pids["worker-1"], signal.SIGKILL)
    assert p.finish() == 0, "\n".join(p.lines)
    out = "\n".join(p.lines)
    assert re.search(rf"worker 'worker-1' \(pid {pids['worker-1']}\) died after \d+ results; the others go on", out)
    assert "published 300 jobs" in out  # the caller went on
    assert "worker-0: completed 300 of 300 jobs" in p.lines
    assert "worker-2: completed 300 of 300 jobs" in p.lines
    assert re.search(r"^worker-1: DIED after (\d+) of 300 jobs$", out, re.M)
    assert not any(line.startswith("job ") for line in p.lines), out  # no wrong or missing answer
    assert p.lines[-1] == "done: 2 of 3 workers completed 300 jobs"


def test_vllm_drop_in_worker_loop(programs: list[Program]) -> None:
    p = Program("vllm_drop_in.py", "--workers", "3", "--steps", "300")
    programs.append(p)
    assert p.finish() == 0, "\n".join(p.lines)
    # Four processes share the pipe, and a line can reach it in two writes (its text, then its
    # newline) with another process's line in between: look for each process's text, not lines.
    out = "\n".join(p.lines)
    assert sorted(re.findall(r"worker (\d) \(pid \d+\) ready", out)) == ["0", "1", "2"], out
    assert re.search(
        r"the scheduler cannot dequeue from its own queue: this is the writer's MessageQueue.*create_from_handle", out
    ), out
    assert p.lines[-1].startswith("300 steps: each of 3 workers answered every step, in order"), p.lines


def test_vllm_executor_collective_rpc(programs: list[Program]) -> None:
    p = Program("vllm_executor.py", "--workers", "3", "--steps", "200")
    programs.append(p)
    assert p.finish() == 0, "\n".join(p.lines)
    assert p.lines[0].startswith("200 steps: every rank answered every step"), p.lines
    assert p.lines[1] == "check_health: worker 'rank-1' raised RuntimeError: rank 1: device lost"
    assert p.lines[2].startswith("statistics: CallerStatistics(calls=202,") and "late_replies=0" in p.lines[2]


# --- the HTTP server ----------------------------------------------------------------------------
async def sse_events(response: httpx.Response) -> AsyncGenerator[tuple[str, str], None]:
    """(event, data) pairs of a server-sent event stream."""
    event, data = "message", ""
    # Closed when this generator is, not by the garbage collector (trio warns about that).
    lines_gen = cast(AsyncGenerator[str, None], response.aiter_lines())
    async with aclosing(lines_gen) as lines:
        async for line in lines:
            if not line:
                yield event, data
                event, data = "message", ""
            elif line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = line.removeprefix("data: ")


@pytest.mark.anyio
async def test_async_server_streams_every_broadcast_to_every_client_in_order(programs: list[Program]) -> None:
    server = Program("async_server.py", "--port", "0", "--tick", "0")
    programs.append(server)
    m = await anyio.to_thread.run_sync(server.wait_for, r"listening on (http://127\.0\.0\.1:\d+)")
    url = m.group(1)
    with anyio.fail_after(60):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            async with (
                AsyncExitStack() as stack,
                client.stream("GET", "/events") as one,
                client.stream("GET", "/events") as two,
            ):
                assert one.headers["content-type"].startswith("text/event-stream")
                events_one = await stack.enter_async_context(aclosing(sse_events(one)))
                events_two = await stack.enter_async_context(aclosing(sse_events(two)))
                ready = [await anext(events_one), await anext(events_two)]
                assert [e for e, _ in ready] == ["ready", "ready"]
                assert ready[0][1] != ready[1][1]  # each client has its own reader
                # Both readers are attached now: every message published from here reaches both.
                sent: list[Any] = []
                for i in range(20):
                    msg = {"n": i, "text": f"broadcast {i}", "nested": [i, {"even": i % 2 == 0}]}
                    res = await client.post("/publish", json=msg)
                    assert res.status_code == 200, res.text
                    sent.append(msg)
                got_one = [await anext(events_one) for _ in sent]
                got_two = [await anext(events_two) for _ in sent]
                assert got_one == got_two  # the same broadcast, in the same order
                assert [e for e, _ in got_one] == ["message"] * len(sent)
                assert [json.loads(d) for _, d in got_one] == sent
                bad = await client.post("/publish", content=b"not json")
                assert bad.status_code == 400
                # Shutting the server down ends every stream cleanly, with an "end" event.
                server.popen.send_signal(signal.SIGTERM)
                assert await anext(events_one) == ("end", '{"received": 20}')
                assert await anext(events_two) == ("end", '{"received": 20}')
                # ... and then the response ends (read to its end: nothing is left half-read).
                assert [e async for e in events_one] == [] and [e async for e in events_two] == []
    code = await anyio.to_thread.run_sync(server.finish)
    assert code in (0, -signal.SIGTERM), server.lines  # uvicorn re-raises the signal once it is done
    assert not any("Traceback" in line for line in server.lines), server.lines
