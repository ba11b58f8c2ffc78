"""The ring's layout: the words and records of a channel's segment, the slot header, and the
arithmetic of the ring (where an entry lives, when there is room, which reader a writer waits
for). Pure: no files, no system calls. docs/design.md draws the layout and gives the
memory-ordering argument; the property tests (tests/test_ring_props.py, test_ring_readers_props.py)
drive this code through the classes that run.
"""

from __future__ import annotations

import os
import platform
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from .._base.errors import BroadcastError
from .atomic import fence as fence  # the ring's modules take it from here

MAGIC = int.from_bytes(b"ABCAST\x00\x01", "little")
LAYOUT_VERSION = 2  # 2: the pickle body format of _base/codec.py (large bytes indexed, or out of band)
EMPTY = 2**64 - 1
BUSY = 2**64 - 2

# Header words (index into the segment viewed as uint64).
W_MAGIC, W_VERSION, W_CAPACITY, W_SLOT_BYTES, W_MAX_READERS = 0, 1, 2, 3, 4
W_POLICY, W_CODEC, W_WRITER_PID, W_TOKEN = 5, 6, 7, 8  # token: words 8 and 9
W_WRITER_PIDNS = 10  # the writer's pid namespace (inode of /proc/self/ns/pid), 0 if unknown
W_WRITER_HOST = 11  # words 11 and 12: where the writer lives (host_name(), HOST_BYTES, NUL-padded)
W_HEAD, W_CLOSED, W_NEXT_MSG = 16, 17, 18
W_WAIT_TARGET = 24
WAITING_OFFSET = 256

RECORD_BYTES = 128
RECORD_WORDS = RECORD_BYTES // 8
R_ACTIVE, R_CURSOR, R_PID, R_GENERATION, R_RECEIVED, R_NAME_LEN = 0, 1, 2, 3, 4, 5
# R_ACTIVE's values: 0 free; JOINING while a joining reader's cursor holds the writer back but the
# entry it starts at is not chosen yet; ACTIVE once it is (docs/design.md, "Memory ordering", step 7).
ACTIVE, JOINING = 1, 2
R_NAME_OFFSET = 48
NAME_BYTES = 64
R_HOST_OFFSET = R_NAME_OFFSET + NAME_BYTES  # where the reader lives: HOST_BYTES, NUL-padded
HOST_BYTES = 16


def name_key(name: str) -> bytes:
    """A reader name as a reader record keeps it (UTF-8, at most ``NAME_BYTES``): two names are
    one name, for uniqueness (docs/design.md, "Reader names"), when these are equal."""
    return name.encode("utf-8")[:NAME_BYTES]


SLOT_HEADER = struct.Struct("<QQIIQ")  # seq, msg, frag_len, flags, total
SLOT_REST = struct.Struct("<QIIQ")  # the header after seq
SLOT_HEADER_BYTES = SLOT_HEADER.size  # 32: a slot's payload starts this many bytes into it
SLOT_REST_OFFSET = 8  # SLOT_REST starts after the seq word
F_FIRST, F_LAST, F_OOB, F_GAP = 1, 2, 4, 8  # F_GAP: `total` messages were lost upstream
F_WHOLE = F_FIRST | F_LAST

