"""A reader's place in the segment's records: taking one (or, after a restart, the place of the
dead reader it replaces, cursor and all) without missing a message, and leaving it."""

from __future__ import annotations

import os
import time

from .._base.constants import TCP_SERVER_READER_NAME
from .._base.errors import InvalidArgument, InvalidHandle, TooManyReaders
from . import layout as _layout
from . import segment as _segment
from .layout import (
    ACTIVE,
    F_FIRST,
    JOINING,
    R_ACTIVE,
    R_CURSOR,
    R_GENERATION,
    R_NAME_LEN,
    R_PID,
    R_RECEIVED,
    SLOT_REST,
    W_CLOSED,
    W_HEAD,
    W_NEXT_MSG,
    W_WAIT_TARGET,
    W_WRITER_PID,
    W_WRITER_PIDNS,
    fence,
    name_key,
)
from .segment import Segment
from .wake import Inbox, Outbox

#: A claim that fails finds its holder's record at once, unless the holder is between its claim
#: and its record (or leaving): looked for again this many times, this far apart.
HOLDER_LOOKS, HOLDER_LOOK_S = 10, 0.01


class NameTaken(InvalidArgument):
    """A reader name that another live reader of the channel holds (an ``InvalidArgument``).
    ``holder``: who, as people read it (its pid, host and place; for a remote reader its pid and
    host, over TCP), or None if it was not found (a remote reader: ``_open`` looks for it in the
    TCP server's report)."""

    def __init__(self, name: str, holder: str | None) -> None:
        self.name = name
        self.holder = holder
        who = holder or "a reader attaching right now"
        super().__init__(
            f"a reader named {name!r} is already attached to this channel ({who}): "
            "reader names are unique per channel; close that reader, or open this one under another name"
        )


def local_holder(seg: Segment, name: str) -> str | None:
    """Who holds the reader name ``name`` among the readers of the ring, as its record says: an
    active place whose lock is held and whose record carries the name. None if none does."""
    key = name_key(name)
    lay = seg.layout
    w = seg.words
    for i, active in enumerate(seg.rec_active.tolist()):
        # Acquire on active and on the name's length (write_name's release) orders the bytes after.
        if not active or w[lay.record_word(i, R_NAME_LEN)] != len(key) or name_key(seg.read_name(i)) != key:
            continue
        if _segment.is_locked(seg.fd, _segment.reader_lock_byte(i)):
            host = seg.read_host(i)
            return f"pid {w[lay.record_word(i, R_PID)]}" + (f" on {host}" if host else "") + f", place {i}"
    return None


