"""Settings validation and the system checks, one test per check id."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.core.checks import Error, Warning
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from django_redlock.checks import check_settings
from django_redlock.core.config import DEFAULTS, mask_url

from .polling import wait_until


def ids(settings: Any) -> list[str]:
    return [m.id for m in check_settings()]


def test_valid_settings_have_no_problems(settings: Any) -> None:
    settings.REDLOCK_NODES = ["redis://127.0.0.1:6379/0", "rediss://:pw@10.0.0.2:6380/0",
                              {"URL": "redis://10.0.0.3:6379/0", "OPTIONS": {"socket_timeout": 0.05}}]
    settings.REDLOCK = {"TTL": 5, "TIMEOUT": None, "AUTO_RENEW": False}
    assert ids(settings) == []


@pytest.mark.parametrize("nodes,expected", [
    (None, "redlock.E001"),
    ([], "redlock.E001"),
    ("redis://127.0.0.1:6379/0", "redlock.E002"),
    ([42], "redlock.E003"),
    ([{"OPTIONS": {}}], "redlock.E003"),
    (["cache:"], "redlock.E003"),
    (["http://127.0.0.1:6379/0"], "redlock.E004"),
    (["redis://127.0.0.1:99999/0"], "redlock.E004"),
    (["redis://127.0.0.1:6379/abc"], "redlock.E004"),
    (["redis:///0"], "redlock.E004"),
    (["redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379"], "redlock.E005"),
    (["cache:nope"], "redlock.E006"),
    ([{"URL": "redis://127.0.0.1:6379/0", "OPTIONS": {"sokcet_timeout": 1}}], "redlock.E011"),
    ([{"URL": "redis://127.0.0.1:6379/0", "OPTIONS": {"socket_timeout": -1}}], "redlock.E011"),
    # an int too large for a float: the check ended in an OverflowError traceback
    ([{"URL": "redis://127.0.0.1:6379/0", "OPTIONS": {"socket_timeout": 10**400}}],
     "redlock.E011"),
    (["redis://127.0.0.1:6379/0", "redis://127.0.0.1:6380/0"], "redlock.W001"),
    (["redis://localhost:6379/0", "redis://127.0.0.1:6379"], "redlock.E005"),
    (["redis://127.0.0.1:6379/0?socket_timeout=abc"], "redlock.E011"),
    (["unix:///tmp/redis.sock?db=x"], "redlock.E004"),
    (["unix:///tmp/\ud800.sock"], "redlock.E004"),
    (["redis://127.0.0.1:6379/0?socket_timeout=5"], "redlock.W003"),
    # an IP address with a trailing dot is looked up as a name: never found
    (["redis://127.0.0.1.:6379/0"], "redlock.E004"),
    (["redis://2130706433.:6379/0"], "redlock.E004"),
    (["redis://256.0.0.1:6379/0"], "redlock.E004"),
    (["redis://1.2.3.4.5:6379/0"], "redlock.E004"),
])
def test_node_problems(settings: Any, nodes: Any, expected: str) -> None:
    if nodes is None:
        del settings.REDLOCK_NODES
    else:
        settings.REDLOCK_NODES = nodes
    assert expected in ids(settings)


def test_cache_alias_must_be_django_redis(settings: Any) -> None:
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    settings.REDLOCK_NODES = ["cache:default"]
    messages = check_settings()
    assert [m.id for m in messages] == ["redlock.E006"]
    assert "not django-redis" in messages[0].msg


@pytest.mark.parametrize("options,expected", [
    ([1], "redlock.E007"),
    ({"TTLL": 5}, "redlock.E008"),
    ({"TTL": "10"}, "redlock.E009"),
    ({"AUTO_RENEW": 1}, "redlock.E009"),
    ({"BUSY_STATUS": True}, "redlock.E009"),
    ({"TTL": 0}, "redlock.E010"),
    ({"TIMEOUT": -1}, "redlock.E010"),
    ({"TTL": 10**400}, "redlock.E009"),  # an OverflowError traceback before
    ({"TIMEOUT": -10**400}, "redlock.E009"),
    ({"DRIFT_FACTOR": 0.9}, "redlock.E010"),
    ({"BUSY_STATUS": 200}, "redlock.E010"),
    ({"KEY_PREFIX": "has space"}, "redlock.E010"),
    # "$" matched before a trailing newline: "x\n" passed the check and the runtime
    ({"KEY_PREFIX": "x\n"}, "redlock.E010"),
    ({"TTL": 0.5, "NODE_TIMEOUT": 0.1}, "redlock.W002"),
])
def test_option_problems(settings: Any, options: Any, expected: str) -> None:
    settings.REDLOCK = options
    assert expected in ids(settings)


def test_unknown_key_suggests_the_right_one(settings: Any) -> None:
    settings.REDLOCK = {"TTLL": 5}
    (message,) = check_settings()
    assert isinstance(message, Error)
    assert "'TTL'" in (message.hint or "")


def test_even_nodes_is_a_warning_not_an_error(settings: Any) -> None:
    settings.REDLOCK_NODES = ["redis://127.0.0.1:6379/0", "redis://127.0.0.1:6380/0"]
    (message,) = check_settings()
    assert isinstance(message, Warning)


def test_manage_py_check_reports_and_fails(settings: Any) -> None:
    settings.REDLOCK = {"TTL": -3}
    with pytest.raises(SystemCheckError, match=r"redlock\.E010"):
        call_command("check")


def test_passwords_never_appear_in_messages(settings: Any) -> None:
    settings.REDLOCK_NODES = ["redis://:hunter2@127.0.0.1:6379/0", "redis://:hunter2@127.0.0.1:6379/0",
                              {"URL": "redis://u:hunter2@h:1/x", "OPTIONS": {"password": 5}}]
    text = " ".join(f"{m.msg} {m.hint}" for m in check_settings())
    assert "redlock.E005" in ids(settings)
    assert "hunter2" not in text
    assert mask_url("rediss://user:secret@h:6380/0?password=secret") == \
        "rediss://user:***@h:6380/0?password=***"


def test_lock_manager_raises_the_same_problems() -> None:
    from django_redlock import LockManager

    with pytest.raises(ImproperlyConfigured, match=r"redlock\.E008.*'tll'"):
        LockManager(["redis://127.0.0.1:6379/0"], tll=3)
    with pytest.raises(ImproperlyConfigured, match=r"redlock\.E001"):
        LockManager([])
    with pytest.raises(ImproperlyConfigured, match=r"redlock\.E001"):
        LockManager(None)  # a bare "'NoneType' object is not iterable" before
    with pytest.raises(ImproperlyConfigured, match=r"redlock\.E002"):
        LockManager(5)


def test_defaults_are_complete_and_valid(settings: Any) -> None:
    settings.REDLOCK = dict(DEFAULTS)
    assert ids(settings) == []


def test_get_manager_is_rebuilt_when_settings_change(settings: Any) -> None:
    from django_redlock import get_manager

    first = get_manager()
    assert get_manager() is first
    settings.REDLOCK = {"TTL": 7.5}
    second = get_manager()
    assert second is not first and second.ttl == 7.5


def test_a_tls_option_left_at_none_on_a_plain_url_builds_a_connection() -> None:
    """``ssl_ca_certs=None`` on a redis:// node is accepted (it asks for nothing) and
    must not reach redis-py's plain Connection, which refuses any ssl_* keyword."""
    from django_redlock import LockManager

    mgr = LockManager([{"URL": "redis://127.0.0.1:6379/0",
                        "OPTIONS": {"ssl_ca_certs": None, "ssl_cert_reqs": None}}])
    try:
        conn = mgr.nodes[0].pool.make_connection()  # builds it; connects to nothing
        conn.disconnect()
    finally:
        mgr.close()


