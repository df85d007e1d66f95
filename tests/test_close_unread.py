"""A connection closed with replies unread in it still delivers what was written on it.

A settled round leaves a slow node's reply *owed* on its connection
(transport/sync.py), and a release may be written behind it. When that
connection is then closed (``manager.close()``, a retired manager closed by
``conf``, an owed connection dropped), the reply may already sit unread in
our receive buffer, and Linux then ends the connection with a RST, not a
FIN. The worry: a RST makes the node's kernel throw away the release it
received but redis-server has not read yet (the node is busy)::

    t0  node 3 busy (SIGSTOP, or another client's DEBUG SLEEP)
    t1  acquire settles on nodes 1 and 2; node 3's reply is owed
    t2  node 3 answers it: 28 bytes wait unread in our socket
    t3  node 3 busy again; the release is written behind (not read by it)
    t4  manager.close(): close() with unread bytes sends a RST
    t5  node 3 wakes up: does it still run the release?

It does: the node's kernel keeps the bytes it had received and acknowledged
readable after a RST, and redis-server reads (and runs) them before it sees
the reset. What a RST throws away is the closing side's own unsent or
unacknowledged bytes; a request written in full has left by then on
loopback, so a release written before the close lands, however the close
ends the connection, and the library need not drain a connection before
closing it. These tests keep that guarantee: they make sure the RST case happens
(bytes unread at the close) and that the release still lands on node 3,
while a lock that was not released keeps its key there (what a lost release
would look like). Sync (redis-py's ``disconnect()``: ``shutdown()``, then
``close()``: a FIN and a RST) and asyncio (the transport's ``close()`` or
``abort()``: a bare RST). Every close path of both transports (a manager
closed by its owner, by ``conf`` once retired, or by the exit hook; an owed
connection dropped as overdue; a timed-out read; a deadline's abort) ends in
one of these two.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any, Callable, Iterator

import pytest

from django_redlock.testing import RedisNodes, RedisServer
from django_redlock.transport.sync import unread_bytes
from tests.polling import wait_until

MakeManager = Callable[..., Any]

pytestmark = pytest.mark.slow

#: How long another client's ``DEBUG SLEEP`` keeps node 3 busy: long enough
#: that the release and the close happen inside it on a loaded machine.
BUSY_SECONDS = 1.0


def _nodes(redis_nodes_factory: Callable[..., RedisNodes], busy: str) -> RedisNodes:
    if busy != "debug-sleep":
        return redis_nodes_factory(3)
    try:  # DEBUG is refused by default since Redis 7; older servers lack the option
        return redis_nodes_factory(3, extra_args=("--enable-debug-command", "yes"))
    except RuntimeError as e:
        pytest.skip(f"no --enable-debug-command: {e}")


@contextlib.contextmanager
def _node_busy(server: RedisServer, busy: str) -> Iterator[Callable[[], bool]]:
    """``server`` reads no request inside the block; yields ``still_busy()``,
    True while it has certainly not read anything new yet."""
    if busy == "pause":
        server.pause()
        try:
            yield lambda: server.paused
        finally:
            server.resume()
        return
    sleeper = socket.create_connection((server.host, server.port), timeout=5.0)
    try:
        sleeper.sendall(b"*3\r\n$5\r\nDEBUG\r\n$5\r\nSLEEP\r\n$3\r\n%.1f\r\n" % BUSY_SECONDS)
        # The server is in the sleep once it no longer answers another client.
        with socket.create_connection((server.host, server.port), timeout=5.0) as probe:
            probe.settimeout(0.05)
            answered = True
            for _ in range(20):  # bounded: 20 PINGs of 50 ms
                probe.sendall(b"PING\r\n")
                try:
                    probe.recv(16)
                except TimeoutError:
                    answered = False
                    break
            assert not answered, "DEBUG SLEEP did not make the node busy"
        yield lambda: unread_bytes(sleeper) == 0  # its +OK comes when it wakes
        sleeper.settimeout(BUSY_SECONDS + 5.0)
        assert sleeper.recv(16) == b"+OK\r\n"
    finally:
        sleeper.close()


def _exists(server: RedisServer, key: bytes) -> int:
    client = server.client()
    try:
        return int(client.exists(key))
    finally:
        client.close()


def _hold_a_control_lock(make_manager: MakeManager, nodes: RedisNodes) -> bytes:
    """A lock of another manager, held and never released: its key on node 3
    is what a release that never arrived leaves there."""
    kept = make_manager(nodes, node_timeout=0.5, auto_renew=False).lock(
        "close-unread:kept", ttl=30)
    assert kept.acquire(timeout=0)
    key: bytes = kept._key_b
    assert wait_until(lambda: _exists(nodes[2], key) == 1, timeout=3.0)
    return key


@pytest.mark.parametrize("busy", ["pause", "debug-sleep"])
def test_a_release_written_before_a_close_with_unread_replies_lands(
        redis_nodes_factory: Callable[..., RedisNodes], make_manager: MakeManager,
        busy: str) -> None:
    nodes = _nodes(redis_nodes_factory, busy)
    node3 = nodes[2]
    kept = _hold_a_control_lock(make_manager, nodes)
    mgr = make_manager(nodes, node_timeout=0.5, auto_renew=False)
    with mgr.lock("warm"):
        pass
    lock = mgr.lock("close-unread:released", ttl=30)
    node3.pause()
    try:
        assert lock.acquire(timeout=0)  # settled on nodes 1 and 2
    finally:
        node3.resume()
    (owed,) = mgr.nodes[2]._owed
    sock = owed.conn._sock
    assert wait_until(lambda: unread_bytes(sock) > 0, timeout=3.0)  # node 3's late grant
    assert _exists(node3, lock._key_b) == 1  # which the release must now undo
    with _node_busy(node3, busy) as still_busy:
        lock._release_unawaited()  # written behind the unread reply, not read by node 3
        (owed,) = mgr.nodes[2]._owed
        assert owed.conn._sock is sock and len(owed.expect) == 2
        assert unread_bytes(sock) > 0  # so close() sends a RST, not a FIN
        mgr.close()
        assert still_busy(), "node 3 read the release before the close: nothing tested"
    assert wait_until(lambda: _exists(node3, lock._key_b) == 0, timeout=3.0)
    assert _exists(node3, kept) == 1


@pytest.mark.parametrize("busy", ["pause", "debug-sleep"])
def test_a_release_written_before_an_aclose_with_unread_replies_lands(
        redis_nodes_factory: Callable[..., RedisNodes], make_manager: MakeManager,
        busy: str) -> None:
    nodes = _nodes(redis_nodes_factory, busy)
    node3 = nodes[2]
    kept = _hold_a_control_lock(make_manager, nodes)
    mgr = make_manager(nodes, node_timeout=0.5, auto_renew=False)

    async def scenario() -> bytes:
        async with mgr.alock("warm"):
            pass
        state = mgr._async_transport._loops[asyncio.get_running_loop()]
        on_node3 = state.nodes[2]
        for _ in range(100):  # bounded: the warm-up's replies read, 1 s at most
            if on_node3.open and set(on_node3.open) == set(on_node3.idle):
                break
            await asyncio.sleep(0.01)
        lock = mgr.alock("close-unread:released", ttl=30)
        node3.pause()
        try:
            assert await lock.acquire(timeout=0)  # settled; a task waits for node 3's reply
            (conn,) = [c for c in on_node3.open if c not in on_node3.idle]
            # As if the loop had not turned since the reply came: it stays in
            # the socket (the stream's buffer would not make a RST).
            conn._writer.transport.pause_reading()
        finally:
            node3.resume()
        sock = conn._writer.transport.get_extra_info("socket")
        assert wait_until(lambda: unread_bytes(sock) > 0, timeout=3.0)  # blocks the loop: bounded
        assert _exists(node3, lock._key_b) == 1  # node 3's late grant
        with _node_busy(node3, busy) as still_busy:
            await lock._release_unawaited()  # written behind the unread reply
            assert [c for c in on_node3.open if c not in on_node3.idle] == [conn]
            assert unread_bytes(sock) > 0  # so the close sends a RST
            await mgr.aclose()
            assert still_busy(), "node 3 read the release before the close: nothing tested"
        return lock._key_b

    released = asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    assert wait_until(lambda: _exists(node3, released) == 0, timeout=3.0)
    assert _exists(node3, kept) == 1
