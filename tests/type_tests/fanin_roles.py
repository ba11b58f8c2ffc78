# This file must fail to type-check exactly on the lines marked "# error: <code>".
# tests/test_types.py runs mypy --strict on it and compares.
from __future__ import annotations

from pydantic import BaseModel

import aiobroadcast as ab
from aiobroadcast import blocking


class Tick(BaseModel):
    price: float


async def misuse() -> None:
    async with ab.open_collector(schema=Tick) as collector:
        async with ab.open_sender(collector.handle, name="a", schema=Tick) as sender:
            await sender.put(Tick(price=1.0))
            sender.put_nowait(Tick(price=2.0))
            await sender.put_many([Tick(price=3.0)])
            await sender.put("not a tick")  # error: arg-type
            await sender.get()  # error: attr-defined
            sender.get_nowait()  # error: attr-defined
        got = await collector.get()
        match got:
            case ab.Item(source, value):
                price: float = value.price
                name: str = source
                print(price, name)
            case ab.SourceGone(source, pid):
                print(source, pid)
        also = collector.get_nowait()
        if isinstance(also, ab.Item):
            tick: Tick = also.value
            wrong: str = also.value  # error: assignment
            print(tick, wrong)
        async for delivery in collector:
            print(delivery)
        await collector.put(Tick(price=1.0))  # error: attr-defined
        collector.put_nowait(Tick(price=1.0))  # error: attr-defined
    ab.Collector()  # error: call-arg
    ab.Sender()  # error: call-arg


def blocking_misuse() -> None:
    with blocking.open_collector(schema=Tick) as collector:
        with blocking.open_sender(collector.handle, name="a", schema=Tick) as sender:
            sender.put(Tick(price=1.0), timeout=1.0)
            sender.put("not a tick")  # error: arg-type
            sender.get()  # error: attr-defined
        got = collector.get(timeout=1.0)
        if isinstance(got, ab.Item):
            tick: Tick = got.value
            print(tick)
        collector.put(Tick(price=1.0))  # error: attr-defined
    blocking.BlockingCollector()  # error: call-arg