def test_a_huge_int_setting_is_reported_briefly(settings: Any) -> None:
    settings.REDLOCK = {"TTL": 10**400}
    settings.REDLOCK_NODES = [{"URL": "redis://127.0.0.1:6379/0",
                               "OPTIONS": {"socket_timeout": 10**400}}]
    messages = check_settings()
    assert {m.id for m in messages} == {"redlock.E009", "redlock.E011"}
    assert all(len(m.msg) < 200 for m in messages), [m.msg for m in messages]


@pytest.mark.parametrize("options", [
    {"BUSY_STATUS": 10**5000},  # past the 4,300 digits str() takes: a ValueError traceback
    {"REPLICA_ACKS": 10**5000},
    {"KEY_PREFIX": 10**5000},
    {"TTL": -10**5000},
    {10**5000: 1},  # an unknown key of that size
])
def test_an_int_of_thousands_of_digits_is_reported_not_a_traceback(
        settings: Any, options: Any) -> None:
    settings.REDLOCK = options
    messages = check_settings()
    assert messages and all(m.id.startswith("redlock.E") for m in messages)
    assert all("digits" in m.msg and len(m.msg) < 200 for m in messages), messages


def test_a_node_option_of_thousands_of_digits_is_reported(settings: Any) -> None:
    settings.REDLOCK_NODES = [{"URL": "redis://127.0.0.1:6379/0",
                               "OPTIONS": {"max_connections": -10**5000}}]
    assert "redlock.E011" in ids(settings)


