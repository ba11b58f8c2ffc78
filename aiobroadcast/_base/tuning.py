"""The library's timing and batching constants, in one place, each with why it has its value.

Modules read them as ``_tuning.NAME`` at the time of use (never ``from _tuning import NAME``),
so a test can change one for a whole process. docs/design.md ("Tuning") lists them too.
"""

from __future__ import annotations

# --- waiting without spinning ------------------------------------------------------------------
#: A side that must wait (a reader for a message, a blocked writer for room) first polls the ring
#: for up to ``POLL_NS``, but only if its previous sleep was shorter than ``DENSE_NS`` (a dense
#: stream): then what it waits for usually comes within microseconds, and neither side pays a
#: wake-up (a system call on each side and a trip through each event loop, 30-60 us here). A side
#: that waited longer (a paced or idle stream) sleeps at once and uses no CPU.
POLL_NS = 50_000
DENSE_NS = 200_000
#: A fixed ``spin_us`` poll (opt-in) is skipped after a sleep this long: an idle reader, woken only
#: by its periodic liveness check, goes back to sleep without polling.
IDLE_NS = 100_000_000
#: A task that never has to wait yields to the event loop once every this many calls, so that a
#: tight loop of ``put``/``get`` does not starve the loop's other tasks (one checkpoint costs about
#: as much as one small message; once in 64 keeps that under 2 %).
YIELD_EVERY = 64

#: The TCP server, after it took a message that came within this long of the one before, polls
#: the ring (giving the CPU up between looks) for this long before it sleeps: a stream of
#: messages this close together (a paced stream at 1 ms) is served by a process that is awake
#: and warm, without a wake-up per message (docs/tcp.md, "The pumps"). A sparser stream, and a
#: channel gone idle, get no spin: the server sleeps and costs no CPU.
TCP_SERVER_SPIN_NS = 2_000_000

#: ``wait_readers`` (``Writer``, ``BlockingWriter``, ``publish --wait-readers``) looks at the
#: attached readers again this often: nothing tells a writer that a reader joined (a joining
#: reader only writes its record, and a remote one is admitted in the TCP server's process), so
#: it polls, at a pace that costs nothing (a snapshot of the records, a lock test per reader) and
#: answers within a human's glance.
READERS_POLL_S = 0.05

# --- taking messages ahead --------------------------------------------------------------------
#: A shared-memory reader that finds several small whole messages ready takes up to this many out
#: of the ring at once, decoded, and hands them out one per ``get`` (docs/design.md, "Taking
#: ahead"): one pass over the ring, one store of its cursor and one look at the writer's wait per
#: batch, instead of per message, which halves what a small message costs a reader here. Bounded,
#: so that a reader never holds much decoded data it has not handed out, and frees ring room soon.
AHEAD_MESSAGES = 32
#: ... and at most about this many body bytes (the message that crosses it is the last one). Four
#: 64 KiB messages: a reader (a fan-in's collector too) that finds them ready takes them with one
#: store of its cursor instead of four. Alternated against 64 KiB (where a 64 KiB message was
#: never taken ahead) on this project's 2-CPU machines, medians of 12 paired ratios: 64 KiB
#: broadcast to 1 and 2 readers 1.04x and 1.06x, gather of 4 senders x 64 KiB 1.03x (a noisy
#: cell: 0.85-1.32x); 4 KiB to 2 readers 1.03x (docs/performance.md).
AHEAD_BYTES = 256 * 1024

# --- liveness ----------------------------------------------------------------------------------
#: How often a writer blocked on a full ring re-checks that the readers it waits for are alive
#: (a dead reader's liveness lock is free). Bounds how long a dead reader holds the writer: about
#: a second with the hysteresis of the wait.
ROOM_CHECK_S = 0.5
#: How often a sleeping reader checks the writer's liveness lock when nothing else tells it of the
#: writer's death (the writer in another pid namespace: no pidfd).
LIVENESS_S = 0.5
#: How often a sleeping reader re-checks the ring and the writer's lock when the writer's pidfd
#: watches for its exit. A safety net: for a wake-up lost outside the protocol (its socket file
#: removed), and for a writer that stops without closing while its process lives on (a relay
#: whose upstream died wakes its readers as it stops). Longer than LIVENESS_S, so an idle
#: reader wakes rarely; short enough that a lost wake-up costs a message 2 s at most.
WATCHED_LIVENESS_S = 2.0
#: How long a remote reader's task sleeps at most before it looks at its queue again. A last
#: resort only: its I/O thread wakes it for every message it queues, for the stream's end and for
#: the server's silence, and every turn of that thread (at least one every two heartbeats, the
#: interval of an idle reader's own heartbeat) wakes a sleeper that has something queued, so a
#: wake-up lost on the way costs a message two heartbeats at most.
#: Each wake-up of an idle reader's loop costs several hundred microseconds of CPU on a small VM
#: (about 1 ms per 5 s at a 2 s limit), so it is rare.
REMOTE_SLEEP_S = 10.0
#: ``sweep_stale`` leaves a channel's files alone while they are this new: a writer may be in the
#: middle of creating them (its lock not taken yet).
STALE_MIN_AGE_S = 2.0

#: How often at most a fan-in sender looks at its collector's lock on the put path (a few
#: system calls). A collector that dies while the sender's ring has room clears nothing in the
#: ring, so without it the sender would learn only when the ring filled, after up to a ring of
#: puts that nobody will read.
SENDER_WATCH_S = 0.25
