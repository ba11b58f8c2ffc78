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

from .._base.constants import TCP_SERVER_READER_NAME
from .._base.errors import (
    DeserializationError,
    EndOfStream,
    InvalidHandle,
    ReaderLagged,
    TransportError,
    WriterGone,
    plural,
)
from .._base.handle import CurveKeys, Handle
from .._broadcast.open import open_reader, open_writer
from .._broadcast.reader import Reader
from .._broadcast.writer import Writer
from ._common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    HelpFormatter,
    UsageError,
    children_ignore_sigint,
    error,
    fail,
    load_handle,
    load_keys,
    run_async,
    stop_on_signals,
)
from ._reach import known_gone, may_still_start


# --- publish ------------------------------------------------------------------------------------
# argparse, spelled out per command as in the other cli modules: a table or wrapper of
# add_parser/add_argument calls would only hide argparse's own API.
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
        formatter_class=HelpFormatter,
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
        "--directory",
        default="/dev/shm",
        metavar="DIR",
        help="where the ring's file goes: a tmpfs (shared memory) that the readers on this host see at the same path",
    )
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
        help="serve with these CurveZMQ keys (from 'aiobroadcast keygen --out FILE') instead of fresh ones: "
        "with a fixed port in --tcp, the channel is the same at every start, so readers' handles stay valid "
        "across restarts (readers attached to the old run end; 'subscribe --follow' re-attaches)",
    )
    p.add_argument(
        "--make-keys",
        action="store_true",
        help="with --keys FILE: if FILE does not exist, make fresh keys and save them there (mode 0600) first, "
        "so that this start and the later ones serve with the same keys (a service's first start)",
    )
    p.add_argument(
        "--allow-list",
        default=None,
        metavar="FILE",
        help="admit only the remote readers on this allow list, each with a key pair of its own ('aiobroadcast "
        "keygen --reader NAME --allow-list FILE ...'), not the handle's shared key; the file is read again when "
        "it changes: a reader revoked there ('keygen --revoke NAME') is dropped and shut out for good",
    )
    p.add_argument(
        "--channel",
        default=None,
        metavar="NAME",
        help="a name that makes the channel the same at every start of this command (same NAME, and with "
        "--tcp the same endpoint and --keys): handles saved by earlier runs open readers on this one, over "
        "shared memory too (default: a new channel each start, unless --keys and a fixed port)",
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
    if (args.insecure or args.keys or args.allow_list) and args.tcp is None:
        error("--insecure, --keys and --allow-list need --tcp")
        return EXIT_USAGE
    if args.make_keys and not args.keys:
        error("--make-keys needs --keys FILE (where to keep the keys)")
        return EXIT_USAGE
    if args.insecure and args.keys:
        error("--insecure sends no CurveZMQ at all: drop --keys or --insecure")
        return EXIT_USAGE
    if args.advertise is not None and not _HOST.fullmatch(args.advertise):
        error(f"--advertise takes a host name or address, without scheme or port, not {args.advertise!r}")
        return EXIT_USAGE
    if args.make_keys and not os.path.lexists(args.keys):
        try:
            _make_keys(args.keys)
        except UsageError as exc:
            error(str(exc))
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
            directory=args.directory,
            tcp=args.tcp,
            insecure=args.insecure,
            advertise=args.advertise,
            keys=keys,
            allow_list=args.allow_list,
            channel=args.channel,
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
    attached = f"{plural(readers, 'reader')} {'was' if readers == 1 else 'were'} attached at the end"
    _status(f"published {plural(sent, 'message')}; {attached}; channel closed")
    return stop.exit_code if stop.exit_code is not None else EXIT_OK


def _make_keys(path: str) -> None:
    """``--make-keys``: the first start of a service makes the keys its later starts use."""
    try:
        CurveKeys.generate().save(path)
    except OSError as exc:
        fail(f"cannot write the key file {path!r}: {exc.strerror or exc}")
    _status(f"made fresh CurveZMQ keys in {path} (mode 0600); later starts with --keys {path} use them")


def _attached(writer: Writer[Any]) -> list[Any]:
    """The attached readers, without the TCP server's own place in the ring (it reads the ring
    on behalf of the remote readers, which are listed too)."""
    serves_tcp = writer.handle.tcp is not None
    return [
        r
        for r in writer.statistics().readers
        if not (serves_tcp and r.transport in ("shm", "tcp-server") and r.name == TCP_SERVER_READER_NAME)
    ]


async def _wait_readers(writer: Writer[Any], n: int) -> None:
    _status(f"waiting for {plural(n, 'reader')} to attach")
    attached = await writer.wait_readers(n)  # local and remote, not the TCP server's own place
    _status(f"{plural(len(attached), 'reader')} attached: " + ", ".join(f"{r.name} ({r.transport})" for r in attached))


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
    """Remove the handle file at exit, unless another writer has replaced it meanwhile (a
    restarted writer of the same channel has the same name, in another process)."""
    try:
        saved = load_handle(path)
        if (saved.name, saved.writer_pid) == (handle.name, handle.writer_pid):
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
            "SIGTERM/Ctrl-C; a summary goes to stderr. With --follow, a writer that closes or dies does not "
            "end it: it waits for the writer to start again and re-attaches with the same handle (a writer "
            "started again with the same 'publish --channel', or the same --keys and --tcp port, accepts it), "
            "saying on stderr that it did and how many messages it may have missed. Exit codes: 0 done (also "
            "after SIGTERM), 1 the writer died or the channel closed before --count, 2 usage error (missing or "
            "bad handle file, writer unreachable), 130 Ctrl-C."
        ),
        formatter_class=HelpFormatter,
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
    p.add_argument(
        "--follow",
        action="store_true",
        help="when the writer closes the channel or dies, wait for it to start again and re-attach with the "
        "same handle (until --count, SIGTERM or Ctrl-C)",
    )
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
        handle: Handle | None = None
        try:
            handle = load_handle(args.handle_file)
            gone = await known_gone(handle) if args.transport == "auto" else None
            if gone is not None:
                raise InvalidHandle(gone)  # rather than waiting --connect-timeout for TCP
            return await _open(args, handle, name)
        except (UsageError, InvalidHandle, TransportError) as exc:
            if time.monotonic() >= deadline:
                if args.wait:
                    hint = f" (after waiting {args.wait:g} s)"
                elif await may_still_start(exc, handle):
                    hint = " (--wait SECONDS waits for the writer to start)"
                else:
                    hint = ""  # a bad file, a channel that is gone, another writer: waiting would not help
                raise UsageError(f"{exc}{hint}") from None
        await anyio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


