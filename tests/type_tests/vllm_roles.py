# This file must fail to type-check exactly on the lines marked "# error: <code>".
# tests/test_types.py runs mypy --strict on it and compares.
from __future__ import annotations

from aiobroadcast.vllm import MessageQueue, MessageQueueReader, MessageQueueWriter


def misuse(group: object) -> None:
    writer = MessageQueue(1, 1)
    writer.enqueue("x", timeout=1.0)
    writer.broadcast_object("x")
    writer.dequeue()  # error: attr-defined
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    print(reader.dequeue(timeout=1.0), reader.broadcast_object())
    reader.enqueue("x")  # error: attr-defined
    mq = MessageQueue.create_from_process_group(group, 1 << 20, 4, writer_rank=0)
    mq.broadcast_object(None)
    mq.enqueue("x")  # error: union-attr
    if isinstance(mq, MessageQueueWriter):
        mq.enqueue("x")
    elif isinstance(mq, MessageQueueReader):
        mq.dequeue()
