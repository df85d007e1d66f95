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
from django_redlock.engine import rounds
from django_redlock.testing import FaultProxy, RedisNodes
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


# -- a slow minority node ------------------------------------------------------
#: 400 locks in calls of 20: the 20 calls per pass that 20,000 locks make at
#: the default EXTEND_BATCH (only the number of calls matters).
SLOW_HELD = 400
SLOW_BATCH = 20
SLOW_TTL = 1.5  # renewed every 0.5 s, with 1 s of lease left
SLOW_WAY = 0.045  # each way: a 90 ms round trip, within the node timeout


def _slow_third(nodes3: RedisNodes, make_manager: MakeManager,
                fault_proxy_factory: Callable[..., FaultProxy],
                monkeypatch: pytest.MonkeyPatch) -> tuple[Any, FaultProxy, list[float]]:
    """A manager on three nodes, the third behind a latency proxy; the
    renewal's batched passes (both flavours run ``rounds.extend_many_steps``)
    are timed, in seconds, in ``passes``."""
    monkeypatch.setattr(rounds, "EXTEND_BATCH", SLOW_BATCH)
    proxy = fault_proxy_factory(nodes3[2])
    mgr = make_manager([nodes3[0].url, nodes3[1].url, proxy.url], node_timeout=0.3,
                       auto_renew=True)
    passes: list[float] = []
    steps = rounds.extend_many_steps

    def timed(ctx: Any, items: Any) -> Any:
        began = ctx.clock()
        results = yield from steps(ctx, items)
        if len(items) > SLOW_BATCH:
            passes.append(ctx.clock() - began)
        return results

    monkeypatch.setattr(rounds, "extend_many_steps", timed)
    return mgr, proxy, passes


def _slow_pass_checks(nodes3: RedisNodes, keys: list[str], passes: list[float],
                      lost: list[str], fewest: int) -> None:
    assert not lost, lost[:3]
    assert fewest == SLOW_HELD
    assert passes, "no batched renewal pass of several calls ran"
    # 20 calls x 90 ms would be 1.8 s; one slow round trip is 0.09 s (the
    # rest is slack for a loaded machine).
    assert max(passes) < 0.6, passes
    # The slow node was renewed too: unrenewed, its keys would have expired
    # 1.5 s after the latency began.
    slow = nodes3[2].client()
    assert sum(slow.exists(key) for key in keys) == SLOW_HELD


