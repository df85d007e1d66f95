"""Node kinds together (issue 21): a plain master, a Sentinel group and a
Cluster are three votes of one manager; ``locks health`` shows the master
each Sentinel node resolves to and each Cluster's state."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any, Callable, Iterator

import pytest
from django.core.management import call_command

from django_redlock import QuorumUnavailable
from django_redlock.testing import RedisClusterGroup, RedisServer, SentinelGroup

from .polling import wait_until

pytestmark = pytest.mark.slow

MakeManager = Callable[..., Any]


@pytest.fixture(scope="module")
def kinds() -> Iterator[tuple[RedisServer, SentinelGroup, RedisClusterGroup]]:
    with RedisServer() as plain, SentinelGroup() as group, RedisClusterGroup(3) as cluster:
        yield plain, group, cluster


def nodes_of(kinds: Any) -> list[Any]:
    plain, group, cluster = kinds
    return [plain.url, group.node_setting(), cluster.node_setting()]


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_each_kind_is_one_vote(kinds: Any, make_manager: MakeManager, flavour: str) -> None:
    plain, group, cluster = kinds
    mgr = make_manager(nodes_of(kinds))
    assert mgr.quorum == 2 and len(mgr.nodes) == 3
    def on_each(key: str) -> bool:
        servers = [plain, group.master, cluster.master_for_slot(cluster.key_slot(key))]
        return all(server.execute("EXISTS", key) == 1 for server in servers)

    if flavour == "sync":
        with mgr.lock("mixed", auto_renew=False) as lock:
            assert lock.granted_nodes >= 2  # a quorum (the round may not wait for the third)
            assert wait_until(lambda: on_each(lock.key), timeout=2.0)
    else:
        async def scenario() -> None:
            async with mgr.alock("mixed", auto_renew=False) as lock:
                assert lock.granted_nodes >= 2
                assert wait_until(lambda: on_each(lock.key), timeout=2.0)

        asyncio.run(scenario())


def test_two_kinds_down_is_no_quorum_one_down_is_fine(
        make_manager: MakeManager) -> None:
    with RedisServer() as plain, SentinelGroup() as group, RedisClusterGroup(3) as cluster:
        mgr = make_manager([plain.url, group.node_setting(), cluster.node_setting()])
        with mgr.lock("a", auto_renew=False):
            pass
        plain.kill()
        with mgr.lock("b", auto_renew=False) as lock:  # the Sentinel node and the Cluster
            assert lock.granted_nodes == 2
        group.master.kill()
        for sentinel in group.sentinels:  # and no sentinel to say where the master is
            sentinel.kill()
        with pytest.raises(QuorumUnavailable):
            mgr.lock("c", timeout=0.5, auto_renew=False).acquire()


def test_locks_health_shows_the_sentinel_master_and_the_cluster_state(
        kinds: Any, settings: Any) -> None:
    plain, group, cluster = kinds
    settings.REDLOCK_NODES = nodes_of(kinds)
    out = io.StringIO()
    call_command("locks", "health", "--json", stdout=out)
    health = json.loads(out.getvalue())
    assert [h["ok"] for h in health] == [True, True, True]
    master = group.master
    assert health[0]["topology"] is None
    assert health[1]["topology"] == f"master {master.host}:{master.port} (mymaster)"
    assert health[1]["role"] == "master"
    assert health[2]["topology"] == "cluster_state:ok, 3 masters, 16384 slots ok"
    text = io.StringIO()
    call_command("locks", "health", stdout=text)
    assert f"master {master.host}:{master.port} (mymaster)" in text.getvalue()
    assert "cluster_state:ok" in text.getvalue()
    assert "3 of 3 nodes healthy" in text.getvalue()
