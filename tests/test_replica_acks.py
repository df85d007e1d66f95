"""REDLOCK["REPLICA_ACKS"]: a grant counts only once WAIT confirms the replicas
have it (issue 21), on real masters with real replicas (``RedisNodes(n,
replicas=k)``), faults by SIGSTOP and kill -9. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from django_redlock import LockLost, QuorumUnavailable
from django_redlock.checks import check_settings
from django_redlock.testing import RedisNodes, RedisServer

from .polling import wait_until

pytestmark = pytest.mark.slow

NODE_TIMEOUT = 0.2
#: rounds.wait_ms: WAIT blocks at most half the node timeout
WAIT_S = NODE_TIMEOUT / 2
MakeManager = Callable[..., Any]


@pytest.fixture
def one(redis_nodes_factory: Callable[..., RedisNodes]) -> RedisNodes:
    return redis_nodes_factory(1, replicas=1)


@pytest.fixture
def three(redis_nodes_factory: Callable[..., RedisNodes]) -> RedisNodes:
    return redis_nodes_factory(3, replicas=1)


def replica(nodes: RedisNodes, i: int = 0) -> RedisServer:
    return nodes.replicas[i][0]


def has_key(server: RedisServer, key: str) -> bool:
    return bool(server.execute("EXISTS", key))


def fault(server: RedisServer, kind: str) -> None:
    getattr(server, kind)()


# -- the harness ------------------------------------------------------------------
def test_the_harness_starts_masters_with_replicas_in_sync(one: RedisNodes) -> None:
    master, rep = one[0], replica(one)
    assert b"role:slave" in rep.execute("INFO", "replication")
    assert b"connected_slaves:1" in master.execute("INFO", "replication")
    master.execute("SET", "k", "v")
    assert wait_until(lambda: rep.execute("GET", "k") == b"v", timeout=2.0)
    assert one.urls == [master.url] and len(one) == 1  # replicas are not nodes
    one.flushall()  # masters only: a replica refuses writes
    assert wait_until(lambda: not has_key(rep, "k"), timeout=2.0)


def test_replicas_follow_a_master_with_a_password(
        redis_nodes_factory: Callable[..., RedisNodes], make_manager: MakeManager) -> None:
    nodes = redis_nodes_factory(1, replicas=1, password="s3cret")
    mgr = make_manager(nodes, node_timeout=NODE_TIMEOUT, replica_acks=1)
    with mgr.lock("auth", auto_renew=False) as lock:
        assert has_key(replica(nodes), lock.key)


def test_replicas_are_refused_as_a_bad_count() -> None:
    with pytest.raises(ValueError, match="replicas"):
        RedisNodes(1, replicas=-1)
    with pytest.raises(ValueError, match="replicas"):
        RedisNodes(1, replicas=True)


# -- the setting --------------------------------------------------------------------
@pytest.mark.parametrize("value,expected", [
    (True, "redlock.E009"), ("1", "redlock.E009"), (1.0, "redlock.E009"), (None, "redlock.E009"),
    (-1, "redlock.E010"), (65, "redlock.E010"),
])
def test_a_bad_replica_acks_is_a_check_error(settings: Any, value: Any, expected: str) -> None:
    settings.REDLOCK = {"REPLICA_ACKS": value}
    messages = [m for m in check_settings() if m.id.startswith("redlock.E")]
    assert [m.id for m in messages] == [expected]
    assert "REPLICA_ACKS" in messages[0].msg
    with pytest.raises(SystemCheckError, match=expected.replace(".", r"\.")):
        call_command("check")


def test_a_bad_replica_acks_is_refused_by_the_manager() -> None:
    from django_redlock import LockManager
    from django_redlock.engine.manager import InvalidOption

    with pytest.raises(InvalidOption, match=r"redlock\.E010: REDLOCK\['REPLICA_ACKS'\]"):
        LockManager(["redis://127.0.0.1:1/0"], replica_acks=-1)
    with pytest.raises(InvalidOption, match=r"redlock\.E009"):
        LockManager(["redis://127.0.0.1:1/0"], replica_acks=False)


def test_valid_replica_acks_pass_the_checks(settings: Any) -> None:
    for value in (0, 1, 64):
        settings.REDLOCK = {"REPLICA_ACKS": value}
        assert [m.id for m in check_settings()] == []


# -- locks with a replica that keeps up -----------------------------------------------------
@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_locks_work_when_the_replica_acknowledges(one: RedisNodes, make_manager: MakeManager,
                                                  flavour: str) -> None:
    mgr = make_manager(one, node_timeout=NODE_TIMEOUT, replica_acks=1)
    rep = replica(one)
    if flavour == "sync":
        with mgr.lock("acked", ttl=5, auto_renew=False) as lock:
            # A grant counts only once the replica has it: it is there already.
            assert has_key(rep, lock.key)
            assert lock.granted_nodes == 1 and lock.fence > 0
            lock.extend(20)
            assert 5_000 < int(rep.execute("PTTL", lock.key)) <= 20_000
        key = lock.key
    else:
        async def scenario() -> str:
            async with mgr.alock("acked", ttl=5, auto_renew=False) as lock:
                assert has_key(rep, lock.key)
                await lock.extend(20)
                assert 5_000 < int(rep.execute("PTTL", lock.key)) <= 20_000
            return lock.key

        key = asyncio.run(scenario())
    assert wait_until(lambda: not has_key(rep, key) and not has_key(one[0], key), timeout=2.0)


def test_renewal_works_when_the_replica_acknowledges(one: RedisNodes,
                                                     make_manager: MakeManager) -> None:
    mgr = make_manager(one, node_timeout=NODE_TIMEOUT, replica_acks=1)
    with mgr.lock("renewed", ttl=1.2) as lock:
        time.sleep(2.6)  # more than two leases: only the renewals keep it
        assert lock.owned()
        assert has_key(replica(one), lock.key)


# -- a replica that does not acknowledge --------------------------------------------------
@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("kind", ["pause", "kill"])
def test_one_node_whose_replica_is_down_grants_nothing(one: RedisNodes, make_manager: MakeManager,
                                                       kind: str, flavour: str) -> None:
    mgr = make_manager(one, node_timeout=NODE_TIMEOUT, replica_acks=1)
    with mgr.lock("warm"):
        pass
    fault(replica(one), kind)
    lock = mgr.lock("unconfirmed", timeout=None)  # would wait forever if merely busy
    started = time.monotonic()
    with pytest.raises(QuorumUnavailable) as info:
        if flavour == "sync":
            lock.acquire()
        else:
            asyncio.run(mgr.alock("unconfirmed", timeout=None).acquire())
    took = time.monotonic() - started
    assert took < NODE_TIMEOUT + 0.5
    assert "only 0 of 1 replica(s) acknowledged" in str(info.value)
    assert not lock.owned()
    # The master granted it; the attempt's clean-up took it back.
    assert wait_until(lambda: not has_key(one[0], lock.key), timeout=2.0)


def test_the_point_a_grant_counts_only_once_the_replica_has_it(
        one: RedisNodes, make_manager: MakeManager) -> None:
    """With REPLICA_ACKS=0 a lock is granted while the replica is stopped (it
    cannot have the key: a failover then would lose the lock); with 1 the same
    grant does not count until the replica is back and has it."""
    rep = replica(one)
    unchecked = make_manager(one, node_timeout=NODE_TIMEOUT)
    checked = make_manager(one, node_timeout=NODE_TIMEOUT, replica_acks=1)
    rep.pause()
    with unchecked.lock("point", timeout=0, auto_renew=False) as lock:
        assert lock.owned()  # on the master only: the replica is stopped
    with pytest.raises(QuorumUnavailable):
        checked.lock("point", timeout=0).acquire()
    rep.resume()
    one.wait_replicated()
    with checked.lock("point", timeout=0, auto_renew=False) as lock:
        assert has_key(rep, lock.key)  # returned only once the replica had it


def test_an_extension_the_replica_does_not_confirm_does_not_count(
        one: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(one, node_timeout=NODE_TIMEOUT, replica_acks=1)
    lock = mgr.lock("extend-unconfirmed", ttl=5, auto_renew=False)
    lock.acquire()
    replica(one).pause()
    with pytest.raises(QuorumUnavailable, match="replica"):
        lock.extend(10)
    lock.release()


def test_renewals_the_replica_does_not_confirm_end_in_a_lost_lock(
        one: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(one, node_timeout=NODE_TIMEOUT, replica_acks=1)
    lock = mgr.lock("renew-unconfirmed", ttl=0.6)
    lock.acquire()
    replica(one).pause()
    # Each renewal is applied by the master but never counts: the lease the
    # holder can trust runs out, and it is told.
    assert wait_until(lambda: not lock.owned(), timeout=3.0)
    with pytest.raises(LockLost):
        lock.release()


def test_a_majority_grants_when_one_masters_replica_is_paused(
        three: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(three, node_timeout=NODE_TIMEOUT, replica_acks=1)
    with mgr.lock("warm"):
        pass
    replica(three, 0).pause()
    with mgr.lock("two-of-three", ttl=1.2) as lock:
        assert lock.owned()
        for i in (1, 2):
            assert has_key(replica(three, i), lock.key)
        time.sleep(2.6)  # more than two leases: renewed by the other two
        assert lock.owned()
        lock.extend(5)


@pytest.mark.parametrize("acks,acquired", [(0, True), (1, False)])
def test_an_unconfirmed_grant_is_not_a_vote(three: RedisNodes, make_manager: MakeManager,
                                            acks: int, acquired: bool) -> None:
    """One master down and another's replica stopped: two masters grant, but
    with REPLICA_ACKS=1 only one grant counts, and one of three is no majority."""
    mgr = make_manager(three, node_timeout=NODE_TIMEOUT, replica_acks=acks)
    with mgr.lock("warm"):
        pass
    three[2].kill()
    replica(three, 0).pause()
    lock = mgr.lock("vote", timeout=0, auto_renew=False)
    if acquired:
        assert lock.acquire()
        lock.release()
        return
    with pytest.raises(QuorumUnavailable) as info:
        lock.acquire()
    assert "1 of 3 nodes answered, 2 needed" in str(info.value)
    for master in (three[0], three[1]):
        assert wait_until(lambda m=master: not has_key(m, lock.key), timeout=2.0)


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_flushed_script_cache_sends_the_whole_chain_again(
        one: RedisNodes, make_manager: MakeManager, flavour: str) -> None:
    """NOSCRIPT to the script of a chain: the script goes again as EVAL with
    WAIT behind it again (a WAIT that ran before the script confirms nothing),
    and the stale WAIT reply is read and dropped, never taken for another's."""
    mgr = make_manager(one, node_timeout=NODE_TIMEOUT, replica_acks=1)
    rep = replica(one)

    def sync_rounds() -> None:
        with mgr.lock("warm"):  # a live connection with the scripts loaded
            pass
        one[0].execute("SCRIPT", "FLUSH")
        with mgr.lock("flushed", ttl=5, auto_renew=False) as lock:
            assert has_key(rep, lock.key)
            one[0].execute("SCRIPT", "FLUSH")
            lock.extend(20)
            assert int(rep.execute("PTTL", lock.key)) > 5_000

    async def async_rounds() -> None:
        async with mgr.alock("warm"):
            pass
        one[0].execute("SCRIPT", "FLUSH")
        async with mgr.alock("flushed", ttl=5, auto_renew=False) as lock:
            assert has_key(rep, lock.key)
            one[0].execute("SCRIPT", "FLUSH")
            await lock.extend(20)
            assert int(rep.execute("PTTL", lock.key)) > 5_000

    if flavour == "sync":
        sync_rounds()
    else:
        asyncio.run(async_rounds())