def test_a_slow_minority_node_costs_a_renewal_pass_no_round_trip_per_call(
        nodes3: RedisNodes, make_manager: MakeManager,
        fault_proxy_factory: Callable[..., FaultProxy],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One node of three answers in 90 ms, within its timeout; the other two
    are healthy. The renewal pass's 20 calls each waited for it: 1.8 s a pass
    against a 1 s margin, and the locks ran out one pass after another
    (owned() False, then reported lost: "3 of 3 nodes no longer have this
    holder's key") while a majority renewed them. Each call now returns on
    the healthy quorum's replies; the slow node still gets every call (its
    keys stay), pipelined behind the one before."""
    mgr, proxy, passes = _slow_third(nodes3, make_manager, fault_proxy_factory, monkeypatch)
    locks = [mgr.lock(f"slow:{i}", ttl=SLOW_TTL) for i in range(SLOW_HELD)]
    for lock in locks:
        assert lock.acquire(timeout=1)
    lost: list[str] = []

    def on_lost(name: str, reason: str = "", **kwargs: Any) -> None:
        lost.append(f"{name}: {reason}")

    signals.lock_lost.connect(on_lost)
    try:
        proxy.set_latency(SLOW_WAY)
        ends = time.monotonic() + 2 * SLOW_TTL  # about six renewal periods
        fewest = SLOW_HELD
        while time.monotonic() < ends:  # bounded: 3 s
            fewest = min(fewest, sum(lock.owned() for lock in locks))
            time.sleep(0.05)
        _slow_pass_checks(nodes3, [lock.key for lock in locks], passes, lost, fewest)
    finally:
        signals.lock_lost.disconnect(on_lost)
        proxy.set_latency(0)
    for lock in locks:
        lock.release()


def test_asyncio_a_slow_minority_node_costs_a_renewal_pass_no_round_trip_per_call(
        nodes3: RedisNodes, make_manager: MakeManager,
        fault_proxy_factory: Callable[..., FaultProxy],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The asyncio twin: its batched renewal (``_Renewals``) runs the same calls."""
    import asyncio

    mgr, proxy, passes = _slow_third(nodes3, make_manager, fault_proxy_factory, monkeypatch)
    lost: list[str] = []

    def on_lost(name: str, reason: str = "", **kwargs: Any) -> None:
        lost.append(f"{name}: {reason}")

    async def scenario() -> None:
        locks = [mgr.alock(f"aslow:{i}", ttl=SLOW_TTL) for i in range(SLOW_HELD)]
        for lock in locks:
            assert await lock.acquire(timeout=1)
        proxy.set_latency(SLOW_WAY)
        loop = asyncio.get_running_loop()
        ends = loop.time() + 2 * SLOW_TTL  # about six renewal periods
        fewest = SLOW_HELD
        while loop.time() < ends:  # bounded: 3 s
            fewest = min(fewest, sum(lock.owned() for lock in locks))
            await asyncio.sleep(0.05)
        proxy.set_latency(0)
        _slow_pass_checks(nodes3, [lock.key for lock in locks], passes, lost, fewest)
        for lock in locks:
            await lock.release()

    signals.lock_lost.connect(on_lost)
    try:
        asyncio.run(scenario())
    finally:
        signals.lock_lost.disconnect(on_lost)
        proxy.set_latency(0)


def test_a_lease_that_ran_out_during_its_renewal_stays_lost(
        nodes3: RedisNodes, make_manager: MakeManager,
        fault_proxy_factory: Callable[..., FaultProxy]) -> None:
    """A renewal's reply that comes after the lease ran out by the holder's
    clock never makes owned() True again. Two nodes of three answer in 0.9 s
    (within their 1.5 s timeout), so every renewal waits for one of them: a
    renewal sent with 0.8 s of lease left is confirmed 0.1 s after the lease
    ended, with a new lease of 1.2 s - 0.9 s. owned() said False in between,
    and nothing was reported; then the late "extended" made it True again,
    for a hold that had no lease for 0.1 s. Now the lock is reported lost,
    and owned() stays False."""
    proxies = [fault_proxy_factory(nodes3[i]) for i in (1, 2)]
    mgr = make_manager([nodes3[0].url, proxies[0].url, proxies[1].url], node_timeout=1.5,
                       auto_renew=True)
    locks = [mgr.lock(f"late:{i}", ttl=1.2) for i in range(10)]
    for lock in locks:
        assert lock.acquire(timeout=1)
    # The replies the acquires did not wait for are due by now: the renewals
    # that follow find connections to the slow nodes (a new one would cost
    # its set-up's round trips there).
    time.sleep(1.6)
    assert all(lock.owned() for lock in locks)
    reasons: dict[str, str] = {}

    def on_lost(name: str, reason: str = "", **kwargs: Any) -> None:
        reasons[name] = reason

    signals.lock_lost.connect(on_lost)
    try:
        for proxy in proxies:
            proxy.set_latency(0.45)
        seen_out: set[int] = set()
        again: list[str] = []
        ends = time.monotonic() + 2.5
        while time.monotonic() < ends:  # bounded: 2.5 s
            for i, lock in enumerate(locks):
                if not lock.owned():
                    seen_out.add(i)
                elif i in seen_out:
                    again.append(lock.name)
            time.sleep(0.01)
        assert not again, f"owned() True again after its lease ran out: {sorted(set(again))}"
        assert len(seen_out) == len(locks)
        assert wait_until(lambda: len(reasons) == len(locks), timeout=2.0), reasons
        assert all("ran out" in why for why in reasons.values()), reasons
    finally:
        signals.lock_lost.disconnect(on_lost)
        for proxy in proxies:
            proxy.set_latency(0)
    for lock in locks:
        with pytest.raises(LockLost):
            lock.release()
