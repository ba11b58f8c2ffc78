"""The blocking API: the same channels for code without an event loop (threads, worker processes,
``torch.distributed`` ranks).

``open_writer`` and ``open_reader`` take the arguments of ``aiobroadcast.open_writer`` and
``aiobroadcast.open_reader`` and return a ``BlockingWriter`` / ``BlockingReader`` (also context
managers: ``with open_writer(...) as writer:``). They are thin facades over the private state
the async roles use, on the same ring and the same TCP transport, with the same guarantees:
every reader gets every message in order, a dead reader is dropped within about a second, a
reader of a dead writer gets ``WriterGone``.

No event loop and no helper thread: a waiting ``get`` blocks its thread in ``poll()`` on the very
file descriptor an async reader sleeps on (its wake-up socket, with the writer's pidfd), and a
``put`` waiting for room blocks on the writer's socket. So blocking and async readers, and a
blocking or an async writer, mix freely on one channel, in any processes. Over TCP a reader
waits on the socket its I/O thread (the transport's own) signals.

Threads. Every method of both classes may be called from any thread at any time:

- ``BlockingWriter``: ``put``/``put_nowait`` from several threads publish one message at a
  time (a lock; encoding happens under it), each message whole; ``put_nowait`` raises
  ``WouldBlock`` while another thread's ``put`` is in progress. ``statistics()`` never waits
  for a ``put``. ``close()`` wakes a ``put`` waiting for room (it raises
  ``ClosedResourceError``), lets a ``put`` that is publishing finish, then closes.
- ``BlockingReader``: ``get``/``get_nowait`` from several threads each take a distinct message
  (none lost, none twice). One thread at a time sleeps on the socket; the others wait for it
  and then look again, so threads parked on one reader all get messages. ``close()`` wakes
  every parked ``get`` (they raise ``ClosedResourceError``).
- A call made from inside one of the same object's own calls on the same thread (a
  ``__getstate__`` that calls ``put_nowait`` while its object is being pickled by ``put``, a
  ``__setstate__`` that calls ``get``) raises ``WouldBlock`` instead of deadlocking.
- A Ctrl-C anywhere in a call leaves no lock held (``_shm/owned.py``): the call raises, having lost
  at most what it was doing, and the next call works.
- With ``zero_copy=True`` a message's views stay valid until the next ``get``/``get_nowait`` on
  that reader by any thread; on a channel with an arena, for as long as they are referenced.

Timeouts: ``put(obj, timeout=s)`` and ``get(timeout=s)`` raise ``WaitTimeout`` (a ``WouldBlock``
and a built-in ``TimeoutError``) when ``s`` seconds pass first; nothing is published or taken. A
negative timeout counts as 0 (never as "forever"). A put's names the readers that held it.
"""

from ._broadcast.blocking import BlockingReader, BlockingWriter, open_reader, open_writer
from ._calls.blocking import BlockingCaller, BlockingRequest, BlockingWorker
from ._calls.open import open_blocking_caller as open_caller
from ._calls.open import open_blocking_worker as open_worker
from ._fanin.blocking import BlockingCollector, BlockingSender, open_collector, open_sender

# Every public name says where users import it from (in reprs, tracebacks and the reference), as
# the fan-in and call roles do in their own modules.
for _public in (BlockingReader, BlockingWriter, open_reader, open_writer):
    _public.__module__ = __name__
del _public

# The blocking front's own list (its names differ from aiobroadcast.__all__ but for the open_*
# factories, which are this module's blocking ones).
__all__ = [
    "BlockingCaller",
    "BlockingCollector",
    "BlockingReader",
    "BlockingRequest",
    "BlockingSender",
    "BlockingWorker",
    "BlockingWriter",
    "open_caller",
    "open_collector",
    "open_reader",
    "open_sender",
    "open_worker",
    "open_writer",
]