@pytest.mark.parametrize("caches", [{"locks": "redis://10.0.0.4:6379/1"},
                                    {"locks": None}, "not a dict"])
def test_a_cache_node_whose_cache_is_not_a_dict_is_e006(settings: Any, caches: Any) -> None:
    from django_redlock.core.config import check_cache_aliases, parse_nodes

    specs, problems = parse_nodes(["cache:locks"])
    assert not problems
    found = check_cache_aliases(specs, caches)  # CACHES itself: Django checks it
    assert [p.id for p in found] == ["E006"], found


def test_get_manager_refuses_a_cache_node_it_cannot_borrow(settings: Any) -> None:
    """A ``cache:`` alias that is missing or not django-redis is E006 when the
    manager is built, as ``manage.py check`` says, not an ImproperlyConfigured
    at the first acquire (raised in a connection set-up thread too)."""
    from django_redlock import get_manager

    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    settings.REDLOCK_NODES = ["cache:locks"]
    with pytest.raises(ImproperlyConfigured, match=r"redlock\.E006.*'locks'"):
        get_manager()
    settings.CACHES = {**settings.CACHES,
                       "locks": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    with pytest.raises(ImproperlyConfigured, match=r"redlock\.E006.*not django-redis"):
        get_manager()


LOCMEM = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}


