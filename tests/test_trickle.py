"""A node that stalls in the middle of a reply: every call stays bounded.

A node behind :class:`TrickleProxy` answers each request with the head of a
100,000-byte bulk reply, then one byte every 0.2 s: each byte comes within
the node timeout (0.5 s), so a read bounded per ``recv`` (the socket's
timeout) never ends. Before the fix every synchronous call that reached that
node hung for ever (stack: hiredis ``read_from_socket`` <- ``_read_next`` <-
``_read_until_settled`` <- ``Lock.acquire``), also as one node of three; a
connection set-up to it held its thread for ever, and the exit hook of a
process holding a lock never finished. Now each reply is read by its
deadline as a whole (transport/sync.py ``_Reads``).

Every call runs in a daemon thread joined with a bound, so a regression fails
the test instead of hanging it; every loop here is bounded in count and time.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import pytest
import redis
from redis._parsers import _RESP2Parser

from django_redlock import QuorumUnavailable
from django_redlock.testing import RedisNodes
from tests.polling import wait_until

pytestmark = pytest.mark.slow

MakeManager = Callable[..., Any]

NODE_TIMEOUT = 0.5
CONNECT_TIMEOUT = 0.5
#: One byte this often (s): well within the node timeout.
INTERVAL = 0.2
#: The head of the reply a stalled node starts and never finishes.
HEAD = b"$100000\r\n"
#: Bounds of the proxy's loops: at most this many bytes trickled per
#: connection, this many turns of a socket wait (0.1 s each).
MAX_BYTES = 600
MAX_TURNS = 1200


class TrickleProxy:
    """A TCP proxy in front of one server: forwards both ways until
    :meth:`stall`; from then on, every chunk a client sends is not forwarded,
    and that client gets :data:`HEAD`, then one byte every :data:`INTERVAL`
    seconds (until :meth:`stop`, or :data:`MAX_BYTES`)."""

    def __init__(self, port: int) -> None:
        self.target = ("127.0.0.1", port)
        self.stalled = threading.Event()
        self.stopping = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.socks: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self._spawn(self._accept)

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self.threads.append(thread)
        thread.start()

    def stall(self) -> None:
        self.stalled.set()

    def _accept(self) -> None:
        for _ in range(MAX_TURNS):
            if self.stopping.is_set():
                return
            try:
                client, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=1.0)
            except OSError:
                client.close()
                continue
            self.socks += [client, upstream]
            self._spawn(self._down, upstream, client)
            self._spawn(self._up, client, upstream)

    def _down(self, upstream: socket.socket, client: socket.socket) -> None:
        upstream.settimeout(0.1)
        for _ in range(MAX_TURNS):
            if self.stopping.is_set():
                return
            try:
                data = upstream.recv(65536)
                if not data:
                    return
                client.sendall(data)
            except TimeoutError:
                continue
            except OSError:
                return

    def _up(self, client: socket.socket, upstream: socket.socket) -> None:
        client.settimeout(0.1)
        for _ in range(MAX_TURNS):
            if self.stopping.is_set():
                return
            try:
                data = client.recv(65536)
                if not data:
                    return
                if self.stalled.is_set():
                    self._trickle(client)
                    return
                upstream.sendall(data)
            except TimeoutError:
                continue
            except OSError:
                return

    def _trickle(self, client: socket.socket) -> None:
        with contextlib.suppress(OSError):
            client.sendall(HEAD)
            for _ in range(MAX_BYTES):
                if self.stopping.wait(INTERVAL):
                    return
                client.sendall(b"x")

    def stop(self) -> None:
        self.stopping.set()
        for sock in [self.listener, *self.socks]:
            with contextlib.suppress(OSError):
                sock.close()
        for thread in self.threads:
            thread.join(timeout=2.0)


@pytest.fixture
def trickle_proxies(nodes3: RedisNodes) -> Any:
    proxies = [TrickleProxy(server.port) for server in nodes3]
    yield proxies
    for proxy in proxies:
        proxy.stop()


def bounded(fn: Callable[[], Any], limit: float) -> tuple[Any, float]:
    """``fn()``'s result (or the exception it raised, returned) and how long
    it took; fails the test when it still runs after ``limit`` seconds (its
    daemon thread ends once the proxies stop)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as e:  # noqa: BLE001 - returned to the test
            out.append(e)

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    took = time.monotonic() - started
    assert not thread.is_alive(), f"still running after {took:.1f} s (a node stalls mid-reply)"
    return out[0], took


def _python_parser_pool(spec: Any) -> Any:
    return redis.ConnectionPool.from_url(spec.url, parser_class=_RESP2Parser, protocol=2,
                                         socket_timeout=NODE_TIMEOUT,
                                         socket_connect_timeout=CONNECT_TIMEOUT)


