"""Settled asyncio rounds: the replies left behind, and what is sent behind them.

An asyncio round returns once its outcome is known; the slower nodes' replies
are read by tasks after it. A later request to such a node goes on the same
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

import redis

from django_redlock.testing import FaultProxy, RedisNodes
from django_redlock.transport.resp import ACQUIRE, Command
from django_redlock.transport.sync import NOT_AWAITED, Settle
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
        await asyncio.sleep(0.1)  # each reply comes 0.1 s after the one before
        # B: token T2; no idle connection to the slow node: sent behind A's.
        b = await transport.round(ask(1), tag="T2", settle=settle)
        assert b[0] is NOT_AWAITED, b
        await asyncio.sleep(0.1)
        # C: token T1 again: behind the last request on that connection (B's),
        # not beside B behind A's (then B and C would both read once A's reply
        # is in, before B's has come).
        c = await transport.round(ask(2), tag="T1", settle=settle)
        assert c[0] is NOT_AWAITED, c
        background = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        done, pending = await asyncio.wait(background, timeout=5)
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


def _lock_keys(url: str) -> list[bytes]:
    client = redis.Redis.from_url(url)
    try:
        return [k for k in client.keys("redlock:*") if not k.endswith(b":waiters")]
    finally:
        client.close()


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
    proxy = fault_proxy_factory(nodes3[0])
    mgr = make_manager([proxy.url, nodes3[1].url, nodes3[2].url], node_timeout=2.0,
                       auto_renew=False)
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
    assert wait_until(lambda: _lock_keys(nodes3[0].url) == [], timeout=3.0), \
        f"a release never ran on node 0: {_lock_keys(nodes3[0].url)}"
