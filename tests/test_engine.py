"""The lock engine against real Redis nodes: the contract of Lock and LockManager."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from django_redlock import (
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    RedlockError,
    signals,
)
from django_redlock.core.keys import fence_key
from django_redlock.core.owner import parse_value
from django_redlock.testing import RedisNodes
from tests.polling import child_exit_code, run_in_threads

MakeManager = Callable[..., Any]


@pytest.fixture(params=[1, 3, 5], ids=["1node", "3nodes", "5nodes"])
def cluster(request: Any, nodes3: RedisNodes, nodes5: RedisNodes) -> list[str]:
    n = request.param
    if n == 1:
        return nodes3.urls[:1]
    return (nodes3 if n == 3 else nodes5).urls


def test_acquire_release_and_busy(cluster: list[str], make_manager: MakeManager) -> None:
    mgr = make_manager(cluster, ttl=5)
    first = mgr.lock("stock:1")
    assert first.acquire()
    assert first.owned() and first.locked()
    assert 4.5 < first.validity <= 5.0
    other = mgr.lock("stock:1")
    started = time.monotonic()
    assert other.acquire(timeout=0) is False
    assert time.monotonic() - started < 1.0
    assert not other.owned()
    first.release()
    assert not first.owned() and not first.locked()
    assert first.validity == 0.0
    assert other.acquire(timeout=0)
    other.release()


def test_value_carries_token_fence_and_owner(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    with mgr.lock("order:7", label="checkout") as held:
        # A settled round returns once a quorum granted; the last node's grant
        # was sent too and lands a moment later.
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and not all(
                server.client().exists(held.key) for server in nodes3):
            time.sleep(0.005)
        fences = []
        for server in nodes3:
            stored = parse_value(server.client().get(held.key))
            assert stored is not None
            fences.append(stored.fence)
            assert stored.owner["pid"] == os.getpid()
            assert stored.owner["label"] == "checkout"
            assert stored.owner["thread"] == threading.current_thread().name
            assert 0 < server.client().pttl(held.key) <= 10_000
        # Each node issues its own fence; the holder's is the highest among the
        # grants that made its quorum: one of them, and at least the second highest.
        assert held.fence in fences and held.fence >= sorted(fences)[-mgr.quorum]


def test_fence_grows_strictly_across_holders(nodes5: RedisNodes, make_manager: MakeManager) -> None:
    a, b = make_manager(nodes5), make_manager(nodes5)
    fences = []
    for i in range(30):
        with (a if i % 2 else b).lock("fenced") as held:
            fences.append(held.fence)
    assert fences == sorted(fences) and len(set(fences)) == len(fences)
    # Written back on release: every node's counter is at least the last fence.
    for server in nodes5:
        assert int(server.client().get(fence_key("redlock:fenced"))) >= fences[-1]


def test_fence_keeps_growing_after_the_counter_is_gone(nodes3: RedisNodes,
                                                       make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    with mgr.lock("f2") as held:
        before = held.fence
    nodes3.flushall()  # as if every node restarted empty
    with mgr.lock("f2") as held:
        assert held.fence > before


def test_unfenced_lock_has_fence_zero(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    with mgr.lock("nofence", fencing=False) as held:
        assert held.fence == 0
    assert nodes3[0].client().exists(fence_key("redlock:nofence")) == 0


def test_timeout_zero_tries_once_and_timeout_waits(nodes3: RedisNodes,
                                                   make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3, retry_delay=0.05)
    holder = mgr.lock("busy", ttl=5)
    holder.acquire()
    waiter = mgr.lock("busy")
    started = time.monotonic()
    assert waiter.acquire(timeout=0.4) is False
    waited = time.monotonic() - started
    assert 0.35 <= waited < 1.5
    assert waiter.retry_after > 4  # the holder's lease, as the nodes report it
    started = time.monotonic()
    with pytest.raises(LockNotAcquired) as info:
        with mgr.lock("busy", timeout=0):
            pass  # pragma: no cover
    assert time.monotonic() - started < 0.5
    assert info.value.retry_after > 4 and info.value.lock_name == "busy"
    assert mgr.lock("busy").acquire(blocking=False) is False
    holder.release()


def test_release_wakes_a_blocked_waiter_fast(nodes5: RedisNodes, make_manager: MakeManager) -> None:
    # A 5 s retry delay: only the release notice can explain a quick hand-off.
    mgr = make_manager(nodes5, retry_delay=5.0, ttl=10)
    holder = mgr.lock("handoff")
    holder.acquire()
    got: dict[str, float] = {}

    def wait() -> None:
        lock = mgr.lock("handoff", timeout=8)
        if lock.acquire():
            got["at"] = time.monotonic()
            lock.release()

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.3)  # let the waiter fail once and subscribe
    released = time.monotonic()
    holder.release()
    thread.join(timeout=10)
    assert "at" in got
    assert got["at"] - released < 0.5


def test_dead_holder_costs_waiters_only_its_remaining_lease(nodes3: RedisNodes,
                                                            make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3, retry_delay=5.0)
    dead = mgr.lock("crashed", ttl=0.6, auto_renew=False)
    dead.acquire()  # never released: the key expires on its own
    started = time.monotonic()
    waiter = mgr.lock("crashed", timeout=5)
    assert waiter.acquire()
    assert time.monotonic() - started < 1.5
    waiter.release()


def test_non_owner_release_and_extend(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    lock = mgr.lock("mine")
    with pytest.raises(LockNotOwned):
        lock.release()
    with pytest.raises(LockNotOwned):
        lock.extend()
    holder = mgr.lock("mine")
    holder.acquire()
    assert not lock.acquire(timeout=0)
    with pytest.raises(LockNotOwned):
        lock.release()  # it never held it: the holder's key stays
    assert holder.locked() and holder.owned()
    with pytest.raises(RedlockError, match="not reentrant"):
        holder.acquire(timeout=0)
    holder.release()
    with pytest.raises(LockNotOwned):
        holder.release()


def test_slow_holders_release_never_deletes_the_next_holders_key(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    slow = mgr.lock("resource", ttl=0.3, auto_renew=False)
    slow.acquire()
    time.sleep(0.5)  # lease over
    assert not slow.owned()
    fast = mgr.lock("resource", timeout=1)
    assert fast.acquire()
    with pytest.raises(LockLost):
        slow.release()
    assert fast.owned() and fast.locked()
    for server in nodes3:
        assert server.client().exists(fast.key)
    assert fast.fence > slow.fence
    fast.release()


def test_extend_resets_the_lease(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    lock = mgr.lock("ext", ttl=1, auto_renew=False)
    lock.acquire()
    lock.extend(5)
    assert lock.validity > 4
    assert all(server.client().pttl(lock.key) > 4000 for server in nodes3)
    lock.release()


def test_watchdog_keeps_the_lock_past_its_ttl(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    with mgr.lock("long-job", ttl=0.6) as held:
        time.sleep(1.8)  # three leases
        assert held.owned()
        assert not mgr.lock("long-job").acquire(timeout=0)
    assert not held.locked()


def test_without_renewal_a_long_body_raises_lock_lost(nodes3: RedisNodes,
                                                      make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    with pytest.raises(LockLost):
        with mgr.lock("short", ttl=0.3, auto_renew=False):
            time.sleep(0.5)


def test_failed_renewal_is_reported_never_silent(nodes3: RedisNodes,
                                                 make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    operator = make_manager(nodes3)
    lost: list[dict[str, Any]] = []

    def on_lost(sender: Any, **kwargs: Any) -> None:
        lost.append(kwargs)

    signals.lock_lost.connect(on_lost)
    try:
        with pytest.raises(LockLost, match="no longer have"):
            with mgr.lock("stolen", ttl=0.6) as held:
                operator.force_release("stolen")  # e.g. `manage.py locks release --force`
                thief = operator.lock("stolen")
                assert thief.acquire(timeout=0)
                deadline = time.monotonic() + 2
                while held.owned() and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert not held.owned()
        assert thief.owned()  # the loser's release left the new holder alone
        thief.release()
    finally:
        signals.lock_lost.disconnect(on_lost)
    assert len(lost) == 1
    assert lost[0]["name"] == "stolen" and "no longer have" in lost[0]["reason"]


def test_body_exception_is_not_replaced_by_lock_lost(nodes3: RedisNodes,
                                                     make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    with pytest.raises(KeyError):
        with mgr.lock("both", ttl=0.2, auto_renew=False):
            time.sleep(0.3)
            raise KeyError("body failed")


def test_max_hold_caps_renewal(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    started = time.monotonic()
    with pytest.raises(LockLost, match="MAX_HOLD|lease ran out"):
        with mgr.lock("capped", ttl=0.4, max_hold=0.9) as held:
            deadline = time.monotonic() + 3
            while held.owned() and time.monotonic() < deadline:
                time.sleep(0.02)
    assert 0.8 < time.monotonic() - started < 2.5


def test_renewals_never_extend_a_key_past_acquired_plus_max_hold(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """implementation.rst: "With MAX_HOLD, renewals never extend past acquired +
    MAX_HOLD". Read off the nodes: the key's end (now + PTTL) on every node,
    sampled through the hold, never passes the start of the acquire + 1.0 s,
    and the key is gone from every node soon after."""
    mgr = make_manager(nodes3)
    lock = mgr.lock("capped-keys", ttl=0.4, max_hold=1.0)
    started = time.monotonic()
    assert lock.acquire()
    ends: list[float] = []
    for _ in range(60):  # bounded: 60 samples, about 1.8 s
        for server in nodes3:
            pttl = server.execute("PTTL", lock.key)
            if pttl > 0:
                ends.append(time.monotonic() - started + pttl / 1000)
        time.sleep(0.03)
    assert ends, "the key was never seen"
    assert max(ends) <= 1.0 + 0.05, max(ends)  # PTTL is rounded to the ms; sampling takes time
    assert all(server.execute("EXISTS", lock.key) == 0 for server in nodes3)
    assert not lock.owned()
    with pytest.raises(LockLost):
        lock.release()


def test_signals_carry_name_fence_and_durations(nodes3: RedisNodes,
                                                make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    seen: list[tuple[str, dict[str, Any]]] = []

    def acquired(sender: Any, **kw: Any) -> None:
        seen.append(("acquired", kw))

    def released(sender: Any, **kw: Any) -> None:
        seen.append(("released", kw))

    signals.lock_acquired.connect(acquired)
    signals.lock_released.connect(released)
    try:
        with mgr.lock("sig") as held:
            pass
    finally:
        signals.lock_acquired.disconnect(acquired)
        signals.lock_released.disconnect(released)
    assert [kind for kind, _ in seen] == ["acquired", "released"]
    assert seen[0][1]["fence"] == held.fence and seen[0][1]["wait"] >= 0
    assert seen[1][1]["name"] == "sig" and seen[1][1]["held"] >= 0


def test_a_receiver_connected_after_sends_to_nobody_is_heard(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """The signals keep each sender's receivers (``use_caching``): a send
    while nobody listened remembers "no receiver", and a receiver connected
    later (for every sender, or for ``Lock`` only) must still be called; one
    disconnected, or collected, no more."""
    import gc

    from django_redlock.engine.lock import Lock

    mgr = make_manager(nodes3)
    with mgr.lock("cache-sig", auto_renew=False):  # sent to nobody (or the metrics)
        pass
    seen: list[str] = []

    def any_sender(sender: Any, **kw: Any) -> None:
        seen.append("any:" + kw["name"])

    def lock_only(sender: Any, **kw: Any) -> None:
        seen.append("lock:" + kw["name"])

    signals.lock_acquired.connect(any_sender)
    signals.lock_acquired.connect(lock_only, sender=Lock)
    try:
        with mgr.lock("cache-sig", auto_renew=False):
            pass
        assert seen == ["any:cache-sig", "lock:cache-sig"]
    finally:
        signals.lock_acquired.disconnect(any_sender)
    with mgr.lock("cache-sig", auto_renew=False):
        pass
    assert seen[2:] == ["lock:cache-sig"]
    del lock_only  # a weak receiver: collected, it is heard no more
    gc.collect()
    with mgr.lock("cache-sig", auto_renew=False):
        pass
    assert seen[3:] == []


def test_lock_extended_is_sent_for_extend_and_renewal_in_both_flavours(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Built only when a receiver is connected (the renewal path skips it
    otherwise): with one, every extension says so, by hand or renewed."""
    import asyncio

    from .polling import wait_until

    mgr = make_manager(nodes3)
    seen: list[tuple[str, float]] = []

    def extended(sender: Any, **kw: Any) -> None:
        seen.append((kw["name"], kw["ttl"]))

    signals.lock_extended.connect(extended)
    try:
        with mgr.lock("ext", ttl=5, auto_renew=False) as held:
            held.extend(7)
        assert seen == [("ext", 7.0)]

        async def by_hand() -> None:
            async with mgr.alock("aext", ttl=5, auto_renew=False) as aheld:
                await aheld.extend(6)

        asyncio.run(by_hand())
        assert seen[-1] == ("aext", 6.0)
        with mgr.lock("renewed", ttl=0.3):  # renewed every 0.1 s
            assert wait_until(lambda: ("renewed", 0.3) in seen, timeout=5.0)
    finally:
        signals.lock_extended.disconnect(extended)
    count = len(seen)
    with mgr.lock("quiet", ttl=5, auto_renew=False) as held:
        held.extend(7)
    assert len(seen) == count  # disconnected: nothing more


