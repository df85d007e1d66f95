"""``django_redlock.metrics``: Prometheus collectors fed by the lock signals,
against the suite's real Redis nodes (deltas of the default registry)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import RequestFactory

import django_redlock
from django_redlock import LockLost, QuorumUnavailable
from django_redlock.decorators import with_lock
from django_redlock.exceptions import FencedWriteRejected
from tests.polling import wait_until
from tests.testapp.models import Product

prometheus_client = pytest.importorskip("prometheus_client")
metrics = pytest.importorskip("django_redlock.metrics")
metrics._disconnect()  # imported at collection: count only while this module runs


@pytest.fixture(autouse=True, scope="module")
def _counting() -> Iterator[None]:
    metrics._connect()
    yield
    metrics._disconnect()


def value(name: str, **labels: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0


class Delta:
    """``Delta()`` then ``.of(name, **labels)``: how much a sample grew since."""

    def __init__(self) -> None:
        self.start = {(s.name, tuple(sorted(s.labels.items()))): s.value
                      for m in prometheus_client.REGISTRY.collect() for s in m.samples}

    def of(self, name: str, **labels: str) -> float:
        return value(name, **labels) - self.start.get((name, tuple(sorted(labels.items()))), 0.0)


@with_lock("job:<key>", timeout=0)
def job(key: str) -> str:
    return key


def test_acquired_busy_and_hold_by_bounded_label(make_manager: Any, session_nodes: Any) -> None:
    manager = make_manager(session_nodes, auto_renew=False)
    d = Delta()
    with manager.lock("stock:42"):
        assert not manager.lock("stock:42", timeout=0).acquire()
        other = manager.lock("stock:43", timeout=0)
        assert other.acquire()
        other.release()
    with manager.lock("stock:43"):
        pass
    wait = "redlock_acquire_wait_seconds_count"
    assert d.of(wait, lock="stock", outcome="acquired") == 3  # 42, 43 (inside), 43
    assert d.of(wait, lock="stock", outcome="busy") == 1
    assert d.of("redlock_hold_seconds_count", lock="stock") == 3
    text = metrics_text()
    assert "stock:42" not in text and "stock:43" not in text  # never the concrete name


def test_with_lock_labels_by_template() -> None:
    d = Delta()
    assert job("a") == "a"
    with django_redlock.lock("job:b"), pytest.raises(django_redlock.LockNotAcquired):
        job("b")
    wait = "redlock_acquire_wait_seconds_count"
    assert d.of(wait, lock="job:<key>", outcome="acquired") == 1
    assert d.of(wait, lock="job:<key>", outcome="busy") == 1
    assert d.of(wait, lock="job", outcome="acquired") == 1  # the plain lock("job:b")


def test_the_lock_family_decorators_label_by_template_too() -> None:
    """A semaphore, segments, a multi-lock and a reentrant lock are made of
    plain locks, and those send the signals: they were labelled by their own
    names ("api-alice#0", "ma-bob"...), one series per client-chosen value,
    until the bounded label set was full and every later label read "other".
    They carry their decorator's template now."""
    from django_redlock.decorators import with_multi_lock, with_segments, with_semaphore

    @with_semaphore("fam-api-<user>", 2, timeout=0)
    def sem(user: str) -> str:
        return user

    @with_segments("fam-seg-<user>", 2, timeout=0)
    def seg(user: str) -> str:
        return user

    @with_multi_lock(["fam-ma-<user>", "fam-mb-<user>"], timeout=0)
    def multi(user: str) -> str:
        return user

    @with_lock("fam-re-<user>", timeout=0, reentrant=True)
    def re_(user: str) -> str:
        return user

    d = Delta()
    for call in (sem, seg, multi, re_):
        for user in ("alice", "bob"):
            assert call(user) == user
    wait = "redlock_acquire_wait_seconds_count"
    for label in ("fam-api-<user>", "fam-seg-<user>", "fam-ma-<user> + fam-mb-<user>",
                  "fam-re-<user>"):
        assert d.of(wait, lock=label, outcome="acquired") >= 2, label
    labels = {s.labels.get("lock") for m in prometheus_client.REGISTRY.collect()
              for s in m.samples}
    assert not {label for label in labels if label and "alice" in label}


def test_quorum_unavailable(make_manager: Any) -> None:
    from django_redlock.testing import RedisServer

    dead = []
    for _ in range(3):  # free ports with nobody listening
        server = RedisServer()
        server.start()
        dead.append(server.url)
        server.stop()
    manager = make_manager(dead, node_timeout=0.2)
    d = Delta()
    with pytest.raises(QuorumUnavailable):
        manager.lock("stock:1", timeout=0).acquire()
    assert d.of("redlock_acquire_wait_seconds_count", lock="stock",
                outcome="quorum_unavailable") == 1


