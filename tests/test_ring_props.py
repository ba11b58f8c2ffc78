"""Property tests of the ring's arithmetic (aiobroadcast/_shm/layout.py) and of the writer's
room logic, on the code that runs: the model below drives the real ``Publisher`` and
``ReaderRecords`` over a real segment (a writer that keeps a possibly stale minimum cursor and
rescans only when it looks full), with readers that join at the head, read and leave, in any
interleaving, over many wraps of the ring, from sequence numbers near 0, 2**32 and 2**63.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from aiobroadcast._shm import layout as _layout
from aiobroadcast._shm.layout import W_HEAD, Layout, crossed, has_room, wait_target
from aiobroadcast._shm.publisher import Publisher
from aiobroadcast._shm.segment import Segment, create_segment

SLOT_BYTES = 64  # the smallest slot: messages of several entries are small
MAX_READERS = 8

#: Realistic sequence numbers: a fresh ring, one past 32 bits, and long-lived rings around 2**63.
BASES = st.sampled_from([0, 1, 2**32 - 3, 2**62, 2**63 - 17, 2**63, 2**63 + 5])
SEQ = st.one_of(st.integers(0, 2**12), st.integers(2**63 - 2**12, 2**63 + 2**12), st.integers(0, _layout.BUSY - 1))
CAPACITY = st.integers(2, 64)
SETTINGS = settings(max_examples=200, deadline=None, database=None)


# --- has_room / wait_target / crossed -------------------------------------------------------------
@SETTINGS
@given(head=SEQ, capacity=CAPACITY, data=st.data())
def test_wait_target_is_exactly_the_boundary_of_has_room(head: int, capacity: int, data: st.DataObject) -> None:
    entries = data.draw(st.integers(1, capacity), label="entries")
    target = wait_target(head, entries, capacity)
    assert has_room(head, target, entries, capacity)
    assert not has_room(head, target - 1, entries, capacity)
    # has_room is monotonic in the slowest cursor, over every cursor a reader can have (<= head).
    for min_cursor in range(max(0, head - 2 * capacity), head + 1):
        assert has_room(head, min_cursor, entries, capacity) == (min_cursor >= target)
    # A message of at most `capacity` entries waits for a cursor readers can reach (<= head) ...
    assert target <= head
    # ... and whenever it has to wait at all, the target is never 0, the "not waiting" value.
    if not has_room(head, max(0, head - capacity), entries, capacity):
        assert target >= 1


@SETTINGS
@given(old=SEQ, step=st.integers(0, 8), target=st.one_of(st.just(0), SEQ))
def test_crossed_means_this_move_reached_the_target(old: int, step: int, target: int) -> None:
    new = old + step
    assert crossed(old, new, target) == (target != 0 and old < target <= new)
    # The reader's check in ReaderCursor.moved, for a one-entry move.
    assert crossed(old, old + 1, target) == bool(target and old < target <= old + 1)
    # Moving step by step, exactly one single step crosses a target that the whole move crosses.
    singles = [crossed(c, c + 1, target) for c in range(old, new)]
    assert sum(singles) == (1 if crossed(old, new, target) else 0)


@settings(max_examples=100, deadline=None, database=None)
@given(capacity=st.integers(2, 16), head=SEQ, data=st.data())
def test_the_last_reader_to_reach_the_target_is_one_that_crossed_it(
    capacity: int, head: int, data: st.DataObject
) -> None:
    """The blocked writer is woken by the reader whose move made room, in any interleaving."""
    entries = data.draw(st.integers(1, capacity), label="entries")
    target = wait_target(head, entries, capacity)
    lowest = max(0, head - capacity)
    cursors = data.draw(st.lists(st.integers(lowest, head), min_size=1, max_size=6), label="cursors")
    if min(cursors) >= target:
        return  # room already: the writer does not wait
    woken = False
    while min(cursors) < target:
        i = data.draw(st.integers(0, len(cursors) - 1), label="who moves")
        if cursors[i] >= head:
            continue
        old, cursors[i] = cursors[i], cursors[i] + 1
        woken = woken or crossed(old, cursors[i], target)
        if min(cursors) >= target:
            assert crossed(old, cursors[i], target), "the move that made room did not wake the writer"
    assert woken and has_room(head, min(cursors), entries, capacity)


# --- Layout ---------------------------------------------------------------------------------------
@SETTINGS
@given(
    capacity=st.integers(1, 4096),
    slot_bytes=st.integers(1, 1 << 14).map(lambda k: 64 * k),
    max_readers=st.integers(1, 512),
    seq=SEQ,
)
def test_layout_regions_and_slot_offsets(capacity: int, slot_bytes: int, max_readers: int, seq: int) -> None:
    lay = Layout(capacity, slot_bytes, max_readers)
    # Header words, waiting words, records and slots do not overlap, in that order.
    assert 8 * (_layout.W_WAIT_TARGET + 1) <= _layout.WAITING_OFFSET
    assert 8 * (lay.waiting_word(max_readers - 1) + 1) <= lay.records_offset
    assert 8 * (lay.record_word(max_readers - 1, _layout.R_NAME_OFFSET // 8) + 1) <= lay.data_offset
    assert lay.records_offset + _layout.RECORD_BYTES * max_readers <= lay.data_offset
    assert lay.data_offset % 4096 == 0
    assert lay.size == lay.data_offset + capacity * slot_bytes
    # Every entry maps to a whole, 64-byte aligned slot inside the segment ...
    off = lay.slot_offset(seq)
    assert lay.data_offset <= off <= lay.size - slot_bytes
    assert (off - lay.data_offset) % slot_bytes == 0
    assert off % 64 == 0
    # ... the same slot as the entry `capacity` later, and a different one from its neighbours.
    assert lay.slot_offset(seq + capacity) == off
    window = {lay.slot_offset(s) for s in range(seq, seq + min(capacity, 64))}
    assert len(window) == min(capacity, 64)


@SETTINGS
@given(slot_bytes=st.integers(1, 1 << 14).map(lambda k: 64 * k), body=st.integers(0, 1 << 40))
def test_entries_for_is_the_fewest_slots_that_hold_the_body(slot_bytes: int, body: int) -> None:
    lay = Layout(4, slot_bytes, 1)
    n = lay.entries_for(body)
    assert n >= 1
    assert n * lay.payload_bytes >= body
    if body > 0:
        assert (n - 1) * lay.payload_bytes < body
    else:
        assert n == 1  # an empty body still takes one entry (its header says FIRST|LAST)


# --- the model: the real publisher and readers in random interleavings --------------------------
class RingModel(RuleBasedStateMachine):
    """Drives the code that runs: a real segment, the writer's ``Publisher`` (its room check, its
    stale minimum cursor and rescan, its slot writes) and ``ReaderRecords``, with readers that
    store their cursors in their records as ``ShmSource`` does (join at the head, read, leave)
    and wake a blocked writer when ``crossed`` says they made its room."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="ring-model-")
        self.seg: Segment | None = None
        self.pub: Publisher | None = None
        self.capacity = 2
        self.places: dict[int, int] = {}  # reader id -> its place in the records
        self.next_id = 0
        self.blocked: tuple[int, int] | None = None  # (entries, target) of a waiting put
        self.woken = False

    @initialize(capacity=CAPACITY, base=BASES, readers=st.integers(0, 3))
    def start(self, capacity: int, base: int, readers: int) -> None:
        self.capacity = capacity
        self.seg = create_segment(self.dir, secrets.token_hex(16), capacity, SLOT_BYTES, MAX_READERS, 0, 0)
        self.pub = Publisher(self.seg, block=True)
        self.pub.head = self.pub.msg = self.pub.records.min_cursor = base
        self.seg.words[W_HEAD] = base
        for _ in range(readers):
            self.join()

    def teardown(self) -> None:
        if self.pub is not None:
            self.pub.outbox.close()
        if self.seg is not None:
            self.seg.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # The readers' side, as ShmSource stores it.
    def cursor(self, rid: int) -> int:
        assert self.seg is not None
        return int(self.seg.rec_cursor[self.places[rid]])

    def true_min(self) -> int:
        assert self.pub is not None
        return min([self.pub.head, *(self.cursor(r) for r in self.places)])

    def write(self, entries: int) -> None:
        """Publish one message of ``entries`` entries through the real write path."""
        assert self.pub is not None
        body = b"m" * (entries * self.pub.layout.payload_bytes)
        assert self.pub.layout.entries_for(len(body)) == entries
        self.pub.publish([body], len(body), False, entries)

    @precondition(lambda self: len(self.places) < MAX_READERS)
    @rule()
    def join(self) -> None:
        assert self.seg is not None and self.pub is not None
        place = next(i for i in range(MAX_READERS) if i not in self.places.values())
        self.seg.rec_cursor[place] = self.pub.head  # joins at "now"
        self.seg.rec_active[place] = 1
        self.places[self.next_id] = place
        self.next_id += 1

    @precondition(lambda self: self.blocked is None)
    @rule(data=st.data())
    def put(self, data: st.DataObject) -> None:
        assert self.pub is not None
        entries = data.draw(st.integers(1, self.capacity), label="entries")
        if self.pub.room(entries):
            self.write(entries)
            return
        target = wait_target(self.pub.head, entries, self.capacity)
        assert self.pub.records.min_cursor < target <= self.pub.head
        self.blocked, self.woken = (entries, target), False

    @precondition(lambda self: self.blocked is not None)
    @rule()
    def writer_wakes(self) -> None:
        """The blocked put re-checks, as it does on a datagram or a liveness timeout."""
        assert self.blocked is not None and self.pub is not None
        entries, _target = self.blocked
        if self.pub.room(entries):
            self.write(entries)
            self.blocked = None
        else:
            self.woken = False  # the datagrams were drained; it sleeps again on the same target

    @precondition(lambda self: bool(self.places))
    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        assert self.seg is not None and self.pub is not None
        rid = data.draw(st.sampled_from(sorted(self.places)), label="reader")
        steps = data.draw(st.integers(1, self.capacity), label="steps")
        lay = self.pub.layout
        for _ in range(steps):
            c = self.cursor(rid)
            if c >= self.pub.head:
                return
            assert self.seg.words[lay.slot_offset(c) >> 3] == c, f"entry {c} was not in its slot when read"
            self.seg.rec_cursor[self.places[rid]] = c + 1
            if self.blocked is not None and crossed(c, c + 1, self.blocked[1]):
                self.woken = True  # ShmSource wakes the writer

    @precondition(lambda self: bool(self.places))
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        assert self.seg is not None
        rid = data.draw(st.sampled_from(sorted(self.places)), label="reader")
        self.seg.rec_active[self.places.pop(rid)] = 0
        if self.blocked is not None:
            self.woken = True  # a leaving reader wakes a waiting writer

    @invariant()
    def every_unread_entry_is_still_in_its_slot(self) -> None:
        if self.pub is None:
            return
        lay = self.pub.layout
        for rid in self.places:
            cursor = self.cursor(rid)
            assert self.pub.head - cursor <= self.capacity, f"entries reader {rid} at {cursor} needs overwritten"
            for e in range(cursor, self.pub.head):
                held = self.pub.seg.words[lay.slot_offset(e) >> 3]
                assert held == e, f"entry {e} overwritten while a reader needs it"

    @invariant()
    def the_writer_never_overestimates_the_slowest_reader(self) -> None:
        if self.pub is not None:
            assert self.pub.records.min_cursor <= self.true_min()

    @invariant()
    def a_writer_that_could_go_on_has_been_woken(self) -> None:
        """No lost wake-up: once the readers made room for a blocked put, one of them woke it."""
        if self.blocked is not None:
            assert self.pub is not None
            entries, target = self.blocked
            if has_room(self.pub.head, self.true_min(), entries, self.capacity):
                assert self.true_min() >= target
                assert self.woken