@pytest.mark.parametrize("n", [1, 3])
def test_a_waiter_gets_the_lock_a_release_hands_over_confirmed(
        redis_nodes_factory: Callable[..., RedisNodes], make_manager: MakeManager,
        n: int) -> None:
    """A waiter queued at the gate (on one node: handed the lock by the
    release) is not given an unconfirmed grant: its attempt finds the key its
    own, renews it and WAIT confirms it; it gets the lock promptly."""
    import threading

    nodes = redis_nodes_factory(n, replicas=1)
    mgr = make_manager(nodes, node_timeout=NODE_TIMEOUT, replica_acks=1)
    holder = mgr.lock("line", ttl=10, auto_renew=False)
    holder.acquire()
    got: dict[str, Any] = {}

    def wait() -> None:
        lock = mgr.lock("line", ttl=10, timeout=5, auto_renew=False)
        got["ok"] = lock.acquire()
        got["at"] = time.monotonic()
        got["on_replicas"] = sum(has_key(replica(nodes, i), lock.key) for i in range(n))
        lock.release()

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    time.sleep(0.3)  # the waiter asks, is refused and waits in line
    assert waiter.is_alive()
    released_at = time.monotonic()
    holder.release()
    waiter.join(6.0)
    assert not waiter.is_alive()
    assert got["ok"] is True
    assert got["at"] - released_at < 1.0  # woken by the release, not by its lease
    assert got["on_replicas"] >= n // 2 + 1


