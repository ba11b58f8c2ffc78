"""Zero-copy reads: ``open_reader(zero_copy=True)`` hands out views of the ring, and keeps the
slot they point into until the reader's next ``get``, so the writer cannot overwrite them."""

from __future__ import annotations

import array
from typing import Any, Literal

import anyio
import numpy as np
import pytest

import aiobroadcast as ab
from aiobroadcast._base.codec import OOB_MIN_BYTES

pytestmark = pytest.mark.anyio

BIG = 70_000  # a bytes this large leaves the pickle stream without a copy


def payload(tag: int, size: int = BIG) -> bytes:
    return bytes([tag]) * size


async def test_large_bytes_arrive_as_read_only_views_and_small_values_as_usual() -> None:
    async with ab.open_writer(capacity=4, slot_bytes=BIG + 4096) as writer:
        async with ab.open_reader(writer.handle, zero_copy=True) as reader:
            await writer.put({"n": 1, "body": payload(1), "small": b"abc"})
            got = await reader.get()
            assert isinstance(got["body"], memoryview) and got["body"].readonly
            assert got["body"] == payload(1) and got["small"] == b"abc" and got["n"] == 1
            with pytest.raises(TypeError):
                got["body"][0] = 0
            # Messages without large buffers are what a copying reader gets.
            await writer.put((2, b"x" * 100))
            assert await reader.get() == (2, b"x" * 100)


async def test_the_slot_is_kept_until_the_next_get_and_then_given_back() -> None:
    async with ab.open_writer(capacity=2, slot_bytes=BIG + 4096) as writer:
        async with ab.open_reader(writer.handle, zero_copy=True) as reader:
            await writer.put(payload(1))
            first = await reader.get()
            writer.put_nowait(payload(2))  # the other slot is free
            # The ring is full: slot 0 is still held for `first`, though it has been read.
            with pytest.raises(ab.WouldBlock):
                writer.put_nowait(payload(3))
            assert first == payload(1)
            # The writer counts a held entry as not yet read: it is what it waits for.
            assert writer.statistics().readers[0].lag == 2
            second = await reader.get()  # gives slot 0 back
            writer.put_nowait(payload(3))  # so this fits now, and overwrites `first`'s slot
            assert second == payload(2)
            assert await reader.get() == payload(3)


async def test_a_writer_waiting_for_a_held_slot_goes_on_after_the_next_get() -> None:
    async with ab.open_writer(capacity=2, slot_bytes=BIG + 4096) as writer:
        async with ab.open_reader(writer.handle, zero_copy=True) as reader:
            await writer.put(payload(1))
            assert await reader.get() == payload(1)
            await writer.put(payload(2))
            done = anyio.Event()

            async def put_third() -> None:
                await writer.put(payload(3))  # waits: slot 0 is held, slot 1 unread
                done.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(put_third)
                await anyio.sleep(0.05)
                assert not done.is_set()
                with anyio.fail_after(10):  # a liveness bound, not a timing assertion
                    assert await reader.get() == payload(2)  # gives slot 0 back
                    await done.wait()
                assert await reader.get() == payload(3)


