"""Node URLs: what ``manage.py check`` accepts works at run time, and no form prints a password.

The rules live in :mod:`django_redlock.core.config`; these tests hold the
check and the runtime to them on a real, password-protected server.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator
from urllib.parse import quote

import pytest
import redis
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError

import django_redlock
from django_redlock import LockManager
from django_redlock.checks import check_settings
from django_redlock.core.config import Secret, check_node_timeouts, mask_url, parse_nodes
from django_redlock.testing import RedisServer

#: Every character a URL gives a meaning to, and one that is not ASCII.
PASSWORD = "Pw7:pa/ss?w#rd@x%20é"
ENCODED = quote(PASSWORD, safe="")
#: Pieces of it that must not leak either (a masked URL may keep its host part).
PIECES = ("Pw7", "pa/ss", "w#rd")


@pytest.fixture(scope="module")
def secured() -> Iterator[RedisServer]:
    server = RedisServer(password=PASSWORD)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _raw(server: RedisServer, db: int) -> redis.Redis:
    return redis.Redis(host=server.host, port=server.port, password=PASSWORD, db=db,
                       socket_timeout=5)


def _problems(settings: Any, nodes: Any) -> list[Any]:
    settings.REDLOCK_NODES = nodes
    return check_settings()


def _errors(settings: Any, nodes: Any) -> list[str]:
    return [m.id for m in _problems(settings, nodes) if m.id.startswith("redlock.E")]


def _no_secret(text: str) -> None:
    assert PASSWORD not in text and ENCODED not in text
    for piece in PIECES:
        assert piece not in text, text


# ----------------------------------------------------------------- accepted forms work


@pytest.mark.parametrize("form,db", [
    ("REDIS://{auth}127.0.0.1:{port}/0", 0),
    ("Redis://{auth}127.0.0.1:{port}/0", 0),
    ("  redis://{auth}127.0.0.1:{port}/1  ", 1),
    ("redis://{auth}localhost:{port}/2", 2),
    ("redis://{auth}127.0.0.1:{port}?db=3", 3),
    ("redis://{auth}127.0.0.1:{port}/4?db=4&socket_timeout=2&client_name=orders-app", 4),
    ("redis://{auth}127.0.0.1:{port}/5?socket_connect_timeout=1&health_check_interval=0", 5),
    ("redis://default:{encoded}@127.0.0.1:{port}/6", 6),
    ("redis://127.0.0.1:{port}/7?password={encoded}", 7),
])
def test_what_the_check_accepts_works_at_run_time(settings: Any, secured: RedisServer,
                                                  form: str, db: int) -> None:
    url = form.format(auth=f":{ENCODED}@", encoded=ENCODED, port=secured.port)
    assert _errors(settings, [url]) == []
    name = f"url-{uuid.uuid4().hex[:8]}"
    with django_redlock.lock(name, timeout=2):
        assert _raw(secured, db).exists(f"redlock:{name}")  # the database the URL names
    assert not _raw(secured, db).exists(f"redlock:{name}")


# ----------------------------------------------------------------- refused forms


@pytest.mark.parametrize("node,expected", [
    ("unix:///tmp/redis.sock?db=x", "redlock.E004"),
    ("redis://127.0.0.1:6379/0?db=x", "redlock.E004"),
    ("redis://127.0.0.1:6379/1?db=2", "redlock.E004"),
    ("redis://127.0.0.1:6379/²", "redlock.E004"),
    ("redis://127.0.0.1:0/0", "redlock.E004"),
    ("redis://bad host:6379/0", "redlock.E004"),
    ("redis://127.0.0.1:6379/0#x", "redlock.E004"),
    ("redis://127.0.0.1:63\n79/0", "redlock.E004"),
    ("unix://host/tmp/redis.sock", "redlock.E004"),
    ("redis://127.0.0.1:6379/0?socket_timeout=abc", "redlock.E011"),
    ("redis://127.0.0.1:6379/0?socket_timeout=nan", "redlock.E011"),
    ("redis://127.0.0.1:6379/0?max_connections=1.5", "redlock.E011"),
    ("redis://127.0.0.1:6379/0?sokcet_timeout=1", "redlock.E011"),
    ("redis://127.0.0.1:6379/0?protocol=3", "redlock.E011"),
    ("redis://127.0.0.1:6379/0?socket_timeout=1&socket_timeout=2", "redlock.E011"),
    ("redis://127.0.0.1:6379/0?ssl_ca_certs=/etc/ca.pem", "redlock.E011"),
    ("rediss://127.0.0.1:6379/0?ssl_cert_reqs=REQUIRED", "redlock.E011"),
    ("redis://127.0.0.1:6379/0?client_name=two%20words", "redlock.E011"),
    ({"URL": "redis://127.0.0.1:6379/0", "OPTIONS": {"ssl_ca_certs": "/etc/ca.pem"}},
     "redlock.E011"),
    ({"URL": "redis://127.0.0.1:6379/0", "OPTIONS": {"client_name": "two words"}},
     "redlock.E011"),
])
def test_what_cannot_work_is_a_check_error_and_the_same_error_at_run_time(
        settings: Any, node: Any, expected: str) -> None:
    assert expected in _errors(settings, [node])
    with pytest.raises(ImproperlyConfigured, match=expected.replace(".", r"\.")):
        LockManager([node])


def test_a_bad_query_value_names_the_option(settings: Any) -> None:
    (message,) = _problems(settings, ["redis://127.0.0.1:6379/0?socket_timeout=abc"])
    assert "'socket_timeout'" in message.msg and "'abc'" in message.msg


# ----------------------------------------------------------------- passwords


@pytest.mark.parametrize("form", [
    "redis//:{pw}@127.0.0.1:6379/0",
    "redis:/:{pw}@127.0.0.1:6379/0",
    ":{pw}@127.0.0.1:6379/0",
    "redis:{pw}@127.0.0.1",
    "http://:{pw}@127.0.0.1:6379/0",
    "redis://:{pw}@127.0.0.1:6379/0",  # raw: / ? # @ unencoded
    "redis://locker:{pw}@127.0.0.1:6379/x",
    "REDIS://:{pw}@127.0.0.1:6379/0?db=x",
    "redis://127.0.0.1:6379/0?password={pw}&db=x",
    "redis://:{pw}@bad host:6379/0",
    "redis://:{pw}",
])
@pytest.mark.parametrize("dict_node", [False, True])
def test_no_form_prints_the_password(settings: Any, form: str, dict_node: bool) -> None:
    url = form.format(pw=PASSWORD)
    node = {"URL": url, "OPTIONS": {"password": PASSWORD}} if dict_node else url
    messages = _problems(settings, [node, node])
    assert any(m.id == "redlock.E004" for m in messages)
    _no_secret(" ".join(f"{m.msg} {m.hint}" for m in messages))
    with pytest.raises(ImproperlyConfigured) as runtime:
        LockManager([node])
    _no_secret(str(runtime.value))
    with pytest.raises(CommandError) as command:
        call_command("locks", "list")
    _no_secret(str(command.value))


def test_the_check_and_the_runtime_mask_an_accepted_url(settings: Any) -> None:
    url = f"redis://:{ENCODED}@127.0.0.1:6379/0"
    messages = _problems(settings, [url, url])  # E005 names the node
    assert [m.id for m in messages] == ["redlock.E005"]
    assert "redis://:***@127.0.0.1:6379/0" in messages[0].msg
    _no_secret(messages[0].msg)


@pytest.mark.parametrize("text,shown", [
    ("redis//:s3cret@h:1/0", "redis//***@h:1/0"),
    ("redis:/:s3cret@h", "redis:/***@h"),
    (":s3cret@h", "***@h"),
    ("redis://:s3/cret@h:1/0", "redis://***@h:1/0"),
    ("redis://:s3#cret@h:1/0", "redis://***@h:1/0"),
    ("redis://:s3?cret@h:1/0", "redis://***@h:1/0"),
    ("redis://h:s3cret", "redis://h:***"),
    ("redis://h:1/0?password=s3cret&db=x", "redis://h:1/0?***"),
    ("redis://h:1/0?pass%77ord=s3cret&db=x", "redis://h:1/0?***"),
    # an '@' in the query's password: masking up to it showed "***@s3cret"
    ("redis://h:1/0?password=p@s3cret", "redis://h:1/0?***"),
    ("redis://h:1/0?passwd=s3cret", "redis://h:1/0?***"),  # a mistyped key
    ("redis://:s3?cret@h:1/0?passwd=s3cret", "redis://***@h:1/0?***"),
    ("redis://h:1/1?db=1&pass%77ord=s3cret", "redis://h:1/1?db=1&pass%77ord=***"),
    ("redis//h:1/0 password=s3cret", "redis//h:1/0 password=***"),
    ("redis://user@h:1/0", "redis://***@h:1/0"),
    ("redis://h:6379/abc", "redis://h:6379/abc"),
    ("cache:locks", "cache:locks"),
])
def test_mask_url_masks_what_it_cannot_parse(text: str, shown: str) -> None:
    assert mask_url(text) == shown


@pytest.mark.parametrize("url", [
    "redis://default:s3cret",  # '@host' went missing: the password reads as the port
    "redis://127.0.0.1:6379/0?password=p@s3cret",
])
def test_a_refused_urls_reason_does_not_repeat_its_password(url: str) -> None:
    _, problems = parse_nodes([url])
    assert problems and all("s3cret" not in f"{p.msg} {p.hint}" for p in problems), problems


def test_specs_and_their_options_never_show_a_password(secured: RedisServer) -> None:
    nodes = [f"redis://:{ENCODED}@127.0.0.1:{secured.port}/0",
             f"redis://127.0.0.1:{secured.port}/1?password={ENCODED}",
             {"URL": f"redis://127.0.0.1:{secured.port}/2", "OPTIONS": {"password": PASSWORD}}]
    specs, problems = parse_nodes(nodes)
    # Three databases of one server (a test's economy): warned about, and the
    # warnings name the nodes without their password.
    assert [p.id for p in problems] == ["W004", "W004"]
    for problem in problems:
        _no_secret(f"{problem.msg} {problem.hint}")
    for spec in specs:
        assert isinstance(spec.options["password"], Secret)
        assert spec.options["password"] == PASSWORD  # what AUTH sends
        for shown in (repr(spec), str(spec), repr(spec.options), repr(dict(spec.options)),
                      spec.url, spec.display, repr(specs)):
            _no_secret(shown)
    manager = LockManager(nodes, node_timeout=2)
    try:
        assert manager.lock("masked", timeout=2).acquire()  # the Secret authenticates
        for node in manager.nodes:
            _no_secret(repr(node.pool))
            _no_secret(repr(node.pool.connection_kwargs))  # what a traceback's locals hold
    finally:
        manager.close()


# ----------------------------------------------------------------- one server twice


@pytest.mark.parametrize("a,b", [
    ("redis://localhost:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://localhost:6379/0", "redis://[::1]:6379/0"),
    ("redis://[0:0::1]:6379/0", "redis://127.0.0.1:6379"),
    ("redis://127.0.0.1:6379", "redis://127.0.0.1/0?db=0"),
    ("redis://Redis-A.example.com.:6379/1", "rediss://redis-a.example.com:6379/1"),
    ("unix:///run/redis.sock", "unix:///run/../run/redis.sock"),
])
def test_two_spellings_of_one_server_are_a_duplicate(settings: Any, a: str, b: str) -> None:
    messages = _problems(settings, [a, b, "redis://10.0.0.9:6379/0"])
    assert [m.id for m in messages] == ["redlock.E005"]
    assert "[0]" in messages[0].msg and "[1]" in messages[0].msg


@pytest.mark.parametrize("a,b", [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6380/0"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.2:6379/0"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/1"),
])
def test_different_servers_are_not_a_duplicate(settings: Any, a: str, b: str) -> None:
    assert "redlock.E005" not in _errors(settings, [a, b, "redis://10.0.0.9:6379/0"])


def test_two_databases_of_one_server_are_a_warning(settings: Any) -> None:
    """Not a duplicate (E005 compares the database too), but one server's
    restart takes both: a quorum of three databases on one server held every
    lock on that one server."""
    messages = _problems(settings, ["redis://10.0.0.1:6379/0", "redis://10.0.0.1:6379/1",
                                    "redis://10.0.0.2:6379/0"])
    assert [m.id for m in messages] == ["redlock.W004"]
    assert "[0]" in messages[0].msg and "[1]" in messages[0].msg


def test_a_cache_on_the_same_server_as_a_url_node_is_a_duplicate(settings: Any) -> None:
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "locks": {"BACKEND": "django_redis.cache.RedisCache",
                  "LOCATION": f"redis://:{ENCODED}@localhost:6379/1"}}
    messages = _problems(settings, ["redis://127.0.0.1:6379/1", "cache:locks",
                                    "redis://10.0.0.9:6379/0"])
    assert [m.id for m in messages] == ["redlock.E005"]
    _no_secret(messages[0].msg)


# ----------------------------------------------------------------- timeouts vs NODE_TIMEOUT


CACHE_URL = "redis://127.0.0.1:6379/1"


@pytest.mark.parametrize("node,location,cache_options", [
    ("redis://127.0.0.1:6379/0?socket_timeout=5", CACHE_URL, {}),
    ({"URL": "redis://127.0.0.1:6379/0", "OPTIONS": {"socket_connect_timeout": 1}}, CACHE_URL, {}),
    ("cache:locks", CACHE_URL, {"SOCKET_TIMEOUT": 5.0}),
    ("cache:locks", CACHE_URL, {"SOCKET_CONNECT_TIMEOUT": 1}),
    ("cache:locks", CACHE_URL, {"CONNECTION_POOL_KWARGS": {"socket_timeout": 5.0}}),
    ("cache:locks", CACHE_URL + "?socket_timeout=5", {}),
    ("cache:locks", [CACHE_URL + "?socket_timeout=5", "redis://127.0.0.1:6380/1"], {}),
])
def test_a_node_timeout_longer_than_node_timeout_is_a_warning(
        settings: Any, node: Any, location: Any, cache_options: dict[str, Any]) -> None:
    settings.CACHES = {"locks": {"BACKEND": "django_redis.cache.RedisCache",
                                 "LOCATION": location, "OPTIONS": cache_options}}
    settings.REDLOCK = {"NODE_TIMEOUT": 0.2}
    messages = _problems(settings, [node])
    assert [m.id for m in messages] == ["redlock.W003"]
    assert "0.2 s" in messages[0].msg and messages[0].hint


def test_timeouts_within_node_timeout_are_fine(settings: Any) -> None:
    settings.CACHES = {"locks": {"BACKEND": "django_redis.cache.RedisCache",
                                 "LOCATION": "redis://127.0.0.1:6379/1",
                                 "OPTIONS": {"SOCKET_TIMEOUT": 0.2}}}
    settings.REDLOCK = {"NODE_TIMEOUT": 0.2}
    assert _problems(settings, ["cache:locks", "redis://127.0.0.1:6380/0?socket_timeout=0.1",
                                "redis://127.0.0.1:6381/0"]) == []


def test_the_timeout_check_uses_the_same_specs_as_the_runtime() -> None:
    specs, _ = parse_nodes(["redis://127.0.0.1:6379/0?socket_timeout=3"])
    assert [p.id for p in check_node_timeouts(specs, {"NODE_TIMEOUT": 0.5}, {})] == ["W003"]
    manager = LockManager(["redis://127.0.0.1:6379/0?socket_timeout=3"], node_timeout=0.5)
    try:
        # The warning is about a setting that does not do what it reads as: at
        # run time the lock's own bound wins over the URL's longer timeout.
        assert manager.nodes[0].timeout == 0.5
    finally:
        manager.close()


@pytest.mark.parametrize("node,url,options", [
    (" REDIS://u:p%2Fw@LocalHost:7000?db=3&socket_timeout=0.5 ", "redis://localhost:7000/3",
     {"username": "u", "password": "p/w", "socket_timeout": 0.5}),
    ("rediss://[::1]/2?ssl_check_hostname=no", "rediss://[::1]:6379/2",
     {"ssl_check_hostname": False}),
    ("unix:///run/my%20redis.sock?db=2", "unix:///run/my%20redis.sock?db=2", {}),
    ({"URL": "redis://:url@h/0", "OPTIONS": {"password": "opt", "max_connections": 4}},
     "redis://h:6379/0", {"password": "url", "max_connections": 4}),  # the URL wins, as in redis-py
])
def test_a_spec_holds_what_the_pool_is_built_from(node: Any, url: str,
                                                  options: dict[str, Any]) -> None:
    (spec,), problems = parse_nodes([node])
    assert problems == []
    assert (spec.url, dict(spec.options)) == (url, options)
