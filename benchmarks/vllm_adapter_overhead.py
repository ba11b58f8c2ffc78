"""What ``aiobroadcast.vllm.MessageQueue`` adds to the blocking API, per message.

    python benchmarks/vllm_adapter_overhead.py [--count N] [--repeat R]

One process, one thread, one writer and one reader on a ring that never fills: each round
publishes a small object and takes it back, first with ``BlockingWriter.put`` and
``BlockingReader.get_nowait`` (the cheapest direct path), then with ``MessageQueue.enqueue``
and ``MessageQueue.dequeue`` on another channel of the same shape. The two kinds of round
alternate R times; the difference of the medians is the adapter's cost for one ``enqueue``
plus one ``dequeue``. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from aiobroadcast import blocking
from aiobroadcast.vllm import MessageQueue


def per_message_ns(put: Callable[[object], object], get: Callable[[], object], count: int) -> float:
    obj = (1, b"x" * 64)
    start = time.perf_counter_ns()
    for _ in range(count):
        put(obj)
        get()
    return (time.perf_counter_ns() - start) / count


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--count", type=int, default=200_000)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    direct: list[float] = []
    adapted: list[float] = []
    with blocking.open_writer(capacity=256, slot_bytes=4160) as writer, blocking.open_reader(writer.handle) as reader:
        mq_writer = MessageQueue(1, 1, max_chunk_bytes=4160, max_chunks=256)
        mq_reader = MessageQueue.create_from_handle(mq_writer.export_handle(), 0)
        mq_writer.wait_until_ready()
        try:
            for _ in range(args.repeat):
                direct.append(per_message_ns(writer.put, reader.get_nowait, args.count))
                adapted.append(per_message_ns(mq_writer.enqueue, mq_reader.dequeue, args.count))
        finally:
            mq_reader.close()
            mq_writer.close()
    d, a = statistics.median(direct), statistics.median(adapted)
    print(
        json.dumps(
            {
                "count": args.count,
                "repeat": args.repeat,
                "blocking_put_get_ns": round(d),
                "mq_enqueue_dequeue_ns": round(a),
                "adapter_overhead_ns": round(a - d),
                "samples_blocking_ns": [round(x) for x in direct],
                "samples_mq_ns": [round(x) for x in adapted],
            }
        )
    )


if __name__ == "__main__":
    main()