async def test_arrays_out_of_band_arrive_as_read_only_arrays_on_the_ring() -> None:
    arr = np.arange(OOB_MIN_BYTES // 8, dtype=np.int64)
    async with ab.open_writer(capacity=2, slot_bytes=2 * OOB_MIN_BYTES) as writer:
        async with ab.open_reader(writer.handle, zero_copy=True) as copied_not:
            async with ab.open_reader(writer.handle) as copying:
                await writer.put({"a": arr, "b": payload(7)})
                view = await copied_not.get()
                copy = await copying.get()
                assert np.array_equal(view["a"], arr) and not view["a"].flags.writeable
                assert view["b"] == payload(7) and isinstance(view["b"], memoryview)
                assert np.array_equal(copy["a"], arr) and copy["a"].flags.writeable
                assert type(copy["b"]) is bytes and copy["b"] == payload(7)


async def test_a_message_larger_than_a_slot_is_copied_once_and_stays_valid() -> None:
    async with ab.open_writer(capacity=8, slot_bytes=16 * 1024) as writer:
        async with ab.open_reader(writer.handle, zero_copy=True) as reader:
            await writer.put((1, payload(5)))  # spans 5 slots: assembled in the reader
            n, body = await reader.get()
            for k in range(16):  # every slot is reused meanwhile
                await writer.put((k, payload(9, 1000)))
                await reader.get()
            assert n == 1 and body == payload(5)


async def test_under_policy_lag_views_are_of_a_private_copy() -> None:
    async with ab.open_writer(capacity=2, slot_bytes=BIG + 4096, policy="lag") as writer:
        async with ab.open_reader(writer.handle, zero_copy=True) as reader:
            await writer.put(payload(1))
            got = await reader.get()
            for k in range(4):  # a "lag" writer does not wait: it overwrites every slot
                await writer.put(payload(2 + k))
            assert got == payload(1)


async def test_zero_copy_over_tcp() -> None:
    async with ab.open_writer(capacity=4, slot_bytes=BIG + 4096, tcp="tcp://127.0.0.1:0") as writer:
        async with ab.open_reader(writer.handle, transport="tcp", zero_copy=True) as reader:
            await writer.put((1, payload(3)))
            with anyio.fail_after(30):
                n, body = await reader.get()
            assert n == 1 and isinstance(body, memoryview) and body.readonly and body == payload(3)


async def test_no_effect_on_json_channels() -> None:
    async with ab.open_writer(capacity=4, slot_bytes=256, codec="json") as writer:
        async with ab.open_reader(writer.handle, zero_copy=True) as reader:
            await writer.put({"a": [1, 2]})
            assert await reader.get() == {"a": [1, 2]}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_bytes_an_object_is_built_from_stay_bytes_and_nothing_is_lost(transport: Literal["shm", "tcp"]) -> None:
    """A sliced numpy array pickles its data as a ``bytes`` argument of its reconstructor, and so
    does an ``array.array``: the reconstructor refuses a view ("pickle not returning string",
    "fourth argument should be bytes"). A dict key is hashed, which a view of the ring cannot be.
    Such a ``bytes`` stays ``bytes`` for a zero-copy reader; a large ``bytes`` of the message
    itself is still a view beside it."""
    sliced = np.arange(40_000.0)[::2]  # 160 KB of data, not contiguous: no PickleBuffer
    floats = array.array("d", range(20_000))
    tcp = "tcp://127.0.0.1:0" if transport == "tcp" else None
    async with ab.open_writer(capacity=32, slot_bytes=64 * 1024, tcp=tcp) as writer:  # all five fit
        async with ab.open_reader(writer.handle, transport=transport, zero_copy=True) as reader:
            for k, obj in enumerate([sliced, floats, (sliced, payload(4), floats), {payload(5): "key"}]):
                await writer.put((k, obj))
            await writer.put((4, "after"))
            with anyio.fail_after(30):
                k0, got_sliced = await reader.get()
                assert k0 == 0 and got_sliced.dtype == sliced.dtype and np.array_equal(got_sliced, sliced)
                k1, got_floats = await reader.get()
                assert k1 == 1 and got_floats == floats
                k2, (again, body, floats_again) = await reader.get()
                assert k2 == 2 and np.array_equal(again, sliced) and floats_again == floats
                assert isinstance(body, memoryview) and body == payload(4)
                k3, keyed = await reader.get()
                assert k3 == 3 and keyed == {payload(5): "key"} and type(next(iter(keyed))) is bytes
                assert await reader.get() == (4, "after")


@pytest.mark.parametrize("zero_copy", [False, True])
async def test_over_tcp_what_the_user_keeps_of_a_body_is_never_written_over(zero_copy: bool) -> None:
    """A remote reader opens large bodies into buffers it uses again (``seal.Buffers``: where
    ``cryptography`` cannot open them in place, from 51 on). What the user keeps of a body (a
    view of it, an array on its out-of-band buffer) stays as it was while later bodies are opened,
    some of them into the buffers of the bodies the user let go."""
    async with ab.open_writer(capacity=8, slot_bytes=2 * BIG, tcp="tcp://127.0.0.1:0") as writer:
        async with ab.open_reader(writer.handle, transport="tcp", zero_copy=zero_copy) as reader:
            kept: dict[int, tuple[Any, Any]] = {}
            with anyio.fail_after(60):
                for first in range(0, 40, 4):  # four bodies in flight at a time
                    for k in range(first, first + 4):
                        await writer.put((k, np.full(8192, float(k)), payload(k)))
                    for k in range(first, first + 4):
                        n, arr, body = await reader.get()
                        assert n == k
                        if k % 2:
                            kept[k] = (arr, body)  # the even ones are dropped: their buffers free
            for k, (arr, body) in kept.items():
                assert np.array_equal(arr, np.full(8192, float(k))), f"message {k}'s array was written over"
                assert body == payload(k), f"message {k}'s body was written over"
