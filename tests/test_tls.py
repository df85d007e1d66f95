"""Locks and release notices over TLS (``rediss://``), against real TLS servers.

The servers keep their plain port for the harness's own checks and listen for
TLS on a second one, with a self-signed certificate made here by the
``openssl`` command. The pub/sub connections of the notifier are TLS sockets:
the waiting thread reads them itself and toggles them to blocking to send,
which is what these tests exercise. Every wait is bounded.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import quote

import pytest

from django_redlock.testing import RedisServer
from tests.polling import wait_until
from tests.test_waiters import SLOW_RETRY, WaitingThread, _queued, async_handoff_seconds

MakeManager = Callable[..., Any]
PASSWORD = "tls-secret"
BY_NOTICE = 1.0
TLS_PORT_ATTEMPTS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_certificate(tmp_path_factory)


def make_certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate and its key for 127.0.0.1 (skips without openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a test certificate (apt-get install openssl)")
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "server.crt", where / "server.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60)
    return cert, key


class _TLSNodes:
    def __init__(self, servers: list[RedisServer], tls_ports: list[int], cert: Path) -> None:
        self.servers = servers
        ca = quote(str(cert), safe="")
        #: What a client uses: TLS, the password, our certificate as the only CA.
        self.tls_urls = [f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={ca}"
                         for port in tls_ports]
        #: The plain ports, for the test's own look at the queues.
        self.urls = [server.url for server in servers]


@pytest.fixture
def tls_nodes(certificate: tuple[Path, Path]) -> Iterator[_TLSNodes]:
    cert, key = certificate
    servers: list[RedisServer] = []
    ports: list[int] = []
    try:
        for _ in range(3):
            # The TLS port is picked here, and someone may take it before the
            # server binds it: a fresh one is tried before TLS is called missing.
            for attempt in range(TLS_PORT_ATTEMPTS):
                port = _free_port()
                server = RedisServer(password=PASSWORD, extra_args=[
                    "--tls-port", str(port), "--tls-cert-file", str(cert),
                    "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                    "--tls-auth-clients", "no"])
                servers.append(server)
                try:
                    server.start()
                    break
                except Exception as e:  # noqa: BLE001 - a server built without TLS
                    if attempt == TLS_PORT_ATTEMPTS - 1:
                        pytest.skip(f"redis-server does not start with TLS here "
                                    f"({TLS_PORT_ATTEMPTS} tries): {e}")
            ports.append(port)
        yield _TLSNodes(servers, ports, cert)
    finally:
        for server in servers:
            server.stop()


def test_a_sync_waiter_is_woken_by_notice_over_tls(
        tls_nodes: _TLSNodes, make_manager: MakeManager) -> None:
    holder = make_manager(tls_nodes.tls_urls)
    waiter = make_manager(tls_nodes.tls_urls, retry_delay=SLOW_RETRY)
    lock = holder.lock("tls-line")
    assert lock.acquire() and lock.fence > 0
    waiting = WaitingThread(waiter, "tls-line")
    assert wait_until(lambda: _queued(tls_nodes, holder, "tls-line") == 1)
    for link in waiter.notifier._links:  # the notices really come over TLS
        assert wait_until(lambda link=link: link.sock is not None)
        assert link.sock.version() is not None  # an ssl.SSLSocket, handshake done
    released = time.monotonic()
    lock.release()
    assert waiting.seconds_after(released) < BY_NOTICE


def test_an_async_waiter_is_woken_by_notice_over_tls(
        tls_nodes: _TLSNodes, make_manager: MakeManager) -> None:
    holder = make_manager(tls_nodes.tls_urls)
    waiter = make_manager(tls_nodes.tls_urls, retry_delay=SLOW_RETRY)
    assert async_handoff_seconds(tls_nodes, holder, waiter, "tls-async") < BY_NOTICE
