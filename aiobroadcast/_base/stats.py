"""Statistics snapshots returned by ``Writer.statistics()`` and ``Reader.statistics()``."""

from __future__ import annotations

from typing import Literal, NamedTuple

#: the state of the process that serves remote readers (``open_writer(tcp=...)``)
TcpServerState = Literal["none", "running", "restarting", "failed"]


class ReaderInfo(NamedTuple):
    """One attached reader, as the writer sees it."""

    place: int  #: its place (0 .. max_readers-1) in the segment
    name: str  #: the name given to ``open_reader``
    pid: int  #: its process id (for people; liveness is checked with a lock, not the pid)
    received: int  #: messages it has taken
    lag: int  #: ring entries published that it has not read yet (one per message up to slot size)
    sleeping: bool  #: parked, waiting for the next message
    #: "shm"; "tcp" for a remote reader (then ``place`` is -1); "tcp-server" for the ring place
    #: of the process that serves remote readers (it holds the writer back for them)
    transport: str = "shm"
    #: where it lives, to read the pid by: its host name (in a container, by default, the
    #: container's short id); for shared memory the first 16 bytes of it; "" if it did not say
    host: str = ""
    #: bytes of the arena this reader's views keep (docs/design.md, "The arena"); 0 without one
    pinned_bytes: int = 0


class WriterStatistics(NamedTuple):
    sent: int  #: messages published by this writer
    head: int  #: ring entries published (messages larger than a slot take several)
    capacity: int  #: slots in the ring
    readers: tuple[ReaderInfo, ...]  #: every attached reader
    waiting_for: tuple[ReaderInfo, ...]  #: the readers a blocked ``put`` is waiting on
    tasks_waiting: int  #: ``put`` calls waiting for room or for their turn
    dropped_readers: int  #: readers found dead and removed by this writer
    #: the process that serves remote readers: "none" (no ``tcp=``), "running", "restarting"
    #: (it died; the writer is starting a new one on the same endpoint), "failed" (it could not
    #: be restarted: remote readers are not served; the log says why)
    tcp_server: TcpServerState = "none"
    tcp_server_restarts: int = 0  #: times the writer restarted it
    rejected_frames: int = 0  #: frame groups from remote peers the TCP server refused
    #: whether the running TCP server can serve: "ok", or what stops it (out of file descriptors,
    #: so new remote readers cannot connect; a report it cannot write); "" unless ``tcp_server``
    #: is "running". Readers already connected may still be served.
    tcp_server_health: str = ""
    arena_bytes: int = 0  #: the arena's size (``open_writer(arena_bytes=...)``); 0: no arena
    arena_used_bytes: int = 0  #: bytes of it held by messages readers have not passed or still view
    arena_placed: int = 0  #: messages whose large buffers went through the arena
    #: messages with large buffers that found the arena full and were copied through the ring
    arena_fallbacks: int = 0


class ReaderStatistics(NamedTuple):
    name: str
    place: int  #: its place (0 .. max_readers-1) in the segment
    received: int  #: messages delivered by ``get``/``get_nowait``
    lagged: int  #: messages lost to ``ReaderLagged`` (policy "lag")
    lag: int  #: ring entries published that this reader has not read yet
    tasks_waiting: int  #: ``get`` calls parked on this reader
    writer_pid: int
    writer_closed: bool
    #: remote readers: data frames refused (did not open, replayed, out of window, unknown key)
    rejected_frames: int = 0


# --- why a writer waits, in words ----------------------------------------------------------------
# One wording for ``aiobroadcast stats`` (which reads the ring from outside) and for the
# ``WaitTimeout`` of a put (which reads it from the writer's side, when the time passed).

#: A holder whose process is gone: the writer finds it dead on its next look (``ROOM_CHECK_S``).
HOLDER_GONE = "its process is gone; the writer drops it within a second"
#: A holder whose process is alive: the writer cannot tell busy from stopped, and waits.
HOLDER_STUCK = "it is alive but not reading (busy, stopped, or not calling get)"
#: The place of the process that serves remote readers: it holds the writer for them.
HOLDER_TCP_SERVER = "the TCP server, held by a slow remote reader"


def where(pid: int, host: str) -> str:
    """A pid and where it means something: 'pid 7 on 3f2a9c1d0b4e'."""
    return f"pid {pid} on {host}" if host else f"pid {pid}"


def remote_holder(name: str, pid: int, host: str, lag: int) -> str:
    """A remote reader holding the TCP server back (``lag``: messages it has not acknowledged)."""
    return f"{name} (remote {where(pid, host)}, {lag} {'message' if lag == 1 else 'messages'} unacknowledged)"
