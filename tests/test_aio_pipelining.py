"""Settled asyncio rounds: the replies left behind, and what is sent behind them.

An asyncio round returns once its outcome is known; the slower nodes' replies
are read after it (by a task, or a reading stepped without one). A later request to such a node goes on the same
connection behind the reply still on its way (the same lock token's, to keep
its requests in order on the node; or anyone's, when the node has no idle
connection). One connection has one reader at a time: a request sent behind
another goes behind the *last* one sent there. Two requests chained behind the
same one read the connection together (``RuntimeError: read() called while
another coroutine is already waiting``, seen under a burst), and one of them
would take the other's reply.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from django_redlock.testing import FaultProxy, RedisNodes
from django_redlock.transport.resp import ACQUIRE, Command
from django_redlock.transport.sync import NOT_AWAITED, Settle
from tests.holding import lock_keys
from tests.polling import wait_until


def _never(reply: Any) -> bool:
    return False


def test_requests_sent_behind_one_reply_left_behind_are_read_in_turn(
        nodes3: RedisNodes, make_manager: Callable[..., Any],
        fault_proxy_factory: Callable[..., FaultProxy]) -> None:
    proxy = fault_proxy_factory(nodes3[0])
    mgr = make_manager([proxy.url, nodes3[1].url, nodes3[2].url], node_timeout=2.0)

    async def scenario() -> None:
        async with mgr.alock("warm"):
            pass  # one connection to each node, loaded
        transport = mgr._async_transport
        proxy.set_latency(0.3)
        echo = [Command(b"ECHO", b"slow-%d" % k) for k in range(4)]

        def ask(k: int) -> list[Any]:
            return [echo[k], Command(b"PING"), Command(b"PING")]

        settle = Settle(2, lambda r: r == b"PONG" or (isinstance(r, bytes)
                                                      and r.startswith(b"slow")), _never)
        # A: token T1; the slow node's reply is left behind.
        a = await transport.round(ask(0), tag="T1", settle=settle)
        assert a[0] is NOT_AWAITED and a[1:] == [b"PONG", b"PONG"], a
        slow = transport._loops[asyncio.get_running_loop()].nodes[0]
        # What reads each reply left behind there (a task, or the future of
        # a reading without one), taken as each round leaves it.
        left = {e.task for e in slow.behind}
        await asyncio.sleep(0.1)  # each reply comes 0.1 s after the one before
        # B: token T2; no idle connection to the slow node: sent behind A's.
        b = await transport.round(ask(1), tag="T2", settle=settle)
        assert b[0] is NOT_AWAITED, b
        left |= {e.task for e in slow.behind}
        await asyncio.sleep(0.1)
        # C: token T1 again: behind the last request on that connection (B's),
        # not beside B behind A's (then B and C would both read once A's reply
        # is in, before B's has come).
        c = await transport.round(ask(2), tag="T1", settle=settle)
        assert c[0] is NOT_AWAITED, c
        left |= {e.task for e in slow.behind}
        done, pending = await asyncio.wait(left, timeout=5)
        assert not pending
        errors = [t.exception() for t in done if not t.cancelled() and t.exception()]
        assert not errors, errors
        replies = sorted(t.result() for t in done if not t.cancelled()
                         and isinstance(t.result(), bytes))
        assert replies == [b"slow-0", b"slow-1", b"slow-2"], replies
        # D reads its own reply: every reply before it was read by its owner.
        proxy.set_latency(0.0)
        d = await transport.round(ask(3), tag="T1")
        assert d == [b"slow-3", b"PONG", b"PONG"], d

    asyncio.run(scenario())


def _slow_first(nodes3: RedisNodes, make_manager: Callable[..., Any],
                fault_proxy_factory: Callable[..., FaultProxy]) -> tuple[FaultProxy, Any]:
    """A manager on three nodes, the first behind a latency proxy (none yet)."""
    proxy = fault_proxy_factory(nodes3[0])
    return proxy, make_manager([proxy.url, nodes3[1].url, nodes3[2].url], node_timeout=2.0,
                               auto_renew=False)


async def _idle_then_slow(mgr: Any, proxy: FaultProxy, latency: float) -> None:
    """Connections opened and idle on every node; then node 0 slow."""
    async with mgr.alock("warm"):
        pass
    await asyncio.sleep(0.1)  # every reply read: each node's connection idle
    proxy.set_latency(latency)


def test_replies_left_behind_that_meet_a_flushed_script_cache_are_run_again(
        nodes3: RedisNodes, make_manager: Callable[..., Any],
        fault_proxy_factory: Callable[..., FaultProxy]) -> None:
    """Node 0 is slow, so no round waits for it, and its scripts were
    flushed; only the acquire script came back (another client loaded it).
    Each acquire runs there; each release, read late, answers ``NOSCRIPT``,
    and the next acquire was sent behind it on the same connection, so it
    cannot be sent again there (it would be read as that acquire's reply).
    It was dropped, which left the lock on node 0 for its whole lease: the
    release now goes again in a round of its own (the sync transport sends
    an owed release again too). Fences stay in order, and nothing is left
    on any node."""
    proxy, mgr = _slow_first(nodes3, make_manager, fault_proxy_factory)
    direct = nodes3[0].client()

    async def scenario() -> list[int]:
        async with mgr.alock("warm"):
            pass
        direct.script_flush()
        direct.script_load(ACQUIRE.source)
        proxy.set_latency(0.05)
        fences = []
        for _ in range(5):
            async with mgr.alock("flushed", ttl=30) as held:
                fences.append(held.fence)
        proxy.set_latency(0.0)
        await asyncio.sleep(0.3)  # node 0's late replies are in, and read
        return fences

    fences = asyncio.run(scenario())
    assert fences == sorted(fences) and len(set(fences)) == 5, fences
    assert wait_until(lambda: lock_keys(nodes3[0].url) == [], timeout=3.0), \
        f"a release never ran on node 0: {lock_keys(nodes3[0].url)}"


def test_a_reply_left_behind_whose_connection_a_loops_end_closed_says_nothing_of_its_node(
        nodes3: RedisNodes, make_manager: Callable[..., Any],
        fault_proxy_factory: Callable[..., FaultProxy]) -> None:
    """Node 0 is slow: an acquire's reply there is left behind (read on, no
    task), and the release goes behind it on the same connection, in a task
    that waits for it. The loop ends (``asyncio.run``): that task is
    cancelled and closes the connection, and the acquire's read fails. That
    failure is ours, not the node's: it marked node 0 failed, the next
    loop's rounds skipped it ("failed recently"), and a release there left
    the lock on node 0 for its whole lease (a multi-lock test saw it, 1 run
    in 9)."""
    proxy, mgr = _slow_first(nodes3, make_manager, fault_proxy_factory)

    async def first_loop() -> None:
        await _idle_then_slow(mgr, proxy, 0.3)
        lock = mgr.alock("left-behind", ttl=30)
        assert await lock.acquire(timeout=1)  # node 0's reply: left behind
        await lock.release()  # behind it on node 0, in a task
        # What asyncio.run does as the loop ends: every task cancelled (that
        # one closes the connection); then the loop runs on a little.
        loop = asyncio.get_running_loop()
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task() and task.get_loop() is loop:
                task.cancel()
        await asyncio.sleep(0.1)

    asyncio.run(first_loop())
    proxy.set_latency(0.0)
    assert mgr.nodes[0]._failures == 0

    async def second_loop() -> list[Any]:
        lock = mgr.alock("next", ttl=30)
        assert await lock.acquire(timeout=1)
        await lock.release()
        return [mgr.nodes[i].backing_off(mgr.clock()) for i in range(3)]

    assert asyncio.run(second_loop()) == [False, False, False]
    assert wait_until(lambda: lock_keys(nodes3[0].url) == [], timeout=3.0), \
        lock_keys(nodes3[0].url)


def test_a_connection_left_to_a_task_cancelled_before_it_ran_is_closed(
        nodes3: RedisNodes, make_manager: Callable[..., Any],
        fault_proxy_factory: Callable[..., FaultProxy]) -> None:
    """An acquire's reply on slow node 0 is left behind (read on, no task);
    the release goes behind it in a task, which the connection is left to
    once that reply is read. That task is cancelled before its first step
    (as ``asyncio.run``'s end cancels every task): its ``finally`` never
    runs, and nothing closed the connection; the garbage collector found it
    unclosed (``ResourceWarning``, the socket open until then; review of the
    readings, 2 runs in 10). The reading that ends after it closes it now."""
    import gc
    import warnings

    proxy, mgr = _slow_first(nodes3, make_manager, fault_proxy_factory)

    async def scenario() -> None:
        await _idle_then_slow(mgr, proxy, 0.2)
        lock = mgr.alock("orphan", ttl=30)
        assert await lock.acquire(timeout=1)  # node 0's reply: left behind
        release = asyncio.ensure_future(lock.release())
        await asyncio.sleep(0)  # the release's round sends behind node 0's reply, in a task
        left = [t for t in asyncio.all_tasks()
                if t is not asyncio.current_task() and t is not release]
        assert left, "no task was made for the request sent behind"
        for task in (*left, release):
            task.cancel()  # before their first step, as asyncio.run's end does
        await asyncio.sleep(0.5)  # node 0's reply comes and is read
        gc.collect()  # before the loop's end closes what it still knows of

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(scenario())
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == [], unclosed