def test_scripts_reload_after_script_flush(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    with mgr.lock("warm"):
        pass
    for server in nodes3:
        server.client().script_flush()
    with mgr.lock("warm") as held:
        assert held.owned()


def test_threads_sharing_one_manager_are_mutually_excluded(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3, retry_delay=0.05)
    counter = nodes3[0].client()
    counter.set("counter", 0)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(25):
                with mgr.lock("counter-lock", timeout=20):
                    value = int(counter.get("counter"))
                    counter.set("counter", value + 1)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    run_in_threads(work, 6)
    assert not errors
    assert int(counter.get("counter")) == 150


WORKER = textwrap.dedent("""
    import sys
    from django.conf import settings
    settings.configure()
    import redis
    from django_redlock import LockManager
    urls = sys.argv[1].split(",")
    n = int(sys.argv[2])
    mgr = LockManager(urls, node_timeout=0.5, retry_delay=0.05)
    counter = redis.Redis.from_url(urls[0])
    for _ in range(n):
        with mgr.lock("xproc", timeout=30):
            value = int(counter.get("xproc-counter"))
            counter.set("xproc-counter", value + 1)
    mgr.close()
""")


@pytest.mark.slow
def test_mutual_exclusion_across_processes(nodes5: RedisNodes) -> None:
    """Four processes, a non-atomic read-modify-write under the lock: no lost update."""
    counter = nodes5[0].client()
    counter.set("xproc-counter", 0)
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, ",".join(nodes5.urls), "40"])
             for _ in range(4)]
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    assert int(counter.get("xproc-counter")) == 160


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork() with threads, Python 3.12+
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_forked_child_neither_owns_nor_renews(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    lock = mgr.lock("forked", ttl=0.6)
    lock.acquire()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            if lock.owned() or lock.validity != 0.0:
                code = 2
            try:
                lock.release()
                code = 3
            except LockNotOwned:
                pass
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    time.sleep(1.0)  # past the TTL: only the parent's renewal keeps it
    assert lock.owned() and lock.locked()
    lock.release()


def test_lock_objects_cannot_be_pickled(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    import pickle

    with pytest.raises(TypeError):
        pickle.dumps(make_manager(nodes3).lock("x"))


def test_bad_names_and_options_are_clear_errors(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    with pytest.raises(ValueError, match="control character"):
        mgr.lock("a\nb")
    with pytest.raises(ValueError, match="ttl"):
        mgr.lock("a", ttl=0)
    with pytest.raises(ValueError, match="timeout"):
        mgr.lock("a", timeout=-1)


def test_module_level_lock_uses_the_settings(session_nodes: RedisNodes) -> None:
    import django_redlock

    with django_redlock.lock("from-settings") as held:
        assert held.manager is django_redlock.get_manager()
        assert session_nodes[0].client().exists("redlock:from-settings")


def test_cache_alias_node_reuses_the_django_redis_pool(settings: Any,
                                                       session_nodes: RedisNodes) -> None:
    from django.core.cache import caches
    from django_redis import get_redis_connection

    import django_redlock

    settings.CACHES = {"default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": session_nodes[0].url,
        "OPTIONS": {"CLIENT_CLASS": "django_redis.client.DefaultClient"},
    }}
    settings.REDLOCK_NODES = ["cache:default"]
    try:
        mgr = django_redlock.get_manager()
        with django_redlock.lock("via-cache") as held:
            assert mgr.nodes[0].pool is get_redis_connection("default").connection_pool
            assert session_nodes[0].client().exists(held.key)
        mgr.close()  # must not disconnect the borrowed pool
        caches["default"].set("still", "works")
        assert caches["default"].get("still") == "works"
    finally:
        caches["default"].close()


def test_password_protected_nodes_and_no_password_in_errors(
        redis_nodes_factory: Callable[..., RedisNodes], make_manager: MakeManager) -> None:
    nodes = redis_nodes_factory(3, password="s3cret-pw")
    mgr = make_manager(nodes)
    assert all("s3cret-pw" not in node.name for node in mgr.nodes)
    with mgr.lock("auth") as held:
        assert held.owned()
    nodes[0].kill()
    nodes[1].kill()
    with pytest.raises(Exception) as info:
        mgr.lock("auth").acquire()
    assert "s3cret-pw" not in str(info.value) and "***" in str(info.value)


def test_a_server_that_quotes_the_password_in_its_error_is_reported_without_it(
        caplog: pytest.LogCaptureFixture, make_manager: MakeManager) -> None:
    """A server that does not know ``AUTH`` (renamed away, an old or a proxied
    one) answers the handshake with an error quoting its arguments: "unknown
    command 'AUTH', with args beginning with: '<password>'". That text used to
    reach ``QuorumUnavailable``, its ``errors`` and the logs as it came.
    (redis-py's asyncio client goes on after that error, so the asyncio
    flavour never sees it; every node failure's reason of either flavour is
    a ``NodeError``'s, which scrubs it.)"""
    from django_redlock import QuorumUnavailable
    from django_redlock.testing import RedisServer

    secret = "Qu0ted-Pw"
    with RedisServer(extra_args=("--rename-command", "AUTH", "")) as server:
        mgr = make_manager([f"redis://:{secret}@127.0.0.1:{server.port}/0"], node_timeout=0.2)
        with caplog.at_level(logging.DEBUG), pytest.raises(QuorumUnavailable) as info:
            mgr.lock("quoted", timeout=0.3).acquire()
    shown = str(info.value) + repr(info.value.errors) + caplog.text
    assert "AUTH" in shown  # the server's answer is there: the test drove the quoting
    assert secret not in shown and "***" in shown


def test_release_notices_a_loss_the_watchdog_did_not_see_yet(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr, operator = make_manager(nodes3), make_manager(nodes3)
    lost: list[str] = []

    def on_lost(sender: Any, **kwargs: Any) -> None:
        lost.append(kwargs["reason"])

    signals.lock_lost.connect(on_lost)
    try:
        with pytest.raises(LockLost, match="no longer had"):
            with mgr.lock("taken", ttl=30):  # next renewal in 10 s: too late to notice
                operator.force_release("taken")
                thief = operator.lock("taken")
                assert thief.acquire(timeout=0)
    finally:
        signals.lock_lost.disconnect(on_lost)
    assert lost and thief.owned()
    thief.release()


def test_release_channel_lingers_then_unsubscribes(nodes3: RedisNodes, make_manager: MakeManager,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from django_redlock.transport import notify

    monkeypatch.setattr(notify, "LINGER", 0.3)
    mgr = make_manager(nodes3)
    sub = mgr.notifier.subscribe(b"redlock:linger", confirm_timeout=1.0)
    sub.close()
    assert b"redlock:linger" in mgr.notifier._subs  # kept for the next waiter
    again = mgr.notifier.subscribe(b"redlock:linger", confirm_timeout=0.0)
    # Confirmed at once, with no SUBSCRIBE of its own: no new round trip.
    assert again.notifier._is_confirmed(b"redlock:linger")
    assert ("subscribe", b"redlock:linger") not in again.notifier._ops
    again.close()
    deadline = time.monotonic() + 3
    while b"redlock:linger" in mgr.notifier._subs and time.monotonic() < deadline:
        time.sleep(0.05)
    assert b"redlock:linger" not in mgr.notifier._subs


def test_listener_does_not_spin_with_a_dead_node_and_no_waiters(
        redis_nodes_factory: Callable[..., RedisNodes], make_manager: MakeManager,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from django_redlock.transport import notify

    monkeypatch.setattr(notify, "LINGER", 0.1)
    nodes = redis_nodes_factory(3)
    mgr = make_manager(nodes)
    mgr.notifier.subscribe(b"redlock:spin", confirm_timeout=1.0).close()
    nodes[0].kill()
    time.sleep(0.5)  # the channel expired; node 0's link is down
    cpu = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - cpu < 0.3


def test_releaser_steps_back_only_when_another_process_waits(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    releaser, other = make_manager(nodes3), make_manager(nodes3)  # two "processes"
    lock = releaser.lock("fair")
    lock.acquire()
    lock.release()
    assert releaser._handoff_pause(lock._key_b) == 0.0  # nobody waited
    lock.acquire()
    waiting = threading.Thread(target=lambda: other.lock("fair", timeout=5).acquire())
    waiting.start()
    deadline = time.monotonic() + 3
    while not other._notifier and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the waiter is subscribed
    lock.release()
    assert releaser._handoff_pause(lock._key_b) > 0.0  # it lets the woken waiter go first
    waiting.join(timeout=5)


def test_renewal_thread_does_not_wake_once_per_dropped_lock(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3, ttl=1.5)  # renewals due 0.5 s after each acquire
    watchdog = mgr.watchdog
    waits = [0]
    real_wait = watchdog._cond.wait

    def counting_wait(timeout: float | None = None) -> bool:
        waits[0] += 1
        return real_wait(timeout)

    watchdog._cond.wait = counting_wait  # type: ignore[method-assign]
    for _ in range(200):  # a loop that acquires, releases and drops its lock
        lock = mgr.lock("loop")
        lock.acquire()
        lock.release()
    del lock
    time.sleep(1.0)  # every renewal of the loop would have been due by now
    assert waits[0] < 20, f"the renewal thread woke {waits[0]} times for 200 dropped locks"
    assert not len(watchdog._queue)


def test_a_reused_lock_object_is_renewed_once_per_period(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """One ``Lock`` object acquired and released in a loop (a worker's job
    loop): each acquire queued a renewal entry and none was ever dropped, so
    an entry of an earlier hold fell due during a later hold, renewed it and
    queued itself again. After 20 cycles the lock was renewed 20 times per
    period (and 51 times after 51 cycles: without limit). An entry belongs to
    the hold that queued it; a later hold's tick drops it."""
    mgr = make_manager(nodes3, ttl=1.5)  # renewed every 0.5 s
    lock = mgr.lock("reused", ttl=1.5)
    for _ in range(20):  # well within the 0.5 s before the first entry falls due
        with lock:
            pass
    renewals: list[str] = []

    def extended(sender: Any, **kw: Any) -> None:
        if kw["name"] == "reused":
            renewals.append(kw["name"])

    signals.lock_extended.connect(extended)
    try:
        with lock:
            time.sleep(1.6)  # three renewal periods of this hold
            assert lock.owned()
    finally:
        signals.lock_extended.disconnect(extended)
    assert 2 <= len(renewals) <= 4, len(renewals)
    time.sleep(0.6)  # every entry of an earlier hold fell due: none is queued again
    assert not len(mgr.watchdog._queue)


def test_step_back_entries_of_keys_never_acquired_again_are_swept(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    from django_redlock.engine import manager as manager_module

    mgr = make_manager(nodes3)
    for i in range(manager_module._HANDOFF_KEYS_MAX * 3):
        mgr._note_release(b"redlock:key-%d" % i, woken=1)
        if i % 500 == 0:
            time.sleep(manager_module.HANDOFF_YIELD * 2)  # let earlier pauses run out
    assert len(mgr._handoff) <= manager_module._HANDOFF_KEYS_MAX + 500


def test_the_wake_up_flag_behaves_like_an_event_between_two_threads() -> None:
    from django_redlock.transport.notify import Flag

    flag = Flag()
    assert not flag.is_set()
    started = time.monotonic()
    assert flag.wait(0.05) is False  # nobody set it: the wait times out
    assert time.monotonic() - started >= 0.04
    setter = threading.Timer(0.05, flag.set)
    setter.start()
    assert flag.wait(5.0) is True  # woken by the other thread
    setter.join()
    assert flag.is_set() and flag.wait(0) is True  # stays set until cleared
    flag.set()  # setting twice is harmless
    flag.clear()
    assert not flag.is_set() and flag.wait(0.01) is False
    flag.clear()  # clearing twice too
    for _ in range(200):  # set and clear racing across threads never wedge it
        t = threading.Thread(target=flag.set)
        t.start()
        assert flag.wait(5.0)
        t.join()
        flag.clear()
    assert not flag.is_set()


def test_a_forked_child_exits_while_a_parent_thread_was_renewing(
        redis_nodes_factory: Callable[..., RedisNodes], fault_proxy_factory: Any,
        make_manager: MakeManager) -> None:
    """A parent thread is in ``extend()`` (holding the lock's ``_io``) when
    the process forks. The child's exit hook (gunicorn's worker exits through
    it) waited for that ``_io``, held by a thread that does not exist in the
    child: the child never exited. A parent's lock is skipped before its
    ``_io`` is looked at."""
    from django_redlock.engine.held import release_held_locks

    nodes = redis_nodes_factory(3)
    proxies = [fault_proxy_factory(server) for server in nodes]
    mgr = make_manager([p.url for p in proxies], node_timeout=2.0)
    lock = mgr.lock("fork-io", ttl=30, auto_renew=False)
    assert lock.acquire()
    for proxy in proxies:
        proxy.set_latency(0.3)
    extending = threading.Thread(target=lock.extend)
    extending.start()
    time.sleep(0.2)  # the thread is in its round, holding lock._io
    pid = os.fork()
    if pid == 0:  # child: what its exit hook does, then out (no pytest teardown here)
        try:
            release_held_locks()
        finally:
            os._exit(0)
    code = child_exit_code(pid, 10.0, "the forked child's exit hook (on the parent "
                                      "thread's lock)")
    extending.join(10)
    for proxy in proxies:
        proxy.set_latency(0.0)
    assert code == 0
    assert lock.owned()  # the parent's lock: untouched by the child
    lock.release()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork() with threads, Python 3.12+
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.parametrize("table", ["reentrant holds", "hand-off"])
def test_a_forked_child_acquires_while_a_parent_thread_held_a_manager_table(
        nodes3: RedisNodes, make_manager: MakeManager, table: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A parent thread is inside the manager's reentrant hold table (a
    reentrant join or leave, all in memory) or its hand-off table (a release
    stepping back) when the process forks. The child's copy of that table's
    lock stays held by a thread the child does not have: its first reentrant
    acquire, or its first release that woke a waiter, waited for ever (the
    acquire's timeout never applied: no I/O had begun)."""
    from django_redlock.engine import manager as manager_module

    monkeypatch.setattr(manager_module, "_HANDOFF_KEYS_MAX", 0)  # every release sweeps
    mgr = make_manager(nodes3.urls)
    guard = mgr._reentrant._guard if table == "reentrant holds" else mgr._handoff_lock
    inside, leave = threading.Event(), threading.Event()

    def hold_it() -> None:
        with guard:  # what the parent thread is doing at the fork
            inside.set()
            leave.wait(10)

    parent_thread = threading.Thread(target=hold_it)
    parent_thread.start()
    assert inside.wait(5)
    try:
        pid = os.fork()
        if pid == 0:  # child: no pytest teardown here
            code = 3
            try:
                if table == "reentrant holds":
                    lock = mgr.lock("fork-table", reentrant=True, ttl=5, auto_renew=False)
                    if lock.acquire(timeout=2):
                        lock.release()
                        code = 0
                else:
                    mgr._note_release(b"fork-table", 1)  # a release that woke a waiter
                    code = 0
            finally:
                os._exit(code)
        status = child_exit_code(pid, 10.0, f"the forked child (on the parent thread's "
                                            f"{table} table)")
    finally:
        leave.set()
        parent_thread.join(10)
    assert status == 0


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork() with threads, Python 3.12+
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_child_forked_during_a_renewal_round_neither_hangs_nor_owns(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """The renewal thread holds a lock's ``_io`` for its whole round, and a
    paused node stretches the round to the node timeout. A fork then copied
    ``_io`` held by a thread that does not exist in the child, and the child's
    ``release()``, ``extend()`` and ``acquire()`` on the inherited object waited
    for it forever. In the child they raise ``LockNotOwned`` (release, extend)
    or acquire anew (here: busy, the parent holds it), each at once."""
    mgr = make_manager(nodes3, node_timeout=0.5)
    lock = mgr.lock("fork-renewing", ttl=1.5)  # renewed every 0.5 s
    assert lock.acquire()
    nodes3[2].pause()  # each renewal round now waits 0.5 s for it
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # until a renewal round holds _io
            if not lock._io.acquire(blocking=False):
                break
            lock._io.release()
            time.sleep(0.001)
        else:
            pytest.fail("no renewal round was seen in flight")
        pid = os.fork()
        if pid == 0:  # child: no pytest teardown here
            code = 0
            try:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not a plugin's handler
                signal.alarm(5)  # a hang ends the child
                for call in (lock.release, lock.extend):
                    try:
                        call()
                        code = code or 2
                    except LockNotOwned:
                        pass
                if lock.owned() or lock.acquire(timeout=0):
                    code = code or 3  # the parent holds it
            except BaseException as exc:  # noqa: BLE001 - any failure is the child's exit code
                print(f"child: {exc!r}", file=sys.stderr, flush=True)
                code = code or 4
            finally:
                os._exit(code)
        started = time.monotonic()
        code = child_exit_code(pid, 10.0)
    finally:
        nodes3[2].resume()
    assert code != -signal.SIGALRM, "the child hung (its alarm went off)"
    assert code == 0
    assert time.monotonic() - started < 5
    assert lock.owned()  # the parent's: still renewed
    lock.release()


_HOLD_MANY_THEN_EXIT = textwrap.dedent("""
    import sys, time
    from django_redlock import LockManager
    import django_redlock.engine.held as held
    held.EXIT_BUDGET = float(sys.argv[2])
    mgr = LockManager(sys.argv[1].split(","), node_timeout=0.2, connect_timeout=0.5)
    locks = [mgr.lock(f"exit-{i}", ttl=30, auto_renew=False) for i in range(40)]
    assert all(lock.acquire() for lock in locks)
    print("held", flush=True)
    sys.stdin.readline()  # the parent cuts two nodes of three meanwhile
    print("exiting", flush=True)
    sys.exit(0)  # the exit hook releases what is held
""")


def test_the_exit_hook_is_bounded_whatever_the_number_of_held_locks(
        redis_nodes_factory: Callable[..., RedisNodes], fault_proxy_factory: Any) -> None:
    """Two nodes of three black-holed, 40 locks held: the exit hook released
    them one after the other, each round bounded by the node timeouts, and
    the whole took 16 s for 60 locks (28 s for 200), past a process
    manager's grace and into a SIGKILL. It stops at EXIT_BUDGET (1 s here);
    the rest expire with their leases."""
    nodes = redis_nodes_factory(3)
    proxies = [fault_proxy_factory(server) for server in nodes]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD_MANY_THEN_EXIT, ",".join(p.url for p in proxies), "1.0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "held"
        proxies[0].cut()
        proxies[1].cut()
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "exiting"
        started = time.monotonic()
        assert proc.wait(timeout=30) == 0
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
    # The budget, one release round past it, and the late-release flush (1 s).
    assert took < 1.0 + 1.5 + 1.0, took
