"""Node settings that silently drop held locks: eviction (``maxmemory`` with an
evicting ``maxmemory-policy``), settings that cannot be read, replicas, nodes
that do not answer. ``manage.py check --deploy`` and ``locks health`` report them.

Every server here is real; the evicting one is started with ``--maxmemory`` and
``--maxmemory-policy allkeys-lru``, as a ``cache:<alias>`` node often is.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import redis
from django.core import checks
from django.core.management import call_command
from django.core.management.base import CommandError, SystemCheckError

from django_redlock.testing import RedisNodes, RedisServer

MakeManager = Callable[..., Any]
EVICTING = ["--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru"]


@pytest.fixture
def evicting() -> Iterator[RedisServer]:
    with RedisServer(extra_args=EVICTING) as server:
        yield server


@pytest.fixture
def two(redis_nodes_factory: Any) -> RedisNodes:
    nodes: RedisNodes = redis_nodes_factory(2)
    return nodes


def deploy_checks() -> dict[str, list[checks.CheckMessage]]:
    """The node checks' messages by id (the settings' own, such as W001 for an even
    number of nodes, are left out)."""
    found: dict[str, list[checks.CheckMessage]] = {}
    for message in checks.run_checks(include_deployment_checks=True, tags=["redlock"]):
        if (message.id or "").startswith(("redlock.E02", "redlock.W02")):
            found.setdefault(message.id or "", []).append(message)
    return found


def health(*args: str) -> tuple[str, int]:
    """``locks health``: (stdout, plus the CommandError's text when it fails; status)."""
    out = io.StringIO()
    try:
        call_command("locks", "health", *args, stdout=out, stderr=io.StringIO())
    except CommandError as e:
        return out.getvalue() + f"\nCommandError: {e}", e.returncode
    return out.getvalue(), 0


def health_json() -> list[dict[str, Any]]:
    text, _ = health("--json")
    data: list[dict[str, Any]] = json.loads(text.split("\nCommandError: ")[0])
    return data


# -- a node's host: what the check accepts is what connects ---------------------------
#: Hosts of digits and dots (and inet_aton's other forms), each with whether it
#: names this machine's loopback for the resolver.
HOST_FORMS = [("127.0.0.1", True), ("127.1", True), ("2130706433", True), ("0x7f.1", True),
              ("0177.0.0.1", True), ("127.0.0.1.", False), ("2130706433.", False),
              ("0x7f.1.", False), ("256.0.0.1", False), ("1.2.3.4.5", False),
              ("09.0.0.1", False)]


@pytest.mark.parametrize("host,connects", HOST_FORMS)
def test_a_host_the_check_accepts_is_one_that_connects(settings: Any, redis_server: RedisServer,
                                                       host: str, connects: bool) -> None:
    """``redis://127.0.0.1.:PORT/0`` passed the check (a name may end with a dot),
    then every acquire failed QuorumUnavailable ("Name or service not known"):
    the resolver looks an address with a trailing dot up as a name."""
    from django.core.exceptions import ImproperlyConfigured

    from django_redlock import LockManager
    from django_redlock.checks import check_settings

    url = f"redis://{host}:{redis_server.port}/0"
    settings.REDLOCK_NODES = [url]
    errors = [m for m in check_settings() if m.level >= checks.ERROR]
    if not connects:
        assert [m.id for m in errors] == ["redlock.E004"], errors
        assert repr(host) in errors[0].msg
        with pytest.raises(ImproperlyConfigured, match=r"redlock\.E004"):
            LockManager([url])
        return
    assert errors == []
    with LockManager([url], node_timeout=2.0) as mgr:
        lock = mgr.lock("host-form", timeout=0)
        assert lock.acquire()
        lock.release()


@pytest.mark.parametrize("host", ["123456789012", "4294967296", "09"])
def test_one_label_of_digits_that_is_no_address_is_a_name(settings: Any, host: str) -> None:
    """One label of digits that inet_aton does not read is looked up as a
    short name (a 12-digit Docker container id resolves on its network), so
    the check lets it through; dotted digits that are no address are refused
    (a top-level domain is not all digits), see the test above."""
    from django_redlock.checks import check_settings

    settings.REDLOCK_NODES = [f"redis://{host}:6390/0"]
    assert [m.id for m in check_settings() if m.level >= checks.ERROR] == []


def test_the_ipv4_forms_the_check_reads_are_the_resolvers() -> None:
    """The check reads an IPv4 address as the resolver's inet_aton does (it looks
    nothing up itself): compared with this platform's, form by form."""
    import socket

    from django_redlock.core.config import _ipv4_form

    forms = ["0", "00", "08", "0x", "0x0", "0X1f", "0xg", "1", "255", "256", "127.1", "127.0.1",
             "1.2.3.4", "1.2.3.256", "1.16777215", "1.16777216", "255.255.65535",
             "4294967295", "4294967296", "0xffffffff", "0x100000000", "0177.0.0.1",
             "09.0.0.1", "1.2.3.4.5", "1..2", "1.2.", ".1", "01.02.03.04",
             "000000000000000000001", "1.0x", "0x7f.0x0.0.01"]
    for form in forms:
        try:
            socket.inet_aton(form)
        except OSError:
            expected = False
        else:
            expected = True
        assert _ipv4_form(form) is expected, form


def test_eviction_drops_a_held_lock(evicting: RedisServer, make_manager: MakeManager) -> None:
    """Why the check exists: ordinary cache traffic on an evicting node deletes a held
    lock, a second holder gets it, and the first still believes it holds it."""
    first_mgr = make_manager([evicting.url], auto_renew=False)
    second_mgr = make_manager([evicting.url], auto_renew=False)
    first = first_mgr.lock("report", ttl=60)
    assert first.acquire(timeout=0)
    client = evicting.client()
    key = first_mgr.key("report")
    payload = b"x" * 1024
    for i in range(20_000):  # at most ~20 MB into a 2 MB server
        client.set(f"cache:{i}", payload)
        if i % 200 == 0 and not client.exists(key):
            break
    assert not client.exists(key), "the lock key survived 20 MB of cache traffic"
    second = second_mgr.lock("report", ttl=60)
    assert second.acquire(timeout=0)
    assert first.owned() and second.owned()  # two holders: fencing is what saves the data
    assert second.fence > first.fence  # ... because the fence still grows


def test_check_deploy_and_health_report_an_evicting_node(evicting: RedisServer, two: RedisNodes,
                                                         settings: Any) -> None:
    settings.REDLOCK_NODES = [evicting.url, *two.urls]
    found = deploy_checks()
    (error,) = found["redlock.E020"]
    assert isinstance(error, checks.Error)
    assert "allkeys-lru" in error.msg and "maxmemory 2097152 bytes" in error.msg
    assert str(evicting.port) in error.msg
    assert error.hint and "noeviction" in error.hint
    assert not any(k.startswith("redlock.W02") for k in found)
    # Not on every `manage.py check`: it talks to the nodes (decided; documented).
    assert not [m for m in checks.run_checks(tags=["redlock"]) if m.id == "redlock.E020"]
    with pytest.raises(SystemCheckError, match="redlock.E020"):
        call_command("check", "--deploy", "--tag", "redlock", stdout=io.StringIO(),
                     stderr=io.StringIO())

    data = health_json()
    assert [(h["ok"], h["status"]) for h in data] == [(False, "unsafe"), (True, "ok"),
                                                        (True, "ok")]
    assert data[0]["eviction"] == {"maxmemory": 2097152, "policy": "allkeys-lru"}
    assert "deletes held locks" in data[0]["problem"]
    text, status = health()
    assert status == 0 and "2 of 3 nodes healthy, quorum 2: OK" in text
    assert "UNSAFE" in text and "evicts keys: maxmemory 2097152 bytes" in text

    for node in two:  # now every node evicts: not a usable quorum
        node.client().config_set("maxmemory", "100mb")
        node.client().config_set("maxmemory-policy", "volatile-ttl")
    text, status = health()
    assert status == 1 and "0 of 3 nodes healthy" in text and "NOT SAFE" in text
    assert "not safe:" in text and "(unsafe)" in text
    assert len(deploy_checks()["redlock.E020"]) == 3


def test_an_evicting_policy_without_maxmemory_is_a_warning(two: RedisNodes,
                                                           settings: Any) -> None:
    settings.REDLOCK_NODES = list(two.urls)
    two[0].client().config_set("maxmemory-policy", "allkeys-lru")
    found = deploy_checks()
    assert list(found) == ["redlock.W020"], found
    data = health_json()
    assert [h["status"] for h in data] == ["ok", "ok"]
    assert any("setting maxmemory would start deleting" in w for w in data[0]["warnings"])


def test_settings_that_cannot_be_read_are_unknown_not_healthy(two: RedisNodes,
                                                              settings: Any) -> None:
    """A user that may not run CONFIG (or INFO): the node answers, but nobody can
    tell whether it evicts, so it is not counted healthy."""
    for node in two:
        node.client().acl_setuser("locker", enabled=True, passwords=["+pw"], keys=["*"],
                                  channels=["*"], commands=["+@all", "-config", "-info"])
    settings.REDLOCK_NODES = [f"redis://locker:pw@127.0.0.1:{node.port}/0" for node in two]
    client = redis.Redis.from_url(settings.REDLOCK_NODES[0])
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.config_get("maxmemory")
    client.close()
    found = deploy_checks()
    assert list(found) == ["redlock.W021"] and len(found["redlock.W021"]) == 2
    assert "pw@" not in found["redlock.W021"][0].msg
    data = health_json()
    assert [(h["ok"], h["status"]) for h in data] == [(False, "unknown")] * 2
    text, status = health()
    assert status == 1 and "NOT SAFE" in text and "eviction settings unknown" in text
    assert ":pw@" not in text


def test_a_replica_is_a_warning(two: RedisNodes, settings: Any) -> None:
    settings.REDLOCK_NODES = list(two.urls)
    two[1].client().replicaof("127.0.0.1", two[0].port)
    try:
        found = deploy_checks()
        assert list(found) == ["redlock.W023"]
        assert str(two[1].port) in found["redlock.W023"][0].msg
    finally:
        two[1].client().replicaof("NO", "ONE")


def test_a_node_down_is_a_warning_within_the_bound(two: RedisNodes, settings: Any) -> None:
    settings.REDLOCK_NODES = list(two.urls)
    two[1].pause()  # accepts connections, never answers
    try:
        started = time.monotonic()
        found = deploy_checks()
        assert time.monotonic() - started < 4.0
    finally:
        two[1].resume()
    assert list(found) == ["redlock.W022"]
    assert str(two[1].port) in found["redlock.W022"][0].msg
    two[0].kill()
    started = time.monotonic()
    found = deploy_checks()
    assert time.monotonic() - started < 4.0
    assert len(found["redlock.W022"]) == 1  # node 1 answers again


def test_every_master_of_a_cluster_node_is_checked(settings: Any) -> None:
    """A Cluster node is several masters, each holding the locks of its own
    slots. ``check --deploy`` and ``locks health`` read only the master of
    slot 0 (the node's pool): a Cluster whose other masters evict keys
    passed as healthy. Now every master is read, and each one that fails is
    named by its address (never with the password)."""
    from django_redlock.testing import RedisClusterGroup

    with RedisClusterGroup(3, password="s3cret-pw") as cluster:
        slot0 = cluster.master_for_slot(0)
        bad = next(m for m in cluster if m is not slot0)  # not the node's pool
        bad.execute("CONFIG", "SET", "maxmemory", "100mb")
        bad.execute("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
        settings.REDLOCK_NODES = [cluster.node_setting()]
        settings.REDLOCK = {"REPLICA_ACKS": 0}
        found = deploy_checks()
        assert list(found) == ["redlock.E020"], found
        (error,) = found["redlock.E020"]
        assert f"master {bad.host}:{bad.port} evicts keys" in error.msg
        assert "allkeys-lru" in error.msg and "s3cret-pw" not in error.msg

        (data,) = health_json()
        assert (data["ok"], data["status"]) == (False, "unsafe")
        assert data["eviction"] == {"maxmemory": 104857600, "policy": "allkeys-lru"}
        assert f"master {bad.host}:{bad.port}" in data["problem"]
        assert sorted(data["masters"]) == sorted(f"{m.host}:{m.port}" for m in cluster)
        text, status = health()
        assert status == 1 and "UNSAFE" in text and "s3cret-pw" not in text
        assert f"master {bad.host}:{bad.port}: evicts keys" in text

        # REPLICA_ACKS (W024): every master without a replica, each named
        settings.REDLOCK = {"REPLICA_ACKS": 1}
        bad.execute("CONFIG", "SET", "maxmemory-policy", "noeviction")
        found = deploy_checks()
        assert list(found) == ["redlock.W024"], found
        named = sorted(m.msg.split(" master ", 1)[1].split(" ", 1)[0]
                       for m in found["redlock.W024"])
        assert named == sorted(f"{m.host}:{m.port}" for m in cluster)

        # A master that does not answer: a warning naming it, within the bound
        settings.REDLOCK = {"REPLICA_ACKS": 0}
        bad.pause()
        try:
            started = time.monotonic()
            found = deploy_checks()
            took = time.monotonic() - started
            (data,) = health_json()
        finally:
            bad.resume()
        assert took < 4.0, took
        assert list(found) == ["redlock.W022"], found
        (warning,) = found["redlock.W022"]
        assert f"master {bad.host}:{bad.port}" in warning.msg and "s3cret-pw" not in warning.msg
        assert data["status"] == "unknown" and f"master {bad.host}:{bad.port}" in data["problem"]
