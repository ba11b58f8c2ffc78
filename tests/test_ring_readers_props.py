"""Property test of the ring with its real readers: hypothesis drives the writer's ``Publisher`` and
several ``ShmSource`` readers (the class ``open_reader`` uses) over one real segment, in any order
of puts (one slot, several, a relay's gap marker), gets, floods that lap the readers (policy
"lag"), joins, leaves and the writer's close, from sequence numbers near 0 and 2**63.

What every run checks, on the messages the readers actually return:
- each reader gets every message in order, or a ``ReaderLagged(n)`` exactly where ``n`` are
  missing (a gap marker's count under policy "block", where nothing else is ever lost);
- ``WouldBlock`` only when it has everything, ``EndOfStream`` only after the close, and then too;
- a writer blocked on a full ring (policy "block") is woken, through its real inbox, by the reader
  whose move made its room (or by a leaving reader), never left asleep with room to go on.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from typing import Literal

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aiobroadcast._base.errors import EndOfStream, ReaderLagged, WouldBlock
from aiobroadcast._base.handle import Handle
from aiobroadcast._shm.layout import POLICIES, W_HEAD, W_NEXT_MSG, W_WAIT_TARGET, has_room, wait_target
from aiobroadcast._shm.publisher import Publisher
from aiobroadcast._shm.segment import Segment, attach_segment, create_segment
from aiobroadcast._shm.subscriber import ShmSource
from aiobroadcast._shm.wake import Inbox

SLOT_BYTES = 64  # 32 bytes of payload: messages of several entries stay small
MAX_READERS = 4
BASES = st.sampled_from([0, 2**32 - 3, 2**63 - 7])


def body(number: int, size: int) -> bytes:
    """Message ``number``'s body: its number, then ``size`` bytes that depend on it."""
    return number.to_bytes(8, "little") + bytes([number % 251]) * size


def decode(raw: memoryview | bytes | bytearray, oob: bool) -> bytes:
    return bytes(raw)  # a copy: a held slot's view would not outlive the next get


