"""Redis nodes for the benchmark: the project's own harness, started on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis


@contextmanager
def running_nodes(count: int) -> Iterator[list[str]]:
    """Start ``count`` independent Redis servers; yield their URLs; stop them.

    The servers of :class:`django_redlock.testing.RedisNodes`, the ones the test
    suite uses: free loopback ports, no persistence.
    """
    from django_redlock.testing import RedisNodes

    if count == 0:  # a section that is not run
        yield []
        return
    with RedisNodes(count) as nodes:
        yield [str(u) for u in nodes.urls]


def server_version(url: str) -> str:
    """The server's name and version as INFO reports it (valkey reports both)."""
    client = redis.Redis.from_url(url)
    try:
        info = client.info("server")
    finally:
        client.close()
    if "valkey_version" in info:
        return f"valkey {info['valkey_version']}"
    return f"redis {info.get('redis_version', '?')}"
