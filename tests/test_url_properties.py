"""Properties over generated node URLs, held against redis-py itself and a real server.

* Whatever :func:`parse_nodes` (so ``manage.py check``) accepts, a
  :class:`LockManager` builds, and redis-py builds its pool and a connection
  object from it, sync and asyncio, without ``ValueError`` or ``TypeError``;
  whatever it refuses, ``LockManager`` refuses with the same ``redlock.E0xx``.
* No message, ``repr()`` or error shows the password, whatever the URL's shape.
* Valid URLs in all their spellings reach the server they name: a lock taken
  through them lands in the database they name.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator
from urllib.parse import quote

import pytest
import redis
from django.core.exceptions import ImproperlyConfigured
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from django_redlock import LockManager
from django_redlock.core.config import check_node_timeouts, parse_nodes
from django_redlock.testing import RedisServer
from django_redlock.transport.aio import connection_params

#: No example database on disk, no deadline (the machine is shared), bounded runs.
FAST = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SLOW = settings(max_examples=25, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

MARK = "Qz9"  # starts every generated password, so a leak is found by a plain search

passwords = st.text(alphabet=st.sampled_from(list("aZ09:/?#@%&=+ .-_~é!$'[]")), min_size=2,
                    max_size=10).map(lambda s: MARK + s)
#: (good, bad) spellings of each part of a URL.
PARTS: dict[str, tuple[list[str], list[str]]] = {
    "lead": (["", " ", "\t"], []),
    "prefix": (["redis://", "rediss://", "unix://", "REDIS://", "Rediss://"],
               ["redis:/", "redis//", "redis:", "", "http://", "redis:///"]),
    "host": (["127.0.0.1", "localhost", "[::1]", "Example.COM", "redis_1", "h.", "",
              "%31%32%37.0.0.1", "xn--bcher-kva.example"],
             ["bad host", "[::1", "a..b", "[zz::1]", "h\x00", "%", "-"]),
    "port": (["", ":", ":6379", ":1"], [":0", ":65536", ":abc", ":99999999999", ":٣"]),
    "path": (["", "/", "/0", "/15", "/0/", "/%30", "/tmp/r.sock"],
             ["/x", "/²", "/2147483648", "/" + "9" * 20, "/tmp/%00", "/0/1"]),
    "key": ([], ["protocol", "foo", "retry_on_timeout", "", "db"]),
    "value": ([], ["abc", "-1", "nan", "inf", "1e400", "REQUIRED", "a b", "a%20b", "", "1.5",
                   "٣"]),
    "tail": (["", " ", "\n"], ["#frag", "?", "&"]),
}
#: Good values of each query option.
GOOD_VALUES = {"db": ["0", "3"], "socket_timeout": ["0.5", "2"], "socket_connect_timeout": ["1"],
               "max_connections": ["8"], "client_name": ["x-y"],
               "ssl_cert_reqs": ["required", "none"], "ssl_ca_certs": ["/tmp/ca.pem"],
               "ssl_check_hostname": ["true", "no"], "health_check_interval": ["0", "1.5"],
               "username": ["u"]}


@st.composite
def urls(draw: st.DrawFn) -> tuple[str, str]:
    """(url, password) in every shape: all parts good, or one or two parts bad."""
    broken = set(draw(st.lists(st.sampled_from([*PARTS, "password"]), max_size=2)))

    def part(name: str) -> str:
        good, bad = PARTS[name]
        return draw(st.sampled_from(bad if name in broken and bad else good))

    password = draw(passwords)
    shown = password if "password" in broken else quote(password, safe="")
    userinfo = draw(st.sampled_from(["", f":{shown}@", f"user:{shown}@", "user@"]))
    prefix = part("prefix")
    unix = prefix == "unix://"
    host = part("host") if not unix or "host" in broken else ""
    port = part("port") if not unix or "port" in broken else ""
    path = part("path") if not unix or "path" in broken else "/tmp/r.sock"
    keys = draw(st.lists(st.sampled_from([*GOOD_VALUES, "password"]), unique=True, max_size=3))
    pairs = [(k, shown if k == "password" else draw(st.sampled_from(GOOD_VALUES[k])))
             for k in keys]
    if "key" in broken:
        pairs.append((part("key"), "1"))
    if "value" in broken and pairs:
        pairs[0] = (pairs[0][0], part("value"))
    spelled = {"password": draw(st.sampled_from(["password", "pass%77ord", "PASSWORD"]))}
    query = "&".join(f"{spelled.get(k, k)}={v}" for k, v in pairs)
    url = (part("lead") + prefix + userinfo + host + port + path
           + (f"?{query}" if query else "") + part("tail"))
    return url, password


node_options = st.one_of(st.just({}), st.dictionaries(
    st.sampled_from(["socket_timeout", "password", "client_name", "ssl_ca_certs", "max_connections",
                     "ssl_cert_reqs", "nope"]),
    st.sampled_from([0.5, -1, "x y", "required", None, 3, "abc", True]), max_size=2))


def _texts(problems: list[Any]) -> str:
    return " ".join(f"{p.msg} {p.hint}" for p in problems)


def _assert_no_leak(password: str, text: str) -> None:
    assert password not in text and quote(password, safe="") not in text, text


def _build_everything(manager: LockManager) -> None:
    """What the first acquire would build, short of connecting."""
    for node in manager.nodes:
        node.pool.make_connection()  # redis-py's kwargs and URL handling
        node.new_connection()
        cls, kwargs, _ = connection_params(node)  # the asyncio transport's
        cls(**kwargs)


@FAST
@given(case=urls(), as_dict=st.booleans(), options=node_options)
def test_accepted_means_built_refused_means_the_same_error(case: tuple[str, str], as_dict: bool,
                                                           options: dict[str, Any]) -> None:
    url, password = case
    node: Any = {"URL": url, "OPTIONS": options} if as_dict else url
    specs, problems = parse_nodes([node, node])
    errors = [p for p in problems if p.is_error]
    event("refused" if any(p.id != "E005" for p in errors) else "accepted")
    _assert_no_leak(password, _texts(problems) + repr(specs) + " ".join(s.display for s in specs))
    _assert_no_leak(password, _texts(check_node_timeouts(specs, {"NODE_TIMEOUT": 0.01}, {})))
    if any(p.id != "E005" for p in errors):
        with pytest.raises(ImproperlyConfigured) as refused:
            LockManager([node])
        assert f"redlock.{errors[0].id}" in str(refused.value)
        _assert_no_leak(password, str(refused.value))
        return
    manager = LockManager([node], node_timeout=0.05)
    try:
        _build_everything(manager)
        _assert_no_leak(password, repr(manager.nodes[0].spec) + manager.nodes[0].name
                        + repr(manager.nodes[0].pool.connection_kwargs))
    finally:
        manager.close()


@FAST
@given(text=st.one_of(st.text(max_size=40),
                      st.text(st.characters(exclude_categories=()), max_size=40),
                      st.builds(lambda p, t: p + t, st.sampled_from(["redis://", "unix:///"]),
                                st.text(max_size=30))))
def test_any_text_is_refused_or_built(text: str) -> None:
    specs, problems = parse_nodes([text])
    if not any(p.is_error for p in problems):
        manager = LockManager([text], node_timeout=0.05)
        try:
            _build_everything(manager)
        finally:
            manager.close()


# ----------------------------------------------------------------- against a real server

PASSWORD = "Qz9:s/e?c#r@t %é"


@pytest.fixture(scope="module")
def secured() -> Iterator[RedisServer]:
    server = RedisServer(password=PASSWORD)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@st.composite
def working_nodes(draw: st.DrawFn, port: int) -> tuple[Any, int]:
    """(node, database) spelled in any way the check accepts, for one server."""
    scheme = draw(st.sampled_from(["redis", "REDIS", "Redis"]))
    host = draw(st.sampled_from(["127.0.0.1", "localhost", "LOCALHOST", "%31%32%37.0.0.1"]))
    db = draw(st.integers(0, 15))
    where_db = draw(st.sampled_from(["path", "query", "path/"] + (["none"] if db == 0 else [])))
    where_pw = draw(st.sampled_from(["userinfo", "user", "query", "options"]))
    encoded = quote(PASSWORD, safe="")
    userinfo = {"userinfo": f":{encoded}@", "user": f"default:{encoded}@"}.get(where_pw, "")
    path = {"path": f"/{db}", "path/": f"/{db}/", "query": "", "none": ""}[where_db]
    query = [f"db={db}"] if where_db == "query" else []
    if where_pw == "query":
        query.append(f"password={encoded}")
    extra = draw(st.dictionaries(
        st.sampled_from(["socket_timeout", "socket_connect_timeout", "client_name",
                         "health_check_interval", "max_connections"]),
        st.sampled_from(["2", "1.5", "app-1", "0", "8"]), max_size=3))
    for key, value in extra.items():
        if key == "client_name":
            value = "app-1"
        elif key == "max_connections" or key == "health_check_interval":
            value = "8"
        elif value in ("app-1", "0"):
            value = "2"
        query.append(f"{key}={value}")
    url = (draw(st.sampled_from(["", " "])) + f"{scheme}://{userinfo}{host}:{port}{path}"
           + (f"?{'&'.join(query)}" if query else "") + draw(st.sampled_from(["", "\n"])))
    if where_pw == "options":
        return {"URL": url, "OPTIONS": {"password": PASSWORD}}, db
    return url, db


@SLOW
@given(data=st.data())
def test_every_accepted_spelling_reaches_its_server(secured: RedisServer, data: st.DataObject) -> None:
    node, db = data.draw(working_nodes(secured.port))
    specs, problems = parse_nodes([node])
    assert [p for p in problems if p.is_error] == []
    manager = LockManager([node], node_timeout=2, auto_renew=False)
    raw = redis.Redis(host=secured.host, port=secured.port, password=PASSWORD, db=db,
                      socket_timeout=5)
    name = f"prop-{uuid.uuid4().hex[:8]}"
    try:
        lock = manager.lock(name, timeout=2)
        assert lock.acquire()
        assert raw.exists(f"redlock:{name}")
        lock.release()
        assert not raw.exists(f"redlock:{name}")
    finally:
        manager.close()
        raw.close()
