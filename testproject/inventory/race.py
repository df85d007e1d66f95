"""The race lab's clients: N processes each doing M increments of one Redis key.

Three ways to do ``x = GET k; SET k x+1`` concurrently, the classic experiment:

``no lock``
    the read and the write are two commands; another client's write can land
    between them and is then overwritten: a *lost update*.
``WATCH/MULTI/EXEC``
    optimistic: the transaction is aborted (``EXEC`` returns nil) if the key
    changed after ``WATCH``, and the client retries. Correct, but every conflict
    costs a retry; the aborts are counted.
``django-redlock``
    the read-modify-write runs under a Redlock lock on the demo's nodes: clients
    take turns; no lost update, no retry loop in the caller.

Spawned processes import only this module (plus redis-py and django_redlock's
engine, which needs no Django settings when given node URLs).
"""

from __future__ import annotations

import signal
import time
from typing import Any

import redis

STRATEGIES = ("no lock", "WATCH/MULTI/EXEC", "django-redlock")

#: Upper bound on one increment's WATCH retries: a run always ends.
MAX_ATTEMPTS = 10_000


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5.0)


def client_main(strategy: str, counter_url: str, nodes: list[Any], key: str, increments: int,
                gap: float, results: Any, go: Any) -> None:
    """Run one client; put ``(aborts, gave_up, seconds)`` on ``results`` (or an error)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent stops us
    try:
        r = _client(counter_url)
        r.ping()
        manager = None
        if strategy == "django-redlock":
            from django_redlock import LockManager

            manager = LockManager(nodes, ttl=5.0, timeout=60.0, node_timeout=0.5)
            warmup = manager.lock(key + ":warmup", timeout=0)  # connect before the start
            if warmup.acquire():
                warmup.release()
    except (redis.RedisError, OSError) as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))
        return
    results.put(("ready", None))
    go.wait(60)
    aborts = gave_up = 0
    started = time.monotonic()
    try:
        for _ in range(increments):
            if strategy == "no lock":
                value = int(r.get(key) or 0)
                if gap:
                    time.sleep(gap)
                r.set(key, value + 1)
            elif strategy == "WATCH/MULTI/EXEC":
                a, g = _watch_increment(r, key, gap)
                aborts += a
                gave_up += g
            else:
                assert manager is not None
                with manager.lock(key):
                    value = int(r.get(key) or 0)
                    if gap:
                        time.sleep(gap)
                    r.set(key, value + 1)
    except (redis.RedisError, OSError) as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))
        return
    finally:
        if manager is not None:
            manager.close()
    results.put(("done", (aborts, gave_up, time.monotonic() - started)))


def _watch_increment(r: redis.Redis, key: str, gap: float) -> tuple[int, int]:
    """One optimistic increment: (aborted attempts, 1 if it gave up)."""
    aborts = 0
    with r.pipeline() as pipe:
        for _ in range(MAX_ATTEMPTS):
            try:
                pipe.watch(key)
                value = int(pipe.get(key) or 0)
                if gap:
                    time.sleep(gap)
                pipe.multi()
                pipe.set(key, value + 1)
                pipe.execute()
                return aborts, 0
            except redis.WatchError:
                aborts += 1
            finally:
                pipe.reset()
    return aborts, 1
