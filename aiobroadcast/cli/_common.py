"""What the ``publish``, ``subscribe``, ``stats`` and ``keygen`` commands share: exit codes,
one-line errors, stopping cleanly on SIGINT/SIGTERM, and the event loop they run on."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, NoReturn, TypeVar

import anyio
import anyio.abc
from pydantic import BaseModel, ValidationError

from .._base.errors import plural
from .._base.handle import CurveKeys, Handle

#: Exit codes of every command, ``bench`` and its driver included (the README lists them).
EXIT_OK = 0  #: done: the input ended, the count was reached, or SIGTERM asked for a clean stop
EXIT_FAILED = 1  #: the channel failed under us (writer died, channel closed before --count, ...)
EXIT_USAGE = 2  #: a mistake the user can fix: bad option, missing or bad handle file, ...
EXIT_INTERRUPTED = 130  #: Ctrl-C (SIGINT); everything was closed first


class UsageError(Exception):
    """A mistake the user can fix. The command prints it as one line and exits with 2."""


class MissingHandleFile(UsageError):
    """The handle file does not exist (yet): the writer has not started, or has exited."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every command's help: each option's default, once. Not for a required option (it has
    none), nor for a flag or an option without one (``None``), nor where the help already
    says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if action.required or default is None or default is False or default == argparse.SUPPRESS or "default" in text:
            return text
        return super()._get_help_string(action)


def error(message: str) -> None:
    """Print one error line, the same shape as argparse's and ``aiobroadcast.run``'s."""
    print(f"aiobroadcast: error: {message}", file=sys.stderr, flush=True)


def fail(message: str) -> NoReturn:
    raise UsageError(message)


def loop_options() -> dict[str, Any]:
    """uvloop when it is installed (it is a dependency on CPython/Linux), else plain asyncio."""
    try:
        import uvloop  # noqa: F401
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return {}
    return {"use_uvloop": True}


class Stop:
    """Which signal (if any) stopped the work."""

    signum: int | None = None

    @property
    def exit_code(self) -> int | None:
        """``None`` if no signal came; 130 for SIGINT; 0 for SIGTERM (a requested, clean stop)."""
        if self.signum is None:
            return None
        return EXIT_INTERRUPTED if self.signum == signal.SIGINT else EXIT_OK


@asynccontextmanager
async def stop_on_signals() -> AsyncIterator[Stop]:
    """Run the body until it ends or SIGINT/SIGTERM arrives; a signal cancels the body only,
    so the caller's own ``async with`` blocks around it still close their channels."""
    stop = Stop()
    scope = anyio.CancelScope()

    async def watch(*, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for signum in signals:
                stop.signum = signum
                scope.cancel()
                return

    try:
        async with anyio.create_task_group() as tg:
            await tg.start(watch)
            try:
                with scope:
                    yield stop
            finally:
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The watcher never fails, so the group holds the body's own error: raise it as it is
        # (callers catch ``UsageError``, ``WriterGone``... rather than groups).
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


@contextmanager
def children_ignore_sigint() -> Iterator[None]:
    """Processes started meanwhile ignore SIGINT (Python keeps an inherited ``SIG_IGN``).

    ``open_writer(tcp=...)`` starts the TCP server as a child process in our process group, so
    a terminal's Ctrl-C reaches it too; it would die with a traceback and remote readers would
    get ``WriterGone`` instead of the clean close this process performs on Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def run_async(func: Callable[[], Awaitable[int]]) -> int:
    """Run ``func`` on asyncio (uvloop when available); ``UsageError`` becomes one line and 2."""
    for fd in (0, 1, 2):  # started with one closed: keep the loop's own descriptors off 0-2
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # takes the lowest free descriptor: this one
    try:
        return anyio.run(func, backend_options=loop_options())
    except UsageError as exc:
        error(str(exc))
        return EXIT_USAGE


def run_sync(func: Callable[[], int]) -> int:
    try:
        return func()
    except UsageError as exc:
        error(str(exc))
        return EXIT_USAGE


M = TypeVar("M", bound=BaseModel)


def load_handle(path: str) -> Handle:
    """Read a handle file, or raise ``UsageError`` with one line that says what is wrong and
    what to do (``Handle.load`` reports pydantic's multi-line details)."""
    return _load_json_model(path, Handle, "handle file", "pass the file a writer saved")


def load_keys(path: str) -> CurveKeys:
    """Read a key file made by ``aiobroadcast keygen``, or raise ``UsageError`` (one line)."""
    return _load_json_model(path, CurveKeys, "key file", "make one with 'aiobroadcast keygen --out FILE'")


def _load_json_model(path: str, model: type[M], what: str, todo: str) -> M:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        if model is Handle:
            raise MissingHandleFile(
                f"handle file {path!r} does not exist; start the writer first (it saves the handle there)"
            ) from None
        fail(f"{what} {path!r} does not exist; {todo}")
    except OSError as exc:
        fail(f"cannot read {what} {path!r}: {exc.strerror or exc}")
    except UnicodeDecodeError:
        fail(f"{path!r} is not a {what} (not text); {todo}")
    try:
        data = json.loads(text)
    except ValueError:
        fail(f"{path!r} is not a {what} (not JSON); {todo}")
    if not isinstance(data, dict):
        fail(f"{path!r} is not a {what} (not a JSON object); {todo}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        where = ".".join(str(p) for p in first["loc"]) or "the file"
        more = f" and {plural(len(errors) - 1, 'more problem')}" if len(errors) > 1 else ""
        fail(f"{path!r} is not a valid {what} ({where}: {first['msg']}{more}); {todo}")
