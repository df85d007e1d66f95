"""A late extend never cuts the lease a later extend set.

One holder's requests to a node can run out of the order they were sent in:
a round that gives up on a slow node drops the connection, the node still
runs what it had received, and it may read that socket after a newer one
(tests/test_attempt_order.py has the acquire side). For extends::

    holder   extend(ttl=5)       node slow: no reply in time, connection dropped
    holder   extend(ttl=60)      a new connection: done, the holder counts on 60 s
    node     runs the first one last: PEXPIRE 5 s
    t+5 s    the key expires; a second client takes the lock while the first
             still believes it has 55 s left

The extend scripts (extend.lua, extend_many.lua, rw_common.lua's rw_extend)
now keep the later of the key's expiry and now + the new lease: a lease is
never shortened on a node. An extend to a shorter lease leaves the longer one
there, and the holder believes the shorter one: the safe side.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest
import redis

from django_redlock.engine import rounds
from django_redlock.testing import FaultProxy, RedisNodes

from .polling import wait_until


def _late_extend(lock: Any, ttl: float) -> Any:
    return rounds.extend_call(lock._key_b, lock._fence_key_b, lock._token, lock.fence, ttl)


def _script_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


def _field_ms_left(client: redis.Redis, key: bytes, token: str) -> int:
    """A read-write lock holder's own expiry on the node, in ms from now."""
    value = client.hget(key, token)
    assert value is not None
    now_s, now_us = client.time()
    return int(value.split(b"|", 1)[0]) - (now_s * 1000 + now_us // 1000)


def test_an_extend_delayed_on_the_wire_never_cuts_a_later_extends_lease(
        nodes3: RedisNodes, make_manager: Callable[..., Any]) -> None:
    """The timeline above, really late: the short extend travels through a
    proxy that holds it 0.4 s while the long one goes straight to the server."""
    server = nodes3.servers[0]
    direct = redis.Redis.from_url(server.url)
    with FaultProxy.for_server(server) as proxy:
        slow = make_manager([proxy.url], node_timeout=2.0)
        fast = make_manager([server.url])
        lock = fast.lock("extend-order", ttl=10, auto_renew=False)
        assert lock.acquire()
        assert slow.transport.round([rounds.Command(b"PING")])[0] == b"PONG"  # connected
        proxy.set_latency(0.4)
        calls = _script_calls(direct)
        sent_at = time.monotonic()
        slow.transport.round([_late_extend(lock, 5.0)], settle=rounds.NO_WAIT,
                             tag=lock._token)
        lock.extend(60)
        assert time.monotonic() - sent_at < 0.3, "the long extend was not ahead of the short one"
        believed = lock.validity
        assert believed > 55
        proxy.set_latency(0.0)
        # The late extend has run once the node counted both script calls.
        assert wait_until(lambda: _script_calls(direct) >= calls + 2, timeout=10)
        left_ms = direct.pttl(lock._key_b)
        assert left_ms >= believed * 1000, \
            f"the late extend cut the lease to {left_ms} ms; the holder believes {believed:.1f} s"
        lock.release()


def test_a_late_batched_renewal_never_cuts_a_later_extends_lease(
        nodes3: RedisNodes, make_manager: Callable[..., Any]) -> None:
    """The renewal thread's batch (extend_many.lua) run after an explicit longer
    extend: the node keeps the longer lease."""
    mgr = make_manager(nodes3.urls[:1])
    direct = redis.Redis.from_url(nodes3.urls[0])
    lock, other = mgr.lock("extend-many-order", ttl=10, auto_renew=False), \
        mgr.lock("extend-many-other", ttl=10, auto_renew=False)
    assert lock.acquire() and other.acquire()
    lock.extend(60)
    late = [rounds.Extension(lk._key_b, lk._fence_key_b, lk._token, lk.fence, 5.0)
            for lk in (lock, other)]
    results = mgr._run(rounds.extend_many_steps(mgr, late))
    assert all(r.extended for r in results)
    assert direct.pttl(lock._key_b) > 55_000, "the batch cut a longer lease"
    assert direct.pttl(other._key_b) > 8_000  # 10 s left, longer than 5 s: kept too
    lock.release()
    other.release()


@pytest.mark.parametrize("kind", ["read_lock", "write_lock"])
def test_a_late_extend_never_cuts_a_read_write_holders_lease(
        kind: str, nodes3: RedisNodes, make_manager: Callable[..., Any]) -> None:
    """rw_extend: the holder's own field and the key's expiry keep the later end."""
    mgr = make_manager(nodes3.urls[:1])
    direct = redis.Redis.from_url(nodes3.urls[0])
    lock = getattr(mgr, kind)("rw-extend-order", ttl=10, auto_renew=False)
    assert lock.acquire()
    lock.extend(60)
    reply = mgr.transport.round([_late_extend(lock, 5.0)], tag=lock._token)[0]
    assert reply == 1
    assert _field_ms_left(direct, lock._key_b, lock._token) > 55_000
    assert direct.pttl(lock._key_b) > 55_000
    # Batched, too (extend_many.lua hands read-write holders to rw_extend).
    late = [rounds.Extension(lock._key_b, lock._fence_key_b, lock._token, lock.fence, 5.0)]
    assert mgr._run(rounds.extend_many_steps(mgr, late))[0].extended
    assert _field_ms_left(direct, lock._key_b, lock._token) > 55_000
    lock.release()


def test_an_explicit_shorter_extend_leaves_the_node_longer_and_the_holder_believes_shorter(
        nodes3: RedisNodes, make_manager: Callable[..., Any]) -> None:
    """What a user sees: extend(5) after extend(60) succeeds; the holder counts
    on 5 s (validity), the node keeps the key for the 60 s lease (a lock
    nobody renews then lingers until that end, or until release())."""
    mgr = make_manager(nodes3)
    direct = [redis.Redis.from_url(u) for u in nodes3.urls]
    lock = mgr.lock("extend-shorter", ttl=10, auto_renew=False)
    assert lock.acquire()
    lock.extend(60)
    lock.extend(5)
    assert 0 < lock.validity <= 5
    assert all(c.pttl(lock._key_b) > 55_000 for c in direct)
    lock.release()
    assert not any(c.exists(lock._key_b) for c in direct)
