"""The lock's fault cases, for the family made of plain locks (multi-lock, segments,
reentrant): a node killed, paused (SIGSTOP) or restarted empty, and a holder
paused past its lease. What the user gets is what a plain lock gives: the
quorum carries on, a majority down is ``QuorumUnavailable`` within the bound,
a lost hold is reported at release, and no name ever has two holders.
(The read-write lock and the semaphore have their own: tests/test_rwlock.py,
tests/test_semaphore.py.) Every wait is bounded.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest

from django_redlock import LockLost, QuorumUnavailable
from django_redlock.testing import RedisNodes

MakeManager = Callable[..., Any]

pytestmark = pytest.mark.slow

FAULTS = ["kill", "pause", "restart-empty"]


def _fault(nodes: RedisNodes, fault: str) -> Callable[[], None]:
    """Apply ``fault`` to node 0; return how to undo it (a no-op for kill/restart)."""
    server = nodes.servers[0]
    if fault == "kill":
        server.kill()
        return lambda: None
    if fault == "pause":
        server.pause()
        return server.resume
    server.restart(empty=True)
    return lambda: None


def _members(mgr: Any, kind: str) -> Any:
    if kind == "multi":
        return mgr.multi_lock(["ff:a", "ff:b"], ttl=30, timeout=1)
    if kind == "segments":
        return mgr.segments("ff", 2, ttl=30, timeout=1)
    return mgr.lock("ff", ttl=30, timeout=1, reentrant=True)


def _rival(mgr: Any, kind: str) -> Any:
    """Something that must not get in while ``_members(kind)`` holds."""
    if kind == "multi":
        return mgr.lock("ff:b", timeout=0.3)
    if kind == "segments":
        return mgr.segments("ff", 2, timeout=0.3)  # one segment is held, one is free
    return mgr.lock("ff", timeout=0.3)


@pytest.mark.parametrize("kind", ["multi", "segments", "reentrant"])
@pytest.mark.parametrize("fault", FAULTS)
def test_a_node_fault_keeps_the_quorum_and_exclusion(
        kind: str, fault: str, redis_nodes_factory: Callable[..., RedisNodes],
        make_manager: MakeManager) -> None:
    nodes = redis_nodes_factory(3)
    mgr = make_manager(nodes, node_timeout=0.2)
    held = _members(mgr, kind)
    assert held.acquire()
    undo = _fault(nodes, fault)
    try:
        rival = _rival(mgr, kind)
        got = rival.acquire()
        if kind == "segments":
            assert got and rival.index != held.index  # the other segment, never the same
            rival.release()
        else:
            assert got is False  # two nodes still hold it: no majority for the rival
        held.extend()  # the quorum of two carries on
        held.release()
        with _members(mgr, kind) as again:  # and takes it again with one node out
            assert again.owned()
    finally:
        undo()


@pytest.mark.parametrize("kind", ["multi", "segments", "reentrant"])
def test_majority_down_is_quorum_unavailable_within_the_bound(
        kind: str, redis_nodes_factory: Callable[..., RedisNodes],
        make_manager: MakeManager) -> None:
    nodes = redis_nodes_factory(3)
    mgr = make_manager(nodes, node_timeout=0.2)
    nodes.servers[0].kill()
    nodes.servers[1].pause()
    try:
        started = time.monotonic()
        with pytest.raises(QuorumUnavailable):
            _members(mgr, kind).acquire()
        assert time.monotonic() - started < 1.0 + 3.0  # its timeout, plus slack
    finally:
        nodes.servers[1].resume()


@pytest.mark.parametrize("kind", ["multi", "segments", "reentrant"])
def test_a_holder_paused_past_its_lease_is_told(
        kind: str, redis_nodes_factory: Callable[..., RedisNodes],
        make_manager: MakeManager) -> None:
    nodes = redis_nodes_factory(3)
    mgr = make_manager(nodes, node_timeout=0.2)
    if kind == "multi":
        held = mgr.multi_lock(["fp:a", "fp:b"], ttl=0.5, auto_renew=False)
        rival = mgr.lock("fp:a", ttl=30)
    elif kind == "segments":
        held = mgr.segments("fp", 1, ttl=0.5, auto_renew=False)
        rival = mgr.segments("fp", 1, ttl=30)
    else:
        held = mgr.lock("fp", ttl=0.5, auto_renew=False, reentrant=True)
        rival = mgr.lock("fp", ttl=30)
    assert held.acquire(timeout=1)
    time.sleep(0.8)  # "paused" past the lease: it ran out on the nodes
    assert rival.acquire(timeout=1)  # the next holder gets in...
    with pytest.raises(LockLost):  # ...and the paused one learns it at release
        held.release()
    assert rival.owned()  # its release did not touch the new holder's key
    rival.release()
