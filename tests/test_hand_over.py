"""A release hands the lock to the first waiter in line, on the hand-over node.

That node is the only node, or the gate node of several (``rounds.hand_over_node``).
Its release script sets the key for the waiter (its token, a new fence, its
owner) and its notice carries the fence and the node's clock, so the woken
waiter sends that node no acquire request: on one node it holds the lock when
it wakes; on several it asks only the others. These tests show what a user gets
from that: fewer requests, the same line order, a fence that still grows, no
lock left to a waiter that is gone or gave up. The retry delay is long (5 s)
wherever a handoff is timed, so a handoff that fell back to the waiter's timer
shows up as slow. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import redis

from django_redlock.core.keys import fence_key, waiters_key
from django_redlock.core.owner import parse_value
from django_redlock.engine.rounds import hand_over_node
from django_redlock.testing import RedisNodes
from django_redlock.transport.aio import AsyncTransport
from django_redlock.transport.resp import ACQUIRE, Call
from tests.polling import wait_until
from tests.test_waiters import (
    SLOW_RETRY,
    Line,
    WaitingThread,
    _queued,
    _queues,
    one_waiting,
)

MakeManager = Callable[..., Any]


@pytest.fixture
def one_node(nodes3: RedisNodes) -> Any:
    """The first of the module's nodes, alone: a one-node manager's cluster."""
    return SimpleNamespace(urls=nodes3.urls[:1], server=nodes3[0])


def _acquire_requests(requests: Any) -> int:
    return sum(1 for r in requests if isinstance(r, Call) and r.script is ACQUIRE)


def _count_acquire_requests(mgr: Any) -> list[int]:
    """Count the acquire requests ``mgr`` sends to its nodes (one per node asked)."""
    sent = [0]
    real = mgr.transport.round

    def counting(requests: Any, **kwargs: Any) -> Any:
        sent[0] += _acquire_requests(requests)
        return real(requests, **kwargs)

    mgr.transport.round = counting
    return sent


def _stored(one_node: Any, mgr: Any, name: str, node: int = 0) -> Any:
    client = redis.Redis.from_url(str(one_node.urls[node]))
    try:
        raw = client.get(mgr.key(name))
        counter = client.get(fence_key(mgr.key(name)))
    finally:
        client.close()
    return (parse_value(raw) if raw is not None else None,
            int(counter) if counter is not None else None)


def test_a_release_hands_the_lock_to_the_waiter_in_line(one_node: Any,
                                                         make_manager: MakeManager) -> None:
    holder = make_manager(one_node, retry_delay=SLOW_RETRY)
    waiter = make_manager(one_node, retry_delay=SLOW_RETRY, ttl=8.0)
    sent = _count_acquire_requests(waiter)
    lock = holder.lock("handed")
    assert lock.acquire()
    mine = waiter.lock("handed", timeout=10, label="next|in|line")
    served: list[float] = []
    t = threading.Thread(target=lambda: mine.acquire() and served.append(time.monotonic()))
    t.start()
    assert wait_until(lambda: _queued(one_node, holder, "handed") == 1), "not queued"
    sent_before = sent[0]
    released = time.monotonic()
    lock.release()
    t.join(timeout=SLOW_RETRY - 1)
    assert served and served[0] - released < 1.0, "not handed over by notice"
    # Held without an acquire request of its own after the release.
    assert sent[0] == sent_before
    assert mine.owned() and 4.0 <= mine.validity <= 8.0
    stored, counter = _stored(one_node, waiter, "handed")
    assert stored is not None and stored.token == mine._token
    assert stored.owner.get("label") == "next|in|line"
    # A fence that grows with the handover, and the node's counter holds it.
    assert mine.fence > lock.fence and counter == mine.fence
    assert _queued(one_node, holder, "handed") == 0
    mine.extend()  # the lease is ours on the node: renewals work as after any acquire
    mine.release()
    assert _stored(one_node, waiter, "handed")[0] is None


def test_waiters_are_handed_the_lock_in_arrival_order(one_node: Any,
                                                      make_manager: MakeManager) -> None:
    holder = make_manager(one_node, retry_delay=SLOW_RETRY)
    managers = [make_manager(one_node, retry_delay=SLOW_RETRY) for _ in range(3)]
    counters = [_count_acquire_requests(mgr) for mgr in managers]
    lock = holder.lock("handed-line")
    assert lock.acquire()
    line = Line(one_node, holder, managers, "handed-line")
    before = [c[0] for c in counters]
    started = time.monotonic()
    lock.release()
    line.join()
    assert [mgr for mgr, _ in line.served] == managers
    assert time.monotonic() - started < SLOW_RETRY
    fences = [fence for _, fence in line.served]
    assert fences == sorted(fences) and len(set(fences)) == 3 and fences[0] > lock.fence
    # Each was handed the lock: not one acquire request after it queued.
    assert [c[0] for c in counters] == before


def test_a_waiter_that_is_gone_is_not_handed_the_lock(one_node: Any,
                                                      make_manager: MakeManager) -> None:
    holder, lock, live = one_waiting(one_node, make_manager, "ghost-hand")
    client = redis.Redis.from_url(str(one_node.urls[0]))
    try:  # dead processes' waiters, in the hand-over form, stand first in line
        for i in range(3):
            client.lpush(waiters_key(holder.key("ghost-hand")),
                         b"redlock:inbox:gone-%d|dead-token-%d|30000|1|{}" % (i, i))
        # and a corrupt one (a lease of 0 would fail the script's SET, after
        # its DEL: the lock free, nobody woken)
        client.lpush(waiters_key(holder.key("ghost-hand")), b"redlock:inbox:gone|t|0|1|{}")
    finally:
        client.close()
    released = time.monotonic()
    lock.release()
    assert live.seconds_after(released, join=SLOW_RETRY - 1) < 1.0
    stored, _ = _stored(one_node, holder, "ghost-hand")
    assert stored is not None and stored.token == live._lock._token
    assert _queued(one_node, holder, "ghost-hand") == 0


@pytest.mark.parametrize("n", [1, 3], ids=["1node", "3nodes"])
def test_a_waiter_that_gives_up_hands_on_a_lock_handed_to_it(
        n: int, nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """The release lands between the impatient waiter's last attempt and its
    leaving the line: the lock (on several nodes, the gate's copy) is handed
    to it, and its leaving hands it on, at once, instead of leaving it unused
    for a whole lease."""
    nodes = SimpleNamespace(urls=nodes3.urls[:n])
    holder = make_manager(nodes)
    impatient = make_manager(nodes, retry_delay=SLOW_RETRY, ttl=30.0)
    patient = make_manager(nodes, retry_delay=SLOW_RETRY)
    lock = holder.lock("hand-on")
    assert lock.acquire()
    gate = hand_over_node(holder.key("hand-on").encode(), n)
    real_give_up = impatient._give_up
    handed_to_it: list[bool] = []

    def release_first(key: bytes, *args: Any) -> None:
        lock.release()  # the holder's release comes in just before it leaves
        stored, _ = _stored(nodes, impatient, "hand-on", node=gate)
        handed_to_it.append(stored is not None and stored.owner.get("label") == "impatient")
        real_give_up(key, *args)

    impatient._give_up = release_first
    gives_up = threading.Thread(
        target=lambda: impatient.lock("hand-on", timeout=1.5, label="impatient").acquire())
    gives_up.start()
    assert wait_until(lambda: _queued(nodes, holder, "hand-on") == 1)
    waits = WaitingThread(patient, "hand-on")
    assert wait_until(lambda: _queued(nodes, holder, "hand-on") == 2)
    gives_up.join(timeout=5)
    assert not gives_up.is_alive()
    assert handed_to_it == [True], "the release did not hand the lock to the leaving waiter"
    left = time.monotonic()
    # Handed on by the leaving waiter's script: not after the 30 s lease, nor a timer.
    assert waits.seconds_after(left, join=SLOW_RETRY - 1) < 1.0
    assert _queued(nodes, holder, "hand-on") == 0


def test_a_waiter_that_times_out_leaves_the_line(one_node: Any,
                                                 make_manager: MakeManager) -> None:
    holder, waiter = make_manager(one_node), make_manager(one_node, retry_delay=0.05)
    lock = holder.lock("impatient-one")
    assert lock.acquire()
    assert waiter.lock("impatient-one", timeout=0.3).acquire() is False
    assert _queued(one_node, holder, "impatient-one") == 0
    stored, _ = _stored(one_node, holder, "impatient-one")
    assert stored is not None and stored.token == lock._token  # the holder's key untouched
    lock.release()


def test_a_handover_the_waiter_cannot_time_is_taken_with_an_attempt(
        one_node: Any, make_manager: MakeManager) -> None:
    """With a drift factor this large, the lease a waiter can prove after a 1 s
    wait is below half its TTL: it makes one attempt, which finds the key
    already its own and renews the whole lease."""
    holder, lock, mine = one_waiting(one_node, make_manager, "slow-clock", ttl=1.0,
                                     drift_factor=0.4)
    waiter = mine._lock.manager
    sent = _count_acquire_requests(waiter)
    time.sleep(1.0)
    sent_before = sent[0]
    released = time.monotonic()
    lock.release()
    assert mine.seconds_after(released, join=SLOW_RETRY - 1) < 1.0
    assert sent[0] == sent_before + 1
    # Validity as after any attempt: ttl - round trip - drift (0.4 s + 2 ms here).
    assert 0.4 < mine._lock.validity <= 0.6
    stored, _ = _stored(one_node, waiter, "slow-clock")
    assert stored is not None and stored.token == mine._lock._token


def test_on_several_nodes_only_the_gate_node_queues_the_hand_over_form(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Every node would hand the lock to whoever stands first *there*, and lines
    that differ would split the vote: so only the gate node may hand over."""
    holder, lock, mine = one_waiting(nodes3, make_manager, "entry-form")
    gate = hand_over_node(holder.key("entry-form").encode(), 3)
    queues = _queues(nodes3, holder, "entry-form")
    assert [len(q) for q in queues] == [1 if i == gate else 0 for i in range(3)]
    assert len(queues[gate][0].split(b"|", 4)) == 5  # inbox, token, lease, fencing, owner
    released = time.monotonic()
    lock.release()
    assert mine.seconds_after(released, join=SLOW_RETRY - 1) < 1.0


def test_on_several_nodes_the_gate_hands_its_lock_over_and_the_waiter_asks_the_others(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    holder, lock, mine = one_waiting(nodes3, make_manager, "handed-3", ttl=8.0)
    waiter = mine._lock.manager
    sent = _count_acquire_requests(waiter)
    gate = hand_over_node(holder.key("handed-3").encode(), 3)
    sent_before = sent[0]
    released = time.monotonic()
    lock.release()
    assert mine.seconds_after(released, join=SLOW_RETRY - 1) < 1.0
    # The two other nodes only: the gate's lock came with the notice (a plain
    # wake-up would ask the gate, then the others: 3). On a loaded machine the
    # holder's release may not have reached the two others yet when they are
    # asked: then the round is lost, the gate's lock goes on to the line, and
    # the waiter, woken again by those nodes' releases, asks the gate and the
    # others: 2 + 3. Served by notice either way (above), never by its timer.
    assert sent[0] - sent_before in (2, 5)
    held = mine._lock
    assert held.owned() and 4.0 <= held.validity <= 8.0
    assert held.fence > lock.fence

    def holding() -> list[int]:
        return [i for i in range(3)
                if (_stored(nodes3, waiter, "handed-3", node=i)[0]
                    or SimpleNamespace(token="")).token == held._token]

    assert wait_until(lambda: len(holding()) >= 2)  # a majority
    if sent[0] - sent_before == 2:
        assert gate in holding()  # handed over there
    held.release()


@pytest.mark.parametrize("n", [1, 3], ids=["1node", "3nodes"])
def test_an_async_waiter_is_handed_the_lock(n: int, nodes3: RedisNodes,
                                            make_manager: MakeManager,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """On one node it sends no acquire request after the release; on three it
    asks the two nodes other than the gate (or, when the holder's release is
    late there on a loaded machine, 2 + 3: see the thread's test above)."""
    nodes = SimpleNamespace(urls=nodes3.urls[:n])
    holder = make_manager(nodes)
    waiter = make_manager(nodes, retry_delay=SLOW_RETRY)
    real_round = AsyncTransport.round
    sent = [0]

    async def counting(self: Any, requests: Any, **kwargs: Any) -> Any:
        sent[0] += _acquire_requests(requests)
        return await real_round(self, requests, **kwargs)

    monkeypatch.setattr(AsyncTransport, "round", counting)
    lock = holder.lock("async-hand")
    assert lock.acquire()
    gate = hand_over_node(holder.key("async-hand").encode(), n)
    marks: dict[str, Any] = {}

    def release_when_queued() -> None:
        if wait_until(lambda: _queued(nodes, holder, "async-hand") == 1):
            marks["sent"] = sent[0]
            marks["released"] = time.monotonic()
        lock.release()

    async def wait() -> None:
        mine = waiter.alock("async-hand", timeout=10, auto_renew=False)
        try:
            assert await mine.acquire()
            marks["served"] = time.monotonic()
            marks["sent_after"] = sent[0]
            marks["fence"] = mine.fence
            marks["stored"] = _stored(nodes, waiter, "async-hand", node=gate)[0]
            marks["token"] = mine._token
            await mine.release()
        finally:
            await waiter.aclose()

    releaser = threading.Thread(target=release_when_queued)
    releaser.start()
    asyncio.run(asyncio.wait_for(wait(), 15))
    releaser.join(timeout=10)
    assert "released" in marks, "the async waiter never queued"
    assert marks["served"] - marks["released"] < 1.0
    assert marks["sent_after"] - marks["sent"] in ((0,) if n == 1 else (2, 5))
    assert marks["fence"] > lock.fence
    assert marks["stored"] is not None and marks["stored"].token == marks["token"]


def test_an_async_waiter_that_gives_up_hands_on_a_lock_handed_to_it(
        one_node: Any, make_manager: MakeManager, monkeypatch: pytest.MonkeyPatch) -> None:
    """As for a thread (above): the release lands just before the asyncio
    waiter, out of time, leaves the line."""
    from django_redlock.engine import aio

    holder = make_manager(one_node)
    impatient = make_manager(one_node, retry_delay=SLOW_RETRY, ttl=30.0)
    patient = make_manager(one_node, retry_delay=SLOW_RETRY)
    lock = holder.lock("async-hand-on")
    assert lock.acquire()
    real_give_up = aio._give_up
    handed_to_it: list[bool] = []

    async def release_first(mgr: Any, *args: Any) -> None:
        if mgr is impatient:
            lock.release()
            stored, _ = _stored(one_node, impatient, "async-hand-on")
            handed_to_it.append(stored is not None and stored.owner.get("label") == "impatient")
        await real_give_up(mgr, *args)

    monkeypatch.setattr(aio, "_give_up", release_first)

    async def give_up() -> bool:
        try:
            return await impatient.alock("async-hand-on", timeout=1.5,
                                         label="impatient").acquire()
        finally:
            await impatient.aclose()

    waits: list[WaitingThread] = []

    def patient_joins() -> None:
        if wait_until(lambda: _queued(one_node, holder, "async-hand-on") == 1):
            waits.append(WaitingThread(patient, "async-hand-on"))
            wait_until(lambda: _queued(one_node, holder, "async-hand-on") == 2)

    joiner = threading.Thread(target=patient_joins)
    joiner.start()
    assert asyncio.run(asyncio.wait_for(give_up(), 15)) is False
    left = time.monotonic()
    joiner.join(timeout=10)
    assert waits, "the asyncio waiter never queued"
    assert handed_to_it == [True], "the release did not hand the lock to the leaving waiter"
    assert waits[0].seconds_after(left, join=SLOW_RETRY - 1) < 1.0
    assert _queued(one_node, holder, "async-hand-on") == 0


def test_a_handover_read_after_its_lease_ran_out_is_not_used(
        one_node: Any, make_manager: MakeManager) -> None:
    """The waiter is stalled (a GC pause, SIGSTOP) between the handover and
    reading it, for longer than the lease: meanwhile the lease runs out and
    another client takes the lock. The waiter, when it runs again, can prove no
    lease left from the handover, so it asks the node, finds the lock busy, and
    waits its turn: it never claims the lock the other client holds."""
    holder = make_manager(one_node, retry_delay=SLOW_RETRY)
    stalled = make_manager(one_node, retry_delay=0.2, ttl=0.6, auto_renew=False)
    other = make_manager(one_node, auto_renew=False)
    lock = holder.lock("stalled")
    assert lock.acquire()
    real_take = stalled.lock("stalled").__class__._take_handover
    taken: list[Any] = []
    grabbed: list[Any] = []

    def stall_then_take(self: Any, sub: Any, refusal: Any) -> Any:
        if sub is not None and sub.handed is not None and not taken:
            time.sleep(0.9)  # past the 0.6 s lease handed over
            late = other.lock("stalled", ttl=5.0)
            assert late.acquire(timeout=0)  # the lease ran out: free for anyone
            grabbed.append(late)
            taken.append(real_take(self, sub, refusal))
            return taken[-1]
        return real_take(self, sub, refusal)

    mine = stalled.lock("stalled", timeout=10)
    mine._take_handover = stall_then_take.__get__(mine)  # this lock object only
    served: list[float] = []
    t = threading.Thread(target=lambda: mine.acquire() and served.append(time.monotonic()))
    t.start()
    assert wait_until(lambda: _queued(one_node, holder, "stalled") == 1)
    lock.release()
    assert wait_until(lambda: bool(grabbed), timeout=5.0), "the handover never reached the waiter"
    assert taken == [None]  # not used: no lease left that it could prove
    time.sleep(0.5)
    assert not served and not mine.owned()  # still waiting: the other client holds it
    stored, _ = _stored(one_node, other, "stalled")
    assert stored is not None and stored.token == grabbed[0]._token
    grabbed[0].release()
    t.join(timeout=SLOW_RETRY)
    assert served and mine.owned() and mine.fence > grabbed[0].fence
    mine.release()
