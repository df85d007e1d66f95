"""On several nodes, the first in line goes first: a round that skips the line
cannot win while a handed lock's waiter gathers its quorum.

A release hands the lock to the first in line on one node only, the hand-over
node (rounds.hand_over_node); there the key is set for the waiter at once. The
other nodes the release simply frees, and the waiter asks them when its notice
arrives. Before, any round that asked every node in that moment won them::

    release     hands the hand-over node's key to W; nodes 2 and 3 are free
    S           a newcomer's first attempt, or a waiter on its timer that
                skips the gate (rounds.gate_node): asks all 3 nodes,
                granted on 2 and 3: a quorum, S holds the lock
    W           reads its notice, asks 2 and 3: busy; W lost its turn

Safe (one holder), but the line was not served in arrival order: on 5 nodes
the bench's lines of 50 and 200 waiters were served out of order in most
grants. Now the hand-over node answers such a round "handed to the first in
line" (acquire.lua's flag 7, release.lua's ``first_until``) for a moment,
``rounds.first_ms`` (two node timeouts, at least one retry delay), and the
round is lost, its grants released. That moment also bounds how long a
hand-over the waiter never completes holds everyone else back.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import redis

from django_redlock.core.owner import owner_json
from django_redlock.engine import rounds
from django_redlock.testing import FaultProxy, RedisNodes

from .polling import wait_until

WAITER = "first-in-line-waiter"


def _hand_to_fake_waiter(mgr: Any, nodes: RedisNodes, name: str, first_ms: int) -> tuple[Any, Any, int]:
    """Hold ``name``, queue a waiter (a plain subscriber, not a lock) in the
    hand-over form on the hand-over node, and release: that node hands the
    key to the waiter, the others are freed. Returns (lock, pubsub, gate)."""
    holder = mgr.lock(name, auto_renew=False)
    assert holder.acquire()
    gate = rounds.hand_over_node(holder._key_b, len(nodes))
    direct = redis.Redis.from_url(nodes.urls[gate])
    inbox = b"test-inbox:" + WAITER.encode()
    pubsub = direct.pubsub()
    pubsub.subscribe(inbox)
    assert wait_until(lambda: pubsub.get_message(timeout=0.1) is not None, timeout=5)
    entry = b"%s|%s|%s" % (inbox, WAITER.encode(),
                           rounds.hand_over_entry(30_000, True, owner_json(None), first_ms))
    direct.rpush(holder._waiters_key_b, entry)
    holder.release()
    value = direct.get(holder._key_b)
    assert value is not None and value.startswith(WAITER.encode() + b"|"), value
    assert b'"first_until":' in value
    return holder, pubsub, gate


def _holders(nodes: RedisNodes, key: bytes) -> list[bytes | None]:
    return [redis.Redis.from_url(u).get(key) for u in nodes.urls]


def _retry_skipping_the_gate(mgr: Any, name: str, token: str, attempt: int) -> Any:
    """One retry of a waiter on its timer that asks every node at once
    (``ask_all``: rounds.gate_node), as LockBase._acquire_plan makes it."""
    probe = mgr.lock(name, auto_renew=False)
    entry = b"test-inbox:" + token.encode() + b"|" + token.encode()
    return mgr._run(rounds.acquire_steps(
        mgr, probe._key_b, probe._fence_key_b, probe._waiters_key_b, token, 30_000,
        owner_json(None), True, 30.0, lock_name=name, waiter=entry, ask_all=True,
        attempt=attempt))


def test_a_retry_that_skips_the_line_loses_while_the_handed_waiter_gathers(
        nodes3: RedisNodes, make_manager: Callable[..., Any]) -> None:
    mgr = make_manager(nodes3)
    holder, pubsub, gate = _hand_to_fake_waiter(mgr, nodes3, "first-in-line", 5_000)
    try:
        others = [i for i in range(3) if i != gate]
        assert all(_holders(nodes3, holder._key_b)[i] is None for i in others)
        # S, second in line, retries on its timer past the gate: two of three free.
        result = _retry_skipping_the_gate(make_manager(nodes3), "first-in-line", "S-token", 2)
        assert not result.acquired, \
            "a retry that skipped the line took the lock from the waiter it was handed to"
        # Its grants on the free nodes were released: they stay free for W.
        assert wait_until(lambda: all(_holders(nodes3, holder._key_b)[i] is None
                                      for i in others), timeout=5)
        # W asks the others (what a woken waiter does): granted there.
        call = rounds.acquire_call(holder._key_b, holder._fence_key_b, holder._waiters_key_b,
                                   WAITER, 30_000, rounds.attempt_owner(owner_json(None), 1),
                                   True)
        replies = mgr.transport.round([None if i == gate else call for i in range(3)],
                                      tag=WAITER)
        assert all(rounds.granted_by(replies[i]) for i in others)
    finally:
        pubsub.close()


def test_a_hand_over_nobody_completes_holds_the_others_back_only_for_a_moment(
        nodes3: RedisNodes, make_manager: Callable[..., Any]) -> None:
    """The waiter never asks the other nodes (it died after the release chose
    it): once its moment (0.3 s here) is over, a round of two free nodes of
    three wins."""
    mgr = make_manager(nodes3)
    holder, pubsub, gate = _hand_to_fake_waiter(mgr, nodes3, "first-in-line-gone", 300)
    pubsub.close()
    other = make_manager(nodes3)
    started = time.monotonic()
    assert not _retry_skipping_the_gate(other, "first-in-line-gone", "S-token", 2).acquired
    won = None
    for attempt in range(3, 200):  # bounded: about 2 s
        won = _retry_skipping_the_gate(other, "first-in-line-gone", "S-token", attempt)
        if won.acquired or time.monotonic() - started > 2.0:
            break
        time.sleep(0.01)
    assert won is not None and won.acquired, "a hand-over nobody completed blocked the lock"
    assert 0.25 < time.monotonic() - started < 2.0
    assert _holders(nodes3, holder._key_b)[gate].startswith(WAITER.encode())  # (it expires)


def test_a_slow_woken_waiter_is_served_before_a_waiter_retrying_on_its_timer(
        nodes3: RedisNodes, make_manager: Callable[..., Any]) -> None:
    """End to end: W, first in line, waits behind proxies that add 40 ms each
    way (its notice and its round to the other nodes are slow); S, second in
    line, retries on its timer every few milliseconds, every other retry
    asking all nodes (rounds.gate_node). When the holder releases, W gets
    the lock, and S only after W."""
    proxies = [FaultProxy.for_server(s).start() for s in nodes3.servers]
    try:
        name = "first-in-line-e2e"
        holder = make_manager(nodes3).lock(name, auto_renew=False)
        assert holder.acquire()
        gate = rounds.hand_over_node(holder._key_b, 3)
        queue = redis.Redis.from_url(nodes3.urls[gate])
        got: list[str] = []
        lock = threading.Lock()

        def wait(lk: Any, who: str) -> None:
            if lk.acquire(timeout=10):
                with lock:
                    got.append(who)
                time.sleep(0.05)
                lk.release()

        slow = make_manager([p.url for p in proxies], node_timeout=0.5)
        first = threading.Thread(target=wait, args=(slow.lock(name, auto_renew=False), "W"))
        first.start()
        assert wait_until(lambda: queue.llen(holder._waiters_key_b) >= 1, timeout=5)
        eager = make_manager(nodes3, retry_delay=0.005)
        second = threading.Thread(target=wait, args=(eager.lock(name, auto_renew=False), "S"))
        second.start()
        assert wait_until(lambda: queue.llen(holder._waiters_key_b) >= 2, timeout=5)
        for p in proxies:
            p.set_latency(0.04)
        time.sleep(0.1)  # S is retrying on its timer now
        holder.release()
        first.join(timeout=15)
        second.join(timeout=15)
        assert got == ["W", "S"], f"served in this order: {got}"
    finally:
        for p in proxies:
            p.stop()


def test_a_retry_past_the_gate_behind_another_waiter_loses_while_the_release_is_on_its_way(
        nodes3: RedisNodes, make_manager: Callable[..., Any]) -> None:
    """The release to the hand-over node is sent last: for a moment the other
    nodes are free while the hand-over node still has the holder's key. A
    retry of the second in line that skips the gate then found a majority
    free; now the hand-over node says it stands behind another (flag 8) and
    the round is lost. The first in line's own retry still wins there, so a
    copy the release never reached holds nobody back for long."""
    mgr = make_manager(nodes3)
    name = "behind-in-line"
    holder = mgr.lock(name, auto_renew=False)
    assert holder.acquire()
    gate = rounds.hand_over_node(holder._key_b, 3)
    others = [i for i in range(3) if i != gate]
    clients = [redis.Redis.from_url(u) for u in nodes3.urls]

    owner = owner_json(None)  # one waiter's entry is the same at every retry

    def entry(token: str) -> bytes:
        return (b"test-inbox:" + token.encode() + b"|" + token.encode() + b"|"
                + rounds.hand_over_entry(30_000, True, owner, 200))

    clients[gate].rpush(holder._waiters_key_b, entry("W-token"), entry("S-token"))
    for i in others:  # the release reached these; the hand-over node's is on its way
        clients[i].delete(holder._key_b)

    def retry(token: str, attempt: int) -> Any:
        probe = mgr.lock(name, auto_renew=False)
        return mgr._run(rounds.acquire_steps(
            mgr, probe._key_b, probe._fence_key_b, probe._waiters_key_b, token, 30_000,
            owner, True, 30.0, lock_name=name,
            waiter=b"test-inbox:" + token.encode() + b"|" + token.encode(),
            hand_over=entry(token), ask_all=True, attempt=attempt))

    result = retry("S-token", 2)
    assert not result.acquired, "the second in line passed the first while a release was on its way"
    assert wait_until(lambda: all(clients[i].get(holder._key_b) is None for i in others),
                      timeout=5)  # its grants were given back
    won = retry("W-token", 2)  # the first in line: the stale copy does not stop it
    assert won.acquired
