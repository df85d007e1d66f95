"""Real concurrency against decorated views.

* Several *processes* (each its own Django, its own test Client, its own lock
  manager) hit the same decorated views, whose bodies do a non-atomic
  read-modify-write on a shared SQLite file. Only the lock keeps the count exact,
  and every value must be handed out once, in fence order.
* Concurrent requests to ``async def`` views in one event loop
  (``asyncio.gather`` of AsyncClient requests) with an ``await`` between the read
  and the write: exact with the lock, and (control) lossy without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from django.test import AsyncClient

import django_redlock
from tests.testapp import views

ROOT = Path(__file__).resolve().parent.parent

WORKERS = 4
REQUESTS = 8  # per worker and per view


def _env(db: Path, session_nodes: Any) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "REDLOCK_TEST_DB": str(db),
        "REDLOCK_TEST_NODES": ",".join(session_nodes.urls),
        "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    })
    env.pop("DATABASE_URL", None)  # the workers only need the SQLite file
    return env


def _hammer(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.testapp.hammer", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_processes_hitting_decorated_views_count_exactly(tmp_path: Path,
                                                         session_nodes: Any) -> None:
    db = tmp_path / "shared.sqlite3"
    env = _env(db, session_nodes)
    setup = _hammer("migrate", "--counter", "fv", "--counter", "cbv", env=env)
    out, err = setup.communicate(timeout=60)
    assert setup.returncode == 0, err
    paths = ["/counter/fv/incr/", "/cbv/cbv/"]  # a function view and a CBV (dispatch)
    args = ["run", "--requests", str(REQUESTS), "--delay", "0.003"]
    for path in paths:
        args += ["--path", path]
    started = time.monotonic()
    workers = [_hammer(*args, env=env) for _ in range(WORKERS)]
    results: dict[str, list[list[int]]] = {path: [] for path in paths}
    for worker in workers:
        out, err = worker.communicate(timeout=80)
        assert worker.returncode == 0, err
        for path, pairs in json.loads(out.strip().splitlines()[-1]).items():
            results[path] += pairs
    elapsed = time.monotonic() - started
    total = WORKERS * REQUESTS
    # closing(): sqlite3's own context manager ends the transaction but leaves the
    # connection open (Python 3.13 reports that as a ResourceWarning when collected)
    with contextlib.closing(sqlite3.connect(db)) as conn:
        stored = dict(conn.execute("SELECT name, value FROM testapp_counter").fetchall())
    assert stored == {"fv": total, "cbv": total}, elapsed
    for path, pairs in results.items():
        values = sorted(value for value, _ in pairs)
        assert values == list(range(1, total + 1)), path  # each value handed out once
        fences = [fence for _, fence in sorted(pairs)]
        assert fences == sorted(fences) and len(set(fences)) == total, path  # fence order


def _gather(path: str, n: int, delay: float) -> list[Any]:
    async def run() -> list[Any]:
        client = AsyncClient()
        return list(await asyncio.gather(*(client.post(f"{path}?delay={delay}")
                                           for _ in range(n))))

    return asyncio.run(run())


@pytest.mark.skipif(not hasattr(django_redlock.LockManager, "alock"),
                    reason="LockManager.alock is not there yet")
@pytest.mark.parametrize("path, key", [("/async/counter/g/", "g"), ("/async/cbv/h/", "h")])
def test_concurrent_async_requests_count_exactly(path: str, key: str) -> None:
    views.ASYNC_COUNTS.pop(key, None)
    responses = _gather(path, 10, 0.01)
    assert [r.status_code for r in responses] == [200] * 10
    assert sorted(r.json()["value"] for r in responses) == list(range(1, 11))
    assert views.ASYNC_COUNTS[key] == 10


def test_control_without_the_lock_async_requests_lose_updates() -> None:
    """The same body undecorated: every request reads 0 before any writes."""
    views.ASYNC_COUNTS.pop("u", None)
    responses = _gather("/async/counter-unlocked/u/", 10, 0.01)
    assert [r.status_code for r in responses] == [200] * 10
    assert views.ASYNC_COUNTS["u"] < 10
