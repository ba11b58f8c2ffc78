# This file must fail to type-check exactly on the lines marked "# error: <code>".
# tests/test_types.py runs mypy --strict on it and compares.
from __future__ import annotations

from pydantic import BaseModel

from aiobroadcast import blocking


class Tick(BaseModel):
    price: float


def misuse() -> None:
    with blocking.open_writer(schema=Tick) as writer:
        writer.put(Tick(price=1.0), timeout=1.0)
        writer.put_nowait(Tick(price=2.0))
        writer.put("not a tick")  # error: arg-type
        writer.get()  # error: attr-defined
        writer.get_nowait()  # error: attr-defined
        for _ in writer:  # error: attr-defined
            pass
        with blocking.open_reader(writer.handle, schema=Tick) as reader:
            tick: Tick = reader.get(timeout=1.0)
            also: Tick = reader.get_nowait()
            for more in reader:
                print(more.price)
            print(tick.price + also.price)
            reader.put(tick)  # error: attr-defined
            reader.put_nowait(tick)  # error: attr-defined
            wrong: str = reader.get()  # error: assignment
            print(wrong)
    blocking.BlockingWriter()  # error: call-arg
    blocking.BlockingReader()  # error: call-arg