def test_renewals_and_lost(make_manager: Any, session_nodes: Any) -> None:
    manager = make_manager(session_nodes, auto_renew=False)
    d = Delta()
    lk = manager.lock("renew:1", ttl=5)
    assert lk.acquire()
    lk.extend()
    lk.extend()
    assert d.of("redlock_renewals_total", lock="renew") == 2
    manager.force_release("renew:1")
    with pytest.raises(LockLost):
        lk.extend()
    assert d.of("redlock_lost_total", lock="renew") == 1
    # The watchdog's renewals count too. The lease is long enough for a
    # loaded CI machine (two suites on two cores): with 0.3 s, one stall of
    # 0.2 s between a renewal and its reply lost the lock, as it should.
    auto = make_manager(session_nodes, auto_renew=True).lock("renew:2", ttl=1.5)
    with auto:
        assert wait_until(lambda: d.of("redlock_renewals_total", lock="renew") >= 4, timeout=5)


def test_waiter_woken(make_manager: Any, session_nodes: Any) -> None:
    manager = make_manager(session_nodes, auto_renew=False)
    d = Delta()
    holder = manager.lock("queue:1", ttl=10)
    assert holder.acquire()
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(
        manager.lock("queue:1").acquire(timeout=8)), daemon=True)
    waiter.start()
    assert wait_until(lambda: any(s.execute("LLEN", "{redlock:queue:1}:waiters")
                                  for s in session_nodes), timeout=5)
    holder.release()
    waiter.join(timeout=10)
    assert got == [True]
    assert d.of("redlock_waiters_woken_total", lock="queue") >= 1


@pytest.mark.django_db
def test_fenced_write_rejected() -> None:
    products = Product.objects
    b = products.create(name="b", stock=1)
    with django_redlock.lock("testapp.products:all") as old:
        pass
    with django_redlock.lock("testapp.products:all") as new:
        pass
    assert products.filter(pk=b.pk).claim(new) == 1
    d = Delta()
    with pytest.raises(FencedWriteRejected):
        products.filter(pk=b.pk).claim(old)
    assert d.of("redlock_fenced_writes_rejected_total", lock="testapp.products",
                model="testapp.Product") == 1


def test_labels_stay_bounded(monkeypatch: Any) -> None:
    monkeypatch.setattr(metrics, "_seen", set())
    monkeypatch.setattr(metrics, "MAX_LABELS", 3)
    labels = [metrics.metrics_label(name=f"name-{i}") for i in range(10)]
    assert labels[:3] == ["name-0", "name-1", "name-2"]
    assert set(labels[3:]) == {metrics.OTHER}
    assert metrics.metrics_label(name="name-1") == "name-1"  # known ones stay


def metrics_text() -> str:
    response = metrics.metrics_view(RequestFactory().get("/metrics"))
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    return response.content.decode()


def test_metrics_view() -> None:
    with django_redlock.lock("view:1"):
        pass
    text = metrics_text()
    for name in ("redlock_acquire_wait_seconds_bucket", "redlock_hold_seconds_sum",
                 "redlock_renewals_total", "redlock_lost_total",
                 "redlock_waiters_woken_total", "redlock_fenced_writes_rejected_total"):
        assert name in text, name
    assert 'redlock_hold_seconds_count{lock="view"}' in text


def test_all_metric_names_start_with_redlock() -> None:
    names = {m.name for m in prometheus_client.REGISTRY.collect()
             if m.name.startswith(("redlock", "lock"))}
    assert names and all(n.startswith("redlock_") for n in names), names


