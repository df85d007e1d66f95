"""A segments waiter is woken by a release of any of its segments, not by a timer.

On real nodes (1 and 3), sync and asyncio. The timers are made long here
(the manager's retry delay, and the slices the segments once polled in):
only a release notice serves the waiter within the bound. Every wait is
bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any, Callable

import pytest

from django_redlock import LockLost
from django_redlock.core.keys import waiters_key
from django_redlock.engine import segments as segments_module
from django_redlock.testing import RedisNodes

MakeManager = Callable[..., Any]

pytestmark = pytest.mark.slow

#: How soon after a release the waiter must hold that segment (s).
SERVED_WITHIN = 0.5


@pytest.fixture(params=[1, 3], ids=["1-node", "3-nodes"])
def nodes(request: pytest.FixtureRequest, redis_nodes_factory: Callable[..., RedisNodes]
          ) -> RedisNodes:
    return redis_nodes_factory(request.param)


@pytest.fixture(autouse=True)
def _slow_timers(monkeypatch: pytest.MonkeyPatch) -> None:
    # A waiter that polled (one segment's queue for a slice, then all again)
    # would find the other segment's release seconds later.
    monkeypatch.setattr(segments_module, "SLICE", 6.0, raising=False)


def _other_than_queued(nodes: RedisNodes, mgr: Any, name: str, count: int,
                       default: int) -> int:
    """The segment to release: one the waiter is not queued on as a plain lock
    waiter (a waiter queued on one segment's line is woken by that segment's
    own release, which proves nothing about the others); ``default`` when it
    is queued on none."""
    queued = [i for i in range(count)
              if any(server.client().llen(waiters_key(mgr.key(f"{name}[{i}]")))
                     for server in nodes)]
    free = [i for i in range(count) if i not in queued]
    return default if default in free else free[0]


def _waiting(make: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """A thread that acquires ``make()`` (timeout 10 s) and notes when it got it
    (``got["at"]``) and what (``got["held"]``), started once it waits (0.5 s)."""
    got: dict[str, Any] = {}

    def waiter() -> None:
        held = make()
        if held.acquire():
            got["at"], got["held"] = time.monotonic(), held

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    time.sleep(0.5)  # it found every member busy and waits
    assert not got
    return thread, got


@pytest.mark.parametrize("released", [0, 1])
def test_a_release_of_either_segment_serves_the_waiter(
        nodes: RedisNodes, make_manager: MakeManager, released: int) -> None:
    mgr = make_manager(nodes, retry_delay=6)
    held = [mgr.segments("w", 2, ttl=30, timeout=0) for _ in range(2)]
    assert all(h.acquire() for h in held)
    by_index = {h.index: h for h in held}
    thread, got = _waiting(lambda: mgr.segments("w", 2, ttl=30, timeout=10))
    try:
        released = _other_than_queued(nodes, mgr, "w", 2, released)
        at = time.monotonic()
        by_index[released].release()
        thread.join(timeout=12)
        assert got, "the waiter was not served"
        assert got["held"].index == released
        assert got["at"] - at < SERVED_WITHIN, got["at"] - at
    finally:
        thread.join(timeout=12)
        for seg in [*held, got.get("held")]:
            if seg is not None and seg.owned():
                seg.release()


@pytest.mark.parametrize("released", [0, 1])
def test_async_a_release_of_either_segment_serves_the_waiter(
        nodes: RedisNodes, make_manager: MakeManager, released: int) -> None:
    mgr = make_manager(nodes, retry_delay=6)

    async def scenario() -> None:
        held = [mgr.asegments("aw", 2, ttl=30, timeout=0) for _ in range(2)]
        for h in held:
            assert await h.acquire()
        by_index = {h.index: h for h in held}
        seg = mgr.asegments("aw", 2, ttl=30, timeout=10)
        task = asyncio.ensure_future(seg.acquire())
        try:
            await asyncio.sleep(0.5)  # it found both busy and waits
            assert not task.done()
            which = _other_than_queued(nodes, mgr, "aw", 2, released)
            at = time.monotonic()
            await by_index[which].release()
            assert await asyncio.wait_for(task, 12)
            waited = time.monotonic() - at
            assert seg.index == which
            assert waited < SERVED_WITHIN, waited
        finally:
            if not task.done():
                task.cancel()
            for h in [*held, seg]:
                if h.owned():
                    await h.release()

    asyncio.run(scenario())


def test_a_segment_whose_holder_vanished_serves_the_waiter_at_its_lease_end(
        nodes: RedisNodes, make_manager: MakeManager) -> None:
    """No notice comes from a crashed holder: the waiter wakes when the
    soonest lease of a busy segment runs out, not a slice or a retry delay
    later."""
    mgr = make_manager(nodes, retry_delay=6)
    crashed = mgr.segments("v", 2, ttl=1.0, auto_renew=False, timeout=0)
    alive = mgr.segments("v", 2, ttl=30, timeout=0)
    assert crashed.acquire() and alive.acquire()
    lease_end = time.monotonic() + 1.0
    seg = mgr.segments("v", 2, ttl=30, timeout=10)
    try:
        assert seg.acquire()
        assert seg.index == crashed.index
        assert time.monotonic() - lease_end < 1.0, time.monotonic() - lease_end
    finally:
        for s in (seg, alive):
            if s.owned():
                s.release()


def test_a_plain_lock_on_a_segment_wakes_the_waiter_too(
        nodes: RedisNodes, make_manager: MakeManager) -> None:
    """Segment ``i`` is the plain lock ``"<name>[<i>]"``: held through
    ``lock()`` (the demo's rows, an admin), its release wakes a segments
    waiter as a segments holder's does."""
    mgr = make_manager(nodes, retry_delay=6)
    plain = [mgr.lock(f"p[{i}]", ttl=30) for i in range(2)]
    assert all(lock.acquire(timeout=1) for lock in plain)
    released: list[float] = []

    def release() -> None:
        released.append(time.monotonic())
        plain[1].release()

    releaser = threading.Timer(0.5, release)
    seg = mgr.segments("p", 2, ttl=30, timeout=10)
    releaser.start()
    try:
        assert seg.acquire()
        served = time.monotonic()
        assert seg.index == 1
        assert served - released[0] < SERVED_WITHIN, served - released[0]
    finally:
        releaser.join(5)
        for s in (seg, plain[0]):
            if s.owned():
                s.release()


def test_a_segment_freed_by_force_release_serves_the_waiter_at_once(
        nodes: RedisNodes, make_manager: MakeManager) -> None:
    """An operator's ``locks release --force`` of a segment (its holder hung, say)
    wakes a segments waiter at once: the forced release publishes on the
    segments' free channel too, as a release does. Before, the waiter found it
    only at its retry delay (6 s here)."""
    mgr = make_manager(nodes, retry_delay=6)
    held = [mgr.segments("f", 2, ttl=30, timeout=0) for _ in range(2)]
    assert all(h.acquire() for h in held)
    thread, got = _waiting(lambda: mgr.segments("f", 2, ttl=30, timeout=10))
    try:
        which = _other_than_queued(nodes, mgr, "f", 2, 0)
        at = time.monotonic()
        replies = mgr.force_release(f"f[{which}]")
        assert sum(r is not None for r in replies) == len(nodes)
        thread.join(timeout=12)
        assert got, "the waiter was not served"
        assert got["held"].index == which
        assert got["at"] - at < SERVED_WITHIN, got["at"] - at
    finally:
        thread.join(timeout=12)
        if got.get("held") is not None and got["held"].owned():
            got["held"].release()
        for h in held:  # the forced one's holder finds it lost
            with contextlib.suppress(LockLost):
                if h.owned():
                    h.release()


def test_a_permit_freed_by_force_release_serves_the_semaphore_waiter_at_once(
        nodes: RedisNodes, make_manager: MakeManager) -> None:
    """The same for a semaphore's permit (``"<name>#<i>"``): its first in line
    listens on the semaphore's free channel, where the forced release now
    publishes the permit's key."""
    mgr = make_manager(nodes, retry_delay=6)
    held = mgr.semaphore("fs", 1, ttl=30, timeout=0)
    assert held.acquire()
    thread, got = _waiting(lambda: mgr.semaphore("fs", 1, ttl=30, timeout=10))
    try:
        at = time.monotonic()
        mgr.force_release("fs#0")
        thread.join(timeout=12)
        assert got, "the waiter was not served"
        assert got["at"] - at < SERVED_WITHIN, got["at"] - at
    finally:
        thread.join(timeout=12)
        if got.get("held") is not None and got["held"].owned():
            got["held"].release()
