"""The TCP protocol's two state machines, without sockets, threads or clocks (docs/tcp.md), and
the parameters both sides of it agree on (here).

``ServerProtocol`` (serving.py) is what the writer's server knows: the messages it holds for
remote readers and what each is sent of them; each reader's place, credit and deadlines, and the
control frames to and from it, are its ``Readers`` (readers.py). ``ClientProtocol``
(receiving.py) is what one remote reader knows: the next message it expects, what it has
acknowledged, when it last heard the server.
Both take frame groups (as they came off the socket, signature included) and the current time
as arguments, and answer with typed events and frame groups to send. The I/O pumps
(``server.py``, ``pump.py``) only move frames between sockets and these objects, so every rule
there is tested by feeding frames (tests/test_tcp_protocol.py).

Frames out, one style for both: neither object calls into I/O, the pump sends what they give.
Control frames go to a list the pump empties (``data_to_send``): neither side needs to know
whether ZeroMQ took one (each is repeated by a later timer, or asked for again, if lost). The
server's data frames come from ``ServerProtocol.transmit``, a generator of ``(ident, frames)``
the pump sends one at a time, answering whether the transport took each: a batch that ZeroMQ
refused (the reader's queue is full) was not sent, so the reader's place must not move past it,
and the protocol has to know that at once, before it decides what goes to that reader next.

Two connections per reader (wire.py): the control frames (signed in insecure mode, CurveZMQ
otherwise) and the data frames (BATCH, LAGGED, END), each sealed by ``seal.py`` under the
group key that WELCOME and KEYS deliver, and each group signed for its reader by the server
(``seal.WriterMac``, its key in that reader's WELCOME). The server protocol seals every
message once, as it takes it from the ring, and hands out data frames from ``transmit``; the
client protocol checks and opens them (``receive_data``) and counts what it refuses.
"""

from __future__ import annotations

__all__ = [
    "ACK_BYTES",
    "BATCH_BYTES",
    "HEARTBEAT_HEARD",
    "HEARTBEAT_LATEST",
    "IDLE_ACK_HEARTBEATS",
]

#: a batch takes no more bodies once it holds this many bytes
BATCH_BYTES = 128 * 1024
#: a reader acknowledges at least every time its user consumed this many bytes (and every half
#: window, and every heartbeat): well below BUFFER_BYTES, so the server, which holds what is
#: not acknowledged, does not wait for acknowledgements of large messages
ACK_BYTES = 2 << 20
#: an idle server's heartbeat goes with a reader's frame that comes at least this many heartbeat
#: intervals after its last one (``ServerProtocol.heartbeat_due``): an idle reader's heartbeat
#: comes every ``IDLE_ACK_HEARTBEATS`` (2) intervals, so the server's goes with every second one
#: at most, and a reader wakes for it about every four intervals (2 s), not every two ...
HEARTBEAT_HEARD = 2.25
#: ... or on its own this many intervals after the last, or sooner when a reader's silence
#: reaches the timeout then (it is dropped at that heartbeat). Above ``HEARTBEAT_HEARD`` by more
#: than an idle reader's interval, so a reader's frame always comes in between; a reader takes
#: the server for gone after 18 intervals of silence, four times this.
HEARTBEAT_LATEST = 4.5
#: a reader's ACK that has nothing new to say (its user consumed nothing and nothing came since
#: the last) is its heartbeat only, and goes this many heartbeat intervals after the last: an
#: idle remote channel wakes the server, and the reader for the server's answer, half as often.
#: The server still drops a reader silent for ``hb_timeout`` (6 intervals: 3 idle ACKs missed),
#: and any ACK with news goes within one interval, as before.
IDLE_ACK_HEARTBEATS = 2
