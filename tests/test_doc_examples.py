"""Every Python block of README.md and docs/, executed and checked.

:func:`test_every_python_block_is_marked_and_executed` walks every page (not a
list of them, tests/docsnippets.py) and fails on a Python block with no marker,
a marker with no ``test_snippet_<name>`` test, or a ``::`` literal block holding
Python code (it must be a marked ``code-block:: python``). The fenced-write
snippets are run by tests/test_doc_snippets.py; every other one by a test below,
on the suite's real Redis servers, with the test app's ``Product`` for the docs'
``shop`` app, and each test checks what the block did:

* settings blocks are executed as Python, their documented addresses replaced by
  real servers' (TLS ones, a Unix socket, a Sentinel group and a Cluster where the
  block configures those), checked by Django's check framework under
  ``override_settings`` (no ``redlock.*`` message), and a lock is taken through
  them and seen on those servers;
* views are called through ``RequestFactory`` or the test client, class-based
  views dispatched, Celery tasks run as functions (or eagerly, for ``delay()``),
  metrics scraped from ``prometheus_client``'s output;
* a block that shows a mistake keeps its marker, and its test shows the mistake
  happen (tests/test_doc_snippets.py::test_snippet_mistake_read_before_lock).
"""

from __future__ import annotations

import ast
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
from asgiref.sync import async_to_sync, iscoroutinefunction
from django.core import checks
from django.test import Client, RequestFactory, override_settings

import django_redlock
from django_redlock import signals
from django_redlock.exceptions import LockLost, LockNotAcquired, QuorumUnavailable
from django_redlock.testing import RedisClusterGroup, RedisNodes, RedisServer, SentinelGroup
from tests import docsnippets
from tests.docsnippets import ROOT, SNIPPETS, run
from tests.test_tls import make_certificate
from tests.testapp.models import Product, SkuItem

TIMEOUT0 = {"NODE_TIMEOUT": 0.5, "TIMEOUT": 0}


# -- the enforcement ----------------------------------------------------------


def test_every_python_block_is_marked_and_executed() -> None:
    """No Python block of README.md or docs/ without a marker, no marker without a
    test that names it, no test left for a marker that is gone."""
    problems: list[str] = []
    for block in docsnippets.python_blocks():
        if block.lang == "::":
            problems.append(f"{block.where}: a '::' block of Python code; make it a "
                            f"'.. code-block:: python' with a '.. snippet: NAME' marker")
        elif block.marker is None:
            problems.append(f"{block.where}: a Python block without a snippet marker "
                            f"({block.code.splitlines()[0]!r}...)")
    tested = docsnippets.tested_snippets()
    for name, block in SNIPPETS.items():
        where = tested.get(name, [])
        if not where:
            problems.append(f"{block.where}: snippet {name!r} has no test "
                            f"(test_snippet_{name.replace('-', '_')} in tests/)")
        problems += [f"{block.where}: {w}" for w in where if "never names" in w]
        if len(where) > 1:
            problems.append(f"snippet {name!r} has more than one test: {where}")
    problems += [f"{w}: no snippet {name!r} in README.md or docs/"
                 for name, where in tested.items() if name not in SNIPPETS for w in where]
    assert not problems, "\n".join(problems)


def test_the_block_finder_sees_every_form() -> None:
    """The walker's own check: directive aliases, indented blocks, fences, the
    marker rule, and which ``::`` blocks count as Python."""
    rst = textwrap.dedent("""\
        .. snippet: a

        .. code-block:: python

           x = 1

        Text.

        .. code-block:: py
           :caption: c

           y = 2

        * item

          .. snippet: b

          .. code:: python3

             z = 3

        .. snippet: stale

        A paragraph: the marker named no block.

        And a literal block::

           import os

        Output::

           {"ok": True}

        .. code-block:: text

           t0  A takes the lock
        """)
    path = ROOT / "tests" / "_doc_examples_probe.rst"
    path.write_text(rst)
    try:
        found = [(b.lang, b.marker, b.code) for b in docsnippets.blocks(str(path.relative_to(ROOT)))]
    finally:
        path.unlink()
    assert found == [("python", "a", "x = 1"), ("py", None, "y = 2"), ("python3", "b", "z = 3"),
                     ("::", None, "import os"), ("::", None, '{"ok": True}')]
    assert docsnippets.looks_like_python("import os")
    assert not docsnippets.looks_like_python('{"ok": True}')
    assert not docsnippets.looks_like_python("t0  A takes the lock")
    assert "README.md" in docsnippets.doc_files() and "docs/settings.rst" in docsnippets.doc_files()


# -- helpers ------------------------------------------------------------------


def redlock_messages(**settings: Any) -> list[checks.CheckMessage]:
    """What ``manage.py check`` says about django-redlock under ``settings``."""
    with override_settings(**settings):
        return [m for m in checks.run_checks(tags=["redlock"]) if (m.id or "").startswith("redlock.")]


def assert_clean(**settings: Any) -> None:
    messages = redlock_messages(**settings)
    assert not messages, [f"{m.id}: {m.msg}" for m in messages]


def settings_of(name: str, replace: dict[str, str] | None = None, **given: Any) -> dict[str, Any]:
    """The settings a settings.py block defines (its upper-case names)."""
    ns = run(name, replace=replace, **given)
    return {k: v for k, v in ns.items() if k.isupper()}


def lock_key_on(server: RedisServer, key: str, db: int = 0) -> bool:
    client = server.client()
    try:
        if db:
            client.execute_command("SELECT", db)
        return bool(client.exists(key))
    finally:
        client.close()