class RingReaders(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="ring-readers-")
        self.seg: Segment | None = None
        self.pub: Publisher | None = None
        self.inbox: Inbox | None = None
        self.handle: Handle | None = None
        self.block = True
        self.hold = False
        self.readers: dict[int, ShmSource] = {}
        self.expected: dict[int, int] = {}  # reader -> number of the next message it must account for
        self.next_id = 0
        self.gaps: dict[int, int] = {}  # message number of a gap marker -> messages it stands for
        self.blocked: tuple[int, int, int] | None = None  # a waiting put: (size, entries, target)
        self.woken = False
        self.closed = False
        self.puts = 0

    @initialize(block=st.booleans(), hold=st.booleans(), capacity=st.integers(2, 8), base=BASES)
    def start(self, block: bool, hold: bool, capacity: int, base: int) -> None:
        self.block, self.hold = block, hold
        token = secrets.token_hex(16)
        policy: Literal["block", "lag"] = "block" if block else "lag"
        self.seg = create_segment(self.dir, token, capacity, SLOT_BYTES, MAX_READERS, POLICIES.index(policy), 0)
        self.inbox = Inbox(self.seg.sock_path("w"))  # the writer's, as WriterChannel binds it
        self.handle = Handle(
            directory=self.dir,
            name=f"aiobroadcast-{token}",
            capacity=capacity,
            slot_bytes=SLOT_BYTES,
            max_readers=MAX_READERS,
            policy=policy,
            codec="pickle",
            writer_pid=0,
        )
        self.pub = Publisher(self.seg, block=block)
        self.pub.head = self.pub.msg = self.pub.records.min_cursor = base
        self.seg.words[W_HEAD] = self.seg.words[W_NEXT_MSG] = base
        self.join()

    def teardown(self) -> None:
        for src in self.readers.values():
            src.close()
        if self.inbox is not None:
            self.inbox.close()
        if self.pub is not None:
            self.pub.outbox.close()
        if self.seg is not None:
            self.seg.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- the writer -------------------------------------------------------------------------------
    def _publish(self, size: int, gap: int = 0) -> bool:
        """Publish through the writer's own path; False if a put under policy "block" must wait."""
        assert self.pub is not None
        self.puts += 1
        if gap:
            return self.pub.try_publish([b""], 0, False, 1, gap)
        raw = body(self.pub.msg, size)
        return self.pub.try_publish([raw], len(raw), False, self.pub.layout.entries_for(len(raw)))

    @precondition(lambda self: not self.closed and self.blocked is None)
    @rule(data=st.data())
    def put(self, data: st.DataObject) -> None:
        assert self.pub is not None and self.seg is not None
        cap = self.pub.layout.capacity
        pay = self.pub.layout.payload_bytes
        if data.draw(st.integers(0, 9), label="gap?") == 0:
            missed = data.draw(st.integers(1, 3), label="missed")
            number = self.pub.msg
            if self._publish(0, missed):
                self.gaps[number] = missed
                return
            size, entries = -missed, 1  # a gap marker waits for room like any message
        else:
            size = data.draw(st.integers(0, cap * pay - 8), label="size")
            entries = self.pub.layout.entries_for(8 + size)
            if self._publish(size):
                return
        # No room: wait as WriterChannel.room_steps does (announce the target, rescan, sleep).
        target = wait_target(self.pub.head, entries, cap)
        assert self.inbox is not None
        self.inbox.drain()  # earlier datagrams (a reader that left) are not this wait's wake-up
        self.seg.words[W_WAIT_TARGET] = target
        self.pub.records.rescan(self.pub.head)
        assert self.pub.records.min_cursor < target, "the writer found no room where there was some"
        self.blocked, self.woken = (size, entries, target), False
        event("a put waits for room")

    @precondition(lambda self: self.blocked is not None)
    @rule()
    def writer_wakes(self) -> None:
        """The blocked put re-checks, as after a datagram or its liveness timeout."""
        assert self.blocked is not None and self.pub is not None and self.seg is not None
        size, entries, _target = self.blocked
        if not self.pub.room(entries):
            return
        self.seg.words[W_WAIT_TARGET] = 0
        self.blocked = None
        number = self.pub.msg
        assert self._publish(max(size, 0), -size if size < 0 else 0)
        if size < 0:
            self.gaps[number] = -size

    @precondition(lambda self: not self.closed and self.blocked is None and not self.block)
    @rule(extra=st.integers(1, 9))
    def flood(self, extra: int) -> None:
        """Policy "lag": run a full ring and more past every reader."""
        assert self.pub is not None
        for _ in range(self.pub.layout.capacity + extra):
            assert self._publish(0)

    # Late in a run (after a few rings' worth of messages), so that most runs wrap and wait first.
    @precondition(lambda self: not self.closed and self.blocked is None and bool(self.readers) and self.puts >= 12)
    @rule()
    def close(self) -> None:
        assert self.pub is not None
        self.pub.mark_closed()
        self.closed = True

    # --- the readers ------------------------------------------------------------------------------
    @precondition(lambda self: len(self.readers) < MAX_READERS and not self.closed)
    @rule()
    def join(self) -> None:
        assert self.seg is not None and self.handle is not None and self.pub is not None
        h = self.handle
        seg = attach_segment(h.path, h.token, h.capacity, h.slot_bytes, h.max_readers)
        src = ShmSource(seg, self.handle, f"r{self.next_id}", decode, hold=self.hold)
        assert src.next_msg == self.pub.msg, "a reader joins at the next message"
        self.readers[self.next_id] = src
        self.expected[self.next_id] = src.next_msg
        self.next_id += 1

    @precondition(lambda self: bool(self.readers))
    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        assert self.pub is not None
        rid = data.draw(st.sampled_from(sorted(self.readers)), label="reader")
        src = self.readers[rid]
        for _ in range(data.draw(st.integers(1, 2 * self.pub.layout.capacity), label="gets")):
            expected = self.expected[rid]
            try:
                raw = src.get_nowait()
            except ReaderLagged as exc:
                assert exc.missed > 0
                if self.block:  # only a relay's gap marker stands for lost messages
                    assert self.gaps.get(expected) == exc.missed, f"reader {rid} lost messages at {expected}"
                assert expected + exc.missed <= self.pub.msg, "more messages counted lost than were sent"
                self.expected[rid] = expected + exc.missed
                event("a reader lagged" if expected not in self.gaps else "a reader passed a gap marker")
                continue
            except WouldBlock:
                assert not self.closed, "WouldBlock after the close"
                assert expected == self.pub.msg, f"reader {rid} at {expected} is stuck, {self.pub.msg} published"
                break
            except EndOfStream:
                assert self.closed and expected == self.pub.msg, "EndOfStream before the end"
                event("a reader reached the end")
                break
            finally:
                self._look_at_writer_inbox()
            assert raw == body(expected, len(raw) - 8), f"reader {rid} got {raw[:8]!r}, expected message {expected}"
            self.expected[rid] = expected + 1

    @precondition(lambda self: len(self.readers) > (1 if self.closed else 0))  # one drains to the end
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.readers)), label="reader")
        self.readers.pop(rid).close()
        del self.expected[rid]
        self._look_at_writer_inbox()

    def _look_at_writer_inbox(self) -> None:
        if self.blocked is not None and self.inbox is not None and self.inbox.drain():
            self.woken = True
            event("a reader woke the writer")

    # --- what must hold after every step ----------------------------------------------------------
    @invariant()
    def a_writer_that_could_go_on_has_been_woken(self) -> None:
        """No lost wake-up: once the readers made room for a blocked put, one of them woke it."""
        if self.blocked is None or self.pub is None or self.seg is None:
            return
        _size, entries, target = self.blocked
        slowest = min(
            [self.pub.head] + [int(self.seg.rec_cursor[i]) for i in range(MAX_READERS) if self.seg.rec_active[i]]
        )
        if has_room(self.pub.head, slowest, entries, self.pub.layout.capacity):
            assert slowest >= target
            assert self.woken, "the readers made room for the writer but none woke it"

    @invariant()
    def every_entry_a_reader_needs_is_in_its_slot(self) -> None:
        """Policy "block": the writer overwrites no entry a reader has not given back (checked here,
        at once: a reader handed an overwritten slot may look for its entry a long time)."""
        if not self.block or self.pub is None or self.seg is None:
            return
        w, slot_offset = self.seg.words, self.pub.layout.slot_offset
        for i in range(MAX_READERS):
            if self.seg.rec_active[i]:
                for e in range(int(self.seg.rec_cursor[i]), self.pub.head):
                    assert w[slot_offset(e) >> 3] == e, f"entry {e} overwritten while place {i} needs it"

    @invariant()
    def nothing_is_ahead_of_the_writer(self) -> None:
        if self.pub is not None:
            for rid, expected in self.expected.items():
                assert expected <= self.pub.msg, f"reader {rid} accounted for messages never sent"


TestRingReaders = RingReaders.TestCase
TestRingReaders.settings = settings(max_examples=100, stateful_step_count=50, deadline=None, database=None)
