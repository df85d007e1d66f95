"""Arguments checked before anything is sent, and keys that no lock wrote.

Issue repros on real nodes: ``extend(0)`` made two owners; ``acquire(timeout=nan)``
never gave up; a key with no expiry made waiters retry every millisecond; a list
at the lock key looked like an outage; a lease that ran out made ``acquire()``
say "already held". Each with its asyncio twin where the flavours differ in
code: a lock made non-expiring by ``PERSIST``, a lapsed hold (reported through
``lock_lost``), and leaving a ``with`` block after a manual ``release()``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from django_redlock import LockNotAcquired
from django_redlock.testing import RedisNodes

NODE_TIMEOUT = 0.5


@pytest.mark.parametrize("bad", [0, -1, 0.002, math.inf, math.nan, True, "1", 1e12,
                                 10**400])
def test_a_bad_extend_is_refused_before_anything_is_sent(
        nodes3: RedisNodes, make_manager: Any, bad: Any) -> None:
    mgr = make_manager(nodes3, node_timeout=NODE_TIMEOUT)
    lock = mgr.lock("ext", ttl=5, auto_renew=False)
    assert lock.acquire(timeout=0)
    with pytest.raises(ValueError, match="ttl"):
        lock.extend(bad)
    # Untouched: still ours on every node, with its lease.
    assert lock.owned() and lock.validity > 4
    for server in nodes3:
        assert server.client().pttl(lock.key) > 4000
    assert mgr.lock("ext").acquire(timeout=0) is False  # no second owner
    lock.release()


@pytest.mark.parametrize("option,bad", [("ttl", 0.001), ("ttl", math.inf), ("ttl", True),
                                        ("ttl", 1e12), ("timeout", -1), ("timeout", "0.3"),
                                        ("timeout", math.nan), ("max_hold", 0),
                                        # an int too large for a float: a bare OverflowError
                                        ("ttl", 10**400), ("timeout", -10**400),
                                        ("max_hold", 10**400)])
def test_lock_options_out_of_range_name_the_argument(
        nodes3: RedisNodes, make_manager: Any, option: str, bad: Any) -> None:
    mgr = make_manager(nodes3, node_timeout=NODE_TIMEOUT)
    with pytest.raises(ValueError, match=option):
        mgr.lock("opt", **{option: bad})


@pytest.mark.parametrize("bad", [-1, "0.3", math.nan, math.inf, 10**400])
def test_acquire_timeout_is_checked_like_lock_timeout(
        nodes3: RedisNodes, make_manager: Any, bad: Any) -> None:
    mgr = make_manager(nodes3, node_timeout=NODE_TIMEOUT)
    lock = mgr.lock("acq")
    with pytest.raises(ValueError, match="timeout"):
        lock.acquire(timeout=bad)
    for server in nodes3:
        assert not server.client().exists(lock.key)


def _acquire_scripts(server: Any) -> int:
    stats = server.client().info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


@pytest.mark.parametrize("call,message", [
    (lambda m: m.lock("stock:\udc80"), "lone surrogate"),  # no UnicodeEncodeError
    (lambda m: m.alock("stock:\udc80"), "lone surrogate"),
    (lambda m: m.lock("a", label=["x"]), "label must be a str"),  # "unhashable type"
    (lambda m: m.alock("a", label=object()), "label must be a str"),
    (lambda m: m.lock("a", label="x" * 201), "the limit is 200"),
    (lambda m: m.lock("a", label="\udc80"), "lone surrogate"),
    (lambda m: m.segments("g", 10**7), "from 1 to 10,000"),  # minutes of CPU first
    (lambda m: m.semaphore("s", 10_001), "from 1 to 10,000"),
])
def test_names_labels_and_counts_are_checked_before_anything_is_sent(
        nodes3: RedisNodes, make_manager: Any, call: Any, message: str) -> None:
    mgr = make_manager(nodes3, node_timeout=NODE_TIMEOUT)
    started = time.monotonic()
    with pytest.raises(ValueError, match=message):
        call(mgr)
    assert time.monotonic() - started < 1.0
    for server in nodes3:
        assert server.client().dbsize() == 0


def test_with_lock_checks_its_label_when_it_decorates() -> None:
    from django_redlock import with_lock

    with pytest.raises(ValueError, match="label must be a str"):
        with_lock("row:<pk>", label=5)


@pytest.mark.parametrize("value", ["raw", "list"])
def test_a_key_no_lock_wrote_is_busy_at_the_normal_pace_and_named(
        nodes3: RedisNodes, make_manager: Any, value: str) -> None:
    mgr = make_manager(nodes3, node_timeout=NODE_TIMEOUT, retry_delay=0.1)
    key = mgr.key("foreign")
    for server in nodes3:
        if value == "raw":
            server.client().set(key, "someone else's")  # no expiry
        else:
            server.client().rpush(key, "a", "b")
    before = [_acquire_scripts(s) for s in nodes3]
    lock = mgr.lock("foreign", timeout=1.0)
    started = time.monotonic()
    with pytest.raises(LockNotAcquired) as info:
        with lock:
            pass
    assert time.monotonic() - started < 3.0
    calls = max(_acquire_scripts(s) - b for s, b in zip(nodes3, before))
    assert calls < 40, f"{calls} acquire scripts in a one-second wait: a hot loop"
    assert "held by something other than a lock" in str(info.value)
    assert info.value.retry_after > 0


def _persisted_holder(nodes: RedisNodes, make_manager: Any, name: str) -> Any:
    """A real lock, held, whose key an operator then made non-expiring
    (``PERSIST`` on every node while it is held)."""
    holder = make_manager(nodes, node_timeout=NODE_TIMEOUT, auto_renew=False)
    held = holder.lock(name, ttl=5)
    assert held.acquire(timeout=0)
    for server in nodes:
        assert server.client().persist(held.key)
        assert server.client().pttl(held.key) == -1
    return held


def _assert_normal_pace(calls: int, took: float, error: Any, retry_delay: float) -> None:
    # One second at a retry delay of 0.1 s (each wait drawn from 0.05..0.1 s):
    # about 10 to 20 attempts; a hot loop made hundreds.
    assert took < 3.0, took
    assert calls < 40, f"{calls} acquire scripts in a one-second wait: a hot loop"
    # Named for what it is: a lock whose key lost its expiry, not "something
    # other than a lock", with the way out.
    message = str(error)
    assert "lock with no expiry" in message and "PERSIST" in message, message
    assert "other than a lock" not in message, message
    assert "locks release" in message and "--force" in message, message
    # Nothing says when it frees: the next try is one normal retry away.
    assert 0 < error.retry_after <= retry_delay, error.retry_after


def test_a_lock_made_non_expiring_is_busy_at_the_normal_pace(
        nodes3: RedisNodes, make_manager: Any) -> None:
    """A real lock value with no expiry (an operator's ``PERSIST`` while it is
    held): the node reports no time left (``PTTL`` -1), which must not be read
    as "free any moment now" (a retry every millisecond)."""
    held = _persisted_holder(nodes3, make_manager, "persisted")
    mgr = make_manager(nodes3, node_timeout=NODE_TIMEOUT, retry_delay=0.1)
    before = [_acquire_scripts(s) for s in nodes3]
    started = time.monotonic()
    with pytest.raises(LockNotAcquired) as info:
        with mgr.lock("persisted", timeout=1.0):
            pass
    took = time.monotonic() - started
    calls = max(_acquire_scripts(s) - b for s, b in zip(nodes3, before))
    _assert_normal_pace(calls, took, info.value, 0.1)
    assert held.owned()  # the holder still has it (its own lease, as it knows it)
    held.release()


def test_a_lock_made_non_expiring_is_busy_at_the_normal_pace_asyncio(
        nodes3: RedisNodes, make_manager: Any) -> None:
    import asyncio

    held = _persisted_holder(nodes3, make_manager, "apersisted")
    mgr = make_manager(nodes3, node_timeout=NODE_TIMEOUT, retry_delay=0.1)

    async def wait() -> tuple[Any, float]:
        lock = mgr.alock("apersisted", timeout=1.0)
        started = time.monotonic()
        with pytest.raises(LockNotAcquired) as info:
            async with lock:
                pass
        return info.value, time.monotonic() - started

    before = [_acquire_scripts(s) for s in nodes3]
    error, took = asyncio.run(wait())
    calls = max(_acquire_scripts(s) - b for s, b in zip(nodes3, before))
    _assert_normal_pace(calls, took, error, 0.1)
    held.release()


def test_a_foreign_value_at_the_waiter_queue_is_named(nodes3: RedisNodes,
                                                     make_manager: Any) -> None:
    """A string some other code wrote where a lock keeps its waiter queue:
    every node answers ``WRONGTYPE``. The error says what the node said and
    which keys of the lock may hold the foreign value (a lock key's own
    foreign value is busy, as above, so the error can only come from the
    queue or the fencing counter)."""
    from django_redlock import QuorumUnavailable
    from django_redlock.core.keys import fence_key, waiters_key

    holder = make_manager(nodes3, node_timeout=NODE_TIMEOUT)
    held = holder.lock("foreign-line", ttl=5, auto_renew=False)
    assert held.acquire(timeout=0)
    queue = waiters_key(held.key)
    for server in nodes3:
        server.client().set(queue, "someone else's")
    mgr = make_manager(nodes3, node_timeout=NODE_TIMEOUT)
    with pytest.raises(QuorumUnavailable) as info:
        mgr.lock("foreign-line", timeout=1.0).acquire()
    message = str(info.value)
    assert "WRONGTYPE" in message, message
    assert repr(queue) in message and repr(fence_key(held.key)) in message, message
    assert "another type" in message, message


def _record(signal: Any) -> tuple[list[dict[str, Any]], Any]:
    """Connect a receiver that records ``signal``'s sends; returns them and the
    receiver (to disconnect)."""
    seen: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        seen.append(kwargs)

    signal.connect(receiver)
    return seen, receiver


def test_a_lease_that_ran_out_is_acquired_again(nodes3: RedisNodes, make_manager: Any) -> None:
    """Not "already held": the lease is over (``owned()`` false), so the object
    acquires again, after reporting the lapsed hold through ``lock_lost`` (once)."""
    from django_redlock import signals

    mgr = make_manager(nodes3, node_timeout=NODE_TIMEOUT)
    lost, receiver = _record(signals.lock_lost)
    try:
        lock = mgr.lock("lapse", ttl=0.1, auto_renew=False)
        assert lock.acquire(timeout=0)
        first = lock.fence
        deadline = time.monotonic() + 3
        while lock.owned() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not lock.owned()
        assert lock.acquire(timeout=1)  # not "already held"
        assert lock.owned() and lock.fence > first
        assert [(e["lock"], e["name"], e["fence"]) for e in lost] == [(lock, "lapse", first)]
        # Held from the grant until the lease ran out (a cold first round eats
        # into the 0.1 s lease; the wait above is bounded by 3 s).
        assert "ran out" in lost[0]["reason"] and 0 < lost[0]["held"] < 3.5, lost
        lock.release()
        assert len(lost) == 1  # the second hold was released, not lost
    finally:
        signals.lock_lost.disconnect(receiver)


def test_a_lease_that_ran_out_is_acquired_again_asyncio(
        nodes3: RedisNodes, make_manager: Any) -> None:
    import asyncio

    from django_redlock import signals

    mgr = make_manager(nodes3, node_timeout=NODE_TIMEOUT)
    lost, receiver = _record(signals.lock_lost)

    async def scenario() -> None:
        lock = mgr.alock("alapse", ttl=0.1, auto_renew=False)
        assert await lock.acquire(timeout=0)
        first = lock.fence
        deadline = time.monotonic() + 3
        while lock.owned() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert not lock.owned()
        assert await lock.acquire(timeout=1)  # not "already held"
        assert lock.owned() and lock.fence > first
        assert [(e["lock"], e["name"], e["fence"]) for e in lost] == [(lock, "alapse", first)]
        # Held from the grant until the lease ran out (a cold first round eats
        # into the 0.1 s lease; the wait above is bounded by 3 s).
        assert "ran out" in lost[0]["reason"] and 0 < lost[0]["held"] < 3.5, lost
        await lock.release()
        assert len(lost) == 1

    try:
        asyncio.run(scenario())
    finally:
        signals.lock_lost.disconnect(receiver)


def test_leaving_a_with_block_after_a_manual_release_does_nothing(
        nodes3: RedisNodes, make_manager: Any) -> None:
    """``release()`` inside ``with lock:``: the exit neither raises (no
    ``LockLost``, no "not held") nor sends anything; the lock stays free."""
    from django_redlock import signals

    mgr = make_manager(nodes3, node_timeout=NODE_TIMEOUT)
    released, on_released = _record(signals.lock_released)
    lost, on_lost = _record(signals.lock_lost)
    try:
        lock = mgr.lock("manual", ttl=5)
        with lock:
            lock.release()
            assert not lock.owned()
            other = mgr.lock("manual")
            assert other.acquire(timeout=0)  # really free on the nodes
            other.release()
        assert len(released) == 2 and not lost  # one each; nothing from the exit
        assert not lock.owned()
        assert not any(server.client().exists(lock.key) for server in nodes3)
        with lock:  # the object is usable again
            assert lock.owned()
    finally:
        signals.lock_released.disconnect(on_released)
        signals.lock_lost.disconnect(on_lost)


def test_leaving_an_async_with_block_after_a_manual_release_does_nothing(
        nodes3: RedisNodes, make_manager: Any) -> None:
    import asyncio

    from django_redlock import signals

    mgr = make_manager(nodes3, node_timeout=NODE_TIMEOUT)
    released, on_released = _record(signals.lock_released)
    lost, on_lost = _record(signals.lock_lost)

    async def scenario() -> None:
        lock = mgr.alock("amanual", ttl=5)
        async with lock:
            await lock.release()
            assert not lock.owned()
            other = mgr.alock("amanual")
            assert await other.acquire(timeout=0)
            await other.release()
        assert len(released) == 2 and not lost
        assert not lock.owned()
        assert not any(server.client().exists(lock.key) for server in nodes3)
        async with lock:
            assert lock.owned()

    try:
        asyncio.run(scenario())
    finally:
        signals.lock_released.disconnect(on_released)
        signals.lock_lost.disconnect(on_lost)


def test_release_signal_only_for_a_release_a_node_confirmed(
        redis_nodes_factory: Any, make_manager: Any) -> None:
    from django_redlock import signals

    one = redis_nodes_factory(1)
    mgr = make_manager(one, node_timeout=0.2, auto_renew=False)
    seen: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        seen.append(kwargs)

    signals.lock_released.connect(receiver)
    try:
        lock = mgr.lock("sig", ttl=5)
        assert lock.acquire(timeout=0)
        lock.release()
        assert [s["nodes"] for s in seen] == [1]
        lock = mgr.lock("sig", ttl=5)
        assert lock.acquire(timeout=0)
        one[0].kill()
        lock.release()  # no node confirmed it
        assert len(seen) == 1
    finally:
        signals.lock_released.disconnect(receiver)


def test_a_release_confirmed_by_fewer_than_a_quorum_is_a_warning(
        redis_nodes_factory: Any, make_manager: Any, caplog: Any) -> None:
    """Two of three nodes stopped after the grant: the release reaches one.
    The key stays on the other two until its lease ends, and a quorum is not
    known free, so others may be kept out that long: said at WARNING (a
    release that reached every node it could is not worth a warning)."""
    import logging

    nodes = redis_nodes_factory(3)
    mgr = make_manager(nodes, node_timeout=0.2, auto_renew=False)
    lock = mgr.lock("partial-release", ttl=5)
    assert lock.acquire(timeout=0)
    caplog.set_level(logging.INFO, logger="django_redlock")
    lock.release()  # every node confirms: nothing to warn of
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert lock.acquire(timeout=0)
    for server in nodes.servers[1:]:
        server.kill()
    lock.release()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("1 of 3 nodes" in m and "partial-release" in m for m in warnings), warnings


def test_a_release_answered_with_an_error_says_what_the_node_said(
        nodes3: RedisNodes, make_manager: Any, caplog: Any) -> None:
    """A foreign value at the waiter queue: release.lua deletes the lock key,
    then fails on the queue (``WRONGTYPE``). The nodes answered: the log must
    say what they said and which keys, not that the release reached no node."""
    import logging

    from django_redlock.core.keys import fence_key, waiters_key

    mgr = make_manager(nodes3, node_timeout=NODE_TIMEOUT, auto_renew=False)
    lock = mgr.lock("foreign-release", ttl=5)
    assert lock.acquire(timeout=0)
    queue = waiters_key(lock.key)
    for server in nodes3:
        server.client().set(queue, "someone else's")
    caplog.set_level(logging.INFO, logger="django_redlock")
    lock.release()
    warnings = "\n".join(r.getMessage() for r in caplog.records
                         if r.levelno >= logging.WARNING)
    assert "WRONGTYPE" in warnings, warnings
    assert repr(queue) in warnings and repr(fence_key(lock.key)) in warnings, warnings
    assert "reached no node" not in warnings, warnings


def test_note_release_is_safe_from_many_threads(nodes3: RedisNodes, make_manager: Any) -> None:
    import threading

    mgr = make_manager(nodes3, node_timeout=NODE_TIMEOUT)
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def churn(t: int) -> None:
        try:
            start.wait(timeout=10)
            for i in range(3000):  # more than 1,024 pending: every call may sweep
                mgr._note_release(b"k%d-%d" % (t, i), 1)
        except BaseException as e:  # noqa: BLE001 - any failure in a thread is the finding
            errors.append(e)

    import sys

    threads = [threading.Thread(target=churn, args=(t,)) for t in range(8)]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads inside the sweep, as a loaded server does
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:3]


def test_a_handed_over_lease_never_exceeds_the_ttl() -> None:
    from django_redlock.core import quorum as q

    # The node's clock stepped forward 4.35 s between queueing and handing over.
    assert q.handover_validity(10.0, 0.5, 4850, 0.01) <= 10.0 - q.drift(10.0, 0.01)
