"""The asyncio flavour against real nodes: AsyncLock, AsyncTransport, LockManager.alock.

Each test is a plain function that runs its scenario with ``asyncio.run`` (no
pytest-asyncio): a fresh event loop per test, which also exercises one manager
serving several loops. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio

from django_redlock import (
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    QuorumUnavailable,
    RedlockError,
    signals,
)
from django_redlock.aio import AsyncLock, alock
from django_redlock.core.owner import parse_value
from django_redlock.engine.lock import Lock
from django_redlock.testing import RedisNodes

from .polling import wait_until

MakeManager = Callable[..., Any]
NODE_TIMEOUT = 0.2


def holders(nodes: RedisNodes, key: str) -> int:
    return sum(server.client().exists(key) for server in nodes)


async def settled(nodes: RedisNodes, key: str, count: int) -> bool:
    """Whether ``count`` nodes hold ``key`` within a second: a round returns
    once its outcome is known (a quorum), and the last node's exchange may
    still be on its way (its task runs while this one waits: the loop is not
    blocked)."""
    deadline = time.monotonic() + 1.0
    while holders(nodes, key) != count:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def run(coro: Any, *, limit: float = 20.0) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, limit)

    return asyncio.run(bounded())


# -- basics ------------------------------------------------------------------------
def test_acquire_release_and_fences_grow(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)
    seen: list[tuple[str, Any, dict[str, Any]]] = []

    def on_signal(signal: Any, sender: Any, **kwargs: Any) -> None:
        seen.append((kwargs["name"], sender, kwargs))

    for sig in (signals.lock_acquired, signals.lock_released):
        sig.connect(on_signal, dispatch_uid="test_aio")

    async def scenario() -> list[int]:
        fences = []
        lock = mgr.alock("basic", ttl=5)
        assert isinstance(lock, AsyncLock) and lock.key == "redlock:basic" and lock.name == "basic"
        assert not lock.owned() and lock.validity == 0.0
        assert await lock.acquire()
        assert lock.owned() and 4 < lock.validity <= 5
        assert await lock.locked()
        assert await settled(nodes3, lock.key, 3)
        stored = [parse_value(server.client().get(lock.key)) for server in nodes3]
        # The max over the nodes that answered in time (a quorum at least).
        assert sum(v is not None and v.fence <= lock.fence for v in stored) >= 2
        await lock.extend(ttl=8)
        assert 7 < lock.validity <= 8
        fences.append(lock.fence)
        await lock.release()
        assert not lock.owned() and not await lock.locked()
        assert await settled(nodes3, lock.key, 0)
        for _ in range(3):
            async with mgr.alock("basic") as held:
                assert held.owned()
                fences.append(held.fence)
            assert not held.owned()
        return fences

    try:
        fences = run(scenario())
    finally:
        for sig in (signals.lock_acquired, signals.lock_released):
            sig.disconnect(dispatch_uid="test_aio")
    assert fences == sorted(fences) and len(set(fences)) == len(fences)
    kinds = [(name, sender) for name, sender, _ in seen]
    assert kinds == [("basic", Lock)] * 8  # sent like the sync lock's: sender=Lock
    assert isinstance(seen[0][2]["lock"], AsyncLock) and "wait" in seen[0][2]
    assert "held" in seen[1][2]


def test_mutual_exclusion_of_concurrent_tasks(nodes3: RedisNodes,
                                              make_manager: MakeManager) -> None:
    """20 tasks (two managers, as two clients) do a non-atomic read-modify-write."""
    managers = [make_manager(nodes3, retry_delay=0.05), make_manager(nodes3, retry_delay=0.05)]
    tasks_n = 20

    async def scenario() -> tuple[int, list[int]]:
        counter = redis.asyncio.Redis.from_url(nodes3[0].url)
        fences: list[int] = []
        inside = 0

        async def worker(i: int) -> None:
            nonlocal inside
            async with managers[i % 2].alock("counter", ttl=5, timeout=15) as held:
                inside += 1
                assert inside == 1
                value = int(await counter.get("test:counter") or 0)
                await asyncio.sleep(0.002)  # let the others try to get in
                await counter.set("test:counter", value + 1)
                fences.append(held.fence)
                inside -= 1

        try:
            await asyncio.gather(*(worker(i) for i in range(tasks_n)))
            return int(await counter.get("test:counter")), fences
        finally:
            await counter.aclose()

    total, fences = run(scenario(), limit=30)
    assert total == tasks_n
    assert fences == sorted(fences) and len(set(fences)) == tasks_n


def test_busy_lock_with_timeout_zero(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)

    async def scenario() -> None:
        async with mgr.alock("busy", ttl=5):
            other = mgr.alock("busy")
            started = time.monotonic()
            assert await other.acquire(timeout=0) is False
            assert not await other.acquire(blocking=False)
            assert time.monotonic() - started < 1.0
            assert 3 < other.retry_after <= 5
            with pytest.raises(LockNotAcquired) as info:
                async with mgr.alock("busy", timeout=0):
                    raise AssertionError("not reached")
            assert 3 < info.value.retry_after <= 5
            started = time.monotonic()
            assert not await mgr.alock("busy", timeout=0.3).acquire()
            assert 0.25 < time.monotonic() - started < 1.5

    run(scenario())


def test_blocked_waiter_is_woken_by_the_release(nodes3: RedisNodes,
                                                make_manager: MakeManager) -> None:
    """With a 5 s retry delay only the release notice can wake the waiter this fast."""
    holder_mgr = make_manager(nodes3, retry_delay=5)
    waiter_mgr = make_manager(nodes3, retry_delay=5)

    async def scenario() -> float:
        holder = holder_mgr.alock("wake", ttl=10)
        assert await holder.acquire()
        waiter = waiter_mgr.alock("wake", ttl=5, timeout=8)
        task = asyncio.ensure_future(waiter.acquire())
        await asyncio.sleep(0.5)  # the waiter failed, subscribed, and sleeps
        assert not task.done()
        released = time.monotonic()
        await holder.release()
        assert await task
        woke = time.monotonic() - released
        assert waiter.fence > holder.fence
        await waiter.release()
        return woke

    assert run(scenario()) < 1.0


# -- renewal and the blocked event loop ------------------------------------------------------
def test_renewal_keeps_a_short_lock(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)

    async def scenario() -> None:
        async with mgr.alock("renewed", ttl=1, auto_renew=True) as held:
            await asyncio.sleep(2.5)
            assert held.owned() and held.validity > 0.3
            assert all(server.client().pttl(held.key) > 300 for server in nodes3)
            timer = held._renewal_timer
            assert timer is not None and not timer.cancelled()  # the next renewal
        assert timer.cancelled() and held._renewal_timer is None  # none outlives release()
        assert held._renewal is None
        assert await settled(nodes3, held.key, 0)

    run(scenario())


def test_blocked_event_loop_loses_the_lock_and_says_so(nodes3: RedisNodes,
                                                       make_manager: MakeManager) -> None:
    """time.sleep() past the lease inside ``async with``: no renewal can run.

    Another client takes the lock meanwhile; the block's exit raises LockLost,
    judged from the monotonic clock, and leaves the new holder's key alone.
    """
    mgr = make_manager(nodes3)
    rival_mgr = make_manager(nodes3)
    rival: dict[str, Any] = {}
    lost: list[dict[str, Any]] = []

    def on_lost(signal: Any, sender: Any, **kwargs: Any) -> None:
        lost.append(kwargs)

    def take_over() -> None:
        lock = rival_mgr.lock("paused", ttl=10, timeout=5, auto_renew=False)
        rival["ok"] = lock.acquire()
        rival["lock"] = lock

    before: list[int] = []

    async def scenario() -> int:
        thread = threading.Thread(target=take_over)
        with pytest.raises(LockLost):
            async with mgr.alock("paused", ttl=1, auto_renew=True) as held:
                thread.start()
                time.sleep(2.0)  # blocks the event loop past the 1 s lease
                assert not held.owned() and held.validity == 0.0
                thread.join(5)  # the rival holds it now
                before.append(holders(nodes3, "redlock:paused"))
        return held.fence

    signals.lock_lost.connect(on_lost, dispatch_uid="test_aio_lost")
    try:
        fence = run(scenario())
    finally:
        signals.lock_lost.disconnect(dispatch_uid="test_aio_lost")
    assert rival["ok"] and rival["lock"].owned()
    assert rival["lock"].fence > fence
    # The rival holds a quorum (its round may settle on 2 of the 3 nodes, the
    # third busy with our expiring key or its reply not waited for), and our
    # release at the block's exit deleted none of its keys.
    assert before and before[0] >= 2
    assert holders(nodes3, "redlock:paused") >= before[0]
    assert len(lost) == 1 and lost[0]["name"] == "paused"
    rival["lock"].release()


def test_max_hold_caps_renewal(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)

    async def scenario() -> None:
        with pytest.raises(LockLost):
            async with mgr.alock("capped", ttl=0.6, max_hold=0.5, auto_renew=True) as held:
                await asyncio.sleep(1.0)
                assert not held.owned()  # renewed up to the cap, then let expire
        assert await settled(nodes3, held.key, 0)

    run(scenario())


def test_release_after_a_force_release_reports_the_loss(nodes3: RedisNodes,
                                                         make_manager: MakeManager) -> None:
    """Our clock still gives the lease time, but a majority no longer has our key."""
    mgr = make_manager(nodes3)

    async def scenario() -> None:
        with pytest.raises(LockLost, match="no longer had this holder's key"):
            async with mgr.alock("forced", ttl=10, auto_renew=False) as held:
                mgr.force_release("forced")
                assert held.owned()  # nothing told it yet

    run(scenario())


def test_a_lock_acquired_again_after_a_loss_has_one_renewal_chain(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """A hold that ended without ``release()`` (lost: an operator's force
    release, found by ``extend()``) left its renewal timer pending; the next
    acquire of the same object set a new one over it without cancelling it.
    The old timer then fired during the new hold, renewed it and set a timer
    of its own: two renewal chains, one more for every such cycle (here 4
    cycles: 5 chains, about 15 renewals where 3 were due). A timer belongs
    to the hold that set it."""
    mgr = make_manager(nodes3)
    renewals: list[float] = []

    def extended(sender: Any, **kw: Any) -> None:
        if kw["name"] == "relost":
            renewals.append(kw["ttl"])

    async def scenario() -> None:
        lock = mgr.alock("relost", ttl=1.5, auto_renew=True)  # renewed every 0.5 s
        for _ in range(4):
            assert await lock.acquire(timeout=1)
            mgr.force_release("relost")
            with pytest.raises(LockLost):
                await lock.extend()  # the hold ends here; its timer is still pending
        assert await lock.acquire(timeout=1)
        renewals.clear()
        await asyncio.sleep(1.6)  # three renewal periods of this hold
        assert lock.owned()
        count = len(renewals)
        await lock.release()
        await asyncio.sleep(0.6)  # no timer of any hold fires after the release
        assert count == len(renewals) and 2 <= count <= 4, (count, len(renewals))

    signals.lock_extended.connect(extended, dispatch_uid="test_aio_relost")
    try:
        run(scenario())
    finally:
        signals.lock_extended.disconnect(dispatch_uid="test_aio_relost")


# -- cancellation ----------------------------------------------------------------------------
def test_task_cancelled_inside_async_with_leaves_no_key(nodes3: RedisNodes,
                                                        make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)

    async def scenario() -> None:
        entered = asyncio.Event()
        lock = mgr.alock("cancelled", ttl=10)

        async def body() -> None:
            async with lock:
                entered.set()
                await asyncio.sleep(30)

        task = asyncio.ensure_future(body())
        await entered.wait()
        assert await settled(nodes3, lock.key, 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await settled(nodes3, lock.key, 0)
        assert not lock.owned() and lock._renewal is None and lock._renewal_timer is None

    run(scenario())


def test_cancelled_release_still_releases(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)

    async def scenario() -> None:
        lock = mgr.alock("cancel-release", ttl=10)
        assert await lock.acquire()
        task = asyncio.ensure_future(lock.release())
        await asyncio.sleep(0)  # release() started: its round is in flight
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await settled(nodes3, lock.key, 0)
        assert not lock.owned()
        with pytest.raises(LockNotOwned):
            await lock.release()

    run(scenario())


def test_cancelled_acquire_leaves_nothing_behind(nodes3: RedisNodes,
                                                 make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3, retry_delay=0.05)

    async def scenario() -> None:
        holder = mgr.alock("cancel-acquire", ttl=10)
        assert await holder.acquire()
        waiter = mgr.alock("cancel-acquire", timeout=None)
        task = asyncio.ensure_future(waiter.acquire())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await holder.release()
        # The waiter's subscription was closed (its channel may linger, empty).
        assert not any(mgr.notifier._subs.values())
        # Cancelled in the middle of a round: one node said yes, the two
        # others are silent (paused), so the round waits for them. What the
        # round set is taken back.
        quick = mgr.alock("cancel-acquire", timeout=None)
        nodes3[1].pause()
        nodes3[2].pause()
        try:
            task = asyncio.ensure_future(quick.acquire())
            await asyncio.sleep(0.15)
            assert not task.done()
            assert nodes3[0].client().exists(quick.key)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            nodes3[1].resume()
            nodes3[2].resume()
        assert not nodes3[0].client().exists(quick.key)
        # The paused nodes run what they were sent when they resume: the
        # acquire, then the release behind it: no key is left there either.
        assert wait_until(lambda: not nodes3[1].client().exists(quick.key)
                          and not nodes3[2].client().exists(quick.key), timeout=5)

    run(scenario())


def test_a_cancelled_acquires_take_back_is_sent_again_to_a_node_it_missed(
        nodes3: RedisNodes, make_manager: MakeManager,
        fault_proxy_factory: Callable[..., Any]) -> None:
    """An acquire cancelled mid-round takes back what the round may have set;
    that clean-up was sent once, and a node whose link was down when it
    arrived kept the key for the whole TTL (30 s here: with two nodes of
    three, the lock stayed busy for everyone). It goes to the late sender
    like any release, for as long as the key may be there::

        t=0.0   acquire() sent; nodes 1 and 2 are 0.6 s away (node 0 grants)
        t=0.3   the task is cancelled: the take-back is sent behind it
        t=0.6   the acquire reaches nodes 1 and 2: they set the key
        t=0.75  their links are cut: the take-back never arrives
        t=1.3   the take-back round gives up on them; the links heal later
    """
    latency = 0.6
    proxies = [fault_proxy_factory(server) for server in nodes3.servers[1:]]
    mgr = make_manager([nodes3[0].url, *(p.url for p in proxies)], node_timeout=1.0)
    landed: list[int] = []

    async def scenario() -> str:
        async with mgr.alock("warm", ttl=5):  # connections set up before the latency
            pass
        for proxy in proxies:
            proxy.set_latency(latency)
        lock = mgr.alock("take-back", ttl=30, timeout=0)
        task = asyncio.ensure_future(lock.acquire())
        await asyncio.sleep(0.3)
        task.cancel()  # the take-back is written behind the acquire
        await asyncio.sleep(0.45)  # the acquire reached nodes 1 and 2, the take-back not
        for proxy in proxies:
            await asyncio.to_thread(proxy.cut)
        landed.append(holders(nodes3, lock.key))
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not lock.owned()
        await asyncio.sleep(0.3)
        for proxy in proxies:
            await asyncio.to_thread(proxy.heal)
            proxy.set_latency(0)
        return lock.key

    key = run(scenario())
    assert landed and landed[0] >= 2  # the interleaving really happened
    assert wait_until(lambda: holders(nodes3, key) == 0, timeout=5.0), \
        f"{holders(nodes3, key)} nodes still hold the cancelled acquire's key"


# -- errors ----------------------------------------------------------------------------------
def test_release_and_extend_of_a_lock_not_held(nodes3: RedisNodes,
                                              make_manager: MakeManager) -> None:
    mgr = make_manager(nodes3)

    async def scenario() -> None:
        never = mgr.alock("mine")
        with pytest.raises(LockNotOwned):
            await never.release()
        with pytest.raises(LockNotOwned):
            await never.extend()
        async with mgr.alock("mine") as held:
            with pytest.raises(LockNotOwned):
                await mgr.alock("mine").release()  # another holder object: not its lock
            with pytest.raises(RedlockError):
                await held.acquire()  # not reentrant
            assert held.owned()
        with pytest.raises(LockNotOwned):
            await held.release()

    run(scenario())
    with pytest.raises(ValueError):
        mgr.alock("x", ttl=0)
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(mgr.alock("x"))


def test_minority_down_acquires_majority_down_is_a_clear_error(
        redis_nodes_factory: Callable[..., RedisNodes], make_manager: MakeManager) -> None:
    five = redis_nodes_factory(5)
    mgr = make_manager(five, node_timeout=NODE_TIMEOUT)

    async def scenario() -> None:
        async with mgr.alock("warm"):
            pass  # connections open to every node
        five[0].kill()
        five[1].pause()  # silent: its exchange must time out
        try:
            started = time.monotonic()
            lock = mgr.alock("minority", ttl=5)
            assert await lock.acquire(timeout=0)
            assert time.monotonic() - started < 2 * NODE_TIMEOUT + 0.5
            assert lock.validity > 4
            await lock.release()
            five[2].kill()
            started = time.monotonic()
            with pytest.raises(QuorumUnavailable) as info:
                await mgr.alock("majority", timeout=None).acquire()
            assert time.monotonic() - started < 2 * NODE_TIMEOUT + 0.5
            assert info.value.answered == 2 and info.value.needed == 3
            assert len(info.value.errors) == 3
        finally:
            five[1].resume()

    run(scenario())


# -- loops, settings, cache nodes --------------------------------------------------------------
def test_one_manager_serves_several_loops(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Sequential loops (asyncio.run) and a loop in another thread share one manager;
    each loop's connections are closed when that loop shuts down."""
    mgr = make_manager(nodes3)
    states: list[Any] = []

    async def once(name: str) -> int:
        async with mgr.alock(name) as held:
            states.append(mgr._async_transport._loops[asyncio.get_running_loop()])
            return held.fence

    fences = [asyncio.run(once("loops")), asyncio.run(once("loops"))]
    box: list[int] = []
    thread = threading.Thread(target=lambda: box.append(asyncio.run(once("loops"))))
    thread.start()
    thread.join(10)
    fences += box
    assert len(fences) == 3 and fences == sorted(fences)
    assert len({id(s) for s in states}) == 3
    for state in states:
        assert state.closed
        assert not any(conn.is_connected for node in state.nodes for conn in node.open)


