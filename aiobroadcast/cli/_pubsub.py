"""``aiobroadcast publish`` and ``aiobroadcast subscribe``: a writer fed from stdin (or a tick
generator) that saves its handle to a file, and a reader that opens a handle file and prints or
counts what arrives. The docker compose services run exactly these."""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import sys
import time
from typing import Any

import anyio

from .._constants import TCP_SERVER_READER_NAME
from .._exceptions import (
    DeserializationError,
    EndOfStream,
    InvalidHandle,
    ReaderLagged,
    TransportError,
    WriterGone,
)
from .._handle import Handle
from .._open import open_reader, open_writer
from .._reader import Reader
from .._writer import Writer
from ._common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    MissingHandleFile,
    UsageError,
    children_ignore_sigint,
    error,
    fail,
    load_handle,
    load_keys,
    run_async,
    stop_on_signals,
)


# --- publish ------------------------------------------------------------------------------------
def register(sub: Any) -> None:
    _register_publish(sub)
    _register_subscribe(sub)


def _register_publish(sub: Any) -> None:
    p = sub.add_parser(
        "publish",
        help="publish stdin lines, JSON values or generated ticks; save the handle to a file",
        description=(
            "Create a channel, save its handle to HANDLE_FILE (mode 0600; readers open it with "
            "'aiobroadcast subscribe HANDLE_FILE'), then publish: each line of stdin as a string "
            '(default), each line of stdin as a JSON value (--json), or a tick {"seq": N, "time": T} '
            "RATE times a second (--ticks RATE). Messages travel as JSON, never pickle. At the end of "
            "the input (or after --count messages) the channel is closed: readers receive everything, "
            "then end. SIGTERM or Ctrl-C closes the channel the same way, and the handle file is "
            "removed. Exit codes: 0 done (also after SIGTERM), 1 failed, 2 usage error, 130 Ctrl-C."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("handle_file", metavar="HANDLE_FILE", help="where to write the channel's handle (mode 0600)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--json", action="store_true", help="each stdin line is one JSON value (else: a string)")
    source.add_argument(
        "--ticks", type=float, default=None, metavar="RATE", help="ignore stdin; publish RATE ticks a second"
    )
    p.add_argument("--count", type=int, default=0, help="stop after this many messages (0: until the input ends)")
    p.add_argument(
        "--wait-readers",
        type=int,
        default=0,
        metavar="N",
        help="publish nothing until N readers (local or remote) are attached",
    )
    p.add_argument("--capacity", type=int, default=64, help="slots in the ring")
    p.add_argument("--slot-bytes", type=int, default=1 << 16, help="bytes per slot (larger messages take several)")
    p.add_argument("--max-readers", type=int, default=16, help="readers that may attach at once (each transport)")
    p.add_argument(
        "--policy",
        choices=("block", "lag"),
        default="block",
        help="block: wait for the slowest live reader; lag: never wait, slow readers are told what they missed",
    )
    p.add_argument(
        "--tcp",
        default=None,
        metavar="ENDPOINT",
        help="also serve remote readers over CurveZMQ on this endpoint, e.g. tcp://0.0.0.0:5555 "
        "(port 0: any free port)",
    )
    p.add_argument(
        "--advertise",
        default=None,
        metavar="HOST",
        help="the host remote readers connect to, written into the handle with the bound port "
        "(needed with tcp://0.0.0.0:...; in docker compose: the writer's service name)",
    )
    p.add_argument(
        "--keys",
        default=None,
        metavar="FILE",
        help="serve with these CurveZMQ keys (from 'aiobroadcast keygen --out FILE') instead of fresh ones, "
        "so that readers' handles stay valid across restarts",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="serve plain TCP without CurveZMQ (messages still signed); only on a closed test network",
    )
    p.set_defaults(func=_run_publish)


def _run_publish(args: argparse.Namespace) -> int:
    if args.count < 0 or args.wait_readers < 0:
        error("--count and --wait-readers must be 0 or more")
        return EXIT_USAGE
    if args.ticks is not None and args.ticks <= 0:
        error("--ticks RATE must be more than 0 (ticks per second)")
        return EXIT_USAGE
    if args.advertise is not None and args.tcp is None:
        error("--advertise needs --tcp (the endpoint to bind)")
        return EXIT_USAGE
    if (args.insecure or args.keys) and args.tcp is None:
        error("--insecure and --keys need --tcp")
        return EXIT_USAGE
    if args.insecure and args.keys:
        error("--insecure sends no CurveZMQ at all: drop --keys or --insecure")
        return EXIT_USAGE
    if args.advertise is not None and not _HOST.fullmatch(args.advertise):
        error(f"--advertise takes a host name or address, without scheme or port, not {args.advertise!r}")
        return EXIT_USAGE
    return run_async(lambda: _publish(args))


#: A host name, an IPv4 address or a bracketed IPv6 address: what ``--advertise`` takes.
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")


async def _publish(args: argparse.Namespace) -> int:
    keys = load_keys(args.keys) if args.keys else None
    try:
        opening = open_writer(
            capacity=args.capacity,
            slot_bytes=args.slot_bytes,
            max_readers=args.max_readers,
            policy=args.policy,
            codec="json",
            tcp=args.tcp,
            insecure=args.insecure,
            advertise=args.advertise,
            keys=keys,
        )
    except ValueError as exc:
        fail(str(exc))
    with children_ignore_sigint():
        writer = await opening
    async with writer:
        handle = writer.handle
        try:
            # Signals are handled before the handle file appears: whoever sees the file may
            # send SIGTERM at once and must get the clean stop it documents.
            async with stop_on_signals() as stop:
                try:
                    handle.save(args.handle_file)
                except OSError as exc:
                    fail(f"cannot write the handle file {args.handle_file!r}: {exc.strerror or exc}")
                where = ""
                if handle.tcp:
                    security = "NO encryption" if args.insecure else f"CurveZMQ, {'fixed' if keys else 'fresh'} keys"
                    where = f"; remote readers: {handle.tcp} (bound {args.tcp}, {security})"
                _status(f"publishing on {handle.name}; handle in {args.handle_file}{where}")
                if args.wait_readers:
                    await _wait_readers(writer, args.wait_readers)
                if args.ticks is not None:
                    await _publish_ticks(writer, args.ticks, args.count)
                else:
                    await _publish_stdin(writer, args.json, args.count)
            sent = writer.statistics().sent
            readers = len(_attached(writer))
        finally:
            _remove_if_ours(args.handle_file, handle)
    _status(f"published {sent} messages; {readers} readers were attached at the end; channel closed")
    return stop.exit_code if stop.exit_code is not None else EXIT_OK


def _attached(writer: Writer[Any]) -> list[Any]:
    """The attached readers, without the TCP server's own place in the ring (it reads the ring
    on behalf of the remote readers, which are listed too)."""
    serves_tcp = writer.handle.tcp is not None
    return [
        r
        for r in writer.statistics().readers
        if not (serves_tcp and r.transport == "shm" and r.name == TCP_SERVER_READER_NAME)
    ]


async def _wait_readers(writer: Writer[Any], n: int) -> None:
    _status(f"waiting for {n} readers to attach")
    attached = await writer.wait_readers(n)  # local and remote, not the TCP server's own place
    _status(f"{len(attached)} readers attached: " + ", ".join(f"{r.name} ({r.transport})" for r in attached))


async def _publish_ticks(writer: Writer[Any], rate: float, count: int) -> None:
    interval = 1.0 / rate
    start = time.monotonic()
    seq = 0
    while not count or seq < count:
        delay = start + seq * interval - time.monotonic()
        if delay > 0:
            await anyio.sleep(delay)
        await writer.put({"seq": seq, "time": time.time()})
        seq += 1


class StdinLines:
    """Lines of a file descriptor, read in the event loop: a signal can stop a wait for the next
    line at once (a thread blocked in ``readline`` would keep the process alive until EOF)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buf = b""
        self._eof = False
        # Regular files never block, and epoll refuses them (and /dev/null): read those directly.
        self._poll = not stat.S_ISREG(os.fstat(fd).st_mode)

    async def readline(self) -> str | None:
        """The next line without its newline, or ``None`` at the end of the input."""
        while True:
            i = self._buf.find(b"\n")
            if i >= 0 or self._eof:
                end = i if i >= 0 else len(self._buf)
                line, self._buf = self._buf[:end], self._buf[end + 1 :]
                if i < 0 and not line:
                    return None
                return line.decode("utf-8", "replace")
            if self._poll:
                try:
                    await anyio.wait_readable(self._fd)
                except OSError:  # not pollable after all
                    self._poll = False
            chunk = os.read(self._fd, 1 << 16)  # readable (or a regular file): does not block
            if not chunk:
                self._eof = True
            self._buf += chunk


async def _publish_stdin(writer: Writer[Any], as_json: bool, count: int) -> None:
    if sys.stdin is None:
        fail("stdin is closed; give publish some input, or use --ticks RATE")
    lines = StdinLines(sys.stdin.fileno())
    sent = 0
    lineno = 0
    while not count or sent < count:
        text = await lines.readline()
        if text is None:
            break
        lineno += 1
        obj: Any = text
        if as_json:
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except ValueError as exc:
                fail(f"stdin line {lineno} is not JSON ({exc}); fix the input, or drop --json to send lines as text")
        await writer.put(obj)
        sent += 1


def _remove_if_ours(path: str, handle: Handle) -> None:
    """Remove the handle file at exit, unless another writer has replaced it meanwhile."""
    try:
        if load_handle(path).name == handle.name:
            os.unlink(path)
    except (UsageError, OSError):
        pass


def _status(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- subscribe ----------------------------------------------------------------------------------
def _register_subscribe(sub: Any) -> None:
    p = sub.add_parser(
        "subscribe",
        help="open a handle file and print (or count) every message that arrives",
        description=(
            "Attach a reader to the channel named by HANDLE_FILE and print every message on stdout, "
            "one line each: strings as they are, anything else as JSON. Over shared memory when the "
            "writer's ring is reachable from here, else over the writer's TCP endpoint (--transport "
            "chooses). Ends when the writer closes the channel, after --count messages, or on "
            "SIGTERM/Ctrl-C; a summary goes to stderr. Exit codes: 0 done (also after SIGTERM), "
            "1 the writer died or the channel closed before --count, 2 usage error (missing or bad "
            "handle file, writer unreachable), 130 Ctrl-C."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("handle_file", metavar="HANDLE_FILE", help="the handle file a writer saved (publish, relay)")
    p.add_argument(
        "--name",
        default=None,
        help="this reader's name in stats and logs, unique on the channel (default: reader-PID-N)",
    )
    p.add_argument("--count", type=int, default=0, help="exit after this many messages (0: until the channel ends)")
    p.add_argument("--quiet", action="store_true", help="print no messages, only the summary")
    p.add_argument(
        "--transport",
        choices=("auto", "shm", "tcp"),
        default="auto",
        help="shm: shared memory (same host or IPC namespace); tcp: the writer's TCP endpoint; auto: shm if reachable",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait this long for the handle file to appear and its writer to answer (0: do not wait)",
    )
    p.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to wait for a TCP writer's answer")
    p.add_argument("--no-pickle", action="store_true", help="refuse a channel that sends pickle (JSON channels only)")
    p.set_defaults(func=_run_subscribe)


def _run_subscribe(args: argparse.Namespace) -> int:
    if args.count < 0 or args.wait < 0 or args.connect_timeout <= 0:
        error("--count and --wait must be 0 or more, --connect-timeout more than 0")
        return EXIT_USAGE
    return run_async(lambda: _subscribe(args))


async def _open_with_retry(args: argparse.Namespace, name: str | None) -> Reader[Any]:
    """Open the reader; with ``--wait``, retry while the file is missing, stale (a previous
    writer's) or its writer does not answer yet."""
    deadline = time.monotonic() + args.wait
    while True:
        try:
            handle = load_handle(args.handle_file)
            return await open_reader(
                handle,
                name=name,
                transport=args.transport,
                trust_pickle=not args.no_pickle,
                connect_timeout=args.connect_timeout,
            )
        except (UsageError, InvalidHandle, TransportError) as exc:
            if time.monotonic() >= deadline:
                if args.wait:
                    hint = f" (after waiting {args.wait:g} s)"
                elif isinstance(exc, UsageError) and not isinstance(exc, MissingHandleFile):
                    hint = ""  # a bad file: waiting would not help
                else:
                    hint = " (--wait SECONDS waits for the writer to start)"
                raise UsageError(f"{exc}{hint}") from None
        await anyio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


async def _subscribe(args: argparse.Namespace) -> int:
    name: str | None = args.name  # None: the library's default, unique (reader-<pid>-<n>)
    received = missed = bad = 0
    code = EXIT_OK
    async with stop_on_signals() as stop:
        reader = await _open_with_retry(args, name)
        name = reader.name
        async with reader:
            st = reader.statistics()
            how = (
                f"remote, over TCP {reader.handle.tcp}"
                if st.place < 0
                else f"local, over shared memory (place {st.place})"
            )
            _status(f"{name}: attached to {reader.handle.name}, {how}")
            out = sys.stdout
            while not args.count or received < args.count:
                try:
                    obj = await reader.get()
                except ReaderLagged as exc:
                    missed += exc.missed
                    _status(f"{name}: missed {exc.missed} messages (the writer overwrote them: policy lag)")
                    continue
                except DeserializationError as exc:
                    bad += 1
                    _status(f"{name}: {exc}")
                    continue
                except EndOfStream:
                    if args.count:
                        error(f"the channel closed after {received} of the {args.count} messages asked for")
                        code = EXIT_FAILED
                    break
                except WriterGone as exc:
                    error(f"{exc} (received {received})")
                    code = EXIT_FAILED
                    break
                received += 1
                if not args.quiet:
                    out.write(_format(obj) + "\n")
                    out.flush()
    extra = f", missed {missed}" if missed else ""
    extra += f", {bad} could not be decoded" if bad else ""
    _status(f"{name}: received {received} messages{extra}")
    return stop.exit_code if stop.exit_code is not None else code


def _format(obj: Any) -> str:
    if isinstance(obj, str):
        return obj
    if hasattr(obj, "model_dump_json"):
        return str(obj.model_dump_json())
    return json.dumps(obj, default=repr, ensure_ascii=False)
