"""A call's state machine (``_calls.machine._Call``), driven by hand: what ``Caller`` and
``BlockingCaller`` both run, built from worker names alone, without a handle, processes or
rings. Which reply answers which call, whom a call waits for, what the ones that did not answer
get, and which moves between its phases it makes and refuses."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import aiobroadcast as ab
from aiobroadcast import blocking
from aiobroadcast._base.errors import BroadcastError, ClosedResourceError
from aiobroadcast._base.steps import drive_blocking
from aiobroadcast._calls.blocking import serve_blocking
from aiobroadcast._calls.machine import (
    TRANSITIONS,
    Need,
    Phase,
    _Book,
    _Call,
    _CallerCore,
)
from aiobroadcast._calls.open import (
    Close,
    OpenCollector,
    OpenEvent,
    OpenReader,
    OpenSender,
    OpenWriter,
    Put,
    _PoolSpec,
    caller_steps,
    worker_steps,
)
from aiobroadcast._calls.roles import serve_async
from aiobroadcast._calls.types import _HELLO
from aiobroadcast._fanin.items import Item, SourceClosed, SourceGone

#: a deadline for liveness only (never a measurement)
WITHIN_S = 30.0


def hello(name: str) -> Item[object]:
    return Item(name, (_HELLO, True, 1234))


def reply(name: str, cid: int, value: object) -> Item[object]:
    return Item(name, (cid, True, value))


def test_a_call_waits_for_every_worker_to_attach_then_sends_then_gathers_the_replies() -> None:
    book = _Book(("a", "b"))
    call = _Call(book, "req")
    assert call.message == (1, "req")
    assert call.need() is Need.GET
    call.take(hello("a"))
    assert call.need() is Need.GET  # b is not attached: a request now would miss it
    call.take(hello("b"))
    assert call.need() is Need.PUT
    assert call.need() is Need.PUT  # until it is sent
    call.sent()
    assert call.need() is Need.GET
    call.take(reply("b", 1, "B"))
    assert call.need() is Need.GET
    call.take(reply("a", 1, "A"))
    assert call.need() is Need.DONE
    book.busy = False
    assert call.result(1.0) == {"a": ab.Reply("a", "A"), "b": ab.Reply("b", "B")}
    assert book.statistics().calls == 1


def test_a_late_reply_never_answers_the_next_call_and_an_unknown_id_is_counted() -> None:
    book = _Book(("a",))
    first = _Call(book, "one")
    first.take(hello("a"))
    assert first.need() is Need.PUT
    first.sent()
    book.busy = False  # its deadline passed
    assert first.result(0.5) == {"a": ab.NoReply("a", "deadline", "worker 'a' did not answer within 0.5 s")}
    second = _Call(book, "two")
    assert second.need() is Need.PUT
    second.sent()
    second.take(reply("a", 1, "late"))  # the first call's answer
    second.take(reply("a", 99, "?"))  # no call has this id
    second.take(Item("a", "not a reply"))
    second.take(Item("stranger", (2, True, "x")))
    assert second.need() is Need.GET
    second.take(reply("a", 2, "two"))
    second.take(reply("a", 2, "again"))  # a second answer to this call: dropped, counted late
    assert second.need() is Need.DONE
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
    assert call.need() is Need.PUT
    call.sent()
    call.take(SourceClosed("left"))  # it ended after the request went out
    call.take(Item("bad", (1, False, ("ValueError", "no"))))
    assert call.need() is Need.GET
    call.take(reply("ok", 1, "yes"))
    assert call.need() is Need.DONE
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
    assert call.need() is Need.GET
    call.ended()  # the collector's stream ended before a worker attached
    assert call.need() is Need.PUT
    call.sent()
    assert call.need() is Need.GET
    call.ended()
    assert call.need() is Need.DONE
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
    core = _CallerCore(("a",))
    call = core.start("x")
    assert call.phase is Phase.ATTACH
    core.book.busy = False
    core.closed = True
    with pytest.raises(ClosedResourceError, match="closed"):
        core.start("y")
    assert core.book.statistics().calls == 1


# --- the phases and their one table of moves (``TRANSITIONS``) --------------------------------------
def call_at(phase: Phase) -> _Call:
    """A call of a pool of one worker, brought to ``phase`` by the events a front end hands it."""
    call = _Call(_Book(("a",)), "req")
    if phase is Phase.ATTACH:
        return call
    assert call.take(hello("a")) is Need.PUT
    if phase is Phase.SEND:
        return call
    assert call.sent() is Need.GET
    if phase is Phase.REPLIES:
        return call
    assert call.take(reply("a", 1, "A")) is Need.DONE
    return call


def test_the_table_names_every_phase_and_over_is_final() -> None:
    assert set(TRANSITIONS) == set(Phase)
    assert TRANSITIONS[Phase.OVER] == frozenset()
    for phase in Phase:
        assert call_at(phase).phase is phase


@pytest.mark.parametrize("start", list(Phase), ids=lambda p: p.name)
@pytest.mark.parametrize("to", list(Phase), ids=lambda p: p.name)
def test_every_move_in_the_table_is_made_and_every_other_is_refused(start: Phase, to: Phase) -> None:
    call = call_at(start)
    if to in TRANSITIONS[start]:
        call.move(to)
        assert call.phase is to
    else:
        with pytest.raises(BroadcastError, match=f"cannot go from {start.name} to {to.name}"):
            call.move(to)
        assert call.phase is start  # refused: it stays where it was


def test_the_events_make_each_move_of_the_table() -> None:
    """Each move of the table, made by the events that make it in a front end."""
    made: set[tuple[Phase, Phase]] = set()

    def step(call: _Call, event: Callable[[], Need], want: Phase) -> None:
        before = call.phase
        event()
        assert call.phase is want
        made.add((before, want))

    c = call_at(Phase.ATTACH)
    step(c, lambda: c.take(hello("a")), Phase.SEND)  # the last worker attached
    step(c, c.sent, Phase.REPLIES)  # the request is out
    step(c, lambda: c.take(reply("a", 1, "A")), Phase.OVER)  # the last answer came
    c = call_at(Phase.ATTACH)
    step(c, c.ended, Phase.SEND)  # every worker ended before attaching: nobody to miss it
    c = call_at(Phase.REPLIES)
    step(c, c.ended, Phase.OVER)  # every worker ended: nobody left to wait for
    c = call_at(Phase.REPLIES)
    step(c, lambda: c.take(SourceClosed("a")), Phase.OVER)  # the last worker left instead of answering
    book = _Book(("a",))
    book.absorb(hello("a"), 0, {})  # attached before the call began
    c = _Call(book, "req")
    step(c, c.need, Phase.SEND)
    assert made == {(a, b) for a, targets in TRANSITIONS.items() for b in targets}


@pytest.mark.parametrize(
    ("phase", "event"),
    [
        (Phase.ATTACH, "sent"),  # the request went out before the call needed a send
        (Phase.REPLIES, "sent"),  # sent twice
        (Phase.OVER, "sent"),
        (Phase.SEND, "ended"),  # the collector's stream ended while the call sends: no get was asked for
    ],
)
def test_an_event_out_of_turn_is_refused_and_changes_nothing(phase: Phase, event: str) -> None:
    call = call_at(phase)
    before = call._book.statistics(), dict(call._book.absent), call._book.expect
    with pytest.raises(BroadcastError, match="cannot go from"):
        getattr(call, event)()
    assert call.phase is phase
    assert (call._book.statistics(), dict(call._book.absent), call._book.expect) == before


# --- a worker's serving loop (``serve_steps``), run by both drivers over fakes ----------------
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


class AsyncFakeRequest(FakeRequest):
    async def reply(self, answer: object) -> None:  # type: ignore[override]
        await anyio.lowlevel.checkpoint()
        super().reply(answer)

    async def fail(self, exc: BaseException) -> None:  # type: ignore[override]
        await anyio.lowlevel.checkpoint()
        super().fail(exc)


def blocking_serve(values: list[object], refuse: dict[object, BaseException]) -> tuple[int, list[Any]]:
    """The blocking driver (``serve_blocking``), as a ``BlockingWorker`` runs it."""
    log: list[Any] = []
    queue = [FakeRequest(v, log, refuse) for v in values]
    return serve_blocking(lambda: queue.pop(0) if queue else None, handler), log


def async_serve(values: list[object], refuse: dict[object, BaseException]) -> tuple[int, list[Any]]:
    """The async driver (``serve_async``), as a ``Worker`` runs it, with a coroutine handler."""
    log: list[Any] = []

    async def requests() -> AsyncIterator[AsyncFakeRequest]:
        for v in values:
            yield AsyncFakeRequest(v, log, refuse)

    async def coroutine_handler(v: object) -> object:
        await anyio.lowlevel.checkpoint()
        return handler(v)

    async def main() -> tuple[int, list[Any]]:
        return await serve_async(requests(), coroutine_handler), log

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
OPENS = {
    OpenWriter: "open_writer",
    OpenCollector: "open_collector",
    OpenSender: "open_sender",
    OpenReader: "open_reader",
}


def open_with_fakes(steps: Any, fail: str | None) -> tuple[list[str], Any]:
    """Drive ``steps`` in a thread over fakes that log what is done; ``fail`` names the step that
    raises. Returns the log and the result (or the error raised)."""
    log: list[str] = []

    def do(event: OpenEvent) -> object:
        match event:
            case Put(sender, _item):
                what, line = "put", f"put {sender}"
            case Close(role):
                what, line = "close", f"close {role}"
            case _:
                what = line = OPENS[type(event)]
        log.append(line)
        if what == fail:
            raise ab.BroadcastError(f"{what} failed")
        return what.removeprefix("open_")

    try:
        return log, drive_blocking(steps, do)
    except ab.BroadcastError as exc:
        return log, exc


def test_opening_a_caller_closes_its_request_channel_when_the_collector_cannot_be_made() -> None:
    spec = _PoolSpec(["a", "b"], capacity=8, slot_bytes=1024, max_reply_bytes=100, directory="/dev/shm")
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


# --- what a late call reads of its request ring (``_CallerBase._late``), on real writers ------------
def test_a_blocking_writer_is_read_only_while_open_and_a_close_waits_for_the_read() -> None:
    """A late call reads where the workers' readers stand through ``read_channel``: a close from
    another thread meanwhile waits until the read is over (the ring is not released under it),
    and once closed the read is not done at all."""
    w = blocking.open_writer(capacity=8, slot_bytes=1024, max_readers=1)
    reading, release, closed = threading.Event(), threading.Event(), threading.Event()
    seen: list[object] = []

    def read(ch: Any) -> object:
        reading.set()
        assert release.wait(WITHIN_S)
        return ch.pub.closed

    def close() -> None:
        assert reading.wait(WITHIN_S)
        w.close()
        closed.set()

    closer = threading.Thread(target=close)
    reader = threading.Thread(target=lambda: seen.append(w.read_channel(read)))
    reader.start()
    closer.start()
    assert reading.wait(WITHIN_S)
    assert not closed.wait(0.2)  # the close waits for the read
    release.set()
    reader.join(WITHIN_S)
    closer.join(WITHIN_S)
    assert closed.is_set()
    assert seen == [False]  # the ring was open all through the read
    assert w.read_channel(read) is None  # closed: nothing is read


def test_an_async_writer_is_read_only_while_open() -> None:
    async def main() -> None:
        w = await ab.open_writer(capacity=8, slot_bytes=1024, max_readers=1)
        assert w.read_channel(lambda ch: ch.handle) == w.handle
        await w.aclose()
        assert w.read_channel(lambda ch: ch.handle) is None

    anyio.run(main)
