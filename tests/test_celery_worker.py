"""``with_lock`` on Celery tasks run by a real ``celery worker`` process (thread
pool, 2 threads), with a Redis server of the suite as broker and result backend
and the suite's nodes as lock nodes. Skipped when Celery is not installed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from django_redlock import LockManager
from django_redlock.jobs import was_skipped
from django_redlock.testing import RedisServer

celery = pytest.importorskip("celery", reason="celery is not installed (pip install celery)")


def _kombu_redis_refusal() -> str:
    """Why kombu's Redis transport refuses this redis-py (recent kombu needs
    redis-py 6.1+; the oldest redis-py this library supports is 5.0), or ''."""
    from types import SimpleNamespace

    try:
        from kombu.exceptions import VersionMismatch
        from kombu.transport import redis as kombu_redis
    except ImportError as exc:
        return str(exc)
    try:  # where kombu checks the version (its channel's client factory)
        kombu_redis.Channel._get_client(SimpleNamespace(global_keyprefix=None))
    except VersionMismatch as exc:
        return str(exc)
    except Exception:  # noqa: BLE001 - another kombu: no version check there
        return ""
    return ""


_REFUSAL = _kombu_redis_refusal()

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(_REFUSAL), reason=f"celery's broker: {_REFUSAL}")]

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def broker() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def worker(broker: RedisServer, session_nodes: Any, tmp_path_factory: Any) -> Iterator[Any]:
    """A started worker and a client app that talks to it (tasks sent by name)."""
    where = tmp_path_factory.mktemp("celery")
    (where / "celery_settings.py").write_text(
        f"from tests.settings import *  # noqa\nREDLOCK_NODES = {list(session_nodes.urls)!r}\n")
    log = where / "worker.log"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "celery_settings",
           "REDLOCK_TEST_BROKER": broker.url,
           "PYTHONPATH": os.pathsep.join([str(where), str(ROOT)])}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.celery_app", "worker", "-P", "threads",
             "-c", "2", "--without-heartbeat", "--without-gossip", "--without-mingle",
             "-l", "INFO", "-n", "redlock-tests@%h"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    client = celery.Celery("client", broker=broker.url, backend=broker.url)
    client.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"])
    try:
        # Ready when it answers a task (bounded).
        result = client.send_task("redlock.ping")
        try:
            assert result.get(timeout=60) == "pong"
        except Exception:  # noqa: BLE001 - any failure: show the worker log
            proc.kill()
            raise AssertionError("the worker did not start:\n" + log.read_text()[-3000:]) from None
        client.worker_log = log  # type: ignore[attr-defined]
        yield client
    finally:
        proc.send_signal(signal.SIGTERM)  # warm shutdown
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        client.close()


@pytest.fixture
def manager(session_nodes: Any, make_manager: Any) -> LockManager:
    return make_manager(session_nodes, auto_renew=False)


def test_task_runs_under_a_lock_named_from_its_arguments(worker: Any) -> None:
    result = worker.send_task("redlock.nightly", args=["2026-11-24"]).get(timeout=30)
    assert result["lock"] == "report:2026-11-24"
    assert result["fence"] > 0
    # Keyword arguments too.
    result = worker.send_task("redlock.nightly", kwargs={"day": "2026-11-25"}).get(timeout=30)
    assert result["lock"] == "report:2026-11-25"


def test_bound_task_reads_placeholders_from_its_arguments(worker: Any) -> None:
    sent = worker.send_task("redlock.invoice", args=[{"id": 42}])
    result = sent.get(timeout=30)
    assert result["lock"] == "invoice:42"
    assert result["task_id"] == sent.id


def test_busy_task_is_skipped_logged_and_visible(worker: Any, manager: LockManager) -> None:
    with manager.lock("report:busy-day", label="someone-else"):
        result = worker.send_task("redlock.nightly", args=["busy-day"]).get(timeout=30)
    assert was_skipped(result), result
    assert result["lock"] == "report:busy-day"
    assert result["reason"] == "busy"
    assert result["retry_after"] is not None and result["retry_after"] > 0
    log = worker.worker_log.read_text()
    assert "skipped: lock 'report:busy-day' is busy" in log
    # Once free, the same task runs.
    result = worker.send_task("redlock.nightly", args=["busy-day"]).get(timeout=30)
    assert not was_skipped(result) and result["lock"] == "report:busy-day"


def test_two_overlapping_runs_one_skips(worker: Any) -> None:
    """Two workers' threads pick the same job at once: one runs, the other skips."""
    first = worker.send_task("redlock.nightly", args=["overlap", 2.0])
    second = worker.send_task("redlock.nightly", args=["overlap", 2.0])
    results = [first.get(timeout=60), second.get(timeout=60)]
    skipped = [r for r in results if was_skipped(r)]
    ran = [r for r in results if not was_skipped(r)]
    assert len(skipped) == 1 and len(ran) == 1, results
    assert ran[0]["lock"] == skipped[0]["lock"] == "report:overlap"


def test_without_a_policy_the_task_fails_with_lock_not_acquired(worker: Any,
                                                                 manager: LockManager) -> None:
    with manager.lock("strict:k"):
        sent = worker.send_task("redlock.strict", args=["k"])
        with pytest.raises(Exception) as caught:
            sent.get(timeout=30)
    assert type(caught.value).__name__ == "LockNotAcquired"
    assert sent.state == "FAILURE"
