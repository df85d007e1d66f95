"""Sentinel and Cluster node entries in REDLOCK_NODES (issue 21): each
malformed form has its own check id, passwords never show, and a valid entry
becomes one node spec with canonical addresses."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from django_redlock.checks import check_settings
from django_redlock.core.config import parse_nodes

SENTINEL = {"SENTINELS": ["redis://10.0.0.5:26379", "redis://10.0.0.6:26379"],
            "SERVICE": "mymaster"}
CLUSTER = {"CLUSTER": ["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"]}


def ids() -> list[str]:
    return [m.id for m in check_settings()]


def test_valid_sentinel_and_cluster_nodes_mix_with_plain_ones(settings: Any) -> None:
    settings.REDLOCK_NODES = [
        "redis://10.0.0.9:6379/0",
        {**SENTINEL, "OPTIONS": {"password": "pw", "socket_timeout": 0.05}},
        {**CLUSTER, "OPTIONS": {}},
    ]
    assert ids() == []
    specs, problems = parse_nodes(settings.REDLOCK_NODES)
    assert problems == []
    assert [s.kind for s in specs] == ["url", "sentinel", "cluster"]
    sentinel, cluster = specs[1], specs[2]
    assert sentinel.addresses == ("redis://10.0.0.5:26379/0", "redis://10.0.0.6:26379/0")
    assert sentinel.service == "mymaster"
    assert sentinel.display == "sentinel:mymaster@10.0.0.5:26379,10.0.0.6:26379"
    assert cluster.addresses == ("redis://10.0.0.1:7000/0", "redis://10.0.0.2:7000/0")
    assert cluster.display == "cluster:10.0.0.1:7000,10.0.0.2:7000"


@pytest.mark.parametrize("entry,expected", [
    ({"SENTINELS": [], "SERVICE": "m"}, "redlock.E012"),
    ({"SENTINELS": "redis://h:1", "SERVICE": ""}, "redlock.E012"),
    ({"SENTINELS": ["redis://h:1"]}, "redlock.E012"),
    ({"SENTINELS": ["redis://h:1"], "SERVICE": "a b"}, "redlock.E012"),
    ({"SENTINELS": [42], "SERVICE": "m"}, "redlock.E012"),
    ({**SENTINEL, "URL": "redis://h:1"}, "redlock.E012"),
    ({"SENTINELS": ["redis://h:1/2"], "SERVICE": "m"}, "redlock.E013"),
    ({"SENTINELS": ["unix:///tmp/s.sock"], "SERVICE": "m"}, "redlock.E013"),
    ({"SENTINELS": ["redis://h:1?socket_timeout=1"], "SERVICE": "m"}, "redlock.E013"),
    ({"SENTINELS": ["redis://h:99999"], "SERVICE": "m"}, "redlock.E013"),
    ({"SENTINELS": ["redis://h:1", "rediss://h2:1"], "SERVICE": "m"}, "redlock.E013"),
    ({**SENTINEL, "OPTIONS": {"sokcet_timeout": 1}}, "redlock.E011"),
    ({**SENTINEL, "OPTIONS": {"ssl_ca_certs": "/ca.pem"}}, "redlock.E011"),
    ({"CLUSTER": []}, "redlock.E014"),
    ({"CLUSTER": None}, "redlock.E014"),
    ({**CLUSTER, "SERVICE": "m"}, "redlock.E014"),
    ({"CLUSTER": ["redis://h:7000/1"]}, "redlock.E015"),
    ({"CLUSTER": ["redis://:pw@h:7000"]}, "redlock.E015"),
    ({"CLUSTER": ["http://h:7000"]}, "redlock.E015"),
    ({**CLUSTER, "OPTIONS": {"max_connections": 0}}, "redlock.E011"),
    ({**CLUSTER, "OPTIONS": {"socket_timeout": 5}}, "redlock.W003"),
])
def test_each_malformed_form_has_its_own_id(settings: Any, entry: Any, expected: str) -> None:
    settings.REDLOCK_NODES = [entry]
    assert expected in ids()
    # ... and only errors of the kind's own ids (besides E011/W003 for options)
    assert {i for i in ids() if i.startswith("redlock.E")} <= {expected}


def test_a_redis_sentinel_url_is_refused_with_a_hint_to_the_sentinel_form(
        settings: Any) -> None:
    settings.REDLOCK_NODES = ["redis+sentinel://:pw@10.0.0.5:26379/mymaster"]
    (message,) = check_settings()
    assert message.id == "redlock.E004" and '"SENTINELS"' in message.hint
    assert "pw" not in message.msg


@pytest.mark.parametrize("nodes", [
    [SENTINEL, {"SENTINELS": ["redis://10.0.0.6:26379"], "SERVICE": "mymaster"}],
    [CLUSTER, {"CLUSTER": ["redis://10.0.0.2:7000", "redis://10.0.0.3:7000"]}],
])
def test_two_entries_sharing_a_sentinel_or_start_up_node_are_one_node(
        settings: Any, nodes: Any) -> None:
    settings.REDLOCK_NODES = nodes
    assert "redlock.E005" in ids()


def test_one_sentinel_set_may_watch_two_services(settings: Any) -> None:
    settings.REDLOCK_NODES = [SENTINEL, {**SENTINEL, "SERVICE": "other"},
                              "redis://10.0.0.9:6379/0"]
    assert ids() == []


def test_passwords_never_show(settings: Any) -> None:
    settings.REDLOCK_NODES = [
        {"SENTINELS": ["redis://:sentinelsecret@h:1", "redis://h:x"], "SERVICE": "m",
         "OPTIONS": {"password": "mastersecret", "bogus": 1}},
        {"CLUSTER": ["redis://:clustersecret@h:7000"], "OPTIONS": {"password": 42}},
    ]
    messages = check_settings()
    assert messages
    text = " ".join(f"{m.msg} {m.hint}" for m in messages)
    for secret in ("sentinelsecret", "mastersecret", "clustersecret", "42"):
        assert secret not in text
    specs, _ = parse_nodes([{"SENTINELS": ["redis://:sentinelsecret@h:1"], "SERVICE": "m",
                             "OPTIONS": {"password": "mastersecret"}}])
    assert "secret" not in repr(specs) and "secret" not in specs[0].display
    assert specs[0].address_options[0]["password"] == "sentinelsecret"


def test_sentinel_urls_carry_credentials_all_or_none(settings: Any) -> None:
    """Each sentinel URL's password is that sentinel's only: a list where some
    carry one and others do not is refused (E013), naming positions, not secrets."""
    settings.REDLOCK_NODES = [{"SENTINELS": ["redis://:sentinelsecret@h:1", "redis://h:2",
                                             "redis://:sentinelsecret@h:3"], "SERVICE": "m"}]
    messages = check_settings()
    (problem,) = [m for m in messages if m.id == "redlock.E013"]
    assert "[0, 2] carry a password and [1] do not" in problem.msg
    assert "its own URL's user and password only" in (problem.hint or "")
    assert "sentinelsecret" not in f"{problem.msg} {problem.hint}"
    for ok in (["redis://h:1", "redis://h:2"],
               ["redis://:a@h:1", "redis://:b@h:2"]):  # none, or one each (may differ)
        specs, problems = parse_nodes([{"SENTINELS": ok, "SERVICE": "m"}])
        assert not problems and specs[0].kind == "sentinel"


def test_manage_py_check_fails_on_a_malformed_cluster_node(settings: Any) -> None:
    settings.REDLOCK_NODES = [{"CLUSTER": ["redis://h:7000/3"]}]
    with pytest.raises(SystemCheckError, match="redlock.E015"):
        call_command("check")
