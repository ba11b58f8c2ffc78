"""A pydantic schema on the channel, and what a bad message does.

With ``open_writer(schema=Order)`` the writer is a ``Writer[Order]``: ``put`` validates every
message and sends it as JSON, and readers get ``Order`` instances back (no pickle on either side,
so readers may pass ``trust_pickle=False``). A bad message never reaches anyone:

- on the writer: ``put`` raises ``ab.SchemaViolation`` (its ``errors`` are pydantic's) and publishes
  nothing; the channel
  and its readers go on (and mypy already rejects ``writer.put({"symbol": ...})``: not an Order);
- on a reader whose model is stricter than the writer's (an older or newer version of the
  schema), ``get`` raises ``DeserializationError`` for that message only: it is consumed, the
  next ``get`` returns the next message, and the writer is never held up.

Readers in other processes import the model by the path in the handle (``module:QualName``), so
in real programs define it in a module both sides can import (not in ``__main__``), or pass
``schema=`` to ``open_reader``.

    python examples/typed_messages.py
"""

from __future__ import annotations

from typing import Literal

import anyio
from pydantic import BaseModel, Field

import aiobroadcast as ab


class Order(BaseModel):
    symbol: str = Field(min_length=1, max_length=12)
    side: Literal["buy", "sell"]
    qty: int = Field(gt=0)
    price: float = Field(gt=0)


class SmallOrder(Order):
    """A reader with a stricter idea of an order: at most 100 shares."""

    qty: int = Field(gt=0, le=100)


async def main() -> None:
    async with ab.open_writer(capacity=16, slot_bytes=1024, schema=Order) as writer:
        print(f"channel codec: {writer.handle.codec}, schema: {writer.handle.schema_path}")
        async with (
            ab.open_reader(writer.handle, name="desk", schema=Order, trust_pickle=False) as desk,
            ab.open_reader(writer.handle, name="small-orders", schema=SmallOrder) as small,
        ):
            await writer.put(Order(symbol="ACME", side="buy", qty=10, price=12.5))

            # A bad message: model_construct() skips validation, put() does not.
            bad = Order.model_construct(symbol="ACME", side="hold", qty=-5, price=12.5)
            try:
                await writer.put(bad)
            except ab.SchemaViolation as exc:
                fields = ", ".join(str(e["loc"][0]) for e in exc.errors)
                print(f"writer: put() refused a bad order ({fields}); nothing was published")

            await writer.put(Order(symbol="INIT", side="sell", qty=500, price=3.0))
            await writer.put(Order(symbol="ACME", side="sell", qty=7, price=13.0))
            print(f"writer: {writer.statistics().sent} messages published")

            for _ in range(3):
                order = await desk.get()
                assert isinstance(order, Order)
                print(f"desk: {order.side} {order.qty} {order.symbol} @ {order.price}")

            for _ in range(3):
                try:
                    got = await small.get()
                except ab.DeserializationError as exc:
                    print(f"small-orders: message #{exc.msg_index} does not fit SmallOrder: skipped, reading on")
                    continue
                print(f"small-orders: {got.side} {got.qty} {got.symbol}")


if __name__ == "__main__":
    anyio.run(main)