TestRingModel = RingModel.TestCase
TestRingModel.settings = settings(max_examples=100, stateful_step_count=50, deadline=None, database=None)


def test_the_model_wraps_the_ring_many_times() -> None:
    """The model above is only worth something if its runs wrap the ring and its checks can fire:
    a scripted run through 3,000 puts across 2**63, then a write that ignores the readers."""
    model = RingModel()
    try:
        model.start(capacity=3, base=2**63 - 5, readers=2)
        assert model.pub is not None
        for i in range(3000):
            model.put(_draws(1 + i % 3))
            while model.blocked is not None:
                for rid in sorted(model.places):
                    model.read(_draws(rid, 3))
                model.writer_wakes()
            model.every_unread_entry_is_still_in_its_slot()
            model.a_writer_that_could_go_on_has_been_woken()
        assert model.pub.head >= 2**63 - 5 + 6000
        behind = min(model.cursor(r) for r in model.places)
        assert behind < model.pub.head
        model.write(model.capacity)  # a writer that ignored its readers ...
        with pytest.raises(AssertionError, match="overwritten"):  # ... is caught
            model.every_unread_entry_is_still_in_its_slot()
    finally:
        model.teardown()


def _draws(*values: int) -> st.DataObject:
    """A stand-in for hypothesis' DataObject that hands out fixed values, for a scripted run."""

    class Draws:
        def draw(self, strategy: object, label: str | None = None) -> int:
            return pending.pop(0)

    pending = list(values)
    return cast(st.DataObject, Draws())
