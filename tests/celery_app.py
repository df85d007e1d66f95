"""A Celery app for tests/test_celery_worker.py, loaded by a real ``celery worker``
process: ``REDLOCK_TEST_BROKER`` is the broker (and result backend), and
``DJANGO_SETTINGS_MODULE`` points at settings whose ``REDLOCK_NODES`` are the
suite's Redis nodes."""

from __future__ import annotations

import os
import time
from typing import Any

import django
from celery import Celery

django.setup()

from django_redlock.decorators import current_lock, with_lock  # noqa: E402
from django_redlock.jobs import skip_if_busy  # noqa: E402

app = Celery("redlock_tests")
app.conf.update(
    broker_url=os.environ["REDLOCK_TEST_BROKER"],
    result_backend=os.environ["REDLOCK_TEST_BROKER"],
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
)


def _held() -> dict[str, Any]:
    lock = current_lock()
    return {"lock": lock.name, "fence": lock.fence, "pid": os.getpid()}


@app.task(name="redlock.ping")
def ping() -> str:
    return "pong"


@app.task(name="redlock.nightly")
@with_lock("report:<day>", timeout=0, on_busy=skip_if_busy)
def nightly(day: str, seconds: float = 0.0) -> dict[str, Any]:
    time.sleep(seconds)
    return _held()


@app.task(name="redlock.invoice", bind=True)
@with_lock("invoice:<order.id>", timeout=0, on_busy=skip_if_busy)
def invoice(self: Any, order: dict[str, Any]) -> dict[str, Any]:
    return {**_held(), "task_id": self.request.id}


@app.task(name="redlock.strict")
@with_lock("strict:<key>", timeout=0)
def strict(key: str) -> dict[str, Any]:
    return _held()