@pytest.mark.parametrize("change", ["CACHES", "REDLOCK", "REDLOCK_NODES"])
def test_a_settings_change_under_a_held_lock_keeps_renewing_it(
        settings: Any, change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A settings change retires the manager instead of closing it: its renewal
    thread stopped, the lease (0.6 s) ran out silently during a 1.5 s hold, and a
    second holder got the lock; LockLost came only at release."""

    import django_redlock
    from django_redlock import get_manager
    from django_redlock.signals import lock_lost

    lost: list[Any] = []

    def on_lost(**kwargs: Any) -> None:
        lost.append(kwargs["name"])

    lock_lost.connect(on_lost)
    try:
        lock = django_redlock.lock("stale:settings", ttl=0.6, auto_renew=True)
        old = lock.manager
        assert lock.acquire(timeout=0)
        if change == "CACHES":
            settings.CACHES = LOCMEM
        elif change == "REDLOCK":
            settings.REDLOCK = {"TTL": 7.5}
        else:
            settings.REDLOCK_NODES = list(settings.REDLOCK_NODES)
        if change != "CACHES":
            assert get_manager() is not old  # a retired manager is not handed out
        time.sleep(1.5)  # more than two leases: only the renewal keeps it
        assert lock.owned() and lock.validity > 0.3, lock.validity
        other = django_redlock.lock("stale:settings", timeout=0)
        assert not other.acquire(timeout=0), "a second holder got a held lock"
        lock.release()  # no LockLost
        assert lost == []
        if change != "CACHES":  # closed by the next look once nothing of it is in use
            assert not old._closed
            from django_redlock import conf

            monkeypatch.setattr(conf, "_next_look", 0.0)
            get_manager()
            assert wait_until(lambda: old._closed, timeout=5.0), \
                "the retired manager is closed once its last lock was released"
    finally:
        lock_lost.disconnect(on_lost)


def test_a_retired_manager_holding_nothing_is_closed_at_once(settings: Any) -> None:
    from django_redlock import get_manager

    old = get_manager()
    settings.REDLOCK = {"TTL": 7.5}
    assert old._closed


def test_a_caches_change_rebuilds_only_a_manager_with_a_cache_node(settings: Any) -> None:
    from django_redlock import get_manager

    first = get_manager()
    settings.CACHES = LOCMEM
    assert get_manager() is first and not first._closed


def test_a_caches_change_rebuilds_a_manager_with_a_cache_node(settings: Any,
                                                              session_nodes: Any) -> None:
    from django.core.cache import caches

    from django_redlock import get_manager

    cache = {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": session_nodes[0].url}
    settings.CACHES = {"default": LOCMEM["default"], "locks": cache}
    settings.REDLOCK_NODES = ["cache:locks"]
    try:
        first = get_manager()
        settings.CACHES = {"default": LOCMEM["default"], "locks": dict(cache, TIMEOUT=5)}
        assert get_manager() is not first and first._closed
    finally:
        caches["locks"].close()


@pytest.mark.parametrize("prefix", ["x\n", "redlock\n", "\nx"])
def test_a_key_prefix_with_a_newline_is_refused_at_run_time(session_nodes: Any,
                                                            prefix: str) -> None:
    """What the check refuses, the runtime refuses too (settings.rst)."""
    from django_redlock import LockManager

    with pytest.raises(ImproperlyConfigured, match=r"redlock\.E010.*KEY_PREFIX"):
        LockManager(list(session_nodes.urls), key_prefix=prefix)


def test_a_settings_change_under_a_held_async_lock_keeps_renewing_it(settings: Any) -> None:
    """The asyncio flavour through the retirement: its renewal runs on the loop
    (not the renewal thread closing stopped), and the retired manager closes
    once the lock is released from the loop."""
    import asyncio

    import django_redlock

    async def main() -> None:
        lock = django_redlock.alock("stale:async", ttl=0.6, auto_renew=True)
        old = lock.manager
        assert await lock.acquire(timeout=0)
        settings.REDLOCK = {"TTL": 7.5}
        await asyncio.sleep(1.5)  # more than two leases: only the renewal keeps it
        assert lock.owned(), "the lease ran out: the renewal stopped"
        other = django_redlock.alock("stale:async", timeout=0)
        assert not await other.acquire(timeout=0)
        await lock.release()  # no LockLost
        from django_redlock import conf

        conf._next_look = 0.0
        django_redlock.get_manager()  # the next look closes it, in a thread
        assert wait_until(lambda: old._closed, timeout=5.0)

    asyncio.run(main())


def test_a_retired_manager_sends_the_release_its_node_missed_before_it_closes(
        settings: Any, make_manager: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last release of a retired manager misses its node (down, coming back
    with its data): closing at that release dropped the request queued to be
    sent again, and the node kept the key a whole lease. The manager stays
    open until it is sent, and a later look closes it."""
    from django_redlock import conf
    from django_redlock.testing import RedisServer

    with RedisServer() as server:
        old = make_manager([server.url])
        lock = old.lock("retired:left", ttl=30, auto_renew=False)
        assert lock.acquire()
        old.retire()
        assert not old._closed  # a lock held
        server.execute("SAVE")
        server.kill()
        lock.release()  # confirmed by no node: logged, sent again later
        assert old._leftovers is not None and old._leftovers.waiting() == 1
        time.sleep(0.3)
        assert not old._closed, "closed with a release still to send"
        server.restart(empty=False)  # the key is back from the dump
        assert wait_until(lambda: server.execute("EXISTS", lock.key) == 0, timeout=5.0), \
            "the missed release was never sent"
        assert wait_until(lambda: old._leftovers.waiting() == 0, timeout=5.0)
        conf._retired.add(old)
        monkeypatch.setattr(conf, "_next_look", 0.0)
        conf.get_manager()  # a later look: nothing needs it now
        assert wait_until(lambda: old._closed, timeout=5.0)


def test_a_retired_manager_whose_last_lock_was_lost_is_closed_by_a_later_look(
        settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lock lost (its lease ran out) never calls back: the retired manager
    kept its renewal thread, its listener and its connections for the rest of
    the process. ``get_manager()`` looks at the retired managers again."""
    import django_redlock
    from django_redlock import conf, get_manager

    monkeypatch.setattr(conf, "RETIRED_LOOK_EVERY", 0.0)
    monkeypatch.setattr(conf, "_next_look", 0.0)  # an earlier look's
    lock = django_redlock.lock("retired:lost", ttl=0.3, auto_renew=False)
    old = lock.manager
    assert lock.acquire(timeout=0)
    settings.REDLOCK = {"TTL": 7.5}  # retired, with a lock held
    assert not old._closed and old in conf._retired
    time.sleep(0.5)  # the lease runs out: lost, never released
    assert not lock.owned()
    new = get_manager()  # looks at the retired managers
    assert new is not old
    assert wait_until(lambda: old._closed and old not in conf._retired, timeout=5.0)


def test_an_interrupted_release_is_not_counted_in_flight_for_ever(make_manager: Any,
                                                                   session_nodes: Any) -> None:
    """A KeyboardInterrupt (a Celery soft time limit) in the middle of a
    release's round left its plan suspended, counted in flight for as long as
    the exception was kept (a stored traceback): the retired manager stayed
    open, and closed whenever and wherever the garbage collector finalized
    the plan."""
    mgr = make_manager(list(session_nodes.urls))
    lock = mgr.lock("retired:interrupted", ttl=30, auto_renew=False)
    assert lock.acquire()
    mgr.retire()

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt  # a signal arriving mid-round

    mgr._release_round = interrupted
    kept: list[BaseException] = []
    try:
        lock.release()
    except KeyboardInterrupt as e:
        kept.append(e)  # a framework keeping the exception
    assert len(mgr._calls) == 0
    assert mgr._close_if_idle()  # what the next look does


def test_a_grant_that_lands_on_a_closed_retired_manager_is_not_held(
        redis_nodes_factory: Any, fault_proxy_factory: Any, make_manager: Any) -> None:
    """An old lock object of a retired manager acquires (its round slowed on
    the wire) while the manager, holding nothing, is closed: the grant landed
    with nobody to renew it (owned() True, the keys expiring silently). Now
    the acquire fails loudly (QuorumUnavailable) and nothing counts as held.
    A grant enrolled before the close is decided keeps the manager open."""
    import threading

    from django_redlock.exceptions import QuorumUnavailable

    nodes = redis_nodes_factory(3)
    proxies = [fault_proxy_factory(server) for server in nodes]
    mgr = make_manager([p.url for p in proxies], node_timeout=1.0)
    lock = mgr.lock("retired:acquiring", ttl=0.9)  # renewed every 0.3 s
    with mgr.lock("retired:warm", timeout=0):
        pass  # connections set up: the slow part below is the acquire's round
    for proxy in proxies:
        proxy.set_latency(0.3)
    outcome: list[Any] = []

    def acquire() -> None:
        try:
            outcome.append(lock.acquire(timeout=5))
        except QuorumUnavailable as e:
            outcome.append(e)

    acquiring = threading.Thread(target=acquire)
    acquiring.start()
    time.sleep(0.1)  # the round is on its way
    mgr.retire()  # nothing held: closed at once
    acquiring.join(10)
    for proxy in proxies:
        proxy.set_latency(0.0)
    assert mgr._closed
    assert len(outcome) == 1 and isinstance(outcome[0], QuorumUnavailable), outcome
    assert not lock.owned()

    # The other order: a lock held keeps a retired manager open, renewed.
    other = make_manager(list(p.url for p in proxies), node_timeout=1.0)
    kept = other.lock("retired:kept", ttl=0.9)
    assert kept.acquire(timeout=2)
    other.retire()
    assert not other._closed and not other._close_if_idle()
    time.sleep(1.5)  # more than a lease: only the renewal keeps it
    assert kept.owned() and all(server.execute("EXISTS", kept.key) == 1 for server in nodes)
    kept.release()
    assert other._close_if_idle()


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_retired_manager_does_not_close_under_a_release_in_flight(
        redis_nodes_factory: Any, fault_proxy_factory: Any, make_manager: Any,
        monkeypatch: pytest.MonkeyPatch, flavour: str) -> None:
    """The switch ``_close_if_idle`` argues about, forced on real nodes: the
    last lock of a retired manager is being released, its round slowed on
    the wire (0.3 s each way to nodes 1 and 2, 1.2 s to node 3), and the close check
    runs in the middle of it, when the lock no longer counts as held
    (``holds_any`` is False) and its requests are out::

        t=0    release(): counted in flight, then no longer held; round sent
        t=0+   the close check (directly, and a look of get_manager()):
               nothing held, but a release in flight: the manager stays open
        t=0.6  nodes 1 and 2 answer: the round is settled, release() returns
        t=0.6+ a later look closes the manager; node 3's release is still on
               the wire (it lands at 1.2 s), and runs all the same: it left
               before the close, and the close only ends the connection

    Closed under the round, its connections would be shut before the
    nodes had the release, and the key left on them for its lease (30 s):
    here it is gone from every node within a few seconds, and release()
    reports nothing lost."""
    import asyncio
    import threading

    from django_redlock import conf
    from django_redlock.engine.held import holds_any

    nodes = redis_nodes_factory(3)
    proxies = [fault_proxy_factory(server) for server in nodes]
    mgr = make_manager([p.url for p in proxies], node_timeout=7.0)  # node 3's reply: 6 s
    make = mgr.lock if flavour == "sync" else mgr.alock
    lock = make(f"retired:releasing:{flavour}", ttl=30, auto_renew=False)
    acquired, go = threading.Event(), threading.Event()
    outcome: list[Any] = []

    async def hold() -> None:
        try:
            result = lock.acquire(timeout=5)
            assert await result if asyncio.iscoroutine(result) else result
            acquired.set()
            await asyncio.get_running_loop().run_in_executor(None, go.wait, 10.0)
            result = lock.release()
            if asyncio.iscoroutine(result):
                await result
            outcome.append("released")
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            outcome.append(e)

    releasing = threading.Thread(target=asyncio.run, args=(hold(),), daemon=True)
    releasing.start()
    assert acquired.wait(10)
    mgr.retire()
    assert not mgr._closed  # a lock held
    conf._retired.add(mgr)
    # Each way. The windows the checks run in are wide enough for a loaded
    # CI (two suites on two cores): the release's round ends after 1.2 s,
    # and reaches node 3 after 3 s (with 0.3 and 1.2 s, the later look had
    # not closed the manager yet when node 3 ran the release).
    for proxy, latency in zip(proxies, (0.6, 0.6, 3.0)):
        proxy.set_latency(latency)
    go.set()
    # The release is under way: no longer held, its round on the wire.
    assert wait_until(lambda: not lock.owned(), timeout=5.0, interval=0.002)
    assert not holds_any(mgr)
    assert not mgr._close_if_idle(), "closed under a release in flight"
    monkeypatch.setattr(conf, "_next_look", 0.0)
    conf.get_manager()  # a look, in a thread of its own
    for thread in threading.enumerate():
        if thread.name == "redlock-retired":
            thread.join(5.0)
    assert not mgr._closed, "a look closed it under a release in flight"
    assert releasing.is_alive(), "the release was over before the close checks ran"
    releasing.join(10)
    assert outcome == ["released"], outcome
    # Node 3's release is still on the wire: a later look closes the manager.
    monkeypatch.setattr(conf, "_next_look", 0.0)
    conf.get_manager()
    assert wait_until(lambda: mgr._closed and mgr not in conf._retired, timeout=5.0)
    assert nodes[2].execute("EXISTS", lock.key) == 1  # node 3 has not run it yet
    assert wait_until(lambda: all(server.execute("EXISTS", lock.key) == 0
                                  for server in nodes), timeout=5.0), \
        "the release did not reach every node: its key is left for its lease"


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_grant_enrolled_after_the_close_was_decided_is_refused(
        make_manager: Any, session_nodes: Any, flavour: str) -> None:
    """The narrow order: the close of a retired manager is decided (nothing
    held) while an acquire's round is out; the round comes back granted
    before the connections are shut. The grant is not held: nobody would
    renew it (here: the decision made, the close itself not yet run). It is
    taken back where the nodes can be reached (the asyncio flavour left the
    keys a whole lease, and the lock busy for everyone)."""
    import asyncio

    from django_redlock.exceptions import QuorumUnavailable

    mgr = make_manager(list(session_nodes.urls))
    name = f"retired:decided:{flavour}"
    mgr._retired = mgr._closing = mgr._closed = True  # what _close_if_idle just decided
    with pytest.raises(QuorumUnavailable, match="granted after its manager was closed"):
        if flavour == "sync":
            lock: Any = mgr.lock(name, ttl=30)
            lock.acquire(timeout=0)
        else:
            lock = mgr.alock(name, ttl=30)
            asyncio.run(lock.acquire(timeout=0))
    assert not lock.owned()
    mgr._closing = mgr._closed = False  # for the fixture's own close
    assert all(server.execute("EXISTS", lock.key) == 0 for server in session_nodes)
    other = make_manager(list(session_nodes.urls)).lock(name, ttl=5)
    assert other.acquire(timeout=0)
    other.release()


def test_the_exit_hook_releases_every_lock_of_a_retired_manager(session_nodes: Any) -> None:
    """Python 3.12 refuses new threads at interpreter shutdown: a retired
    manager's release that started one (to close it) raised there, out of the
    exit hook's loop, and the other locks stayed on the nodes a whole lease."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent("""
        import sys
        from django_redlock import LockManager
        mgr = LockManager(sys.argv[1].split(","), node_timeout=0.5)
        locks = [mgr.lock(f"retired-exit-{i}", ttl=30, auto_renew=False) for i in range(3)]
        assert all(lock.acquire() for lock in locks)
        mgr.retire()
        sys.exit(0)  # the exit hook releases what is held
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", script, ",".join(session_nodes.urls)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    for server in session_nodes:
        assert [server.execute("EXISTS", f"redlock:retired-exit-{i}") for i in range(3)] == \
            [0, 0, 0]