def test_check_deploy_warns_of_a_node_without_the_replicas_to_confirm(
        redis_nodes_factory: Callable[..., RedisNodes], settings: Any) -> None:
    from django.core import checks

    nodes = redis_nodes_factory(3, replicas=1)
    replica(nodes, 1).kill()
    assert wait_until(lambda: b"connected_slaves:0" in nodes[1].execute("INFO", "replication"),
                      timeout=3.0)
    settings.REDLOCK_NODES = nodes.urls

    def w024(acks: int) -> list[checks.CheckMessage]:
        settings.REDLOCK = {"REPLICA_ACKS": acks}
        return [m for m in checks.run_checks(include_deployment_checks=True, tags=["redlock"])
                if m.id == "redlock.W024"]

    (warning,) = w024(1)
    assert str(nodes[1].port) in warning.msg and "0 connected replica(s)" in warning.msg
    assert len(w024(2)) == 3  # one replica each: none has two
    assert w024(0) == []


def test_a_confirmed_lock_survives_a_failover_to_the_replica(
        one: RedisNodes, make_manager: MakeManager) -> None:
    """The master dies right after the grant returned and its replica is
    promoted (what Sentinel does): the lock, and its fence counter, are there."""
    mgr = make_manager(one, node_timeout=NODE_TIMEOUT, replica_acks=1)
    lock = mgr.lock("failover", ttl=10, auto_renew=False)
    assert lock.acquire()
    one[0].kill()  # no time for anything more to reach the replica
    rep = replica(one)
    rep.execute("REPLICAOF", "NO", "ONE")
    after = make_manager([rep.url], node_timeout=NODE_TIMEOUT, auto_renew=False)
    second = after.lock("failover", ttl=10, timeout=0)
    assert not second.acquire()  # still held: no second holder
    assert int(rep.execute("PTTL", lock.key)) > 5_000
    rep.execute("DEL", lock.key)  # as if its lease had run out
    assert second.acquire()
    assert second.fence > lock.fence
    second.release()
