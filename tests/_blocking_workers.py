"""Child-process entry points that use the blocking API (no event loop anywhere in the child),
and the parent's blocking side of talking to a ``_workers.Child``."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from _workers import Child, Conn, Event, _expect, reporting

import aiobroadcast as ab
from aiobroadcast import blocking


def _sync_child(conn: Conn, main: Callable[..., None], *args: Any) -> None:
    reporting(conn, lambda: main(conn, *args))


def writer_proc(conn: Conn, count: int, capacity: int, slot_bytes: int) -> None:
    """A blocking writer: send the handle, wait for "go", put the ints 0 .. count-1, close."""
    _sync_child(conn, _write, count, capacity, slot_bytes)


def _write(conn: Conn, count: int, capacity: int, slot_bytes: int) -> None:
    with blocking.open_writer(capacity=capacity, slot_bytes=slot_bytes) as writer:
        conn.send(("handle", writer.handle.to_json()))
        _expect(conn, "go")
        for i in range(count):
            writer.put(i)
        conn.send(("sent", count))
    conn.send(("closed", True))  # the channel's files are gone: the parent may stop this process


def collect_proc(conn: Conn, handle: str, name: str) -> None:
    """A blocking reader: attach, report, read until the end (by iteration), report the events."""
    _sync_child(conn, _collect, handle, name)


def _collect(conn: Conn, handle: str, name: str) -> None:
    events: list[Event] = []
    with blocking.open_reader(handle, name=name) as reader:
        conn.send(("attached", {"pid": os.getpid(), "place": reader.statistics().place}))
        try:
            events.extend(("msg", obj) for obj in reader)
            events.append(("end",))
        except ab.WriterGone as exc:
            events.append(("gone", exc.pid))
    conn.send(("events", events))


def recv(child: Child, tag: str, within_s: float = 30.0) -> Any:
    """``Child.recv`` for a test without an event loop."""
    if not child.conn.poll(within_s):
        raise AssertionError(f"child {child.pid} sent nothing within {within_s} s (waiting for {tag!r})")
    got, payload = child.conn.recv()
    if got == "error":
        raise AssertionError(f"child {child.pid} failed:\n{payload}")
    assert got == tag, f"expected {tag!r} from child {child.pid}, got {got!r}: {payload!r}"
    return payload


def wait_until(predicate: Callable[[], bool], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within_s} s")
        time.sleep(0.005)
