from __future__ import annotations

import pytest

import aiobroadcast as ab

pytestmark = pytest.mark.anyio


async def test_put_get_roundtrip() -> None:
    async with ab.open_writer(capacity=4, slot_bytes=256) as writer:
        async with ab.open_reader(writer.handle, name="r") as reader:
            await writer.put({"x": 1})
            assert await reader.get() == {"x": 1}