@pytest.mark.parametrize("parser", ["default", "python"])
def test_a_node_stalling_mid_reply_costs_a_call_at_most_its_node_timeout(
        trickle_proxies: list[TrickleProxy], make_manager: MakeManager, parser: str) -> None:
    """One node of three stalls mid-reply: acquire, extend and release still
    succeed, each within about one node timeout, round after round (a
    settled round reads the two that answered and leaves the stalled reply
    owed; a round that waits for every node drops it at its deadline). Both
    redis-py parsers: hiredis's (the default here) and the pure-Python one."""
    options: dict[str, Any] = {}
    if parser == "python":
        options["pool_factory"] = _python_parser_pool
    mgr = make_manager([p.url for p in trickle_proxies], node_timeout=NODE_TIMEOUT,
                       connect_timeout=CONNECT_TIMEOUT, ttl=5, auto_renew=False, **options)
    with mgr.lock("warm"):
        pass  # connections open to every node
    trickle_proxies[0].stall()
    limit = NODE_TIMEOUT + 1.0
    for turn in range(4):
        lock = mgr.lock(f"trickle:{turn}")
        ok, took = bounded(functools.partial(lock.acquire, timeout=2), 2 + NODE_TIMEOUT + 3.0)
        assert ok is True, ok
        assert took < limit, (turn, took)
        result, took = bounded(lock.extend, limit + 3.0)
        assert result is None, result
        assert took < limit, (turn, took)
        result, took = bounded(lock.release, limit + 3.0)
        assert result is None, result
        assert took < limit, (turn, took)


def test_a_majority_stalling_mid_reply_raises_quorum_unavailable_in_time(
        trickle_proxies: list[TrickleProxy], make_manager: MakeManager) -> None:
    """Two nodes of three stall mid-reply: ``acquire(timeout=2)`` raises
    ``QuorumUnavailable`` within its timeout and a node timeout ("raised
    within the configured timeouts, never a hang"), naming the two."""
    mgr = make_manager([p.url for p in trickle_proxies], node_timeout=NODE_TIMEOUT,
                       connect_timeout=CONNECT_TIMEOUT, ttl=5, auto_renew=False)
    with mgr.lock("warm"):
        pass
    trickle_proxies[0].stall()
    trickle_proxies[1].stall()
    error, took = bounded(lambda: mgr.lock("majority").acquire(timeout=2), 20.0)
    assert isinstance(error, QuorumUnavailable), error
    assert took < 2 + NODE_TIMEOUT + 1.0, took
    assert str(trickle_proxies[0].port) in str(error) and str(trickle_proxies[1].port) in str(error)


def test_a_set_up_to_a_node_stalling_mid_reply_fails_within_the_connect_timeout(
        trickle_proxies: list[TrickleProxy], make_manager: MakeManager) -> None:
    """A cold process, one node of three stalling from its first reply (the
    handshake's): its set-up fails within about the connect timeout, so the
    acquire (with 5 s to spare) does not wait for it until its deadline, and
    the set-up's thread ends (it stayed stuck for ever, and no set-up of that
    node ran again)."""
    trickle_proxies[0].stall()
    mgr = make_manager([p.url for p in trickle_proxies], node_timeout=NODE_TIMEOUT,
                       connect_timeout=CONNECT_TIMEOUT, ttl=5, auto_renew=False)
    lock = mgr.lock("cold")
    ok, took = bounded(lambda: lock.acquire(timeout=5), 5 + NODE_TIMEOUT + 3.0)
    assert ok is True, ok
    assert took < CONNECT_TIMEOUT + NODE_TIMEOUT + 1.0, took
    node = mgr.transport.nodes[0]
    assert wait_until(lambda: node._setting_up == 0, timeout=3 * CONNECT_TIMEOUT + 2.0), \
        "the set-up of the stalled node still runs"
    assert node.set_up_failed > -float("inf")
    _, took = bounded(lock.release, NODE_TIMEOUT + 3.0)
    assert took < NODE_TIMEOUT + 1.0, took


_EXIT_SCRIPT = r"""
import sys
from django_redlock import LockManager
mgr = LockManager(sys.argv[1:], ttl=60, auto_renew=False, node_timeout=0.5, connect_timeout=0.5)
held = mgr.lock("trickle-exit")
assert held.acquire()
print("held", flush=True)
sys.stdin.readline()                  # the test stalls node 3, then lets us exit
sys.exit(0)
"""


def test_the_exit_hook_is_bounded_with_a_node_stalling_mid_reply(
        nodes3: RedisNodes, trickle_proxies: list[TrickleProxy]) -> None:
    """A process holds a lock, node 3 then stalls mid-reply, the process
    exits through ``sys.exit`` (a worker's graceful stop): the exit hook
    releases the lock on the two nodes that answer and the process ends
    within seconds (it never ended: the release's read of node 3 never did)."""
    with subprocess.Popen([sys.executable, "-c", _EXIT_SCRIPT, *[p.url for p in trickle_proxies]],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdin is not None
            line = proc.stdout.readline()
            assert line.strip() == "held", proc.stderr.read() if proc.stderr else ""
            trickle_proxies[2].stall()
            started = time.monotonic()
            proc.stdin.write("exit\n")
            proc.stdin.flush()
            try:
                _, err = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                pytest.fail("the exit hook still runs after 20 s (node 3 stalls mid-reply)")
            took = time.monotonic() - started
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err
    assert took < 8.0, (took, err[-2000:])
    key = "redlock:trickle-exit"
    assert not nodes3[0].client().exists(key) and not nodes3[1].client().exists(key)