def test_alock_from_settings(session_nodes: RedisNodes) -> None:
    async def scenario() -> None:
        async with alock("from-settings", ttl=5) as held:
            assert held.owned()
            assert await settled(session_nodes, "redlock:from-settings", 3)
        assert await settled(session_nodes, "redlock:from-settings", 0)

    run(scenario())


def test_cache_node_gets_an_asyncio_twin_of_the_cache_pool(
        nodes3: RedisNodes, make_manager: MakeManager, settings: Any) -> None:
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "locks": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": nodes3[0].url},
    }
    mgr = make_manager(["cache:locks", nodes3[1].url, nodes3[2].url])

    async def scenario() -> None:
        async with mgr.alock("via-cache", ttl=5) as held:
            assert await settled(nodes3, held.key, 3)
            assert held.fence > 0
        assert await settled(nodes3, held.key, 0)

    run(scenario())


def test_a_loop_per_call_reuses_connections(nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Issue 25: an async view under a WSGI server runs in a new event loop per
    request, and each request opened a connection to every node (202 new
    connections for 200 requests). The rounds of such loops now go through the
    process's shared (sync) connections."""
    mgr = make_manager(nodes3)

    def received() -> int:
        return sum(int(node.execute("INFO", "stats").split(b"total_connections_received:")[1]
                       .split(b"\r\n")[0]) for node in nodes3)

    async def request(k: int) -> None:
        async with mgr.alock(f"per-call:{k % 5}", timeout=5):
            pass

    before = received()
    for k in range(50):
        asyncio.run(request(k))  # a loop per request, shut down as asgiref does
    opened = received() - before
    # The first loops' connections, then the shared ones (3 nodes).
    assert opened <= 3 * (3 + 3), opened


# -- cost ----------------------------------------------------------------------------------------
def test_uncontended_acquire_release_waits_once_per_round_trip(
        redis_nodes_factory: Callable[..., RedisNodes], make_manager: MakeManager) -> None:
    """Issue 23: on 1 node, an acquire + release is two round trips, and the
    event loop turns twice for each (the reply's read event, then the task's
    wake-up): no turn to start a task for the release, or to hand its result
    back (it took 7 turns, 3 of them for the release's task)."""
    from tests.loopturns import alock_turns, turns_per_op

    mgr = make_manager(redis_nodes_factory(1))
    turns = alock_turns(mgr, "turns", count=20)
    assert turns <= 20 * turns_per_op() + 2, turns / 20


@pytest.mark.parametrize("count", [3, 5])
def test_a_settled_round_reads_its_replies_without_a_task_per_node(
        count: int, redis_nodes_factory: Callable[..., RedisNodes],
        make_manager: MakeManager) -> None:
    """Issue 23: a round over several nodes returns once its outcome is known
    and reads the other replies after it; it read each reply in a task of
    its own, 2 x ``count`` tasks per acquire + release (at 5 nodes, with
    ``asyncio.wait`` over them, half of the instructions). The replies are
    now read by steps run from the streams' own wake-ups. What is left is a
    task for a release sent behind an acquire's reply still on its way
    (timing: at most one per node), so the bound is ``count`` per operation,
    under the ``2 x count`` a task per node made."""
    mgr = make_manager(redis_nodes_factory(count), auto_renew=False)
    made = 0

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        nonlocal made
        made += 1
        return asyncio.Task(coro, loop=loop, **kwargs)

    async def ops(times: int) -> None:
        for _ in range(times):
            lock = mgr.alock("task-count", ttl=5)
            assert await lock.acquire(timeout=2)
            await lock.release()

    async def scenario() -> None:
        await ops(5)  # connections opened, scripts loaded
        asyncio.get_running_loop().set_task_factory(counting)
        await ops(40)

    asyncio.run(scenario())
    assert made <= 40 * count, made / 40


@pytest.mark.parametrize("count", [1, 3])
def test_a_cancelled_release_ends_within_the_node_timeout(
        redis_nodes_factory: Callable[..., RedisNodes], make_manager: MakeManager,
        count: int) -> None:
    """A release runs to its end when its task is cancelled (the cancellation
    waits for the round); with the nodes silent, the round still ends at the
    node timeout (1 node: the round reads the reply itself; 3: tasks read the
    replies), and what it sent runs when the nodes answer again."""
    three = redis_nodes_factory(count)
    mgr = make_manager(three, node_timeout=NODE_TIMEOUT)

    async def scenario() -> None:
        lock = mgr.alock("cancelled-silent", ttl=10)
        assert await lock.acquire()
        assert await settled(three, lock.key, count)
        for node in three:
            node.pause()
        try:
            started = time.monotonic()
            task = asyncio.ensure_future(lock.release())
            await asyncio.sleep(0.02)
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            took = time.monotonic() - started
            assert NODE_TIMEOUT - 0.05 < took < NODE_TIMEOUT + 0.5, took
        finally:
            for node in three:
                node.resume()
        assert not lock.owned()
        # The nodes run the release they were sent once they resume.
        assert wait_until(lambda: holders(three, lock.key) == 0, timeout=5)

    run(scenario())


def test_requests_skip_redis_py_layers_only_on_its_own_connection_classes() -> None:
    """The rounds write to the stream and read from the parser of redis-py's
    connection classes directly; a class that overrides its send or read
    (a connection_class of the user's) is used through them."""
    import redis.asyncio.connection as aconn

    from django_redlock.transport.aio import _direct

    class Logged(aconn.Connection):
        async def read_response(self, *args: Any, **kwargs: Any) -> Any:
            return await super().read_response(*args, **kwargs)

    assert _direct(aconn.Connection())
    assert _direct(aconn.SSLConnection())
    assert _direct(aconn.UnixDomainSocketConnection(path="/nonexistent"))
    assert not _direct(Logged())


def test_a_blocked_loop_does_not_take_a_node_that_answered_for_a_failed_one(
        redis_nodes_factory: Callable[..., RedisNodes], fault_proxy_factory: Any,
        make_manager: Any) -> None:
    """One node 20 ms away: a release settles on the two near ones and reads
    the far one's reply in the background. The loop is then blocked for 0.3 s
    (a synchronous call in a coroutine), longer than the node timeout, and
    the reply comes meanwhile. The deadline's timer ran before the task that
    reads the reply, aborted the connection and counted the node failed: with
    a second node down, an acquire failed with a quorum up (a review saw 5 of
    40). A reply already here is read: no node is counted failed."""
    nodes = redis_nodes_factory(3)
    proxy = fault_proxy_factory(nodes[2])
    proxy.set_latency(0.02)
    mgr = make_manager([nodes.urls[0], nodes.urls[1], proxy.url], node_timeout=0.2)

    async def scenario() -> None:
        for i in range(5):
            lock = mgr.alock(f"blocked-{i}", ttl=5)
            assert await lock.acquire(timeout=2)
            await lock.release()
            time.sleep(0.3)  # the loop is blocked; the far node's reply comes meanwhile
            await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert [node.errors for node in mgr.nodes] == [0, 0, 0]


# Closing a loop with its transports open is the pattern under test: asyncio
# itself warns about each transport collected with it.
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_loops_closed_without_shutting_down_leave_no_sockets_behind(
        nodes3: RedisNodes, make_manager: Any) -> None:
    """``loop.run_until_complete(...)`` then ``loop.close()``, without
    ``shutdown_asyncgens()``: the reading tasks a settled round left in such a
    loop never finish, and each kept the loop, its selector and a
    connection. A thousand such loops held 567 file descriptors, and under a
    limit of 1,024 every call failed with all nodes up. Such a loop now
    counts as ended, and after PER_CALL_LOOPS of them the next loops' rounds
    go through the sync transport, which leaves no task behind."""
    import gc
    import os

    from django_redlock.transport import aio as transport_aio

    mgr = make_manager(nodes3, node_timeout=0.5)

    async def call(i: int) -> None:
        lock = mgr.alock(f"closed-loop-{i % 7}", ttl=5)
        assert await lock.acquire(timeout=2)
        await lock.release()

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    call_loop = asyncio.new_event_loop()  # one first: the manager's own sockets
    call_loop.run_until_complete(call(0))
    call_loop.close()
    gc.collect()
    before = fds()
    for i in range(300):
        loop = asyncio.new_event_loop()
        loop.run_until_complete(call(i))
        loop.close()
    gc.collect()
    left = [t for t in transport_aio._background if t.get_loop().is_closed()]
    assert len(left) <= 2 * 3, len(left)  # at most the first loops' (3 nodes each)
    assert fds() - before < 20, fds() - before