POLICIES = ("block", "lag")
CODECS = ("pickle", "pydantic-json", "json")


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def pid_namespace() -> int:
    """This process's pid namespace (the inode of ``/proc/self/ns/pid``), 0 if unknown. A pid
    stored in the segment names the writer only for a reader in the same namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def host_name() -> str:
    """Where this process lives, shown beside its pid (a pid means nothing across containers or
    hosts): the host name, which in a Docker or podman container is the container's short id
    unless the container is given another one."""
    return socket.gethostname()


def pack_host(host: str) -> bytes:
    """``host`` in ``HOST_BYTES``: UTF-8, cut at a character boundary, NUL-padded."""
    raw = host.encode("utf-8")[:HOST_BYTES].decode("utf-8", "ignore").encode("utf-8")
    return raw.ljust(HOST_BYTES, b"\0")


def unpack_host(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")


#: The machines whose memory model docs/design.md ("Memory ordering") argues the ring for:
#: ARMv8 (aarch64), and x86-64 (TSO), which gives everything ARMv8 does and more.
MACHINES = ("x86_64", "amd64", "aarch64")


def check_platform() -> None:
    """The ring's memory-ordering argument is made for x86-64 and aarch64 (docs/design.md)."""
    machine = platform.machine().lower()
    if machine not in MACHINES:
        raise BroadcastError(
            "aiobroadcast's shared-memory ring is argued for x86-64 and aarch64 memory ordering only; "
            f"this machine is {machine!r}"
        )


@dataclass(frozen=True)
class Layout:
    """Offsets of one channel's segment, derived from its three size parameters."""

    capacity: int
    slot_bytes: int
    max_readers: int

    # Computed once per channel: the hot paths (slot_offset) read them per message.
    @cached_property
    def records_offset(self) -> int:
        return WAITING_OFFSET + _round_up(8 * self.max_readers, 64)

    @cached_property
    def data_offset(self) -> int:
        return _round_up(self.records_offset + RECORD_BYTES * self.max_readers, 4096)

    @cached_property
    def size(self) -> int:
        return self.data_offset + self.capacity * self.slot_bytes

    @cached_property
    def payload_bytes(self) -> int:
        """Bytes of message body one slot carries."""
        return self.slot_bytes - SLOT_HEADER_BYTES

    @cached_property
    def slot_offset(self) -> Callable[[int], int]:
        """``slot_offset(seq)``: the byte offset of the slot that holds entry ``seq``. The one
        definition of where an entry lives; a function over this channel's numbers (no attribute
        lookups), as the paths per message call it."""
        data_offset, capacity, slot_bytes = self.data_offset, self.capacity, self.slot_bytes

        def slot_offset(seq: int) -> int:
            return data_offset + (seq % capacity) * slot_bytes

        return slot_offset

    def entries_for(self, body_bytes: int) -> int:
        """How many ring entries a message body of ``body_bytes`` takes (at least one)."""
        return max(1, -(-body_bytes // self.payload_bytes))

    def record_word(self, index: int, field: int) -> int:
        return (self.records_offset + RECORD_BYTES * index) // 8 + field

    def waiting_word(self, index: int) -> int:
        return WAITING_OFFSET // 8 + index


def has_room(head: int, min_cursor: int, entries: int, capacity: int) -> bool:
    """Whether entries ``head .. head+entries-1`` can be written without overwriting an entry
    that a reader at ``min_cursor`` still needs: each needs ``e < min_cursor + capacity``.
    The same as ``entries <= free_entries(head, min_cursor, capacity)`` (the property tests
    hold the two together), written out: the writer asks it per message."""
    return head + entries - min_cursor <= capacity


def free_entries(head: int, min_cursor: int, capacity: int) -> int:
    """How many entries from ``head`` on can be written before one that a reader at
    ``min_cursor`` still needs (a streamed message fills them)."""
    return capacity - (head - min_cursor)


def wait_target(head: int, entries: int, capacity: int) -> int:
    """The smallest ``min_cursor`` for which ``has_room`` becomes true."""
    return head + entries - capacity


def holds_writer(cursor: int, target: int) -> bool:
    """Whether a reader at ``cursor`` is one that a blocked writer, which stored ``target`` as its
    ``wait_target`` (0: not waiting), waits for. The one definition, for ``statistics()`` and
    ``aiobroadcast stats``."""
    return target != 0 and cursor < target


def crossed(old_cursor: int, new_cursor: int, target: int) -> bool:
    """Whether a reader moving from ``old_cursor`` to ``new_cursor`` is the one that reached the
    writer's ``target`` (0 means the writer is not waiting)."""
    return target != 0 and old_cursor < target <= new_cursor
