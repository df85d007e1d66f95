"""The harness's Sentinel group and Redis Cluster (issue 21): real processes
on loopback that start, agree, fail over and move slots. Every wait is bounded
(the harness's own waits, and the ones here)."""

from __future__ import annotations

from typing import Iterator

import pytest

from django_redlock.testing import RedisClusterGroup, SentinelGroup
from django_redlock.testing.groups import _cluster_info, _key_in_slot

from .polling import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.harness]


@pytest.fixture
def group() -> Iterator[SentinelGroup]:
    with SentinelGroup(replicas=1, sentinels=3) as g:
        yield g


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterGroup]:
    with RedisClusterGroup(3) as c:
        yield c


def role(server) -> bytes:
    return server.execute("ROLE")[0]


def test_a_sentinel_group_starts_with_its_master_known_to_every_sentinel(
        group: SentinelGroup) -> None:
    master = group.master
    assert master is group.servers[0] and role(master) == b"master"
    assert [role(r) for r in group.replicas] == [b"slave"]
    for sentinel in group.sentinels:
        assert sentinel.master_address() == (master.host, master.port)
    entry = group.node_setting()
    assert entry == {"SENTINELS": group.sentinel_urls, "SERVICE": "mymaster"}


def test_a_forced_failover_promotes_the_replica_and_demotes_the_master(
        group: SentinelGroup) -> None:
    old = group.master
    old.execute("SET", "k", "v")
    new = group.failover()
    assert new is not old and role(new) == b"master"
    assert new.execute("GET", "k") == b"v"  # it was a synced replica
    # Demoted at once (the sentinels would, about 10 s later).
    assert role(old) == b"slave"
    assert wait_until(lambda: old.execute("GET", "k") == b"v", timeout=5.0)


def test_a_killed_master_is_replaced_by_the_sentinels(group: SentinelGroup) -> None:
    old = group.kill_master()
    new = group.wait_master(other_than=old, timeout=20.0)
    assert new is group.servers[1] and role(new) == b"master"
    old.restart()  # back empty: the sentinels make it a replica of the new master
    # A sentinel converts it at its first INFO (every 10 s for a replica) that
    # comes 8 s after it saw the old master claim "master" and 8 s after it
    # last called it down: about 10 s, and 20 s when the first INFO comes a
    # moment too early (CI saw that once, with a 20 s bound). 35 s allows two
    # periods and a loaded machine; a sentinel that never converts still fails.
    # On a loaded machine the sentinels may instead fail over once more, to the
    # restarted server (CI, with two test passes at once: its sentinels listed
    # the new master as the replica). Either way the group must settle: one
    # master the sentinels agree on, the other server its replica, following it.
    assert wait_until(lambda: _settled(group), timeout=35.0), _state(group)
    if role(old) != b"slave":
        print(f"the sentinels failed over again, to the restarted {old}: {_state(group)}")


def _settled(group: SentinelGroup) -> bool:
    """One master the sentinels agree on, every other data server its replica
    (False, to be asked again, while a server is still coming back)."""
    try:
        master = group._agreed_master()
        if master is None:
            return False
        for server in group.servers:
            if server is master:
                continue
            if not server.ping():
                return False
            reply = server.execute("ROLE")
            if reply[0] != b"slave" or int(reply[2]) != master.port \
                    or reply[3] != b"connected":
                return False
        return True
    except Exception:  # noqa: BLE001 - a server restarting: not settled yet
        return False


def _state(group: SentinelGroup) -> str:
    """What each sentinel calls master, and each data server's role (for a failure)."""
    sentinels = [s.master_address() if s.is_running() else None for s in group.sentinels]
    roles = []
    for server in group.servers:
        try:
            roles.append((server.port, server.execute("ROLE")[:4]))
        except Exception as exc:  # noqa: BLE001 - a report, whatever the server says
            roles.append((server.port, repr(exc)))
    return f"sentinels' masters {sentinels}; roles {roles}"


def test_a_master_named_by_a_majority_of_the_sentinels_is_found_with_majority(
        group: SentinelGroup) -> None:
    """``wait_master(majority=True)`` (the chaos run's kill-master) takes the
    master a majority of the sentinels names; the default waits for every
    sentinel. One sentinel made to name a dead address stands for a leader
    stuck in a failover whose promoted replica died."""
    from django_redlock.testing import _free_port

    stale, master = group.sentinels[0], group.master
    stale.execute("SENTINEL", "REMOVE", group.service)
    stale.execute("SENTINEL", "MONITOR", group.service, "127.0.0.1", str(_free_port()), "2")
    assert wait_until(lambda: stale.master_address() != (master.host, master.port), timeout=5)
    assert group._agreed_master() is None
    assert group._agreed_master(majority=True) is master
    other = next(s for s in group.servers if s is not master)
    assert group.wait_master(other_than=other, timeout=5, majority=True) is master


