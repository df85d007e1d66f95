"""The renewal thread's timer queue (engine.watchdog.DueQueue): pure logic.

Lanes (one per ttl, in arrival order) and the heap (everything else) must
together give what one heap gave: every live entry due by now (and may give
those due within the batch-ahead horizon of their ttl), never one early
beyond it, never a dropped lock."""

from __future__ import annotations

import gc
import random
import weakref
from typing import Any

from django_redlock.engine.watchdog import BATCH_AHEAD_MAX, BATCH_AHEAD_SHARE, LANES_MAX, DueQueue


class Held:
    def __init__(self, ttl: float) -> None:
        self.ttl = ttl


def _horizon(now: float, ttl: float) -> float:
    return now + min(BATCH_AHEAD_MAX, ttl * BATCH_AHEAD_SHARE)


def test_entries_come_out_when_due_whatever_lane_or_heap_holds_them() -> None:
    """Random dues over more ttls than there are lanes, some out of order
    within their ttl (they go to the heap): at every step every entry due
    is popped, and none before its horizon (a plain scan of the entries
    tells both)."""
    rng = random.Random(7)
    ttls = [0.05 * (k + 1) for k in range(LANES_MAX + 3)]
    queue = DueQueue()
    keep: list[Held] = []
    expected: dict[int, float] = {}  # id(lock) -> due
    for _ in range(2000):
        lock = Held(rng.choice(ttls))
        keep.append(lock)
        due = rng.uniform(0, 10)
        expected[id(lock)] = due
        queue.push(due, weakref.ref(lock), lock.ttl)
    assert queue._heap and len(queue._lanes) == LANES_MAX  # both in use
    assert len(queue) == 2000
    by_id = {id(lock): lock for lock in keep}
    now = 0.0
    for _ in range(60):  # bounded: 60 steps of 0.2 s cover the 10 s of dues
        now += 0.2
        got = {id(ref()) for ref in queue.pop_due(now)}
        due_now = {i for i, due in expected.items() if due <= now}
        may = {i for i, due in expected.items() if due <= _horizon(now, by_id[i].ttl)}
        assert due_now <= got <= may  # none late, none earlier than its horizon
        for i in got:
            del expected[i]
    assert not expected and len(queue) == 0
    assert queue.earliest() is None


def test_in_order_entries_use_their_lane_and_earliest_sees_every_source() -> None:
    queue = DueQueue()
    a, b, c = Held(3.0), Held(3.0), Held(9.0)
    queue.push(5.0, weakref.ref(a), a.ttl)
    queue.push(6.0, weakref.ref(b), b.ttl)
    queue.push(4.0, weakref.ref(c), c.ttl)
    assert not queue._heap  # all in order within their ttl
    assert queue.earliest() == 4.0
    late = Held(3.0)
    queue.push(1.0, weakref.ref(late), late.ttl)  # before its lane's last: the heap
    assert len(queue._heap) == 1
    assert queue.earliest() == 1.0
    assert [ref() for ref in queue.pop_due(1.0)] == [late]
    assert queue.earliest() == 4.0


def test_dropped_locks_are_let_go_without_being_returned() -> None:
    queue = DueQueue()
    kept = Held(3.0)
    refs: list[Any] = []
    for k in range(5):
        gone = Held(3.0)
        queue.push(float(k), weakref.ref(gone), gone.ttl)
        refs.append(weakref.ref(gone))
        del gone
    queue.push(10.0, weakref.ref(kept), kept.ttl)
    gone_in_heap = Held(3.0)
    queue.push(0.5, weakref.ref(gone_in_heap), gone_in_heap.ttl)  # out of order: the heap
    del gone_in_heap
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert queue.earliest() == 10.0  # the dead heads are gone
    assert len(queue) == 1
    assert [ref() for ref in queue.pop_due(10.0)] == [kept]
    assert not queue._lanes  # an emptied lane is dropped