def take_lock_through(settings: dict[str, Any], name: str,
                      servers: list[tuple[RedisServer, int]]) -> int:
    """Take ``name`` with the manager built from ``settings``; every server in
    ``servers`` ((server, db)) holds its key meanwhile. Returns the fence."""
    with override_settings(**settings):
        prefix = settings.get("REDLOCK", {}).get("KEY_PREFIX", "redlock")
        with django_redlock.lock(name, timeout=5) as held:
            assert held.owned() and held.fence > 0
            on = [lock_key_on(server, f"{prefix}:{name}", db) for server, db in servers]
            assert all(on), on
            fence = held.fence
        assert not any(lock_key_on(server, f"{prefix}:{name}", db) for server, db in servers)
    return fence


class Recorder:
    """Records the lock signals' ``name``s while connected."""

    def __init__(self, *sigs: Any) -> None:
        self.sigs = sigs or (signals.lock_acquired,)
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, sender: Any, **kwargs: Any) -> None:
        self.seen.append((kwargs.get("name", ""), kwargs))

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.seen]

    def __enter__(self) -> Recorder:
        for sig in self.sigs:
            sig.connect(self, weak=False)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig in self.sigs:
            sig.disconnect(self)


class ListLogger:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def _log(self, level: str) -> Callable[..., None]:
        return lambda msg, *args, **kw: self.lines.append((level, msg % args if args else msg))

    def __getattr__(self, level: str) -> Callable[..., None]:
        return self._log(level)


def hold(name: str, **options: Any) -> Any:
    """Another holder of ``name`` (a second Lock object, as another process)."""
    other = django_redlock.lock(name, timeout=0, **options)
    assert other.acquire()
    return other


def user(username: str = "doc") -> Any:
    from django.contrib.auth.models import User

    return User.objects.create(username=username)


def request(path: str = "/", method: str = "get", who: Any = None, **kwargs: Any) -> Any:
    req = getattr(RequestFactory(), method)(path, **kwargs)
    if who is not None:
        req.user = who
    return req


def urlconf(monkeypatch: pytest.MonkeyPatch, name: str, patterns: list[Any]) -> str:
    module = types.ModuleType(name)
    module.urlpatterns = patterns  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, module)
    return name


# -- quickstart.rst -------------------------------------------------------------


def test_snippet_quickstart_lock() -> None:
    with Recorder(signals.lock_acquired, signals.lock_released) as seen:
        ns = run("quickstart-lock")
    assert seen.names == ["stock:42", "stock:42"]  # taken, then released by the block
    assert ns["held"].fence > 0 and not ns["held"].owned()


def test_snippet_quickstart_options() -> None:
    lock = eval(compile(docsnippets.code("quickstart-options"), "<snippet>", "eval"),  # noqa: S307
                {"django_redlock": django_redlock})
    assert (lock.name, lock.ttl, lock.timeout, lock.auto_renew, lock.fencing, lock.max_hold,
            lock.label) == ("report:2024-q1", 30.0, 0.0, True, True, 600.0, "nightly report")
    other = hold("report:2024-q1")
    try:
        assert lock.acquire() is False  # timeout=0: one try
    finally:
        other.release()
    assert lock.acquire() and lock.fence > other.fence
    lock.release()


def test_snippet_quickstart_errors(redis_nodes_factory: Any) -> None:
    reserved: list[int] = []
    log = ListLogger()
    other = hold("stock:42", ttl=30)
    try:
        ns = run("quickstart-errors", reserve=reserved.append, log=log)
    finally:
        other.release()
    assert not reserved and 0 < ns["retry_in"] <= 30  # busy: a hint, no work done
    nodes = redis_nodes_factory(3)
    nodes[0].kill()
    nodes[1].kill()
    with override_settings(REDLOCK_NODES=list(nodes.urls)), pytest.raises(QuorumUnavailable):
        run("quickstart-errors", reserve=reserved.append, log=log)
    assert not reserved
    assert log.lines == [("error", "redis down: 1 of 2 needed nodes answered")]


def test_snippet_quickstart_acquire() -> None:
    reserved: list[Any] = []

    def reserve(pk: int) -> None:
        reserved.append((pk, ns["lock"].owned()))

    ns: dict[str, Any] = {}
    run("quickstart-acquire", ns, reserve=reserve)
    assert reserved == [(42, True)] and not ns["lock"].owned()  # released in the finally
    other = hold("stock:42")
    try:
        run("quickstart-acquire", ns, reserve=reserve)
    finally:
        other.release()
    assert reserved == [(42, True)]  # busy: skipped at once


def test_snippet_quickstart_manager(redis_nodes_factory: Any) -> None:
    nodes = redis_nodes_factory(1)
    seen: list[bool] = []

    def on_node(sender: Any, name: str, **kwargs: Any) -> None:
        if name == "cleanup":
            seen.append(lock_key_on(nodes[0], "jobs:cleanup"))

    signals.lock_acquired.connect(on_node, weak=False)
    try:
        ns = run("quickstart-manager", replace={"redis://127.0.0.1:6379/0": nodes.urls[0]})
    finally:
        signals.lock_acquired.disconnect(on_node)
    assert seen == [True]  # "jobs:cleanup" was on the node while the block ran
    assert not lock_key_on(nodes[0], "jobs:cleanup") and ns["held"].fence > 0


def test_snippet_quickstart_signals() -> None:
    log = ListLogger()
    ns = run("quickstart-signals", log=log)
    try:
        lock = django_redlock.lock("doc:signals", auto_renew=False)
        assert lock.acquire()
        django_redlock.get_manager().force_release("doc:signals")
        with pytest.raises(LockLost):
            lock.extend()
    finally:
        signals.lock_lost.disconnect(ns["alert"])
    ((level, line),) = log.lines
    assert level == "error" and line.startswith("lock doc:signals (fence ")


# -- installation.rst, settings.rst, README.md: settings ------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cert, _ = make_certificate(tmp_path_factory)  # its key beside it: server.key
    return cert


class TLSServer:
    def __init__(self, server: RedisServer, tls_port: int) -> None:
        self.server, self.tls_port = server, tls_port
        self.address = f"127.0.0.1:{tls_port}"


