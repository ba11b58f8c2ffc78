"""The README's example: one writer, one reader, in one process."""

from __future__ import annotations

import anyio

import aiobroadcast as ab


async def main() -> None:
    async with ab.open_writer(capacity=64, slot_bytes=1 << 16) as writer:
        handle = writer.handle  # pass it (or handle.to_json()) to other processes
        async with ab.open_reader(handle, name="worker-1") as reader:
            await writer.put({"step": 1, "weights": b"..."})
            print(await reader.get())  # {'step': 1, 'weights': b'...'}
            writer.put_nowait("no wait")  # raises ab.WouldBlock if a reader would be overrun
            print(reader.get_nowait())
            await writer.aclose()  # readers drain, then EndOfStream
            async for obj in reader:  # ends cleanly after the close
                print(obj)


if __name__ == "__main__":
    anyio.run(main)
