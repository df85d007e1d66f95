"""Settled rounds: an acquire or release returns once its outcome is known.

The replies it did not wait for are read (and dropped) by the next round on
the same connection. What a user must get from that: a slow or paused node no
longer slows every acquire, nothing is misread, nothing is left behind, a node
that stops answering is still found out and skipped, and the number of
connections stays what it was. Every wait is bounded.
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import pytest
import redis

from django_redlock.core.keys import fence_key
from django_redlock.testing import FaultProxy, RedisNodes
from django_redlock.transport.resp import ACQUIRE, RELEASE
from tests.holding import lock_keys
from tests.polling import run_in_threads, wait_until

MakeManager = Callable[..., Any]

pytestmark = pytest.mark.slow


class SlowFirst(NamedTuple):
    """Three nodes, the first behind a latency proxy (set per test)."""

    nodes: RedisNodes
    proxy: FaultProxy
    #: ``manager(**options)``: a manager on them, its connections warm.
    manager: Callable[..., Any]


@pytest.fixture
def slow_first(redis_nodes_factory: Callable[..., RedisNodes], make_manager: MakeManager,
               fault_proxy_factory: Callable[..., FaultProxy]) -> SlowFirst:
    nodes = redis_nodes_factory(3)
    proxy = fault_proxy_factory(nodes[0])
    urls = [proxy.url, nodes[1].url, nodes[2].url]

    def manager(**options: Any) -> Any:
        options.setdefault("node_timeout", 1.0)
        options.setdefault("auto_renew", False)
        mgr = make_manager(urls, **options)
        with mgr.lock("warm"):
            pass
        return mgr

    return SlowFirst(nodes, proxy, manager)


def _our_connections(url: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return sum(1 for c in client.client_list() if c.get("name") == "django-redlock")
    finally:
        client.close()


def test_a_paused_node_costs_an_acquire_nothing(
        redis_nodes_factory: Callable[..., RedisNodes], make_manager: MakeManager) -> None:
    nodes = redis_nodes_factory(3)
    mgr = make_manager(nodes, node_timeout=1.0, auto_renew=False)
    with mgr.lock("warm"):
        pass
    nodes[2].pause()  # SIGSTOP: connections stay open, nothing answers
    try:
        started = time.monotonic()
        fences = []
        for _ in range(20):
            with mgr.lock("paused") as held:
                fences.append(held.fence)
        took = time.monotonic() - started
        # Each of the 20 rounds waited for the two live nodes only; waiting for
        # the paused one would have cost the node timeout (1 s) at least once.
        assert took < 0.9, took
        assert fences == sorted(fences) and len(set(fences)) == 20
        # Its requests wait on one connection; once the oldest is overdue the
        # next round drops that connection and the node is backed off.
        time.sleep(1.1)
        assert mgr.nodes[2]._failures == 0  # not found out yet: nobody waited for it
        with mgr.lock("paused"):
            pass
        assert mgr.nodes[2]._failures > 0  # found out (and backed off) by that round
    finally:
        nodes[2].resume()
    # The resumed node ran what it had received in order, each acquire before
    # its release: no copy of the lock is left behind on it.
    assert wait_until(lambda: lock_keys(nodes[2].url) == [], timeout=3.0), \
        lock_keys(nodes[2].url)
    # And it serves again once its back-off is over.
    assert wait_until(lambda: not mgr.nodes[2].backing_off(time.monotonic()), timeout=3.0)
    with mgr.lock("paused") as held:
        assert wait_until(lambda: nodes[2].client().exists(held.key) == 1, timeout=2.0)


def test_a_slow_node_is_read_later_and_never_misread(
        slow_first: SlowFirst) -> None:
    nodes, proxy = slow_first.nodes, slow_first.proxy
    mgr, other = slow_first.manager(), slow_first.manager()
    proxy.set_latency(0.03)  # each reply of node 0 comes well after the others
    started = time.monotonic()
    last = {name: 0 for name in ("slow:0", "slow:1", "slow:2")}  # fences grow per name
    for i in range(30):
        name = f"slow:{i % 3}"
        lock = mgr.lock(name)
        assert lock.acquire(timeout=0)
        assert lock.fence > last[name]
        last[name] = lock.fence
        # Held: another client is refused, whatever node 0's late replies say.
        assert other.lock(f"slow:{i % 3}").acquire(timeout=0) is False
        lock.release()
    # 30 acquires + 30 releases + 30 refusals, none waiting 60 ms for node 0.
    assert time.monotonic() - started < 30 * 0.06
    # No connection was opened per owed reply: node 0 saw a handful at most.
    assert _our_connections(nodes[0].url) <= 4
    proxy.set_latency(0.0)
    # Node 0 ran every request in the order sent: no lock is left on any node.
    for url in (nodes[0].url, nodes[1].url, nodes[2].url):
        assert wait_until(lambda u=url: lock_keys(u) == [], timeout=3.0), lock_keys(url)


def test_new_connections_load_the_scripts_first(
        redis_nodes_factory: Callable[..., RedisNodes], make_manager: MakeManager) -> None:
    # A settled round may not read a node's reply; were it NOSCRIPT, the request
    # would be lost. So no new connection ever gets one.
    nodes = redis_nodes_factory(3)
    for server in nodes:
        server.client().script_flush()
        server.client().config_resetstat()
    mgr = make_manager(nodes, auto_renew=False)
    for _ in range(5):
        with mgr.lock("cold"):
            pass
    for server in nodes:
        client = server.client()
        assert client.script_exists(ACQUIRE.sha.decode(), RELEASE.sha.decode()) == [True, True]
        assert "errorstat_NOSCRIPT" not in client.info("errorstats")


def test_a_flushed_script_cache_under_an_owed_reply(
        slow_first: SlowFirst) -> None:
    nodes, proxy, mgr = slow_first.nodes, slow_first.proxy, slow_first.manager()
    proxy.set_latency(0.05)
    nodes[0].client().script_flush()  # the operator flushes node 0's scripts
    fences = []
    for _ in range(5):
        with mgr.lock("flushed") as held:
            fences.append(held.fence)
    assert fences == sorted(fences) and len(set(fences)) == 5
    proxy.set_latency(0.0)
    # Node 0's owed NOSCRIPT replies were dropped, not misread; the rounds that
    # waited for it loaded the scripts again, and it grants once more.
    for _ in range(20):
        with mgr.lock("flushed") as held:
            if nodes[0].client().exists(held.key):
                break
    else:
        pytest.fail("node 0 never granted again after its scripts were flushed")
    assert wait_until(lambda: lock_keys(nodes[0].url) == [], timeout=3.0)
    assert int(nodes[0].client().get(fence_key(mgr.key("flushed"))) or 0) >= fences[-1]


def test_threads_sharing_a_manager_with_a_slow_node(
        slow_first: SlowFirst) -> None:
    # Connections that owe replies pass between threads: mutual exclusion must
    # hold, no reply may be read by the wrong round, nothing may be left behind.
    nodes, proxy = slow_first.nodes, slow_first.proxy
    mgr = slow_first.manager(retry_delay=0.05)
    proxy.set_latency(0.005)
    state = {"count": 0, "fences": []}
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(40):
                with mgr.lock("shared", timeout=10) as held:
                    seen = state["count"]
                    time.sleep(0)  # let another thread run inside, if it could
                    state["count"] = seen + 1
                    state["fences"].append(held.fence)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    run_in_threads(work, 6)
    assert errors == []
    assert state["count"] == 240
    fences = state["fences"]
    assert fences == sorted(fences) and len(set(fences)) == 240  # in holding order
    proxy.set_latency(0.0)
    for url in (nodes[0].url, nodes[1].url, nodes[2].url):
        assert wait_until(lambda u=url: lock_keys(u) == [], timeout=3.0), lock_keys(url)
        assert _our_connections(url) <= 6 + 2  # a thread's worth each, plus listeners


def test_a_release_that_met_a_flushed_script_cache_is_sent_again(
        slow_first: SlowFirst) -> None:
    # Node 0 is slow, so neither the acquire nor the release waits for it. Its
    # scripts were flushed, and only the acquire script came back (another
    # client loaded it): the acquire runs there, the release answers NOSCRIPT.
    # Dropped, that release would leave the lock on node 0 for its whole lease;
    # the next round that reads node 0 sends it again.
    nodes, proxy, mgr = slow_first.nodes, slow_first.proxy, slow_first.manager()
    direct = nodes[0].client()
    direct.script_flush()
    direct.script_load(ACQUIRE.source)
    proxy.set_latency(0.05)
    with mgr.lock("flushed-release", ttl=30) as held:
        key = held.key
    assert wait_until(lambda: direct.exists(key) == 1, timeout=2.0)  # the acquire ran
    proxy.set_latency(0.0)
    time.sleep(0.2)  # node 0's replies (the acquire's, the release's NOSCRIPT) are back
    with mgr.lock("other"):  # a later round reads them: the release goes out again
        pass
    assert wait_until(lambda: direct.exists(key) == 0, timeout=3.0), \
        f"the release never ran on node 0 (pttl {direct.pttl(key)} ms)"


def test_a_failed_gate_does_not_turn_one_busy_answer_into_an_outage(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Issue 25: the gate node (asked first by a waiter) failing left the rest
    of the round two nodes needing two grants, so the first busy answer
    "settled" it: "1 of 3 answered", QuorumUnavailable naming only the gate,
    while the third node was up and busy. Now a round that ends on refusals
    waits for as many answers as it needed grants: the lock is busy."""
    from django_redlock.core.keys import waiters_key
    from django_redlock.engine.rounds import hand_over_node

    mgr = make_manager(nodes3)
    holder = mgr.lock("gate-fails", auto_renew=False, ttl=30)
    assert holder.acquire(timeout=0)
    gate = hand_over_node(holder._key_b, 3)
    # The gate's acquire script fails (a wrong type where it keeps waiters):
    # it answers, but with an error, as a node that cannot grant.
    nodes3[gate].execute("DEL", waiters_key(mgr.key("gate-fails")))
    nodes3[gate].execute("SET", waiters_key(mgr.key("gate-fails")), "not a list")
    try:
        for _ in range(5):
            assert mgr.lock("gate-fails", timeout=0.3).acquire() is False
    finally:
        nodes3[gate].execute("DEL", waiters_key(mgr.key("gate-fails")))
        holder.release()