def test_async_locks_count_too(make_manager: Any, session_nodes: Any) -> None:
    import asyncio

    manager = make_manager(session_nodes, auto_renew=False)
    d = Delta()

    async def main() -> None:
        async with manager.alock("async:1") as held:
            assert not await manager.alock("async:1", timeout=0).acquire()
            await held.extend()

    asyncio.run(main())
    wait = "redlock_acquire_wait_seconds_count"
    assert d.of(wait, lock="async", outcome="acquired") == 1
    assert d.of(wait, lock="async", outcome="busy") == 1
    assert d.of("redlock_renewals_total", lock="async") == 1
    assert d.of("redlock_hold_seconds_count", lock="async") == 1


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_node_errors_replies_and_round_trips(flavour: str, make_manager: Any) -> None:
    """Per node: replies and their round trips on live nodes; errors on a node
    that stops (killed here); a password never shows in the ``node`` label."""
    import asyncio

    from django_redlock.testing import RedisNodes, _free_port

    with RedisNodes(4) as nodes:  # with the node down: 5, a quorum of 3
        down = f"redis://:s3cret-pw@127.0.0.1:{_free_port()}/0"  # nobody listens there
        manager = make_manager([*nodes.urls, down], node_timeout=0.2)
        live, dead = [n.name for n in manager.nodes[:4]], manager.nodes[4].name
        assert "s3cret-pw" not in dead and "***" in dead

        def use(times: int) -> None:
            async def some() -> None:
                for _ in range(times):
                    async with manager.alock("nodes:1"):
                        pass

            if flavour == "asyncio":
                asyncio.run(some())
            else:
                for _ in range(times):
                    with manager.lock("nodes:1"):
                        pass

        d = Delta()
        use(3)
        # A round reads at least a quorum of replies itself (3: the node down
        # answers nothing); a settled round may leave a node's reply to be read
        # later, by another round: counted as a reply, not as a round trip.
        trips = [d.of("redlock_node_round_trip_seconds_count", node=name) for name in live]
        assert sum(trips) >= 6 * 3, trips
        for name, count in zip(live, trips):
            assert d.of("redlock_node_replies_total", node=name) >= count
            assert d.of("redlock_node_round_trip_seconds_bucket", node=name, le="+Inf") == count
            if count:
                assert d.of("redlock_node_round_trip_seconds_sum", node=name) > 0
        assert d.of("redlock_node_errors_total", node=dead) >= 1
        assert d.of("redlock_node_replies_total", node=dead) == 0

        nodes.servers[0].kill()  # a live node stops: its errors grow
        d = Delta()
        use(2)
        assert d.of("redlock_node_errors_total", node=live[0]) >= 1
        assert sum(d.of("redlock_node_replies_total", node=name) for name in live[1:]) >= 4 * 3
        text = prometheus_client.generate_latest().decode()
        assert "s3cret-pw" not in text


def test_async_locks_with_the_metrics_connected_turn_the_loop_as_without(
        make_manager: Any, redis_nodes_factory: Any) -> None:
    """The metrics' receivers never block, so the asyncio flavour calls them in
    the loop's thread. Sent through ``asend_robust`` (every sync receiver in a
    worker thread), an uncontended acquire + release turned the event loop 16
    times instead of 4, and took 924 µs against 271 µs without the metrics.
    The counts are still made, in that loop's thread."""
    from tests.loopturns import alock_turns, turns_per_op

    manager = make_manager(redis_nodes_factory(1), auto_renew=False)
    threads: set[int] = set()
    real = metrics.HOLD.labels

    def labels(*args: Any, **kwargs: Any) -> Any:  # where the receiver runs
        threads.add(threading.get_ident())
        return real(*args, **kwargs)

    metrics.HOLD.labels = labels
    try:
        d = Delta()
        turns = alock_turns(manager, "turns:metrics", count=20, warm=5)
    finally:
        del metrics.HOLD.labels
    # Counted for the 5 that open the connections too, and for the 20 timed.
    assert d.of("redlock_acquire_wait_seconds_count", lock="turns", outcome="acquired") == 25
    assert d.of("redlock_hold_seconds_count", lock="turns") == 25
    assert threads == {threading.get_ident()}  # the loop's thread: no hop
    assert turns <= 20 * turns_per_op() + 2, turns / 20  # test_aio.py's bound, no metrics


def test_a_receiver_of_the_users_beside_the_metrics_still_runs_off_the_loop(
        make_manager: Any, session_nodes: Any) -> None:
    """Only the package's own receivers are called in the loop's thread: with
    one of the user's connected too (it may block: the ORM, a file), the
    signal goes through ``asend_robust`` as before, which runs sync receivers
    in a worker thread, and both are called."""
    import asyncio

    from django_redlock import signals

    manager = make_manager(session_nodes, auto_renew=False)
    loop_thread: list[int] = []
    seen: list[int] = []

    def users_receiver(sender: Any, **kwargs: Any) -> None:
        seen.append(threading.get_ident())

    async def main() -> None:
        loop_thread.append(threading.get_ident())
        async with manager.alock("user:receiver"):
            pass

    signals.lock_acquired.connect(users_receiver, dispatch_uid="tests.users_receiver")
    try:
        d = Delta()
        asyncio.run(main())
    finally:
        signals.lock_acquired.disconnect(dispatch_uid="tests.users_receiver")
    assert d.of("redlock_acquire_wait_seconds_count", lock="user", outcome="acquired") == 1
    assert len(seen) == 1 and seen[0] != loop_thread[0]
