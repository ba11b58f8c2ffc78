"""Child-process entry points for the request/reply tests."""

from __future__ import annotations

import os
import time
from typing import Any

import anyio
import anyio.lowlevel
from _workers import Conn, reporting

import aiobroadcast as ab
from aiobroadcast import blocking


def answer(name: str, value: Any) -> Any:
    """What every test worker answers: ``(name, value)``; ``"boom"`` raises, ``("sleep", s)``
    sleeps first, ``"lambda"`` answers something that cannot be pickled."""
    if value == "boom":
        raise ValueError(f"{name} cannot do 42")
    if isinstance(value, tuple) and value[0] == "sleep":
        time.sleep(value[1])
    if value == "lambda":
        return lambda: None
    return (name, value)


def worker_proc(conn: Conn, handle: str, name: str, kind: str) -> None:
    """A pool worker. ``kind``: ``"blocking"`` (serve), ``"async"`` (serve with a coroutine
    handler), ``"leaver"`` (answers until the request ``"leave"``, then closes without
    answering it), ``"rogue"`` (a sender under the worker's name that says hello, then sends a
    reply with an id no call issued and an item that is not a reply at all, then waits)."""
    reporting(conn, lambda: _work(conn, handle, name, kind))


def _work(conn: Conn, handle: str, name: str, kind: str) -> None:
    if kind == "blocking":
        with blocking.open_worker(handle, name=name) as worker:
            conn.send(("ready", os.getpid()))
            served = worker.serve(lambda v: answer(name, v))
    elif kind == "async":

        async def run() -> int:
            async def handler(v: Any) -> Any:
                await anyio.lowlevel.checkpoint()
                return answer(name, v)

            async with ab.open_worker(handle, name=name) as worker:
                conn.send(("ready", os.getpid()))
                return await worker.serve(handler)

        served = anyio.run(run)
    elif kind == "leaver":
        served = 0
        with blocking.open_worker(handle, name=name) as w:
            conn.send(("ready", os.getpid()))
            for request in w:
                if request.value == "leave":
                    break
                try:
                    request.reply(answer(name, request.value))
                except Exception as exc:
                    request.fail(exc)
                served += 1
    elif kind == "rogue":
        pool = ab.PoolHandle.parse(handle)
        with blocking.open_sender(pool.replies, name=name) as sender:
            sender.put((0, True, os.getpid()))
            sender.put((999, True, "forged"))
            sender.put("not a reply")
            conn.send(("ready", os.getpid()))
            time.sleep(3600)
        served = 0
    conn.send(("done", served))
