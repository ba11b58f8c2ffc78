"""Remote readers over ZeroMQ TCP (docs/tcp.md).

``wire``: the frames and their signatures. ``serving`` and ``receiving``: what the server and a
client do with them, without sockets or clocks (``protocol``: what both sides agree on).
``server``: the server process, which pumps frames between a ROUTER socket, the ring and the
protocol. ``supervisor``: the writer's side of that process. ``client``: a remote reader's
source, which pumps frames between a DEALER socket, the protocol and the reader.
"""