def test_a_cluster_starts_with_every_slot_served(cluster: RedisClusterGroup) -> None:
    for server in cluster:
        info = server.execute("CLUSTER", "INFO").decode()
        assert "cluster_state:ok" in info and "cluster_slots_assigned:16384" in info
        assert "cluster_known_nodes:3" in info
    assert cluster.master_for_slot(0) is cluster[0]
    assert cluster.master_for_slot(16383) is cluster[2]
    assert cluster.node_setting() == {"CLUSTER": cluster.urls}


def test_a_slot_migrates_with_its_keys(cluster: RedisClusterGroup) -> None:
    slot = cluster.key_slot("{lock}")
    source = cluster.master_for_slot(slot)
    source.execute("SET", "{lock}", "v")
    source.execute("SET", "{lock}:fence", "7")
    target = next(m for m in cluster if m is not source)
    assert cluster.migrate_slot(slot, to=target) is source
    assert cluster.master_for_slot(slot) is target
    assert target.execute("GET", "{lock}") == b"v"
    assert target.execute("GET", "{lock}:fence") == b"7"
    assert source.execute("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    with pytest.raises(Exception, match="MOVED"):
        source.execute("GET", "{lock}")
    cluster.migrate_slot(slot, to=source)  # back, for the other tests


def _own_epochs(cluster: RedisClusterGroup) -> dict[int, int]:
    return {m.port: int(_cluster_info(m)["cluster_my_epoch"]) for m in cluster}


def test_each_move_of_a_slot_leaves_its_new_owner_with_the_greatest_epoch() -> None:
    """A slot moved back and forth at once, four times: after each move the
    new owner's config epoch is above every other master's, so no claim of
    an earlier owner can take the slot back. Before, the importing master
    bumped its epoch above the ones it had heard of, and gossip had not told
    it of the last move's yet: it claimed the slot with an epoch below its
    source's, or equal to it."""
    with RedisClusterGroup(3) as c:
        slot = 16000
        key = _key_in_slot(slot)
        a = c.master_for_slot(slot)
        b = next(m for m in c if m is not a)
        a.execute("SET", key, "v")
        for to in (b, a, b, a):
            c.migrate_slot(slot, to=to)
            epochs = _own_epochs(c)
            assert all(epochs[to.port] > e for port, e in epochs.items() if port != to.port), \
                (to.port, epochs)
            assert to.execute("GET", key) == b"v"


def test_a_slot_moved_back_keeps_its_keys_however_late_the_source_hands_it_over() -> None:
    """The CI flake of a test's clean-up move: a slot moved from A to B and
    back at once, A's ``SETSLOT`` before A had heard of B's new epoch (no
    bump: its own was the greatest it knew of). Until B's own ``SETSLOT``, B
    still claimed the slot with its greater epoch, and a ping of B then gave
    the slot back to B, and A dropped the key moved. The window is made long
    here (2.5 s, while the nodes ping each other at least every 0.5 s with a
    1 s node timeout), after three moves at once: the key stays, A keeps the
    slot."""
    with RedisClusterGroup(3, node_timeout_ms=1000) as c:
        slot = 16000
        key = _key_in_slot(slot)
        a = c.master_for_slot(slot)
        b = next(m for m in c if m is not a)
        a.execute("SET", key, "v")
        for to in (b, a, b):
            c.migrate_slot(slot, to=to)
        c.migrate_slot(slot, to=a, finish=False)
        c.finish_migration(hand_over_after=2.5)
        assert c.master_for_slot(slot) is a
        assert a.execute("GET", key) == b"v"
        epochs = _own_epochs(c)
        assert all(epochs[a.port] > e for port, e in epochs.items() if port != a.port), epochs


def test_a_cluster_replica_takes_over_on_a_manual_failover() -> None:
    with RedisClusterGroup(3, replicas=1) as c:
        key_slot = c.key_slot("{a}")
        owner = c.master_for_slot(key_slot)
        owner.execute("SET", "{a}", "1")
        owner.execute("WAIT", 1, 1000)
        new = c.failover(c.masters.index(owner))
        assert c.master_for_slot(key_slot) is new
        assert new.execute("GET", "{a}") == b"1"
        assert role(owner) == b"slave"


@pytest.mark.parametrize("start", [1, 2])
def test_a_cluster_starts_with_its_replicas_confirming_the_first_write(start: int) -> None:
    """Once started, every master's first write is confirmed by its replica
    within 250 ms (what ``REPLICA_ACKS`` asks of a grant). The master lists
    a replica as online only after that replica's first ACK, up to a second
    after its sync: a start that counted replicas there went ahead too soon
    about one time in seven, and a test's very first grant was unconfirmed
    (CI, twice). Two starts make a regression show up more often than not."""
    with RedisClusterGroup(3, replicas=1, node_timeout_ms=5000) as c:
        for master in c.masters:
            served = [lo for lo, _, port in c._slot_map(master) if port == master.port]
            probe = _key_in_slot(served[0])
            assert master.execute("SET", probe, "1") in ("OK", b"OK")
            assert master.execute("WAIT", 1, 250) == 1, master