class ReaderPlace:
    """One reader's record and lock byte, and its wake-up inbox."""

    def __init__(self, seg: Segment, channel_name: str, name: str, block: bool, outbox: Outbox) -> None:
        self._seg = seg
        self._words = seg.words
        self._buf = seg.buf
        self._slot_offset = seg.layout.slot_offset
        self._channel_name = channel_name
        self._name = name
        self._block = block
        self._outbox = outbox
        self.writer_sock = seg.sock_path("w")
        self.index = -1
        #: the lock byte of the name this place holds (``_claim_name``), 0 if none
        self.name_byte = 0
        self.inbox: Inbox | None = None
        self.cur_word = self.recv_word = self.wait_word = 0
        self.episode = 0

    def join(
        self, take_over: int | None, inbox: bool = True, reserved: bool = False, unique: bool = True
    ) -> tuple[int, int]:
        """Take a place (``take_over``: the dead reader ``pid``'s, if the writer kept it). Returns
        the entry to read first and the number of the message expected there. ``inbox=False``:
        bind no wake-up socket (a fan-in collector sleeps on one inbox for all its rings, and the
        ring's writer was told its path). ``reserved``: ``take_over`` names a place the writer
        reserved for this reader before publishing anything (a fan-in sender's ring, whose place 0
        waits for its collector at cursor 0), taken over under either policy. ``unique``: claim
        the reader's name, which no other live reader of the channel may hold (``NameTaken``);
        only the writer's TCP server joins without (its name is reserved for it)."""
        seg = self._seg
        lay = seg.layout
        w = self._words
        i = -1 if take_over is None else self._take_over(take_over, reserved)
        resume = i >= 0
        if not resume:
            for i in range(lay.max_readers):
                if _segment.try_lock(seg.fd, _segment.reader_lock_byte(i)):
                    break
            else:
                raise TooManyReaders(lay.max_readers)
        self.index = i
        try:
            # A reserved place is ours whatever became of the writer since: what it put is drained.
            if not (resume and reserved) and (
                _segment.is_locked(seg.fd, _segment.WRITER_LOCK_BYTE) is False or w[W_CLOSED]
            ):
                raise InvalidHandle(f"the writer of {self._channel_name} has closed or exited")
            if unique:
                self._claim_name()
            if inbox:
                self.inbox = Inbox(seg.sock_path(f"r{i}"), self._writer_pidfd())
            self.cur_word = lay.record_word(i, R_CURSOR)
            self.recv_word = lay.record_word(i, R_RECEIVED)
            self.wait_word = lay.waiting_word(i)
            w[lay.record_word(i, R_PID)] = os.getpid()
            w[lay.record_word(i, R_GENERATION)] += 1
            # Sleep episodes unique to this occupant of place i: the writer skips a wake-up for an
            # episode it already woke, and a previous occupant's episodes must not match ours.
            self.episode = w[lay.record_word(i, R_GENERATION)] << 32
            w[self.recv_word] = 0
            seg.write_name(i, self._name)
            seg.write_host(i, _layout.host_name())
            w[self.wait_word] = 0
            if resume:
                # The place never stopped being active, so the entries from its cursor on are
                # still in the ring: go on from there.
                cursor = w[self.cur_word]
                if reserved and cursor == 0:
                    return 0, 0  # nothing was ever read: message 0 is the first expected, kept or not
                return cursor, self._number_at(cursor)
            # docs/design.md, "Joining without missing anything".
            w[self.cur_word] = w[W_HEAD]
            w[lay.record_word(i, R_ACTIVE)] = JOINING
            fence()
            while True:
                n1 = w[W_NEXT_MSG]
                h2 = w[W_HEAD]
                if w[W_NEXT_MSG] == n1:
                    break
            w[self.cur_word] = h2
            # Attached: the start is fixed. A release store, after the loads of h2 and n1: a writer
            # that load-acquires ACTIVE publishes its next message after them (statistics() lists
            # the reader, and vLLM's wait_until_ready counts it, only from here).
            w[lay.record_word(i, R_ACTIVE)] = ACTIVE
            return h2, n1
        except BaseException:
            self.leave()
            raise

    def _claim_name(self) -> None:
        """Take the lock of our name (docs/design.md, "Reader names"): the kernel grants it to one
        open file description at a time, and drops it with its holder's process, so no two live
        readers hold one name, and a dead reader's is free at once. Our record gets the name after
        the claim, so a record that carries a name (with its place's lock held) is its holder's."""
        name = self._name
        if name_key(name) == name_key(TCP_SERVER_READER_NAME):
            raise InvalidArgument(
                f"the reader name {name!r} is the writer's TCP server's own (it reads the ring for the "
                "remote readers): open this reader under another name"
            )
        byte = _segment.name_lock_byte(name)
        fd = self._seg.fd
        holder = None
        for look in range(HOLDER_LOOKS):
            if _segment.try_lock(fd, byte):
                self.name_byte = byte
                return
            holder = local_holder(self._seg, name)
            if holder is not None:
                break
            if look < HOLDER_LOOKS - 1:
                time.sleep(HOLDER_LOOK_S)  # between its claim and its record, or a remote reader's
        raise NameTaken(name, holder)

    def _take_over(self, pid: int, reserved: bool = False) -> int:
        """The place of the dead reader ``pid``, locked, if it is still attached; else -1.

        The writer's TCP server started again takes the dead server's place: under policy
        "block" the writer has kept every entry from that place's cursor on, so nothing in the
        ring is lost to remote readers (docs/design.md, "Remote readers"). The writer drops a
        dead reader's place holding its lock, so a place still active once we hold the lock is
        ours with its cursor. Under policy "lag" nothing is kept for a place: join as new."""
        seg = self._seg
        if not self._block and not reserved:
            return -1
        for i in range(seg.layout.max_readers):
            if not seg.rec_active[i] or self._words[seg.layout.record_word(i, R_PID)] != pid:
                continue
            if _segment.try_lock(seg.fd, _segment.reader_lock_byte(i)):
                if seg.rec_active[i]:
                    return i
                _segment.unlock(seg.fd, _segment.reader_lock_byte(i))  # dropped meanwhile
        return -1

    def _number_at(self, c: int) -> int:
        """The number of the first message whose start is at or after entry ``c`` (which no
        writer overwrites while our place holds it)."""
        off = self._slot_offset(c)
        if self._words[off >> 3] == c:
            msg, _flen, flags, _total = SLOT_REST.unpack_from(self._buf, off + 8)
            return int(msg) if flags & F_FIRST else int(msg) + 1  # the rest of a message is skipped
        # Not published yet. The writer stores next_msg before head, so this may already count a
        # message it is publishing at c: the TCP server renumbers from the first it reads.
        return self._words[W_NEXT_MSG]

    def _writer_pidfd(self) -> int | None:
        """A pidfd of the writer's process, to wake when it exits (docs/design.md, "Liveness"):
        only where the segment's pid names it (same pid namespace) and it still holds its lock
        after the pidfd is open (so the pid was not reused). None otherwise: the reader then
        checks the writer's lock every ``LIVENESS_S`` while it sleeps."""
        w = self._words
        ns = _layout.pid_namespace()
        if not ns or w[W_WRITER_PIDNS] != ns or not hasattr(os, "pidfd_open"):
            return None
        try:
            fd = os.pidfd_open(w[W_WRITER_PID])
        except OSError:
            return None
        if not _segment.is_locked(self._seg.fd, _segment.WRITER_LOCK_BYTE):
            os.close(fd)
            return None
        return fd

    def leave(self) -> None:
        seg = self._seg
        i = self.index
        if i < 0:
            return
        w = self._words
        w[seg.layout.record_word(i, R_ACTIVE)] = 0
        w[seg.layout.waiting_word(i)] = 0
        fence()
        if w[W_WAIT_TARGET]:
            self._outbox.wake(self.writer_sock)  # the writer may be waiting for us
        if self.inbox is not None:
            self.inbox.close()
        if self.name_byte:
            _segment.unlock(seg.fd, self.name_byte)
            self.name_byte = 0
        _segment.unlock(seg.fd, _segment.reader_lock_byte(i))
        self.index = -1
