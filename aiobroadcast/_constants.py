"""Values that more than one layer must agree on, in a module that imports nothing: the command
line reads them without loading ZeroMQ or the TCP server."""

#: The name under which the writer's TCP server takes its place in the ring: it reads the ring as
#: one more local reader, on behalf of the remote readers. ``aiobroadcast stats`` and
#: ``publish --wait-readers`` recognise it by this name, to list the remote readers behind it
#: instead of counting it as a reader of its own.
TCP_SERVER_READER_NAME = "tcp-server"