async def _subscribe(args: argparse.Namespace) -> int:
    name: str | None = args.name  # None: the library's default, unique (reader-<pid>-<n>)
    tally = _Tally()
    code = EXIT_OK
    async with stop_on_signals() as stop:
        reader = await _open_with_retry(args, name)
        name = reader.name
        handle = reader.handle
        _status(f"{name}: attached to {handle.name}, {_how(reader)}")
        while True:
            async with reader:
                ended = await _read(reader, args, name, tally)
            if ended == "count":
                break
            if not args.follow:
                code = EXIT_FAILED if args.count or ended == "gone" else EXIT_OK
                break
            reader = await _reattach(args, name, handle)
            # What the old run had not delivered here (if it died) and what the new one published
            # before this reader attached (it starts with the next message) are not known here.
            _status(f"{name}: writer restarted; re-attached, {_how(reader)}; messages missed: unknown")
    extra = f", missed {tally.missed}" if tally.missed else ""
    extra += f", {tally.bad} could not be decoded" if tally.bad else ""
    _status(f"{name}: received {plural(tally.received, 'message')}{extra}")
    return stop.exit_code if stop.exit_code is not None else code


class _Tally:
    """What ``subscribe`` counted, over every run it followed."""

    def __init__(self) -> None:
        self.received = self.missed = self.bad = 0


def _how(reader: Reader[Any]) -> str:
    st = reader.statistics()
    return f"remote, over TCP {reader.handle.tcp}" if st.place < 0 else f"local, over shared memory (place {st.place})"


async def _read(reader: Reader[Any], args: argparse.Namespace, name: str, tally: _Tally) -> str:
    """Print what arrives until ``--count`` ("count"), the channel closes ("closed") or the
    writer is gone ("gone"), saying so on stderr."""
    out = sys.stdout
    while not args.count or tally.received < args.count:
        try:
            obj = await reader.get()
        except ReaderLagged as exc:
            tally.missed += exc.missed
            _status(f"{name}: missed {plural(exc.missed, 'message')} (the writer overwrote them: policy lag)")
            continue
        except DeserializationError as exc:
            tally.bad += 1
            _status(f"{name}: {exc}")
            continue
        except EndOfStream:
            if args.follow:
                _status(f"{name}: the writer closed the channel; waiting for it to start again (--follow)")
            elif args.count:
                error(f"the channel closed after {tally.received} of the {plural(args.count, 'message')} asked for")
            return "closed"
        except WriterGone as exc:
            if args.follow:
                _status(f"{name}: {exc}; waiting for it to start again (--follow)")
            else:
                error(f"{exc} (received {tally.received})")
            return "gone"
        tally.received += 1
        if not args.quiet:
            out.write(_format(obj) + "\n")
            out.flush()
    return "count"


async def _open(args: argparse.Namespace, handle: Handle, name: str | None) -> Reader[Any]:
    """A reader of ``handle`` as ``subscribe``'s options ask."""
    return await open_reader(
        handle,
        name=name,
        transport=args.transport,
        trust_pickle=not args.no_pickle,
        connect_timeout=args.connect_timeout,
    )


async def _reattach(args: argparse.Namespace, name: str, handle: Handle) -> Reader[Any]:
    """``--follow``: open a reader on ``handle`` again, as soon as a writer of its channel
    accepts it (the segment is back, or the server answers); each new reason it is not yet
    accepted is said once on stderr."""
    said = ""
    while True:
        try:
            return await _open(args, handle, name)
        except (InvalidHandle, TransportError) as exc:
            if str(exc) != said:
                said = str(exc)
                _status(f"{name}: not re-attached yet: {said}")
        await anyio.sleep(0.2)


def _format(obj: Any) -> str:
    if isinstance(obj, str):
        return obj
    if hasattr(obj, "model_dump_json"):
        return str(obj.model_dump_json())
    return json.dumps(obj, default=repr, ensure_ascii=False)
