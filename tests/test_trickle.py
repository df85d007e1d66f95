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

A settled round (one that returns once a quorum answered) never waits for
the rest of a reply, and leaves it to a later round on that connection: a
node behind :class:`PartsProxy` delivers its replies in parts, at the moments
that hurt most (part of a reply, then nothing more, or a byte now and then;
a whole reply held back past its due time; round 1's reply with the head of
round 2's in one segment; a TLS record but its last bytes).

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
from urllib.parse import urlsplit

import pytest
import redis
from redis._parsers import _RESP2Parser

from django_redlock import QuorumUnavailable
from django_redlock.testing import FaultProxy, RedisNodes
from django_redlock.transport.resp import Command
from django_redlock.transport.sync import NOT_AWAITED, NodeError, Settle
from tests.polling import wait_until
from tests.test_tls import _TLSNodes, certificate, tls_nodes  # noqa: F401 - fixtures

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


class _Proxy:
    """A TCP proxy in front of one server, its threads bounded in turns: each
    connection accepted is connected upstream and handed to :meth:`_serve`;
    :meth:`stop` closes every socket and joins every thread."""

    def __init__(self, port: int) -> None:
        self.target = ("127.0.0.1", port)
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.clients: list[socket.socket] = []
        self.upstreams: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self._spawn(self._accept)

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self.threads.append(thread)
        thread.start()

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
            with self.lock:
                self.clients.append(client)
                self.upstreams.append(upstream)
            self._serve(client, upstream)

    def _serve(self, client: socket.socket, upstream: socket.socket) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self.stopping.set()
        for sock in [self.listener, *self.clients, *self.upstreams]:
            with contextlib.suppress(OSError):
                sock.close()
        for thread in self.threads:
            thread.join(timeout=2.0)


class TrickleProxy(_Proxy):
    """Forwards both ways until :meth:`stall`; from then on, every chunk a
    client sends is not forwarded, and that client gets :data:`HEAD`, then one
    byte every :data:`INTERVAL` seconds (until :meth:`stop`, or
    :data:`MAX_BYTES`)."""

    def __init__(self, port: int) -> None:
        self.stalled = threading.Event()
        super().__init__(port)

    def stall(self) -> None:
        self.stalled.set()

    def _serve(self, client: socket.socket, upstream: socket.socket) -> None:
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


def _parser_options(parser: str) -> dict[str, Any]:
    """The manager options of a test run with redis-py's pure-Python parser
    (``"python"``), or with the default one (hiredis when installed)."""
    return {"pool_factory": _python_parser_pool} if parser == "python" else {}


@pytest.mark.parametrize("parser", ["default", "python"])
def test_a_node_stalling_mid_reply_costs_a_call_at_most_its_node_timeout(
        trickle_proxies: list[TrickleProxy], make_manager: MakeManager, parser: str) -> None:
    """One node of three stalls mid-reply: acquire, extend and release still
    succeed, each within about one node timeout, round after round (a
    settled round reads the two that answered and leaves the stalled reply
    owed; a round that waits for every node drops it at its deadline). Both
    redis-py parsers: hiredis's (the default here) and the pure-Python one."""
    mgr = make_manager([p.url for p in trickle_proxies], node_timeout=NODE_TIMEOUT,
                       connect_timeout=CONNECT_TIMEOUT, ttl=5, auto_renew=False, **_parser_options(parser))
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


class PartsProxy(_Proxy):
    """A proxy (plain or TLS: it forwards bytes) that can deliver the server's
    replies in parts. After :meth:`hold`, the server's bytes on the
    connections open at that moment are kept, and ``rule(kept)`` says how
    many of the kept bytes to send now, in one write (the client reads them
    as one segment); :meth:`deliver` sends some by hand. Connections opened
    later, and the client's requests, pass through.
    """

    def __init__(self, port: int) -> None:
        self.kept: dict[socket.socket, bytearray] = {}
        self.rule: Callable[[bytes], int] = lambda kept: 0
        super().__init__(port)

    def hold(self, rule: Callable[[bytes], int] = lambda kept: 0) -> None:
        with self.lock:
            self.rule = rule
            for client in self.clients:
                self.kept.setdefault(client, bytearray())

    def deliver(self, count: int | None = None, *, release: bool = False) -> int:
        """Send ``count`` kept bytes (None: all) of each held connection;
        with ``release``, forward everything from then on."""
        sent = 0
        with self.lock:
            for client, kept in self.kept.items():
                part = bytes(kept if count is None else kept[:count])
                with contextlib.suppress(OSError):
                    client.sendall(part)
                sent += len(part)
                del kept[:len(part)]
            if release:
                self.kept.clear()
        return sent

    def _serve(self, client: socket.socket, upstream: socket.socket) -> None:
        self._spawn(self._pipe, upstream, client, True)
        self._spawn(self._pipe, client, upstream, False)

    def _pipe(self, source: socket.socket, sink: socket.socket, down: bool) -> None:
        source.settimeout(0.1)
        for _ in range(MAX_TURNS):
            if self.stopping.is_set():
                return
            try:
                data = source.recv(65536)
                if not data:
                    return
                with self.lock:
                    kept = self.kept.get(sink) if down else None
                    if kept is not None:
                        kept += data
                        count = self.rule(bytes(kept))
                        data = bytes(kept[:count])
                        del kept[:count]
                    if data:
                        sink.sendall(data)
            except TimeoutError:
                continue
            except OSError:
                return


def once(at: int, count: int) -> Callable[[bytes], int]:
    """A rule: once ``at`` bytes are kept, send ``count`` of them; then nothing."""
    done: list[bool] = []

    def rule(kept: bytes) -> int:
        if done or len(kept) < at:
            return 0
        done.append(True)
        return count

    return rule


PONG = Settle(2, lambda reply: reply == b"PONG", lambda reply: False)
PING = [Command(b"PING")] * 3
#: B's link: its reply comes this long after C's bytes (each way), so that a
#: settled round reads C's part before B decides it.
B_LATENCY = 0.05


@pytest.fixture
def parted(nodes3: RedisNodes) -> Any:
    """Nodes A (direct), B (a slow link), C (behind a :class:`PartsProxy`)."""
    slow = FaultProxy.for_server(nodes3[1]).start()
    slow.set_latency(B_LATENCY)
    parts = PartsProxy(nodes3[2].port)
    yield [nodes3[0].url, slow.url, f"redis://127.0.0.1:{parts.port}/0"], parts
    parts.stop()
    slow.stop()


def _warm(transport: Any) -> list[Any]:
    """A connection to each node (B's set-up over its slow link may take
    longer than a node timeout: the round waits for it up to 5 s)."""
    result: list[Any] = transport.round(PING, until=transport.clock() + 5.0)
    return result


def _owed_replies(node: Any) -> int:
    return max((len(entry.expect) for entry in list(node._owed)), default=0)


@pytest.mark.parametrize("parser", ["default", "python"])
def test_a_settled_round_leaving_part_of_a_reply_fails_its_node_once_overdue(
        parted: Any, make_manager: MakeManager, parser: str) -> None:
    """C sends 3 bytes of ``+PONG\r\n`` and then nothing more on that
    connection. The settled round that read them returns on A and B and
    leaves the rest owed. Once C's reply is overdue, the next round drops
    that connection and fails C (it was kept for ever: the parser's buffer
    held part of a reply, so ``can_read`` said readable; C was reported as
    NOT_AWAITED round after round, with one more owed reply each round, and
    C never counted as failed); then C answers on a new connection."""
    urls, parts = parted
    mgr = make_manager(urls, node_timeout=NODE_TIMEOUT, connect_timeout=CONNECT_TIMEOUT,
                       auto_renew=False, **_parser_options(parser))
    transport, node = mgr.transport, mgr.transport.nodes[2]
    assert _warm(transport) == [b"PONG"] * 3
    parts.hold(once(at=len(b"+PONG\r\n"), count=3))
    first, took = bounded(lambda: transport.round(PING, settle=PONG, tag="t1"), 5.0)
    assert first == [b"PONG", b"PONG", NOT_AWAITED], first
    time.sleep(NODE_TIMEOUT + 0.1)  # C's reply is overdue; nothing more came
    second, took = bounded(lambda: transport.round(PING, settle=PONG, tag="t2"), 5.0)
    assert second[:2] == [b"PONG", b"PONG"], second
    assert isinstance(second[2], NodeError) and not second[2].sent, second
    assert node.errors == 1 and _owed_replies(node) == 0
    time.sleep(0.2)  # C's back-off
    third, took = bounded(lambda: transport.round(PING), 5.0)
    assert third == [b"PONG"] * 3 and took < NODE_TIMEOUT / 2, (third, took)


@pytest.mark.parametrize("parser", ["default", "python"])
def test_an_overdue_owed_reply_coming_a_byte_at_a_time_fails_its_node_at_once(
        parted: Any, make_manager: MakeManager, parser: str) -> None:
    """As above, but one more byte of C's overdue reply comes just before
    the next round (its socket is readable when that round takes the
    connection): the reply is read by its own due time, so the round fails
    C at once; it waited a whole node timeout for the rest (an unsettled
    round), and a node sending a byte now and then kept its connection."""
    urls, parts = parted
    mgr = make_manager(urls, node_timeout=NODE_TIMEOUT, connect_timeout=CONNECT_TIMEOUT,
                       auto_renew=False, **_parser_options(parser))
    transport, node = mgr.transport, mgr.transport.nodes[2]
    assert _warm(transport) == [b"PONG"] * 3
    parts.hold(once(at=len(b"+PONG\r\n"), count=3))
    first, _ = bounded(lambda: transport.round(PING, settle=PONG, tag="t1"), 5.0)
    assert first == [b"PONG", b"PONG", NOT_AWAITED], first
    time.sleep(NODE_TIMEOUT + 0.1)
    assert parts.deliver(1) == 1  # "N": still no whole reply
    time.sleep(0.05)
    second, took = bounded(lambda: transport.round(PING), 5.0)
    assert second[:2] == [b"PONG", b"PONG"], second
    assert isinstance(second[2], NodeError), second
    assert took < NODE_TIMEOUT / 2, took
    assert node.errors == 1 and _owed_replies(node) == 0


@pytest.mark.parametrize("parser", ["default", "python"])
def test_an_overdue_owed_reply_that_came_whole_is_read_however_big(
        parted: Any, make_manager: MakeManager, parser: str) -> None:
    """C's 100,000-byte reply, held back by the proxy past its due time,
    then sent whole before the next round on that connection: the round
    reads it (more than one ``recv``: whatever came already is read however
    late) and C is not failed. An owed reply is read by its own due time;
    had that bounded every recv, the second would have failed a node that
    answered."""
    urls, parts = parted
    mgr = make_manager(urls, node_timeout=NODE_TIMEOUT, connect_timeout=CONNECT_TIMEOUT,
                       auto_renew=False, **_parser_options(parser))
    transport, node = mgr.transport, mgr.transport.nodes[2]
    assert _warm(transport) == [b"PONG"] * 3
    value = b"v" * 100_000
    echo = [Command(b"ECHO", value)] * 3
    settle = Settle(2, lambda reply: reply == value, lambda reply: False)
    parts.hold()
    first, _ = bounded(lambda: transport.round(echo, settle=settle, tag="t"), 5.0)
    assert first == [value, value, NOT_AWAITED], [type(r) for r in first]
    whole = len(b"$100000\r\n") + len(value) + 2
    assert wait_until(lambda: sum(map(len, parts.kept.values())) == whole, timeout=5.0)
    time.sleep(NODE_TIMEOUT + 0.1)  # overdue
    assert parts.deliver(release=True) == whole
    time.sleep(0.1)  # all of it in C's socket
    second, _ = bounded(lambda: transport.round(PING, tag="t"), 5.0)
    assert second == [b"PONG"] * 3, second
    assert node.errors == 0


@pytest.mark.parametrize("parser", ["default", "python"])
def test_a_settled_round_does_not_wait_for_the_rest_of_its_own_reply_after_an_owed_one(
        parted: Any, make_manager: MakeManager, parser: str) -> None:
    """Round 1 settles on A and B, C's reply held back. In round 2 C sends
    round 1's reply and the head of round 2's in one segment, then nothing:
    the round drops the owed reply and returns on A and B (about 2 x
    B_LATENCY), C's rest owed. It waited for the rest of C's reply until C's
    deadline (the first recv of a read took the socket's timeout, and
    ``can_read`` said True for the head in the parser) and reported C down."""
    urls, parts = parted
    mgr = make_manager(urls, node_timeout=NODE_TIMEOUT, connect_timeout=CONNECT_TIMEOUT,
                       auto_renew=False, **_parser_options(parser))
    transport = mgr.transport
    assert _warm(transport) == [b"PONG"] * 3
    parts.hold(once(at=2 * len(b"+PONG\r\n"), count=len(b"+PONG\r\n+PO")))
    first, _ = bounded(lambda: transport.round(PING, settle=PONG, tag="t"), 5.0)
    assert first == [b"PONG", b"PONG", NOT_AWAITED], first
    second, took = bounded(lambda: transport.round(PING, settle=PONG, tag="t"), 5.0)
    assert second == [b"PONG", b"PONG", NOT_AWAITED], second
    assert took < NODE_TIMEOUT - 0.1, took
    assert parts.deliver(release=True) == len(b"NG\r\n")
    third, _ = bounded(lambda: transport.round(PING, tag="t"), 5.0)
    assert third == [b"PONG"] * 3, third  # C's rest read and dropped, in order


def test_a_settled_round_does_not_wait_for_the_rest_of_a_tls_record(
        tls_nodes: _TLSNodes, make_manager: MakeManager) -> None:  # noqa: F811 - the fixture
    """TLS: C's reply record comes but its last 5 bytes. Its socket is
    readable, and nothing of it can be decrypted yet: the settled round
    returns on A and B, C owed. ``SSLSocket.recv`` waited for the rest of the
    record until C's deadline (poll said readable)."""
    ports = [int(urlsplit(url).port or 0) for url in tls_nodes.tls_urls]
    slow = FaultProxy("127.0.0.1", ports[1]).start()
    slow.set_latency(B_LATENCY)
    parts = PartsProxy(ports[2])
    try:
        urls = [url.replace(f":{port}/", f":{proxy}/") for url, port, proxy
                in zip(tls_nodes.tls_urls, ports, [ports[0], slow.port, parts.port])]
        mgr = make_manager(urls, node_timeout=NODE_TIMEOUT, connect_timeout=2.0,
                           auto_renew=False)
        transport = mgr.transport
        warm, _ = bounded(lambda: _warm(transport), 10.0)
        assert warm == [b"PONG"] * 3, warm
        parts.hold(lambda kept: max(len(kept) - 5, 0))
        first, took = bounded(lambda: transport.round(PING, settle=PONG, tag="t"), 5.0)
        assert first == [b"PONG", b"PONG", NOT_AWAITED], first
        assert took < NODE_TIMEOUT - 0.1, took
        assert parts.deliver(release=True) == 5
        second, _ = bounded(lambda: transport.round(PING, tag="t"), 5.0)
        assert second == [b"PONG"] * 3, second
    finally:
        parts.stop()
        slow.stop()
