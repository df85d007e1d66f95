"""A release (or a lost attempt's clean-up) that failed on a node is sent again
until the node answers or the lease has ended (engine/leftovers.py), on real
servers: the lock is free once the node is back, not a whole lease later; a
node that stays down costs one try per pause; and a release sent late never
deletes a later holder's key. (The Sentinel failover case, where the promoted
replica has the key, is in test_sentinel_node.py.) Every wait is bounded."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Iterator

import pytest

from django_redlock.engine import leftovers
from django_redlock.engine.leftovers import failed_requests
from django_redlock.testing import RedisServer
from django_redlock.transport.sync import NOT_AWAITED, NodeError

from .polling import wait_until

MakeManager = Callable[..., Any]
LEASE = 30.0  # far longer than any wait below: a key that expires does not pass


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as node:
        yield node


def counted(mgr: Any) -> list[int]:
    """Count the late sender's rounds (the real transport round, wrapped)."""
    calls = [0]
    real = mgr.transport.round

    def send(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    mgr._send_later([None], [None], 1.0)  # nothing failed: nothing made
    assert mgr._leftovers is None
    mgr._leftovers = leftovers.Leftovers(send, len(mgr.nodes), mgr.clock)
    return calls


def test_only_failed_requests_are_sent_again() -> None:
    a, b, c, d = object(), object(), object(), object()
    replies = [1, NodeError("n2", "no answer"), NOT_AWAITED, RuntimeError("READONLY")]
    assert failed_requests([a, b, c, d], replies) == [None, b, None, d]
    assert failed_requests([a, None], [1, NodeError("n", "skipped", sent=False)]) is None
    assert failed_requests([a, b], [0, 1]) is None


def test_a_lost_attempts_clean_up_is_sent_again_for_its_lease() -> None:
    """The clean-up after a lost attempt asks the driver to send it again
    where it fails (``Ask.redo``: the attempt's TTL); a release too."""
    from django_redlock.engine.rounds import acquire_steps, release_steps

    from .test_core import _Ctx3GateDown

    steps = acquire_steps(_Ctx3GateDown(), b"redlock:c", b"f", b"w", "tok", 7000, "{}", True,
                          7.0, lock_name="c", attempt=1)
    ask = next(steps)
    assert ask.redo == 0.0  # the attempt itself is not sent again
    # one grant, one busy, one silent after its request left: lost
    cleanup = steps.send([[1, 5], [0, 900], NodeError("n3", "no answer in time")])
    assert cleanup.redo == 7.0
    assert cleanup.requests[1] is None and cleanup.requests[0] is not None \
        and cleanup.requests[2] is not None
    release = next(release_steps(_Ctx3GateDown(), b"redlock:c", b"f", b"w", "tok", 5,
                                 redo=12.5))
    assert release.redo == 12.5


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_release_the_node_missed_is_sent_again_when_it_is_back(
        server: RedisServer, make_manager: MakeManager, flavour: str) -> None:
    """One node, restarted with its data (``SAVE``, then a crash):

        A holds (30 s lease); the node saves and dies
        A releases: no answer, A's key is in the node's dump
        the node is back with A's key
        before: everyone is refused (busy) until A's lease ends, 30 s
        now: A's release is sent again and the lock is free at once"""
    holder = make_manager([server.url])
    other = make_manager([server.url])
    if flavour == "sync":
        lock = holder.lock("left", ttl=LEASE, auto_renew=False)
        assert lock.acquire()
    else:
        lock = holder.alock("left", ttl=LEASE, auto_renew=False)
        assert asyncio.run(lock.acquire())
    server.execute("SAVE")
    server.kill()
    if flavour == "sync":
        lock.release()  # confirmed by no node: logged, not raised
    else:
        asyncio.run(lock.release())
    assert holder._leftovers.waiting() == 1
    server.restart(empty=False)  # from its dump: A's key is back
    assert server.execute("EXISTS", lock.key) == 1
    back = time.monotonic()
    assert wait_until(lambda: server.execute("EXISTS", lock.key) == 0, timeout=5.0), \
        "the release was not sent again"
    # popped once its reply is read, a moment after the node deleted the key
    assert wait_until(lambda: holder._leftovers.waiting() == 0, timeout=5.0)
    taken = other.lock("left", timeout=2, auto_renew=False)
    assert taken.acquire()
    assert time.monotonic() - back < 5.0  # not the 30 s lease
    taken.release()


def test_a_node_that_stays_down_costs_one_try_per_pause(
        server: RedisServer, make_manager: MakeManager) -> None:
    """200 releases wait for one dead node: they are tried one at a time at
    growing pauses, not 200 at a time; once it answers, all go through."""
    holder = make_manager([server.url])
    calls = counted(holder)
    locks = [holder.lock(f"many:{i}", ttl=LEASE, auto_renew=False) for i in range(200)]
    for lock in locks:
        assert lock.acquire()
    server.execute("SAVE")
    server.kill()
    for lock in locks:
        lock.release()
    assert holder._leftovers.waiting() == 200
    time.sleep(2.0)  # tries at about 0.1, 0.3, 0.7, 1.5 s
    assert 2 <= calls[0] <= 6, calls[0]
    server.restart(empty=False)
    assert server.execute("DBSIZE") >= 200  # the keys (and fence counters) are back
    assert wait_until(lambda: holder._leftovers.waiting() == 0, timeout=5.0)
    assert all(server.execute("EXISTS", lock.key) == 0 for lock in locks)


def test_at_most_max_pending_releases_wait_per_node_and_the_oldest_go(
        server: RedisServer, make_manager: MakeManager, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The bound the safety page gives ("at most 10,000 wait per node, and the
    oldest are dropped beyond that"), with a bound of 5: 8 releases miss a
    dead node; 5 wait, the 3 oldest are dropped (said once in the log); once
    the node is back (with its data) the 5 newest keys are deleted and the 3
    oldest stay until their leases end."""
    monkeypatch.setattr(leftovers, "MAX_PENDING", 5)
    holder = make_manager([server.url])
    locks = [holder.lock(f"bounded:{i}", ttl=LEASE, auto_renew=False) for i in range(8)]
    for lock in locks:
        assert lock.acquire()
    server.execute("SAVE")
    server.kill()
    with caplog.at_level("WARNING", logger="django_redlock"):
        for lock in locks:
            lock.release()  # confirmed by no node: logged, not raised
    assert holder._leftovers.waiting() == 5
    assert sum("the oldest are dropped" in r.getMessage() for r in caplog.records) == 1
    server.restart(empty=False)  # every key is back from the dump
    assert wait_until(lambda: holder._leftovers.waiting() == 0, timeout=5.0)
    kept = [server.execute("EXISTS", lock.key) for lock in locks]
    assert kept == [1, 1, 1, 0, 0, 0, 0, 0], kept
    assert all(server.execute("PTTL", lock.key) > 20_000 for lock in locks[:3])


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_missed_release_is_sent_again_while_an_extension_keeps_the_key(
        server: RedisServer, make_manager: MakeManager, flavour: str) -> None:
    """A renewal after ``extend(30)`` brings the holder's validity back to the
    TTL, but the node keeps the 30 s lease (a lease is never shortened)::

        A holds (ttl 1 s, renewed), extends to 30 s, is renewed again
        the node saves and dies; A releases: no answer
        the node is back 2 s later with A's key (about 27 s left)
        before: the release was sent again for the TTL only (1 s): given
                up, and the lock busy for 27 s
        now: sent again as long as the node may have the key"""
    holder = make_manager([server.url])

    def renewed_then_node_dies(lock: Any) -> None:
        assert server.execute("PTTL", lock.key) > 25_000
        assert lock.validity < 2.0  # a renewal (every ttl/3) brought it back to the TTL
        server.execute("SAVE")
        server.kill()

    if flavour == "sync":
        lock = holder.lock("extended-left", ttl=1.0)
        assert lock.acquire()
        lock.extend(30)
        time.sleep(0.6)
        renewed_then_node_dies(lock)
        lock.release()  # confirmed by no node: logged, not raised
    else:
        lock = holder.alock("extended-left", ttl=1.0)

        async def hold() -> None:  # one loop: its renewals run on it
            assert await lock.acquire()
            await lock.extend(30)
            await asyncio.sleep(0.6)
            renewed_then_node_dies(lock)
            await lock.release()

        asyncio.run(hold())
    time.sleep(2.0)  # longer than the TTL
    server.restart(empty=False)  # from its dump: A's key is back
    assert server.execute("PTTL", lock.key) > 20_000
    assert wait_until(lambda: server.execute("EXISTS", lock.key) == 0, timeout=8.0), \
        "the release was given up after the TTL while the node kept the extended key"


def test_a_release_sent_late_never_deletes_a_later_holders_key(
        server: RedisServer, make_manager: MakeManager) -> None:
    """The node comes back empty and B takes the lock before A's release is
    sent again: that release finds B's key, not A's, and leaves it."""
    a = make_manager([server.url])
    b = make_manager([server.url])
    lock = a.lock("late", ttl=LEASE, auto_renew=False)
    assert lock.acquire()
    server.kill()
    lock.release()
    assert a._leftovers.waiting() == 1
    # The worst order, made sure of: the late sender waits for its lock
    # (a Condition's RLock: this thread may take it again) while the node
    # comes back empty and B takes the lock.
    with a._leftovers._cond:
        server.restart()  # empty
        taken = b.lock("late", timeout=2, auto_renew=False)
        assert taken.acquire()
        assert a._leftovers.waiting() == 1  # A's release is still to be sent
    assert wait_until(lambda: a._leftovers.waiting() == 0, timeout=5.0)
    assert server.execute("EXISTS", taken.key) == 1
    assert taken.owned()
    taken.release()  # no LockLost: B held it to the end