@pytest.fixture(scope="module")
def tls_servers(certificate: Path) -> Iterator[dict[str, TLSServer]]:
    """TLS servers for the docs' TLS nodes: "secret" (with the ACL user "locker",
    password "secret") and two with "s3cret"."""
    from django_redlock.testing import _free_port

    key = certificate.parent / "server.key"
    started: dict[str, TLSServer] = {}
    try:
        for role, password in (("secret", "secret"), ("a", "s3cret"), ("b", "s3cret")):
            for attempt in range(3):
                port = _free_port()
                server = RedisServer(password=password, extra_args=[
                    "--tls-port", str(port), "--tls-cert-file", str(certificate),
                    "--tls-key-file", str(key), "--tls-ca-cert-file", str(certificate),
                    "--tls-auth-clients", "no",
                    "--user", "locker", "on", f">{password}", "~*", "&*", "+@all"])
                try:
                    server.start()
                    break
                except Exception as e:  # noqa: BLE001 - a server built without TLS
                    if attempt == 2:
                        pytest.skip(f"redis-server does not start with TLS here: {e}")
            started[role] = TLSServer(server, port)
        yield started
    finally:
        for tls in started.values():
            tls.server.stop()


def _addr(server: RedisServer) -> str:
    return f"{server.host}:{server.port}"


def test_snippet_readme_settings(session_nodes: RedisNodes) -> None:
    base = ["django.contrib.contenttypes"]
    given = settings_of("readme-settings", INSTALLED_APPS=list(base), replace={
        f"10.0.0.{i + 1}:6379": _addr(session_nodes[i]) for i in range(3)})
    assert given["INSTALLED_APPS"] == [*base, "django_redlock"]
    nodes = {"REDLOCK_NODES": given["REDLOCK_NODES"]}
    assert_clean(**nodes)
    take_lock_through(nodes, "doc:readme", [(session_nodes[i], 0) for i in range(3)])


def test_snippet_installation_settings(session_nodes: RedisNodes) -> None:
    given = settings_of("installation-settings", replace={
        f"10.0.0.{i + 1}:6379": _addr(session_nodes[i]) for i in range(3)})
    assert given["INSTALLED_APPS"] == ["django_redlock"]
    from django.conf import settings

    installed = [*settings.INSTALLED_APPS]  # the block's own list, with the apps it elides
    assert_clean(REDLOCK_NODES=given["REDLOCK_NODES"], INSTALLED_APPS=installed)
    take_lock_through({"REDLOCK_NODES": given["REDLOCK_NODES"]}, "doc:installation",
                      [(session_nodes[i], 0) for i in range(3)])


def test_snippet_installation_tls(tls_servers: dict[str, TLSServer], certificate: Path,
                                  session_nodes: RedisNodes,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # redis-a's URL names no CA: the system's store is used, which here is our CA.
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate))
    given = settings_of("installation-tls", replace={
        "redis-a.internal:6380": tls_servers["a"].address,
        "redis-b.internal:6380": tls_servers["b"].address,
        "/etc/ssl/internal-ca.pem": str(certificate)})
    nodes = given["REDLOCK_NODES"]
    assert nodes[2] == "cache:locks"
    caches = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
              "locks": {"BACKEND": "django_redis.cache.RedisCache",
                        "LOCATION": f"redis://{_addr(session_nodes[0])}/2"}}
    assert [m.id for m in redlock_messages(REDLOCK_NODES=nodes)] == ["redlock.E006"]  # no cache
    assert_clean(REDLOCK_NODES=nodes, CACHES=caches)
    take_lock_through({"REDLOCK_NODES": nodes, "CACHES": caches}, "doc:tls",
                      [(tls_servers["a"].server, 0), (tls_servers["b"].server, 0),
                       (session_nodes[0], 2)])


def _masked(filter_path: str, nodes: list[Any]) -> Any:
    from django.views.debug import (
        get_default_exception_reporter_filter,
        get_exception_reporter_filter,
    )

    get_default_exception_reporter_filter.cache_clear()  # Django caches the filter
    try:
        with override_settings(DEFAULT_EXCEPTION_REPORTER_FILTER=filter_path,
                               REDLOCK_NODES=nodes):
            return get_exception_reporter_filter(RequestFactory().get("/")).get_safe_settings()
    finally:
        get_default_exception_reporter_filter.cache_clear()


def _reporter_filter(name: str) -> None:
    given = settings_of(name)
    nodes = ["redis://:hunter2@127.0.0.1:1/0", {"URL": "redis://127.0.0.1:2/0",
                                                "OPTIONS": {"password": "hunter2"}}]
    assert "hunter2" not in repr(_masked(given["DEFAULT_EXCEPTION_REPORTER_FILTER"], nodes))
    # Django's own filter shows the URL's password: the block is what hides it.
    assert "hunter2" in repr(_masked("django.views.debug.SafeExceptionReporterFilter", nodes))
    assert_clean(REDLOCK_NODES=["redis://127.0.0.1:1/0"], **given)


def test_snippet_installation_reporter_filter() -> None:
    _reporter_filter("installation-reporter-filter")


def test_snippet_settings_reporter_filter() -> None:
    _reporter_filter("settings-reporter-filter")


def test_snippet_settings_example(session_nodes: RedisNodes, tls_servers: dict[str, TLSServer],
                                  certificate: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate))
    given = settings_of("settings-example", replace={
        "10.0.0.1:6379": _addr(session_nodes[0]), "10.0.0.2:6380": tls_servers["secret"].address,
        "10.0.0.3:6379": _addr(session_nodes[1])})
    from django_redlock.core.config import DEFAULTS

    # Every key of the block is a setting, at its default: the page's list is the real one.
    assert given["REDLOCK"] == {k: v for k, v in DEFAULTS.items() if k in given["REDLOCK"]}
    assert set(given["REDLOCK"]) == set(DEFAULTS)
    assert_clean(**given)
    take_lock_through(given, "doc:settings", [(session_nodes[0], 0),
                                              (tls_servers["secret"].server, 0),
                                              (session_nodes[1], 0)])


