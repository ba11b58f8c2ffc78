"""A schema violation is an error of the project's hierarchy (``SchemaViolation``, a
``SerializationError`` and a ``ValueError``) from every sending role, with pydantic's errors on it
and pydantic's ``ValidationError`` as its cause; nothing is published for it and nothing already
accepted is lost."""

from __future__ import annotations

from typing import Any

import anyio
import pydantic
import pytest
from pydantic import BaseModel

import aiobroadcast as ab
from aiobroadcast import blocking

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> Any:
    return ("asyncio", {"use_uvloop": False})


class Tick(BaseModel):
    symbol: str
    price: float


def _is_violation(exc: BaseException, field: str) -> None:
    assert isinstance(exc, ab.SchemaViolation)
    assert isinstance(exc, ab.SerializationError) and isinstance(exc, ab.BroadcastError)
    assert isinstance(exc, ValueError)
    assert not isinstance(exc, pydantic.ValidationError)
    assert isinstance(exc.__cause__, pydantic.ValidationError)
    assert exc.errors and any(e["loc"] == (field,) for e in exc.errors), exc.errors
    assert "Tick" in str(exc) and field in str(exc)


async def test_a_writer_raises_schema_violation_and_publishes_nothing() -> None:
    async with ab.open_writer(capacity=8, slot_bytes=256, schema=Tick) as writer:
        async with ab.open_reader(writer.handle, schema=Tick) as reader:
            await writer.put(Tick(symbol="A", price=1))
            with pytest.raises(ab.SchemaViolation) as caught:
                await writer.put({"symbol": "X"})  # type: ignore[arg-type]
            _is_violation(caught.value, "price")
            with pytest.raises(ab.SchemaViolation) as caught:
                writer.put_nowait(Tick.model_construct(symbol="Y", price="cheap"))
            _is_violation(caught.value, "price")
            with pytest.raises(ab.SchemaViolation):  # a batch with one bad item: none of it
                await writer.put_many([Tick(symbol="B", price=2), {"price": 3}])  # type: ignore[list-item]
            await writer.put(Tick(symbol="C", price=4))
            assert writer.statistics().sent == 2
            with anyio.fail_after(10):
                assert [await reader.get() for _ in range(2)] == [Tick(symbol="A", price=1), Tick(symbol="C", price=4)]


def test_a_blocking_writer_raises_schema_violation() -> None:
    with blocking.open_writer(capacity=8, slot_bytes=256, schema=Tick) as writer:
        with blocking.open_reader(writer.handle, schema=Tick) as reader:
            puts: list[Any] = [writer.put, writer.put_nowait, lambda o: writer.put_many([o])]
            for put in puts:
                with pytest.raises(ab.SchemaViolation) as caught:
                    put({"symbol": 5, "price": 1})
                _is_violation(caught.value, "symbol")
            writer.put(Tick(symbol="ok", price=1))
            assert reader.get(timeout=10) == Tick(symbol="ok", price=1)


async def test_a_sender_raises_schema_violation_and_its_earlier_items_arrive() -> None:
    async with ab.open_collector(capacity=8, slot_bytes=256, schema=Tick) as collector:
        async with ab.open_sender(collector.handle, name="s") as sender:
            await sender.put(Tick(symbol="A", price=1))
            with pytest.raises(ab.SchemaViolation) as caught:
                await sender.put({"symbol": "X"})
            _is_violation(caught.value, "price")
            with pytest.raises(ab.SchemaViolation):
                sender.put_nowait({"symbol": "X"})
            with pytest.raises(ab.SchemaViolation):
                await sender.put_many([Tick(symbol="B", price=2), {"symbol": "X"}])
            await sender.put(Tick(symbol="C", price=3))
        with anyio.fail_after(10):
            got = [await collector.get() for _ in range(3)]
        assert got == [
            ab.Item("s", Tick(symbol="A", price=1)),
            ab.Item("s", Tick(symbol="C", price=3)),
            ab.SourceClosed("s"),
        ]


def test_a_blocking_sender_raises_schema_violation() -> None:
    with blocking.open_collector(capacity=8, slot_bytes=256, schema=Tick) as collector:
        with blocking.open_sender(collector.handle, name="s") as sender:
            puts: list[Any] = [sender.put, sender.put_nowait, lambda o: sender.put_many([o])]
            for put in puts:
                with pytest.raises(ab.SchemaViolation) as caught:
                    put({"symbol": "X"})
                _is_violation(caught.value, "price")
            sender.put(Tick(symbol="ok", price=1))
        assert collector.get(timeout=10) == ab.Item("s", Tick(symbol="ok", price=1))
