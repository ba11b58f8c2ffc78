"""Values that more than one layer must agree on, in a module that imports nothing: the command
line reads them without loading ZeroMQ or the TCP server."""

#: The name under which the writer's TCP server takes its place in the ring: it reads the ring as
#: one more local reader, on behalf of the remote readers. ``aiobroadcast stats`` and
#: ``publish --wait-readers`` recognise it by this name, to list the remote readers behind it
#: instead of counting it as a reader of its own.
TCP_SERVER_READER_NAME = "tcp-server"

#: The TCP data plane's rekey policy (``_tcp/seal.py``; ``open_writer(rekey_messages=,
#: rekey_bytes=)``): a new group key after this many messages or bytes sealed under one key,
#: by default, and at most. The defaults are far inside AES-256-GCM's limits; the largest
#: accepted still are (a counter nonce is never reused, and 2**32 messages or 2**48 bytes under
#: one key keep the advantage of any attacker negligible).
REKEY_MESSAGES = 1 << 24
REKEY_BYTES = 1 << 36
REKEY_MESSAGES_MAX = 1 << 32
REKEY_BYTES_MAX = 1 << 48