def _entries(name: str) -> list[Any]:
    """The values of a block that lists node entries, one expression each."""
    tree = ast.parse(docsnippets.code(name))
    assert all(isinstance(node, ast.Expr) for node in tree.body)
    return [ast.literal_eval(node.value) for node in tree.body]  # type: ignore[attr-defined]


def _rewrite(entry: Any, replace: dict[str, str]) -> Any:
    text = repr(entry)
    for old, new in replace.items():
        text = text.replace(old, new)
    return ast.literal_eval(text)


@pytest.fixture
def unix_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, str]]:
    import tempfile

    where = tempfile.mkdtemp(prefix="redlock-doc-")  # short: a socket path has a limit
    path = os.path.join(where, "redis.sock")
    server = RedisServer(extra_args=["--unixsocket", path, "--unixsocketperm", "700"])
    server.start()
    try:
        yield server, path
    finally:
        server.stop()
        shutil.rmtree(where, ignore_errors=True)


def test_snippet_settings_urls(session_nodes: RedisNodes, tls_servers: dict[str, TLSServer],
                               unix_server: tuple[RedisServer, str],
                               monkeypatch: pytest.MonkeyPatch, certificate: Path) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate))
    entries = _entries("settings-urls")
    assert len(entries) == 4
    servers = [session_nodes[0], tls_servers["secret"].server, tls_servers["secret"].server,
               unix_server[0]]
    replace = {"127.0.0.1:6379": _addr(session_nodes[0]),
               "10.0.0.2:6380": tls_servers["secret"].address,
               "/run/redis/redis.sock": unix_server[1]}
    for i, (entry, server) in enumerate(zip(entries, servers)):
        nodes = [_rewrite(entry, replace)]
        assert_clean(REDLOCK_NODES=nodes)
        take_lock_through({"REDLOCK_NODES": nodes}, f"doc:url{i}", [(server, 0)])


def test_snippet_settings_dict_node(tls_servers: dict[str, TLSServer], certificate: Path) -> None:
    (entry,) = _entries("settings-dict-node")
    nodes = [_rewrite(entry, {"10.0.0.3:6380": tls_servers["secret"].address,
                              "/etc/ssl/ca.pem": str(certificate)})]
    assert_clean(REDLOCK_NODES=nodes)
    take_lock_through({"REDLOCK_NODES": nodes}, "doc:dict", [(tls_servers["secret"].server, 0)])


