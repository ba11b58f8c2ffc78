"""Child-process entry points for the fan-in tests (blocking API: no event loop in the child)."""

from __future__ import annotations

import os
import time
from typing import Any

from _workers import Conn, _expect, reporting

import aiobroadcast as ab
from aiobroadcast import blocking


def sender_proc(conn: Conn, handle: str, name: str, count: int, then: str) -> None:
    """Attach as ``name``, put ``(name, i)`` for i in 0 .. count-1, then: ``"close"`` (close and
    report), ``"hang"`` (report and wait to be killed), ``"forever"`` (put until an error, and
    report it)."""
    reporting(conn, lambda: _send(conn, handle, name, count, then))


def _send(conn: Conn, handle: str, name: str, count: int, then: str) -> None:
    with blocking.open_sender(handle, name=name) as sender:
        conn.send(("attached", os.getpid()))
        for i in range(count):
            sender.put((name, i))
        if then == "hang":
            conn.send(("sent", count))
            time.sleep(3600)
        if then == "forever":
            conn.send(("sent", count))
            i = count
            try:
                while True:
                    sender.put((name, i))
                    i += 1
            except ab.BroadcastError as exc:
                conn.send(("raised", (type(exc).__name__, str(exc), time.monotonic())))
    conn.send(("closed", count))


def collector_proc(conn: Conn, capacity: int) -> None:
    """Open a blocking collector, send its handle, wait for "go", then take ``n`` items as told
    and report them; then wait to be killed."""
    reporting(conn, lambda: _collect(conn, capacity))


def _collect(conn: Conn, capacity: int) -> None:
    with blocking.open_collector(capacity=capacity, slot_bytes=256) as collector:
        conn.send(("handle", collector.handle.to_json()))
        _expect(conn, "go")
        got: list[Any] = []
        while len(got) < 1:
            got.append(collector.get(timeout=30))
        conn.send(("took", [repr(d) for d in got]))
        time.sleep(3600)


def remote_writer_proc(conn: Conn, count: int, then: str) -> None:
    """A remote sender: a blocking writer serving TCP on loopback. Sends its handle, waits for
    its one TCP reader (the collector), puts 0 .. count-1, then ``"close"`` or ``"die"``
    (SIGKILL itself once its items are taken)."""
    reporting(conn, lambda: _remote_write(conn, count, then))


def _remote_write(conn: Conn, count: int, then: str) -> None:
    with blocking.open_writer(tcp="tcp://127.0.0.1:0", max_readers=1, capacity=8, slot_bytes=512) as writer:
        conn.send(("handle", writer.handle.to_json()))
        deadline = time.monotonic() + 30
        while not any(r.transport == "tcp" for r in writer.statistics().readers):
            if time.monotonic() > deadline:
                raise TimeoutError("the collector did not attach")
            time.sleep(0.01)
        for i in range(count):
            writer.put(i)
        if then == "die":
            _expect(conn, "die")
            os.kill(os.getpid(), 9)
    conn.send(("closed", count))


def remote_sender_proc(conn: Conn, handle: str, count: int) -> None:
    """A remote sender (``open_sender(..., tcp=...)`` on loopback, blocking): sends its remote
    handle, puts 0 .. count-1 at once (before the collector attaches: the last ones wait for it),
    then closes and reports."""
    reporting(conn, lambda: _remote_send(conn, handle, count))


def _remote_send(conn: Conn, handle: str, count: int) -> None:
    with blocking.open_sender(handle, name="far", tcp="tcp://127.0.0.1:0", capacity=8, slot_bytes=256) as sender:
        assert sender.remote_handle is not None
        conn.send(("handle", sender.remote_handle.to_json()))
        for i in range(count):
            sender.put(i)
        conn.send(("sent", count))
    conn.send(("closed", count))


def remote_collector_proc(conn: Conn) -> None:
    """A collector for a remote sender: sends its handle, is sent the remote sender's handle,
    attaches it, takes one item, reports it, and waits to be killed."""
    reporting(conn, lambda: _remote_collect(conn))


def _remote_collect(conn: Conn) -> None:
    with blocking.open_collector(capacity=8, slot_bytes=256) as collector:
        conn.send(("handle", collector.handle.to_json()))
        collector.attach(conn.recv(), name="far")
        conn.send(("took", repr(collector.get(timeout=30))))
        time.sleep(3600)


def netns_remote_sender_proc(conn: Conn, netns: str, handle: str, count: int) -> None:
    """A remote sender on the "writer host" (network namespace ``netns``): sends its remote
    handle, puts 0 .. count-1 (before the collector attaches) and reports "sent"; on "more",
    puts until ``CollectorGone`` and reports how many more it put."""
    import _netns

    _netns.enter(netns)
    reporting(conn, lambda: _netns_send(conn, handle, count))


def _netns_send(conn: Conn, handle: str, count: int) -> None:
    import _netns

    with blocking.open_sender(handle, name="far", tcp=f"tcp://{_netns.WRITER_IP}:0", heartbeat_s=0.5) as sender:
        assert sender.remote_handle is not None
        conn.send(("handle", sender.remote_handle.to_json()))
        for i in range(count):
            sender.put(i)
        conn.send(("sent", count))
        _expect(conn, "more")
        i = count
        try:
            while True:
                sender.put(i, timeout=60)
                i += 1
                time.sleep(0.01)
        except ab.CollectorGone:
            conn.send(("gone", i - count))
    conn.send(("closed", i))


def netns_collector_proc(conn: Conn, netns: str, count: int) -> None:
    """A collector on the "reader host" (network namespace ``netns``): sends its handle, is sent
    a remote sender's handle, attaches it, takes ``count`` items and reports their values."""
    import _netns

    _netns.enter(netns)
    reporting(conn, lambda: _netns_collect(conn, count))


def _netns_collect(conn: Conn, count: int) -> None:
    with blocking.open_collector() as collector:
        conn.send(("handle", collector.handle.to_json()))
        collector.attach(conn.recv(), name="far")
        got = [collector.get(timeout=30) for _ in range(count)]
        conn.send(("took", [d.value if isinstance(d, ab.Item) else repr(d) for d in got]))
        time.sleep(3600)


# --- items the collector cannot decode (pickled by the tests, unpickled in the collector) --------
class CtrlCOnce:
    """Unpickling it raises KeyboardInterrupt the first time (a Ctrl-C in the collector)."""

    fired = False

    def __reduce__(self) -> Any:
        return (_ctrl_c_once, ())


def _ctrl_c_once() -> str:
    if not CtrlCOnce.fired:
        CtrlCOnce.fired = True
        raise KeyboardInterrupt
    return "decoded"


def _refuse() -> None:
    raise ValueError("cannot be built here")


class Undecodable:
    def __reduce__(self) -> Any:
        return (_refuse, ())
