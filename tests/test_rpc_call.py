"""A call's state machine (``_rpc._Call``), driven by hand: what ``Caller`` and ``BlockingCaller``
both run, without processes or rings. Which reply answers which call, whom a call waits for,
and what the ones that did not answer get."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import aiobroadcast as ab
from aiobroadcast import blocking
from aiobroadcast._base.errors import BroadcastError, ClosedResourceError
from aiobroadcast._base.steps import drive, drive_blocking
from aiobroadcast._calls.core import (
    _DONE,
    _GET,
    _HANDLE,
    _HELLO,
    _NEXT,
    _PUT,
    _REPLY,
    _Book,
    _Call,
    _CallerCore,
    _PoolSpec,
    caller_steps,
    serve_steps,
    worker_steps,
)
from aiobroadcast._fanin.items import Item, SourceClosed, SourceGone


def hello(name: str) -> Item[object]:
    return Item(name, (_HELLO, True, 1234))


def reply(name: str, cid: int, value: object) -> Item[object]:
    return Item(name, (cid, True, value))


def test_a_call_waits_for_every_worker_to_attach_then_sends_then_gathers_the_replies() -> None:
    book = _Book(("a", "b"))
    call = _Call(book, "req")
    assert call.message == (1, "req")
    assert call.need() == _GET
    call.take(hello("a"))
    assert call.need() == _GET  # b is not attached: a request now would miss it
    call.take(hello("b"))
    assert call.need() == _PUT
    assert call.need() == _PUT  # until it is sent
    call.sent()
    assert call.need() == _GET
    call.take(reply("b", 1, "B"))
    assert call.need() == _GET
    call.take(reply("a", 1, "A"))
    assert call.need() == _DONE
    book.busy = False
    assert call.result(1.0) == {"a": ab.Reply("a", "A"), "b": ab.Reply("b", "B")}
    assert book.statistics().calls == 1


def test_a_late_reply_never_answers_the_next_call_and_an_unknown_id_is_counted() -> None:
    book = _Book(("a",))
    first = _Call(book, "one")
    first.take(hello("a"))
    assert first.need() == _PUT
    first.sent()
    book.busy = False  # its deadline passed
    assert first.result(0.5) == {"a": ab.NoReply("a", "deadline", "worker 'a' did not answer within 0.5 s")}
    second = _Call(book, "two")
    assert second.need() == _PUT
    second.sent()
    second.take(reply("a", 1, "late"))  # the first call's answer
    second.take(reply("a", 99, "?"))  # no call has this id
    second.take(Item("a", "not a reply"))
    second.take(Item("stranger", (2, True, "x")))
    assert second.need() == _GET
    second.take(reply("a", 2, "two"))
    second.take(reply("a", 2, "again"))  # a second answer to this call: dropped, counted late
    assert second.need() == _DONE
    book.busy = False
    assert second.result(1.0) == {"a": ab.Reply("a", "two")}
    s = book.statistics()
    assert (s.calls, s.late_replies, s.unknown_replies) == (2, 2, 3)


def test_a_failed_handler_and_ended_workers_are_answers_and_not_waited_for() -> None:
    book = _Book(("ok", "bad", "gone", "left"))
    call = _Call(book, 0)
    for name in ("ok", "bad", "gone", "left"):
        call.take(hello(name))
    call.take(SourceGone("gone", 4321))
    assert call.need() == _PUT
    call.sent()
    call.take(SourceClosed("left"))  # it ended after the request went out
    call.take(Item("bad", (1, False, ("ValueError", "no"))))
    assert call.need() == _GET
    call.take(reply("ok", 1, "yes"))
    assert call.need() == _DONE
    book.busy = False
    out = call.result(1.0)
    assert list(out) == ["ok", "bad", "gone", "left"]  # the order the workers were named
    assert out["ok"] == ab.Reply("ok", "yes")
    assert out["bad"] == ab.Failed("bad", "ValueError", "no")
    assert out["gone"] == ab.NoReply("gone", "dead", "worker 'gone' (pid 4321) died")
    assert out["left"] == ab.NoReply("left", "closed", "worker 'left' closed")


def test_when_every_worker_ended_the_call_stops_waiting() -> None:
    book = _Book(("a",))
    call = _Call(book, 0)
    assert call.need() == _GET
    call.ended()  # the collector's stream ended before a worker attached
    assert call.need() == _PUT
    call.sent()
    assert call.need() == _GET
    call.ended()
    assert call.need() == _DONE
    book.busy = False
    assert call.result(1.0)["a"].reason == "deadline"  # type: ignore[union-attr]


def test_one_call_at_a_time_and_a_finished_call_frees_the_turn() -> None:
    book = _Book(("a",))
    _Call(book, 0)
    with pytest.raises(BroadcastError, match="one call at a time"):
        _Call(book, 1)
    book.busy = False
    assert _Call(book, 2).message == (2, 2)  # the refused call took no id


def test_a_closed_callers_core_starts_no_call() -> None:
    core = object.__new__(_CallerCore)  # its handle is not needed here
    core.book, core.closed = _Book(("a",)), True
    with pytest.raises(ClosedResourceError, match="closed"):
        core.start("x")
    assert core.book.statistics().calls == 0


# --- a worker's serving loop (``serve_steps``), driven by both front ends over fakes ----------------
class FakeRequest:
    """Records what the loop answered; ``reply`` raises what ``refuse`` maps the value to."""

    def __init__(
        self, value: object, log: list[tuple[str, object, object]], refuse: dict[object, BaseException]
    ) -> None:
        self.value = value
        self._log = log
        self._refuse = refuse

    def reply(self, answer: object) -> None:
        if answer in self._refuse:
            raise self._refuse[answer]
        self._log.append(("reply", self.value, answer))

    def fail(self, exc: BaseException) -> None:
        self._log.append(("fail", self.value, f"{type(exc).__name__}: {exc}"))


def handler(v: object) -> object:
    if v == "boom":
        raise ValueError("boom")
    return v


def blocking_serve(values: list[object], refuse: dict[object, BaseException]) -> tuple[int, list[Any]]:
    log: list[Any] = []
    queue = [FakeRequest(v, log, refuse) for v in values]

    def do(step: tuple[int, Any]) -> object:
        what, arg = step
        if what == _NEXT:
            return queue.pop(0) if queue else None
        if what == _HANDLE:
            return handler(arg.value)
        request, x = arg
        (request.reply if what == _REPLY else request.fail)(x)
        return None

    return drive_blocking(serve_steps(), do), log


def async_serve(values: list[object], refuse: dict[object, BaseException]) -> tuple[int, list[Any]]:
    log: list[Any] = []
    queue = [FakeRequest(v, log, refuse) for v in values]

    async def coroutine_handler(v: object) -> object:
        await anyio.lowlevel.checkpoint()
        return handler(v)

    async def do(step: tuple[int, Any]) -> object:
        what, arg = step
        if what == _NEXT:
            return queue.pop(0) if queue else None
        if what == _HANDLE:
            return await coroutine_handler(arg.value)
        request, x = arg
        (request.reply if what == _REPLY else request.fail)(x)
        return None

    async def main() -> tuple[int, list[Any]]:
        return await drive(serve_steps(), do), log

    return anyio.run(main)


@pytest.mark.parametrize("serve", [blocking_serve, async_serve])
def test_serving_answers_each_request_and_a_handlers_error_or_an_unsendable_reply_fails_that_call(
    serve: Callable[[list[object], dict[object, BaseException]], tuple[int, list[Any]]],
) -> None:
    too_big = ab.MessageTooLarge(2000, 1000)
    served, log = serve([1, "boom", "big", 4], {"big": too_big})
    assert served == 4
    assert log == [
        ("reply", 1, 1),
        ("fail", "boom", "ValueError: boom"),
        ("fail", "big", f"MessageTooLarge: {too_big}"),
        ("reply", 4, 4),
    ]


@pytest.mark.parametrize("serve", [blocking_serve, async_serve])
def test_serving_ends_when_the_collector_is_gone(
    serve: Callable[[list[object], dict[object, BaseException]], tuple[int, list[Any]]],
) -> None:
    with pytest.raises(ab.CollectorGone):
        serve([1, 2, 3], {2: ab.CollectorGone(1, "w")})


# --- opening a pool's roles (``caller_steps``, ``worker_steps``), over fakes --------------------------
def open_with_fakes(steps: Any, fail: str | None) -> tuple[list[str], Any]:
    """Drive ``steps`` in a thread over fakes that log what is done; ``fail`` names the step that
    raises. Returns the log and the result (or the error raised)."""
    log: list[str] = []

    def do(step: tuple[str, tuple[Any, ...], dict[str, Any]]) -> object:
        what, args, _kwargs = step
        log.append(what if what.startswith("open_") else f"{what} {args[0]}")
        if what == fail:
            raise ab.BroadcastError(f"{what} failed")
        return what.removeprefix("open_")

    try:
        return log, drive_blocking(steps, do)
    except ab.BroadcastError as exc:
        return log, exc


def test_opening_a_caller_closes_its_request_channel_when_the_collector_cannot_be_made() -> None:
    spec = _PoolSpec(["a", "b"], 8, 1024, None, 100, "/dev/shm")
    assert open_with_fakes(caller_steps(spec), None) == (["open_writer", "open_collector"], ("writer", "collector"))
    log, err = open_with_fakes(caller_steps(spec), "open_collector")
    assert log == ["open_writer", "open_collector", "close writer"]
    assert str(err) == "open_collector failed"


def test_opening_a_worker_says_hello_and_closes_what_it_opened_on_a_failure() -> None:
    with blocking.open_caller(workers=["a"], capacity=8, slot_bytes=1024) as caller:
        handle = caller.handle
        assert open_with_fakes(worker_steps(handle, "a"), None) == (
            ["open_sender", "open_reader", "put sender"],
            ("reader", "sender"),
        )
        log, _ = open_with_fakes(worker_steps(handle, "a"), "put")
        assert log == ["open_sender", "open_reader", "put sender", "close reader", "close sender"]
        log, _ = open_with_fakes(worker_steps(handle, "a"), "open_reader")
        assert log == ["open_sender", "open_reader", "close sender"]
        log, err = open_with_fakes(worker_steps(handle, "stranger"), None)
        assert log == []  # nothing opened
        assert isinstance(err, ab.InvalidArgument)
        assert "not one of this pool's workers" in str(err)
