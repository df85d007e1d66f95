"""What users get when nodes fail: one test per fault, each with its own nodes.

Kill (-9), pause (SIGSTOP), restart empty, slow link, partition, majority down,
and a holder paused past its lease. Every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any, Callable

import pytest

from django_redlock import LockLost, QuorumUnavailable, RedlockError
from django_redlock.core.owner import parse_value
from django_redlock.testing import FaultProxy, RedisNodes

pytestmark = pytest.mark.slow

NODE_TIMEOUT = 0.2
MakeManager = Callable[..., Any]


@pytest.fixture
def five(redis_nodes_factory: Callable[..., RedisNodes]) -> RedisNodes:
    return redis_nodes_factory(5)


@pytest.fixture
def three(redis_nodes_factory: Callable[..., RedisNodes]) -> RedisNodes:
    return redis_nodes_factory(3)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    result = fn()
    return result, time.monotonic() - started


@pytest.mark.parametrize("fault", ["kill", "pause"])
def test_minority_down_keeps_the_quorum(five: RedisNodes, make_manager: MakeManager,
                                        fault: str) -> None:
    mgr = make_manager(five, node_timeout=NODE_TIMEOUT)
    with mgr.lock("warm"):
        pass  # connections open to every node
    for server in five.servers[:2]:
        getattr(server, fault)()
    lock = mgr.lock("minority", ttl=5)
    ok, took = timed(lock.acquire)
    assert ok and lock.owned()
    assert took < 3 * NODE_TIMEOUT + 0.5
    assert lock.validity > 4
    _, took = timed(lock.release)
    assert took < 3 * NODE_TIMEOUT + 0.5
    # And again, now that the dead nodes are in back-off: still fine, and fast.
    with mgr.lock("minority") as again:
        assert again.fence > lock.fence


@pytest.mark.parametrize("fault", ["kill", "pause"])
def test_majority_down_is_a_clear_error_within_the_timeouts(
        five: RedisNodes, make_manager: MakeManager, fault: str) -> None:
    mgr = make_manager(five, node_timeout=NODE_TIMEOUT)
    with mgr.lock("warm"):
        pass
    for server in five.servers[:3]:
        getattr(server, fault)()
    lock = mgr.lock("majority", timeout=None)  # would wait forever if it were merely busy
    with pytest.raises(QuorumUnavailable) as info:
        timed(lock.acquire)
    error = info.value
    assert error.answered == 2 and error.needed == 3
    assert len(error.errors) == 3
    assert "2 of 5 nodes answered, 3 needed" in str(error)
    _, took = timed(lambda: pytest.raises(QuorumUnavailable, mgr.lock("majority").acquire))
    assert took < 3 * NODE_TIMEOUT + 0.5
    assert not lock.owned()
    # Nothing stays behind on the live nodes (released after the failed attempt).
    for server in five.servers[3:]:
        assert not server.client().exists(lock.key)


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_node_down_for_long_stays_a_node_down(
        three: RedisNodes, make_manager: MakeManager, flavour: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """A node down for a long time, tried about once a second, had failed 1,025
    times in a row after some 17 minutes: its back-off, doubled per failure,
    overflowed a float, and every call that asked it raised a bare
    ``OverflowError`` (the waiters' listener too, at each reconnect). The
    long outage is stood in for by its failure count; everything else is
    real: the other two nodes still make the quorum, and the node counts
    again once it is back."""
    import asyncio

    from tests.polling import wait_until

    # slow retries: only the release notice serves the waiter below in time
    mgr = make_manager(three, node_timeout=NODE_TIMEOUT, retry_delay=5.0)
    with mgr.lock("warm"):
        pass
    down = three.servers[2]
    down.kill()
    node = mgr.nodes[2]
    node._failures = 5_000  # about 83 minutes of one failed try a second
    node.down_until = 0.0  # its back-off is over: the next round asks it
    listener = mgr.notifier  # a waiter's listener, with the same long outage
    listener._links[2].failures = 5_000

    def once() -> None:
        if flavour == "sync":
            with mgr.lock("long-outage", timeout=1) as held:
                assert held.owned()
        else:
            async def scenario() -> None:
                async with mgr.alock("long-outage", timeout=1) as held:
                    assert held.owned()
            asyncio.run(scenario())

    once()  # asks the dead node: a failure more, counted, no OverflowError
    assert node._failures > 5_000 and node.down_until - time.monotonic() <= 1.0
    # A waiter listens for the release; the listener's link to the dead node
    # is due to reconnect at once, and fails again.
    import threading

    held = mgr.lock("waited", auto_renew=False)
    assert held.acquire()
    link = listener._links[2]
    link.next_connect = 0.0
    served: list[float] = []

    def wait() -> None:
        waiter = mgr.lock("waited", timeout=5, auto_renew=False)
        if waiter.acquire():
            served.append(time.monotonic())
            waiter.release()

    thread = threading.Thread(target=wait)
    thread.start()
    assert wait_until(lambda: link.failures > 5_000, timeout=3.0)  # tried, and counted
    released = time.monotonic()
    held.release()
    thread.join(timeout=6.0)
    assert served and served[0] - released < 1.0  # woken by the notice
    # ... and the listener's own thread, which (re)connects the links, lives on
    assert "release listener stopped" not in caplog.text
    assert link.next_connect > time.monotonic() - 2.0  # its next try is scheduled
    down.restart()

    def counts_again() -> bool:
        once()
        return node._failures == 0

    assert wait_until(counts_again, timeout=5.0)


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("link", ["healed", "distant"])
def test_one_slow_reply_with_a_minority_down_is_not_an_outage(
        three: RedisNodes, make_manager: MakeManager,
        fault_proxy_factory: Callable[..., FaultProxy], flavour: str, link: str) -> None:
    """Issue 25: one of three nodes is down, a second is slow for one reply.

    Timeline (node timeout 0.2 s)::

        t=0.00  round 1: node 0 refuses (down), node 2 grants, node 1's
                request sits in its link (0.5 s each way)
        t=0.10  the link is well again
        t=0.20  node 1 times out: 1 of 3 answered, 2 needed
        t=0.2x  round 2 (the caller may wait 5 s): nodes 1 and 2 grant

    Before the fix the call ended with QuorumUnavailable at t=0.2.

    ``distant``: the link heals to 60 ms each way, not to none. Node 1's
    connection was dropped at t=0.2, and its new one takes four round trips
    (two handshake steps, the scripts, round 1's clean-up), about 0.5 s,
    each step well within the node timeout; round 2 waits for it no longer
    than the node timeout. Before the fix every asyncio call ended with
    ``QuorumUnavailable`` ("no connection yet"), though both live nodes
    answered; the sync flavour's 5 times in 10 (round 1 ended the call:
    its clean-up waited 0.5 s for that connection, and a 0.7 s round counted
    as one that gave every node its chance). Now a node whose set-up answers
    is alive, and a round's length is its attempt's.
    """
    import asyncio
    import threading

    proxy = fault_proxy_factory(three[1])
    mgr = make_manager([three[0].url, proxy.url, three[2].url], node_timeout=NODE_TIMEOUT)
    with mgr.lock("warm"):
        pass
    three[0].kill()
    heal = threading.Timer(NODE_TIMEOUT / 2, proxy.set_latency,
                           (0.0 if link == "healed" else 0.06,))

    def slow_once(acquire: Callable[[], Any]) -> tuple[Any, float]:
        proxy.set_latency(0.5)
        heal.start()
        return timed(acquire)

    try:
        if flavour == "sync":
            lock = mgr.lock("one-slow", timeout=5)
            ok, took = slow_once(lock.acquire)
        else:
            lock = mgr.alock("one-slow", timeout=5)

            async def scenario() -> tuple[Any, float]:
                async with mgr.alock("warm"):  # this loop's connections, warm
                    pass
                started = time.monotonic()
                proxy.set_latency(0.5)
                heal.start()
                ok = await lock.acquire()
                return ok, time.monotonic() - started

            ok, took = asyncio.run(scenario())
    finally:
        heal.cancel()
        heal.join(5)
    assert ok and lock.owned()
    # distant: round 1, the new connection's four round trips, round 2's one
    assert took < 3 * NODE_TIMEOUT + 0.5 + (0.0 if link == "healed" else 5 * 0.12)
    assert three[2].client().exists(lock.key) and three[1].client().exists(lock.key)


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_node_whose_every_reply_is_late_is_not_asked_forever(
        three: RedisNodes, make_manager: MakeManager,
        fault_proxy_factory: Callable[..., FaultProxy], flavour: str) -> None:
    """The other side of the rule above: a node whose set-ups answer, each
    step well within the connect timeout, but whose every request comes back
    after the node timeout (150 ms each way, node timeout 0.2 s), with a
    second node down. Its set-ups' replies must not make it alive for the
    rounds it missed by a late reply, or the call would ask again until its
    timeout, every time: it ends with ``QuorumUnavailable`` after a few
    rounds, as with no set-up at all."""
    import asyncio

    proxy = fault_proxy_factory(three[1])
    mgr = make_manager([three[0].url, proxy.url, three[2].url], node_timeout=NODE_TIMEOUT)
    with mgr.lock("warm"):
        pass
    three[0].kill()
    proxy.set_latency(0.15)
    if flavour == "sync":
        lock = mgr.lock("always-late", timeout=30)
        _, took = timed(lambda: pytest.raises(QuorumUnavailable, lock.acquire))
    else:
        async def scenario() -> float:
            lock = mgr.alock("always-late", timeout=30)
            started = time.monotonic()
            with pytest.raises(QuorumUnavailable):
                await lock.acquire()
            return time.monotonic() - started

        took = asyncio.run(scenario())
    assert took < 10.0  # a few rounds and set-ups of 0.3 s a step, not the 30 s timeout


def test_busy_and_down_are_told_apart(three: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(three, node_timeout=NODE_TIMEOUT)
    holder = mgr.lock("apart")
    holder.acquire()
    assert mgr.lock("apart").acquire(timeout=0) is False  # busy: False, not an error
    three[0].kill()
    three[1].kill()
    with pytest.raises(QuorumUnavailable):
        mgr.lock("apart").acquire(timeout=0)
    assert isinstance(QuorumUnavailable("x"), RedlockError)


def test_single_node_down_is_a_redlock_error_not_a_hang(make_manager: MakeManager) -> None:
    mgr = make_manager(["redis://127.0.0.1:1/0"], node_timeout=NODE_TIMEOUT)
    _, took = timed(lambda: pytest.raises(QuorumUnavailable, mgr.lock("x", timeout=None).acquire))
    assert took < 1.0


def test_partitioned_node_behind_a_proxy(three: RedisNodes, make_manager: MakeManager,
                                         fault_proxy_factory: Callable[..., FaultProxy]) -> None:
    proxies = [fault_proxy_factory(server) for server in three]
    mgr = make_manager([p.url for p in proxies], node_timeout=NODE_TIMEOUT)
    with mgr.lock("warm"):
        pass
    proxies[0].cut()  # black hole: connects hang, nothing answers
    with mgr.lock("partition") as held:
        assert held.owned()
    proxies[1].cut()
    _, took = timed(lambda: pytest.raises(QuorumUnavailable, mgr.lock("partition").acquire))
    assert took < 4 * NODE_TIMEOUT + 0.5


def test_a_slow_node_does_not_delay_the_others(three: RedisNodes, make_manager: MakeManager,
                                               fault_proxy_factory: Callable[..., FaultProxy]) -> None:
    proxy = fault_proxy_factory(three[0])
    mgr = make_manager([proxy.url, three[1].url, three[2].url], node_timeout=NODE_TIMEOUT)
    with mgr.lock("warm"):
        pass
    proxy.set_latency(0.5)  # far beyond the node timeout
    lock = mgr.lock("slow", ttl=5)
    ok, took = timed(lock.acquire)
    assert ok
    # Asked in parallel: the slow node costs at most its timeout, not its latency.
    assert took < NODE_TIMEOUT + 0.3
    lock.release()


def test_node_restarted_empty_does_not_double_grant(three: RedisNodes,
                                                    make_manager: MakeManager) -> None:
    """One node restarted empty: its copy of the lock is gone, but a majority still
    has it, so nobody else gets the lock, and fences keep growing."""
    a, b = make_manager(three, node_timeout=NODE_TIMEOUT), make_manager(three, node_timeout=NODE_TIMEOUT)
    holder = a.lock("restart", ttl=5)
    holder.acquire()
    three[0].restart(empty=True)
    assert not three[0].client().exists(holder.key)
    contender = b.lock("restart")
    assert contender.acquire(timeout=0.3) is False
    assert not three[0].client().exists(holder.key)  # the contender's partial win was released
    holder.extend()  # two of three still have our key: enough
    holder.release()
    with b.lock("restart") as next_holder:
        assert next_holder.fence > holder.fence


def test_majority_restarted_empty_is_what_fencing_is_for(three: RedisNodes,
                                                         make_manager: MakeManager) -> None:
    """Without persistence, a majority restarted empty forgets the lock: a second
    client acquires while the first still thinks it holds it (SAFETY.md item 8).
    What the user gets: the newcomer's fence is higher, and the old holder learns
    of the loss at its next renewal."""
    a, b = make_manager(three, node_timeout=NODE_TIMEOUT), make_manager(three, node_timeout=NODE_TIMEOUT)
    with pytest.raises(LockLost):
        with a.lock("amnesia", ttl=0.9) as old:
            three[0].restart(empty=True)
            three[1].restart(empty=True)
            new = b.lock("amnesia")
            assert new.acquire(timeout=2)
            assert new.fence > old.fence
            deadline = time.monotonic() + 3
            while old.owned() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not old.owned()
    assert new.owned()
    new.release()


PAUSED_HOLDER = textwrap.dedent("""
    import sys, time
    from django.conf import settings
    settings.configure()
    from django_redlock import LockManager, LockLost
    mgr = LockManager(sys.argv[1].split(","), node_timeout=0.2)
    try:
        with mgr.lock("paused", ttl=0.8) as held:
            print("ACQUIRED", held.fence, flush=True)
            time.sleep(1.5)   # SIGSTOP lands here
            print("OWNED", held.owned(), flush=True)
        print("NO-ERROR", flush=True)
    except LockLost as e:
        print("LOCKLOST", flush=True)
    mgr.close()
""")


def test_holder_paused_past_its_lease(three: RedisNodes, make_manager: MakeManager) -> None:
    proc = subprocess.Popen([sys.executable, "-c", PAUSED_HOLDER, ",".join(three.urls)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("ACQUIRED"), line
        old_fence = int(line.split()[1])
        os.kill(proc.pid, signal.SIGSTOP)  # a GC pause, a frozen VM...
        try:
            mgr = make_manager(three, node_timeout=NODE_TIMEOUT)
            newer = mgr.lock("paused", timeout=5)
            assert newer.acquire()  # the paused holder's lease ran out
            assert newer.fence > old_fence
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "OWNED False" in out
    assert "LOCKLOST" in out and "NO-ERROR" not in out
    # The resumed holder's release left the new holder's key alone.
    assert newer.owned() and newer.locked()
    fences = []
    for server in three:
        raw = server.client().get(newer.key)
        # None: a node whose old lease had not run out yet said busy (its key
        # has expired since, so the node holds nothing now).
        stored = parse_value(raw) if raw is not None else None
        if stored is not None:
            assert stored.owner["pid"] == os.getpid()
            fences.append(stored.fence)
    assert len(fences) >= mgr.quorum
    # Each node issues its own fence; the holder's is the highest among the
    # grants that made its quorum (the round settles without the slowest node).
    assert newer.fence in fences and newer.fence >= sorted(fences)[-mgr.quorum]
    newer.release()


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_a_grant_that_arrives_after_the_timeout_is_cleaned_up(
        flavour: str, three: RedisNodes, make_manager: MakeManager) -> None:
    """Issue 17: two nodes paused while an attempt is on its way time out; the
    attempt fails (QuorumUnavailable). When they wake they run the request that
    was sent, and grant a lock nobody holds. The clean-up release must reach
    them (it waits for their connections' set-up, which the round could not)
    instead of leaving the key there for its whole TTL (30 s here)."""
    import asyncio

    from tests.polling import wait_until

    mgr = make_manager(three, node_timeout=NODE_TIMEOUT)

    async def attempt_async() -> None:
        async with mgr.alock("late-grant", ttl=30, timeout=0):
            pass

    def attempt() -> None:
        if flavour == "sync":
            mgr.lock("late-grant", ttl=30, timeout=0).acquire()
        else:
            asyncio.run(attempt_async())

    warm = mgr.lock("warm", auto_renew=False)
    assert warm.acquire(timeout=0)
    warm.release()
    three[0].pause()
    three[1].pause()
    try:
        with pytest.raises(QuorumUnavailable):
            attempt()
    finally:
        time.sleep(0.1)
        three[0].resume()
        three[1].resume()
    key = mgr.key("late-grant")
    assert wait_until(lambda: not any(node.execute("EXISTS", key) for node in three),
                      timeout=3.0), [node.execute("PTTL", key) for node in three]


def test_a_majority_answering_errors_is_quorum_unavailable_at_once(
        redis_nodes_factory: Any, make_manager: Any) -> None:
    """Two of three nodes are replicas (READONLY to every write): they answer,
    with an error, so the call ends at once, not at its 10 s timeout (a round
    missed while the nodes showed life is asked again only for want of time)."""
    nodes = redis_nodes_factory(3)
    for server in nodes.servers[1:]:
        server.client().replicaof("127.0.0.1", nodes.servers[0].port)
    mgr = make_manager(nodes, node_timeout=0.2)
    started = time.monotonic()
    with pytest.raises(QuorumUnavailable, match="read only replica"):
        mgr.lock("readonly", timeout=10).acquire()
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_a_node_slower_than_the_others_costs_a_round_nothing(
        flavour: str, three: RedisNodes, make_manager: MakeManager,
        fault_proxy_factory: Callable[..., FaultProxy]) -> None:
    """One node answers 0.6 s late, within its (long) node timeout: an acquire
    and a release are decided by the two others and return without it, in
    both flavours (issue 23: the asyncio round used to read every node in
    order, so it waited for the slow one). Its requests still run on it, in
    the order sent: after the release, no key is left there."""
    import asyncio

    proxy = fault_proxy_factory(three[0])
    mgr = make_manager([proxy.url, three[1].url, three[2].url], node_timeout=2.0)
    slow_node = three[0].client()

    async def hold_async(name: str) -> tuple[float, float]:
        async with mgr.alock("warm"):
            pass
        proxy.set_latency(0.6)
        lock = mgr.alock(name, ttl=10)
        started = time.monotonic()
        assert await lock.acquire(timeout=5)
        acquired = time.monotonic() - started
        started = time.monotonic()
        await lock.release()
        return acquired, time.monotonic() - started

    def hold_sync(name: str) -> tuple[float, float]:
        with mgr.lock("warm"):
            pass
        proxy.set_latency(0.6)
        lock = mgr.lock(name, ttl=10)
        acquired = timed(lambda: lock.acquire(timeout=5))[1]
        assert lock.owned()
        return acquired, timed(lock.release)[1]

    name = f"slow-{flavour}"
    acquired, released = asyncio.run(hold_async(name)) if flavour == "asyncio" \
        else hold_sync(name)
    assert acquired < 0.3, f"the acquire waited for the slow node ({acquired:.3f} s)"
    assert released < 0.3, f"the release waited for the slow node ({released:.3f} s)"
    key = mgr.lock(name).key
    # The slow node ran the acquire, then the release (in that order): no key left.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and slow_node.exists(key):
        time.sleep(0.05)
    assert not slow_node.exists(key), "the slow node kept a key nobody holds"


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("state", ["out-of-memory", "replicas"])
def test_an_error_reply_says_what_the_node_said_and_what_it_means(
        redis_nodes_factory: Any, make_manager: Any, state: str, flavour: str) -> None:
    """A node that answers with an error is not a node that did not answer:
    the message carries its reply, error code included, and what the code
    means for a lock. redis-py parses ``OOM ...`` and ``READONLY ...`` into
    their own exception classes and drops the code from the text, so the
    meaning was never given for them (only for codes redis-py leaves alone)."""
    import asyncio

    nodes = redis_nodes_factory(3)
    if state == "out-of-memory":
        for server in nodes.servers:
            server.client().config_set("maxmemory-policy", "noeviction")
            server.client().config_set("maxmemory", "1")
        said, means = "OOM command not allowed", "it is out of memory"
    else:
        for server in nodes.servers[1:]:
            server.client().replicaof("127.0.0.1", nodes.servers[0].port)
        said, means = "READONLY You can't write", "it is a read-only replica"
    mgr = make_manager(nodes, node_timeout=0.2)
    with pytest.raises(QuorumUnavailable) as info:
        if flavour == "sync":
            mgr.lock("error-reply", timeout=1).acquire()
        else:
            asyncio.run(mgr.alock("error-reply", timeout=1).acquire())
    message = str(info.value)
    assert said in message and means in message, message


def test_a_node_that_dies_after_running_an_acquire_gets_its_clean_up(
        redis_nodes_factory: Callable[..., RedisNodes], make_manager: MakeManager,
        fault_proxy_factory: Callable[..., FaultProxy]) -> None:
    """A node runs an acquire and its connection closes before the reply is
    read (it died, or was killed: a Sentinel master in the bench's failover).
    The round tries once more on a new connection, which is refused. The
    request must still count as sent, so the attempt's clean-up goes to the
    node (and, refused too, waits to be sent again): before, the round said
    "not sent", nothing was cleaned up, and the key blocked everyone for its
    whole lease once the node (or its promoted replica) was back. Schedule:
    the proxy delays each way by 0.3 s; it is stopped at 0.45 s, after the
    node ran the request and before its reply came back."""
    import threading

    from .polling import wait_until

    server = redis_nodes_factory(1)[0]
    proxy = fault_proxy_factory(server)
    port = proxy.port
    mgr = make_manager([proxy.url], node_timeout=2.0)
    with mgr.lock("warm"):
        pass  # a pooled connection: the next round reuses it
    proxy.set_latency(0.3)
    lock = mgr.lock("ran-then-died", ttl=30, auto_renew=False)
    stopper = threading.Timer(0.45, proxy.stop)
    stopper.start()
    try:
        with pytest.raises(QuorumUnavailable):
            lock.acquire(timeout=0)
    finally:
        stopper.join(5)
    assert server.execute("EXISTS", lock.key) == 1  # the node ran it: the schedule happened
    back = FaultProxy.for_server(server, listen_port=port).start()  # the node answers again
    try:
        # The clean-up arrives within seconds, not at the end of the 30 s lease.
        assert wait_until(lambda: server.execute("EXISTS", lock.key) == 0, timeout=5)
    finally:
        back.stop()
