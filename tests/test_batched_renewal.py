"""Renewals are batched per node: many held locks, few round trips (issue 23).

The renewal thread renews the locks that are due together with one script call
per node, so its round trips per renewal period grow with the nodes, not with
the locks held. Each lock's result is still its own: a lock whose key is gone
is reported lost, the others keep renewing.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest

from django_redlock import LockLost, signals
from django_redlock.testing import RedisNodes
from tests.polling import wait_until

MakeManager = Callable[..., Any]

pytestmark = pytest.mark.slow

HELD = 300
TTL = 0.9  # renewed every 0.3 s


def _script_calls(server: Any) -> int:
    stats = server.client().info("commandstats")
    return sum(v["calls"] for k, v in stats.items()
               if k in ("cmdstat_evalsha", "cmdstat_eval"))


def test_many_held_locks_renew_in_few_calls_and_each_loss_is_its_own(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3, auto_renew=True)
    locks = [mgr.lock(f"batch:{i}", ttl=TTL) for i in range(HELD)]
    for lock in locks:
        assert lock.acquire(timeout=1)
    lost: list[str] = []

    def on_lost(name: str, **kwargs: Any) -> None:
        lost.append(name)

    signals.lock_lost.connect(on_lost)
    try:
        before = [_script_calls(s) for s in nodes3]
        time.sleep(3 * TTL)  # about nine renewal periods
        calls = [_script_calls(s) - b for s, b in zip(nodes3, before)]
        # One call per lock and period would be 300 x 9 = 2,700 per node.
        assert max(calls) < HELD, calls
        assert all(lock.owned() for lock in locks)
        # One lock's key disappears from a majority: only that lock is lost.
        victim = locks[7]
        for server in nodes3.servers[:2]:
            server.client().delete(victim.key)
        # The renewal marks it lost, then sends lock_lost: wait for both.
        assert wait_until(lambda: not victim.owned() and bool(lost), timeout=3 * TTL)
        assert lost == [victim.name]
        assert all(lock.owned() for lock in locks if lock is not victim)
    finally:
        signals.lock_lost.disconnect(on_lost)
    with pytest.raises(LockLost):
        victim.release()
    for lock in locks:
        if lock is not victim:
            lock.release()


def test_asyncio_locks_renew_in_batches_and_each_loss_is_its_own(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """The asyncio twin: locks held in one event loop renew together (one
    extend_many per node and turn), each with its own outcome."""
    import asyncio

    mgr = make_manager(nodes3, auto_renew=True)
    lost: list[str] = []

    def on_lost(name: str, **kwargs: Any) -> None:
        lost.append(name)

    async def scenario() -> None:
        locks = [mgr.alock(f"abatch:{i}", ttl=TTL) for i in range(HELD)]
        for lock in locks:
            assert await lock.acquire(timeout=1)
        before = [_script_calls(s) for s in nodes3]
        await asyncio.sleep(3 * TTL)  # about nine renewal periods
        calls = [_script_calls(s) - b for s, b in zip(nodes3, before)]
        # One call per lock and period would be 300 x 9 = 2,700 per node.
        assert max(calls) < HELD, calls
        assert all(lock.owned() for lock in locks)
        victim = locks[7]
        for server in nodes3.servers[:2]:
            server.client().delete(victim.key)
        deadline = asyncio.get_running_loop().time() + 3 * TTL
        while (victim.owned() or not lost) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)  # the renewal marks it lost, then sends lock_lost
        assert not victim.owned()
        assert lost == [victim.name]
        assert all(lock.owned() for lock in locks if lock is not victim)
        with pytest.raises(LockLost):
            await victim.release()
        for lock in locks:
            if lock is not victim:
                await lock.release()

    signals.lock_lost.connect(on_lost)
    try:
        asyncio.run(scenario())
    finally:
        signals.lock_lost.disconnect(on_lost)


def test_a_foreign_value_at_one_locks_fencing_counter_loses_no_lock(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Some other code writes a list where one held lock keeps its fencing
    counter, on every node. The renewal writes each lock's fence back to its
    counter in the batch's one script call (fence_writeback.lua): a GET there
    answered WRONGTYPE and failed the whole call, so every lock of the batch
    (up to EXTEND_BATCH) was lost, none of them for a reason the log named.
    The counter is left alone: every lock keeps renewing, and releases."""
    from django_redlock.core.keys import fence_key

    mgr = make_manager(nodes3, auto_renew=True)
    locks = [mgr.lock(f"poison:{i}", ttl=TTL) for i in range(5)]
    for lock in locks:
        assert lock.acquire(timeout=1) and lock.fence > 0
    lost: list[str] = []

    def on_lost(name: str, **kwargs: Any) -> None:
        lost.append(name)

    signals.lock_lost.connect(on_lost)
    try:
        counter = fence_key(locks[2].key)
        for server in nodes3:
            server.client().delete(counter)
            server.client().rpush(counter, "someone else's")
        time.sleep(3 * TTL)  # about nine renewal periods, each a batch
        assert lost == []
        assert all(lock.owned() for lock in locks)
    finally:
        signals.lock_lost.disconnect(on_lost)
    for lock in locks:
        lock.release()  # no LockLost, not even for the lock whose counter it is
    for server in nodes3:  # the foreign value is left as it was
        assert server.client().lrange(counter, 0, -1) == [b"someone else's"]
