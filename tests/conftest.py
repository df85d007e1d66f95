"""Fixtures: real Redis servers started by the suite on free loopback ports.

* ``session_nodes``: 3 nodes for the whole session; ``REDLOCK_NODES`` points at
  them (autouse), so ``django_redlock.lock()`` and the Django layer work.
* ``nodes3`` / ``nodes5``: independent sets per test module, flushed per test.
* ``make_manager``: a LockManager factory, every manager closed at teardown.
Fault tests that kill or pause nodes use ``redis_nodes_factory`` (from the
``django_redlock.pytest_plugin``) to get nodes of their own.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

from django_redlock.testing import RedisNodes

#: Node timeout used by tests that do not test timeouts: generous, because the
#: test machine is shared and small, and a spurious node timeout is noise.
TEST_NODE_TIMEOUT = 0.5


@pytest.fixture(scope="session")
def session_nodes() -> Iterator[RedisNodes]:
    with RedisNodes(3) as nodes:
        yield nodes


@pytest.fixture(autouse=True, scope="session")
def _redlock_settings(session_nodes: RedisNodes, django_db_blocker: Any) -> Iterator[None]:
    from django.conf import settings

    from django_redlock.conf import reset_manager

    old = settings.REDLOCK_NODES
    settings.REDLOCK_NODES = list(session_nodes.urls)
    reset_manager()
    yield
    reset_manager()
    settings.REDLOCK_NODES = old


@pytest.fixture(autouse=True)
def _clean_session_nodes(session_nodes: RedisNodes) -> None:
    session_nodes.flushall()


@pytest.fixture(scope="module")
def nodes3_module() -> Iterator[RedisNodes]:
    with RedisNodes(3) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def nodes5_module() -> Iterator[RedisNodes]:
    with RedisNodes(5) as nodes:
        yield nodes


@pytest.fixture
def nodes3(nodes3_module: RedisNodes) -> RedisNodes:
    nodes3_module.flushall()
    return nodes3_module


@pytest.fixture
def nodes5(nodes5_module: RedisNodes) -> RedisNodes:
    nodes5_module.flushall()
    return nodes5_module


@pytest.fixture
def make_manager() -> Iterator[Callable[..., Any]]:
    from django_redlock import LockManager

    made: list[LockManager] = []

    def make(nodes: Any, **options: Any) -> LockManager:
        urls = nodes.urls if hasattr(nodes, "urls") else nodes
        options.setdefault("node_timeout", TEST_NODE_TIMEOUT)
        manager = LockManager(list(urls), **options)
        made.append(manager)
        return manager

    yield make
    for manager in made:
        manager.close()
