"""Helpers of the tests that drive one lock object through several blocks or
entries at once (tests/test_block_exit_hold.py, tests/test_hand_entry_hold.py)."""

from __future__ import annotations

import threading
from typing import Any, Callable

import redis

from django_redlock.testing import RedisNodes


def holders(nodes: RedisNodes, key: str) -> int:
    """How many of ``nodes`` hold ``key``."""
    return sum(bool(server.client().exists(key)) for server in nodes)


def look_from_inside(nodes: RedisNodes, key: str, rival: Any) -> dict[str, Any]:
    """What a holder inside its block sees: on how many of ``nodes`` its
    ``key`` is (``"held on"``), and whether ``rival``, another client's lock
    of the same name, gets in (``"rival got in"``; released again if so)."""
    held_on = holders(nodes, key)
    got = rival.acquire(timeout=0)
    if got:
        rival.release()
    return {"held on": held_on, "rival got in": got}


def lock_keys(url: str) -> list[bytes]:
    """The lock keys on the node at ``url`` (not the waiter lines)."""
    client = redis.Redis.from_url(url)
    try:
        return [k for k in client.keys("redlock:*") if not k.endswith(b":waiters")]
    finally:
        client.close()


def run_threads(*targets: Callable[[], None]) -> None:
    """Run each target in a thread of its own; fail if one still runs after 20 s."""
    threads = [threading.Thread(target=target) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not any(thread.is_alive() for thread in threads)
