"""Fan-in: many senders, one collector (docs/fan-in.md). Built on the broadcast family.

Each sender owns a private ring (an ordinary channel with one reader place) and the collector is
that ring's only reader. Everything the broadcast side guarantees per channel (order, lossless
back-pressure with bounded memory, dead-writer detection, fork safety, encoding errors) holds per
sender; this package adds the rendezvous (a directory the collector owns), one wake-up inbox for
all of a collector's rings, and the turns the collector takes among them.

Its modules, by job: ``items`` (what a collector hands out), ``handle`` (the collector's handle,
sender names, the liveness lock), ``rendezvous`` (a sender meeting its collector, and its checks
around each put), ``feeds`` (the collector's side of the rendezvous: its directory, lock and
inbox, and attaching its senders' rings), ``gather`` (the collector's engine: turns among the
rings, and the source its sleeper sleeps on through the readers' wait machinery), ``collector``
and ``sender`` (each pair's shared base and the async role), ``blocking`` (the blocking roles
and factories), ``open`` (the options, their defaults and the async factories), ``deaths`` (the
senders' pidfds), ``remote`` (senders on another host).
"""
