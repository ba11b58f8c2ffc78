# This file must fail to type-check exactly on the lines marked "# error: <code>".
# tests/test_types.py runs mypy --strict on it and compares.
from __future__ import annotations

from pydantic import BaseModel

import aiobroadcast as ab


class Tick(BaseModel):
    price: float


async def misuse() -> None:
    async with ab.open_writer(schema=Tick) as writer:
        await writer.put(Tick(price=1.0))
        writer.put_nowait(Tick(price=2.0))
        await writer.put("not a tick")  # error: arg-type
        await writer.get()  # error: attr-defined
        writer.get_nowait()  # error: attr-defined
        async for _ in writer:  # error: attr-defined
            pass
        async with ab.open_reader(writer.handle, schema=Tick) as reader:
            tick: Tick = await reader.get()
            also: Tick = reader.get_nowait()
            price: float = tick.price + also.price
            print(price)
            await reader.put(tick)  # error: attr-defined
            reader.put_nowait(tick)  # error: attr-defined
            wrong: str = await reader.get()  # error: assignment
            print(wrong)
    ab.Writer()  # error: call-arg
    ab.Reader()  # error: call-arg