def test_snippet_settings_cache_node(session_nodes: RedisNodes) -> None:
    given = settings_of("settings-cache-node",
                        replace={"10.0.0.4:6379": _addr(session_nodes[2])})
    given["CACHES"]["default"] = {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
    assert given["REDLOCK_NODES"] == ["cache:locks"]
    assert_clean(**given)
    take_lock_through(given, "doc:cache", [(session_nodes[2], 1)])


@pytest.mark.slow
@pytest.mark.harness
def test_snippet_settings_sentinel_node() -> None:
    (entry,) = _entries("settings-sentinel-node")
    with SentinelGroup(replicas=1, sentinels=3, password="secret") as group:
        replace = {f"redis://10.0.0.{5 + i}:26379": url
                   for i, url in enumerate(group.sentinel_urls)}
        nodes = [_rewrite(entry, replace)]
        assert nodes[0]["SERVICE"] == group.service
        assert_clean(REDLOCK_NODES=nodes)
        take_lock_through({"REDLOCK_NODES": nodes}, "doc:sentinel", [(group.master, 0)])


@pytest.mark.slow
@pytest.mark.harness
def test_snippet_settings_cluster_node() -> None:
    (entry,) = _entries("settings-cluster-node")
    with RedisClusterGroup(3, password="secret") as cluster:
        nodes = [_rewrite(entry, {"redis://10.0.0.1:7000": cluster.urls[0],
                                  "redis://10.0.0.2:7000": cluster.urls[1]})]
        assert_clean(REDLOCK_NODES=nodes)
        owner = cluster.master_for_slot(cluster.key_slot("redlock:doc:cluster"))
        take_lock_through({"REDLOCK_NODES": nodes}, "doc:cluster", [(owner, 0)])


# -- safety.rst -----------------------------------------------------------------


def test_snippet_safety_sigterm(session_nodes: RedisNodes) -> None:
    """A program with the block's handler releases its locks when SIGTERMed (the
    exit hook runs); without it the lock would stay until its lease ends."""
    program = textwrap.dedent(f"""\
        import sys, time
        from django_redlock import LockManager
        manager = LockManager({list(session_nodes.urls)!r}, ttl=60)
        lock = manager.lock("doc:sigterm")
        assert lock.acquire(timeout=5)
        """) + docsnippets.code("safety-sigterm") + textwrap.dedent("""
        print("held", flush=True)
        time.sleep(30)
        """)
    key = "redlock:doc:sigterm"
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        assert sum(lock_key_on(s, key) for s in session_nodes) >= 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()
    assert not any(lock_key_on(s, key) for s in session_nodes)  # released at exit


# -- testing.rst ------------------------------------------------------------------


def test_snippet_testing_conftest(tmp_path: Path) -> None:
    """The conftest block, as a project's conftest.py, in a pytest run of its own."""
    (tmp_path / "conftest.py").write_text(docsnippets.code("testing-conftest"))
    (tmp_path / "test_uses_it.py").write_text(textwrap.dedent("""\
        import time
        import django_redlock
        from django.conf import settings

        def test_nodes_are_the_started_ones(redlock_nodes):
            assert settings.REDLOCK_NODES == list(redlock_nodes.urls)
            with django_redlock.lock("t:1") as held:
                assert all(n.client().exists("redlock:t:1") for n in redlock_nodes)

        def test_a_busy_lock_fails_at_once():
            with django_redlock.lock("t:2"):
                started = time.monotonic()
                assert django_redlock.lock("t:2").acquire() is False
                assert time.monotonic() - started < 2  # TIMEOUT 0: no 10 s wait

        def test_emptied_before_each_test(redlock_nodes):
            redlock_nodes[0].client().set("left", "1")

        def test_emptied_after(redlock_nodes):
            assert not redlock_nodes[0].client().exists("left")
        """))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
         "--ds", "tests.settings", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0 and "4 passed" in result.stdout, result.stdout + result.stderr


def test_snippet_testing_busy() -> None:
    with override_settings(REDLOCK=TIMEOUT0):  # as the page's conftest sets it
        def reserve(pk: int) -> None:
            with django_redlock.lock(f"stock:{pk}"):
                pass

        ns = run("testing-busy", reserve=reserve)
        ns["test_reserve_refuses_while_locked"]()  # passes: reserve was refused
        # ... and fails for a reserve() that forgot its lock: the recipe catches it.
        ns = run("testing-busy", reserve=lambda pk: None)
        with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
            ns["test_reserve_refuses_while_locked"]()


def test_snippet_testing_lost() -> None:
    with Recorder(signals.lock_lost) as seen:
        run("testing-lost")["test_job_notices_lost_lock"]()
    assert seen.names == ["job:7"]


def test_snippet_testing_outage(redis_nodes_factory: Any) -> None:
    made: list[Any] = []

    def factory(n: int, **kwargs: Any) -> Any:
        made.append(redis_nodes_factory(n, **kwargs))
        return made[-1]

    started = time.monotonic()
    run("testing-outage")["test_outage_is_not_busy"](factory)
    assert time.monotonic() - started < 10  # within node timeouts, not a hang
    (nodes,) = made
    assert not nodes[0].is_running() and nodes[1].paused
    nodes[1].resume()


# -- howto/views.rst, class-based-views.rst, async-views.rst ------------------------


def _views_buy(monkeypatch: pytest.MonkeyPatch) -> Any:
    from django_redlock.core.templates import parse_template

    monkeypatch.setattr(Product, "lock_name_template", "stock:<pk>", raising=False)
    monkeypatch.setattr(Product, "_redlock_template", parse_template("stock:<pk>"), raising=False)
    return run("views-buy")["buy"]


@pytest.mark.django_db
def test_snippet_views_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    views = types.SimpleNamespace(buy=_views_buy(monkeypatch))
    ns = run("views-urls", replace={"from shop import views\n": ""}, views=views)
    pk = Product.objects.create(name="p", stock=10).pk
    with override_settings(ROOT_URLCONF=urlconf(monkeypatch, "doc_views_urls", ns["urlpatterns"])):
        response = Client().post(f"/products/{pk}/buy/")
    assert response.status_code == 200 and response.json()["stock"] == 9
    assert Product.objects.get(pk=pk).stock == 9


@pytest.mark.django_db
def test_snippet_views_placeholders() -> None:
    ns = run("views-placeholders", with_lock=django_redlock.with_lock)
    someone = user()
    with Recorder() as seen:
        ns["checkout"](request(who=someone))
        ns["report"](request("/?day=2024-05-01", who=someone))
    assert seen.names == [f"cart:{someone.pk}", f"report:2024-05-01:{someone.pk}"]
    from django.core.exceptions import BadRequest

    with pytest.raises(BadRequest):  # no ?day=: the client's mistake, a 400 from Django
        ns["report"](request("/", who=someone))


@pytest.mark.django_db
def test_snippet_views_on_busy() -> None:
    ns = run("views-on-busy", with_lock=django_redlock.with_lock)
    other = hold("stock:5", ttl=30)
    try:
        response = ns["buy"](request(method="post"), pk=5)
    finally:
        other.release()
    assert response.status_code == 409
    seconds = float(response.content.decode().split()[-2])
    assert 0 < seconds <= 30  # the holder's lease, from exc.retry_after


@pytest.mark.django_db
def test_snippet_views_atomic() -> None:
    from django.db import transaction

    ns = run("views-atomic", with_lock=django_redlock.with_lock)
    with Recorder() as seen:
        assert ns["buy"](request(method="post"), pk=3) is None  # the test's own transaction
    assert seen.names == ["stock:3"]                           # does not count
    # Inside a caller's transaction (ATOMIC_REQUESTS) the commit would come after
    # the release: refused before the lock is taken.
    with Recorder() as seen, transaction.atomic(), pytest.raises(RuntimeError):
        ns["buy"](request(method="post"), pk=3)
    assert seen.names == []


def test_snippet_views_signals() -> None:
    logger = ListLogger()
    ns = run("views-signals", logger=logger)
    try:
        with django_redlock.lock("doc:quick"):
            pass
        assert logger.lines == []  # no wait
        other = hold("doc:slow")
        threading.Timer(1.3, other.release).start()
        with django_redlock.lock("doc:slow", timeout=10):
            pass
    finally:
        signals.lock_acquired.disconnect(ns["slow_waits"])
    ((level, line),) = logger.lines
    assert level == "warning" and line.startswith("waited 1.") and line.endswith("doc:slow")


@pytest.mark.django_db
def test_snippet_cbv_dispatch() -> None:
    view = run("cbv-dispatch")["CartView"].as_view()
    someone = user()
    response = view(request(who=someone))
    assert response.status_code == 200
    assert __import__("json").loads(response.content) == {"lock": f"cart:{someone.pk}"}
    with Recorder(signals.lock_acquired) as seen:
        assert view(request(method="post", who=someone)) is None
    assert seen.names == [f"cart:{someone.pk}"]  # every method under the lock
    label = seen.seen[0][1]["lock"].label
    assert label.endswith("CartView.dispatch"), label


@pytest.mark.django_db
def test_snippet_cbv_handler() -> None:
    from django.views import View

    # The page's blocks follow each other: View and with_lock come from the first.
    view = run("cbv-handler", with_lock=django_redlock.with_lock, View=View)["OrderView"].as_view()
    with Recorder() as seen:
        view(request(), order_id=5)
        view(request(method="post"), order_id=5)
    assert seen.names == ["orders:5"]  # only post() is locked, named from self.queue
    other = hold("orders:5")
    try:
        assert view(request(method="post"), order_id=5).status_code == 423  # timeout=0
    finally:
        other.release()


@pytest.mark.django_db
def test_snippet_cbv_async() -> None:
    from django.utils.decorators import method_decorator
    from django.views import View

    from django_redlock.engine.aio import AsyncLock

    view = run("cbv-async", with_lock=django_redlock.with_lock, method_decorator=method_decorator,
               View=View)["FeedView"].as_view()
    assert iscoroutinefunction(view)  # Django sees an async view
    with Recorder(signals.lock_acquired, signals.lock_released) as seen:
        assert async_to_sync(view)(request(method="post"), name="news") is None
    assert seen.names == ["feed:news", "feed:news"]
    assert isinstance(seen.seen[0][1]["lock"], AsyncLock)  # held around the coroutine
    with override_settings(REDLOCK=TIMEOUT0):
        other = hold("feed:news")
        try:
            assert async_to_sync(view)(request(method="post"), name="news").status_code == 423
        finally:
            other.release()


def test_snippet_async_views_refresh_feed(session_nodes: RedisNodes) -> None:
    import json

    refresh_feed = run("async-views-refresh-feed")["refresh_feed"]
    with Recorder(signals.lock_acquired) as seen:
        response = async_to_sync(refresh_feed)(request(), name="news")
    body = json.loads(response.content)
    assert response.status_code == 200 and body["lock"] == "feed:news" and body["fence"] > 0
    assert seen.names == ["feed:news"] and seen.seen[0][1]["fence"] == body["fence"]
    assert not any(lock_key_on(s, "redlock:feed:news") for s in session_nodes)  # released


def test_snippet_async_views_function() -> None:
    sync_account = run("async-views-function", with_lock=django_redlock.with_lock)["sync_account"]
    with Recorder() as seen:
        assert asyncio.run(sync_account(3)) is None
    assert seen.names == ["sync:3"]
    other = hold("sync:3")
    try:
        with pytest.raises(LockNotAcquired):
            asyncio.run(sync_account(3))  # timeout=0
    finally:
        other.release()


# -- howto/celery-tasks.rst, run-once.rst ------------------------------------------


def test_snippet_celery_function() -> None:
    with Recorder() as seen:
        ns = run("celery-function")  # the block calls build_report("2024-05-01")
    assert seen.names == ["report:2024-05-01:daily"]
    other = hold("report:2024-05-02:weekly")
    try:
        with pytest.raises(LockNotAcquired):
            ns["build_report"]("2024-05-02", kind="weekly")
    finally:
        other.release()


def test_snippet_celery_skip() -> None:
    pytest.importorskip("celery")
    from django_redlock.jobs import was_skipped

    sync_catalog = run("celery-skip")["sync_catalog"]
    with Recorder() as seen:
        assert sync_catalog() is None  # the task's body ran, under the lock
    assert seen.names == ["sync-catalog"]
    other = hold("sync-catalog", ttl=30)
    try:
        result = sync_catalog()
    finally:
        other.release()
    assert was_skipped(result) and result["lock"] == "sync-catalog"
    assert 0 < result["retry_after"] <= 30


@pytest.fixture
def celery_app() -> Iterator[Callable[..., Any]]:
    """``make(**conf)``: a new Celery app, made the current one (``shared_task``
    binds to it), with an in-memory broker; the app before is restored after."""
    celery = pytest.importorskip("celery")
    from celery import current_app

    before = current_app._get_current_object()

    def make(**conf: Any) -> Any:
        app = celery.Celery("doc_snippets", set_as_current=True)
        app.conf.update(broker_url="memory://", result_backend="cache+memory://", **conf)
        return app

    try:
        yield make
    finally:
        before.set_current()


def test_snippet_celery_retry(celery_app: Callable[..., Any]) -> None:
    from celery.exceptions import Retry

    celery_app()
    issue_invoice = run("celery-retry")["issue_invoice"]
    with Recorder() as seen:
        assert issue_invoice(7) is None
    assert seen.names == ["invoice:7"]
    other = hold("invoice:7", ttl=30)
    # As a worker runs it (not called directly, not eagerly): retry() sends the
    # task again (to the in-memory broker) with the countdown, and raises Retry.
    issue_invoice.push_request(id="doc-1", args=[7], kwargs={}, retries=0,
                               called_directly=False, is_eager=False, delivery_info={})
    try:
        with pytest.raises(Retry) as retry:
            issue_invoice.run(7)
    finally:
        issue_invoice.pop_request()
        other.release()
    busy = retry.value.__context__  # retry() raises itself, inside the except
    assert isinstance(busy, LockNotAcquired)
    assert 1 <= retry.value.when <= 30  # the holder's lease left, rounded up
    assert retry.value.when == max(1, __import__("math").ceil(busy.retry_after))


@pytest.mark.django_db
def test_snippet_celery_atomic() -> None:
    from django.db import transaction

    post_entries = run("celery-atomic", with_lock=django_redlock.with_lock)["post_entries"]
    with Recorder() as seen:
        assert post_entries(3, []) is None
    assert seen.names == ["ledger:3"]
    with transaction.atomic(), pytest.raises(RuntimeError):
        post_entries(3, [])  # inside a caller's transaction it would commit after the release


def test_snippet_run_once_celery(celery_app: Callable[..., Any],
                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The block's module-level ``delay().get()``, run eagerly (in this process)."""
    celery_app(task_always_eager=True)
    ns = run("run-once-celery")
    assert ns["result"] == {"rows": 1234}
    assert capsys.readouterr().out == ""
    # The block's last part again (its task defined once), the lock busy meanwhile.
    code = docsnippets.code("run-once-celery")
    tail = code[code.index("\nresult = "):]
    other = hold("report:2024-05-01", ttl=30)
    try:
        exec(compile(tail, "<snippet run-once-celery>", "exec"), ns)  # noqa: S102
    finally:
        other.release()
    assert ns["result"]["redlock_skipped"] is True
    out = capsys.readouterr().out
    assert out.startswith("already being built by report:2024-05-01 - try in "), out


# -- howto/models-and-fenced-writes.rst ----------------------------------------------


def _snippet_model(name: str, model: str, stop: str | None = None) -> Any:
    """The model class a block defines, in an app registry of its own."""
    from django.db import models
    from django.test.utils import isolate_apps

    from django_redlock.models import LockableModel

    text = docsnippets.code(name)
    if stop:
        text = text[:text.index(stop)]
    with isolate_apps("tests.testapp"):
        ns = {"__name__": "tests.testapp.doc_models", "models": models,
              "LockableModel": LockableModel}
        exec(compile(text.replace("from tests.testapp.models import", "from shop.models import"),
                     f"<snippet {name}>", "exec"), ns)  # noqa: S102 - our own docs
        return ns[model]


def test_snippet_howto_model() -> None:
    from django_redlock.models import FenceField, LockingManager

    model = _snippet_model("howto-model", "Product")
    fence = model._meta.get_field("fence")
    assert isinstance(fence, FenceField) and fence.default == 0 and not fence.editable
    assert isinstance(model._default_manager, LockingManager)
    assert model.lock_template() == "testapp.product:<pk>"
    # The docs' other blocks run on the test app's Product: the same columns.
    assert {f.name for f in model._meta.fields} <= {f.name for f in Product._meta.fields}


@pytest.mark.django_db
def test_snippet_howto_lock_name_template() -> None:
    model = _snippet_model("howto-lock-name-template", "StockItem", stop="\nwith ")
    # The test app's SkuItem is the block's StockItem, field for field.
    assert [(f.name, type(f)) for f in model._meta.fields] == [
        (f.name, type(f)) for f in SkuItem._meta.fields]
    assert model.lock_name_template == SkuItem.lock_name_template == "sku:<sku>"
    SkuItem.objects.create(sku="A-100", qty=3)
    body = docsnippets.code("howto-lock-name-template")
    with Recorder() as seen:
        exec(compile(body[body.index("\nwith "):], "<snippet>", "exec"),  # noqa: S102
             {"StockItem": SkuItem})
    assert seen.names == ["sku:A-100"]
    assert SkuItem.objects.get(sku="A-100").fence > 0  # claimed before the read


# -- howto/lock-family.rst: the asserts are in the blocks; nothing is left held ----


def _family(name: str, keys: list[str], session_nodes: RedisNodes) -> dict[str, Any]:
    ns = run(name)
    for key in keys:
        assert not any(lock_key_on(s, f"redlock:{key}") for s in session_nodes), key
    return ns


def test_snippet_family_reentrant(session_nodes: RedisNodes) -> None:
    with Recorder() as seen:
        _family("family-reentrant", ["row:7"], session_nodes)
    assert seen.names == ["row:7"]  # one hold on the nodes for the nested calls


def test_snippet_family_multi_lock(session_nodes: RedisNodes) -> None:
    ns = _family("family-multi-lock", ["account:1", "account:2"], session_nodes)
    assert set(ns["fences"]) == {"account:1", "account:2"}


def test_snippet_family_multi_lock_decorator(session_nodes: RedisNodes) -> None:
    ns = _family("family-multi-lock-decorator", ["account:1", "account:2"], session_nodes)
    with pytest.raises(ValueError):
        ns["transfer"](1, 1, 10)  # one name twice, as the page says


def test_snippet_family_segments(session_nodes: RedisNodes) -> None:
    with Recorder() as seen:
        _family("family-segments", [f"stock:42[{i}]" for i in range(4)], session_nodes)
    (name,) = seen.names
    assert name in {f"stock:42[{i}]" for i in range(4)}


def test_snippet_family_segments_decorator(session_nodes: RedisNodes) -> None:
    ns = _family("family-segments-decorator", [f"stock:A-1[{i}]" for i in range(4)],
                 session_nodes)
    held = [hold(f"stock:A-1[{i}]") for i in (0, 1, 3)]
    try:
        assert ns["pick"]("A-1") == 2  # the one free segment
    finally:
        for other in held:
            other.release()


def test_snippet_family_read_write(session_nodes: RedisNodes) -> None:
    ns = _family("family-read-write", ["report:2026-11"], session_nodes)
    assert ns["writer"].fence > max(ns["r1"].fence, ns["r2"].fence)


def test_snippet_family_semaphore(session_nodes: RedisNodes) -> None:
    _family("family-semaphore", [f"exports#{i}" for i in range(3)], session_nodes)
    held = [django_redlock.semaphore("exports", 3, timeout=0) for _ in range(3)]
    assert all(h.acquire() for h in held)
    try:
        with pytest.raises(LockNotAcquired):
            run("family-semaphore")  # a fourth at once: refused within its timeout
    finally:
        for h in held:
            h.release()


def test_snippet_family_semaphore_decorator(session_nodes: RedisNodes) -> None:
    ns = _family("family-semaphore-decorator", ["export:7#0", "export:7#1"], session_nodes)
    assert ns["export"](8) in (0, 1)


# -- howto/metrics.rst, debug-toolbar.rst, admin-locks.rst ---------------------------


def _scrape() -> str:
    from prometheus_client import REGISTRY, generate_latest

    return generate_latest(REGISTRY).decode()


@pytest.fixture
def metrics_counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The metrics' receivers connected for this test, whatever ran before
    (tests/test_metrics.py disconnects them when it is imported), and the
    label budget fresh (earlier tests' lock names may have used it up)."""
    metrics = pytest.importorskip("django_redlock.metrics")
    monkeypatch.setattr(metrics, "_seen", set())
    metrics._connect()
    try:
        yield
    finally:
        metrics._disconnect()


def test_snippet_metrics_app_config(metrics_counting: None) -> None:
    pytest.importorskip("prometheus_client")
    import tests.testapp

    config = run("metrics-app-config")["ShopConfig"]("shop", tests.testapp)
    config.ready()
    assert "django_redlock.metrics" in sys.modules
    with django_redlock.lock("docmetrics:1"):
        pass
    line = 'redlock_acquire_wait_seconds_count{lock="docmetrics",outcome="acquired"}'
    assert line in _scrape()


@pytest.mark.django_db
def test_snippet_metrics_urls(monkeypatch: pytest.MonkeyPatch, metrics_counting: None) -> None:
    pytest.importorskip("prometheus_client")
    patterns = [p for p in run("metrics-urls")["urlpatterns"] if p is not Ellipsis]
    with django_redlock.lock("docscrape:1"):
        pass
    with override_settings(ROOT_URLCONF=urlconf(monkeypatch, "doc_metrics_urls", patterns)):
        response = Client().get("/metrics")
    assert response.status_code == 200
    body = response.content.decode()
    assert 'redlock_hold_seconds_count{lock="docscrape"}' in body
    assert "redlock_node_replies_total{node=" in body


class _Span:
    def __init__(self, name: str, start: int, attributes: dict[str, Any]) -> None:
        self.name, self.start, self.attributes = name, start, attributes
        self.end_time: int | None = None
        self.events: list[tuple[str, dict[str, Any]]] = []

    def end(self, end_time: int) -> None:
        self.end_time = end_time

    def add_event(self, name: str, attributes: dict[str, Any]) -> None:
        self.events.append((name, attributes))


@pytest.fixture
def opentelemetry(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A recording stand-in for ``opentelemetry.trace`` (not a dependency of the
    suite): the spans and events the block makes, with their attributes."""
    spans: list[_Span] = []
    current = _Span("request", 0, {})

    class Tracer:
        def start_span(self, name: str, start_time: int, attributes: dict[str, Any]) -> _Span:
            spans.append(_Span(name, start_time, attributes))
            return spans[-1]

    trace = types.ModuleType("opentelemetry.trace")
    trace.get_tracer = lambda name: Tracer()  # type: ignore[attr-defined]
    trace.get_current_span = lambda: current  # type: ignore[attr-defined]
    package = types.ModuleType("opentelemetry")
    package.trace = trace  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "opentelemetry", package)
    monkeypatch.setitem(sys.modules, "opentelemetry.trace", trace)
    return types.SimpleNamespace(spans=spans, current=current)


def test_snippet_metrics_tracing(opentelemetry: Any) -> None:
    ns = run("metrics-tracing")
    receivers = [(signals.lock_acquired, ns["acquired"]),
                 (signals.lock_not_acquired, ns["not_acquired"]),
                 (signals.lock_released, ns["released"]), (signals.lock_lost, ns["lost"])]
    try:
        with django_redlock.lock("doc:trace") as held:
            assert django_redlock.lock("doc:trace", timeout=0).acquire() is False
        lost = django_redlock.lock("doc:trace", auto_renew=False)
        assert lost.acquire()
        django_redlock.get_manager().force_release("doc:trace")
        with pytest.raises(LockLost):
            lost.extend()
    finally:
        for sig, receiver in receivers:
            sig.disconnect(receiver)
    got = [(s.name, s.attributes) for s in opentelemetry.spans]
    assert got[:3] == [
        ("redlock.acquire", {"redlock.name": "doc:trace", "redlock.fence": held.fence,
                             "redlock.outcome": "acquired"}),
        ("redlock.acquire", {"redlock.name": "doc:trace", "redlock.outcome": "busy"}),
        ("redlock.hold", {"redlock.name": "doc:trace", "redlock.fence": held.fence})]
    assert all(s.end_time is not None and s.start <= s.end_time for s in opentelemetry.spans)
    assert [name for name, _ in opentelemetry.current.events] == ["redlock.lost"]


@pytest.mark.django_db
def test_snippet_debug_toolbar_panels(settings: Any) -> None:
    pytest.importorskip("debug_toolbar", reason="django-debug-toolbar is not installed")
    from django_redlock import panels
    from tests.test_panels import cells, panel

    panels_setting = settings_of("debug-toolbar-panels")["DEBUG_TOOLBAR_PANELS"]
    assert panels_setting[-1] == "django_redlock.panels.LocksPanel"
    settings.ROOT_URLCONF = "tests.toolbar_urls"
    settings.MIDDLEWARE = ["debug_toolbar.middleware.DebugToolbarMiddleware", *settings.MIDDLEWARE]
    settings.DEBUG_TOOLBAR_PANELS = panels_setting
    settings.DEBUG_TOOLBAR_CONFIG = {"SHOW_TOOLBAR_CALLBACK": "tests.toolbar_urls.always",
                                     "IS_RUNNING_TESTS": False, "RENDER_PANELS": False}
    assert not [m for m in checks.run_checks() if m.level >= checks.ERROR]
    panels._connect()
    try:
        _, html = panel(Client(), "/page/7/")
    finally:
        panels._disconnect()
    ((name, outcome, *_),) = cells(html)
    assert (name, outcome) == ("page:7", "acquired")


@pytest.mark.django_db
def test_snippet_admin_release_permission() -> None:
    from django.contrib.auth.models import Group, Permission

    group = Group.objects.create(name="operators")
    someone = user()
    someone.groups.add(group)
    assert not someone.has_perm("django_redlock.release_lock")
    run("admin-release-permission", group=group)
    someone = type(someone).objects.get(pk=someone.pk)  # permissions are cached per object
    assert someone.has_perm("django_redlock.release_lock")
    assert list(group.permissions.all()) == [Permission.objects.get(codename="release_lock")]
