"""pytest fixtures that start real Redis servers (see :mod:`django_redlock.testing`).

Registered as a ``pytest11`` entry point, so installing django-redlock makes
these fixtures available to any test suite:

``redis_server``
    one started :class:`~django_redlock.testing.RedisServer`, stopped at teardown;
``redis_nodes_factory``
    ``make(n, **server_kwargs) -> RedisNodes``: ``n`` started independent
    masters, all stopped at teardown, even when the test failed or left a
    node paused or killed;
``fault_proxy_factory``
    ``make(server, **proxy_kwargs) -> FaultProxy``: a started proxy in front
    of ``server`` (its URL carries the server's password), stopped at teardown.

Why function scope: fault tests kill, pause and restart nodes; sharing a node
between tests would let one test's fault leak into the next. Starting a
server takes a few milliseconds, so isolation is cheap.

This module imports nothing from Django and does not need redis-py (only
``RedisServer.client()`` does, lazily), so loading the plugin can never break
a test run that does not use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from .testing import FaultProxy, RedisNodes, RedisServer

__all__ = [
    "fault_proxy_factory",
    "nodes_factory",
    "proxy_factory",
    "redis_nodes_factory",
    "redis_server",
]


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A started, empty Redis server on a free loopback port."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def nodes_factory() -> Iterator[Callable[..., RedisNodes]]:
    """Context manager behind :func:`redis_nodes_factory` (usable without
    pytest, e.g. with ``unittest``'s ``enterContext``): yields
    ``make(n, **server_kwargs) -> RedisNodes`` and stops every set it made on
    exit, each node even if stopping another raised."""
    made: list[RedisNodes] = []

    def make(n: int, **server_kwargs: Any) -> RedisNodes:
        nodes = RedisNodes(n, **server_kwargs)
        nodes.start()  # stops those it started itself if one fails
        made.append(nodes)
        return nodes

    try:
        yield make
    finally:
        _stop_all(made)


@contextmanager
def proxy_factory() -> Iterator[Callable[..., FaultProxy]]:
    """Context manager behind :func:`fault_proxy_factory`: yields
    ``make(server, **proxy_kwargs) -> FaultProxy`` and stops every proxy it
    made on exit."""
    made: list[FaultProxy] = []

    def make(server: RedisServer, **proxy_kwargs: Any) -> FaultProxy:
        proxy = FaultProxy.for_server(server, **proxy_kwargs)
        proxy.start()
        made.append(proxy)
        return proxy

    try:
        yield make
    finally:
        _stop_all(made)


@pytest.fixture
def redis_nodes_factory() -> Iterator[Callable[..., RedisNodes]]:
    """A factory ``make(n, **server_kwargs) -> RedisNodes`` of started nodes.

    Every set it made is stopped at teardown, even when the test failed or
    left nodes paused or killed."""
    with nodes_factory() as make:
        yield make


@pytest.fixture
def fault_proxy_factory() -> Iterator[Callable[..., FaultProxy]]:
    """A factory ``make(server, **proxy_kwargs) -> FaultProxy`` of started
    proxies in front of ``server`` (URL with its password); all stopped at
    teardown."""
    with proxy_factory() as make:
        yield make


def _stop_all(things: list[Any]) -> None:
    """Call ``stop()`` on each, newest first; re-raise the first error after
    all have been tried, so one broken teardown cannot leak the others."""
    first: BaseException | None = None
    for thing in reversed(things):
        try:
            thing.stop()
        except Exception as exc:  # noqa: BLE001 - keep stopping the others
            if first is None:
                first = exc
    if first is not None:
        raise first
