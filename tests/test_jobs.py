"""``django_redlock.jobs.skip_if_busy`` in-process (the real worker is in
tests/test_celery_worker.py)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from django.test import RequestFactory

from django_redlock import lock
from django_redlock.decorators import with_lock
from django_redlock.jobs import skip_if_busy, was_skipped


@with_lock("job:<key>", timeout=0, on_busy=skip_if_busy)
def job(key: str) -> str:
    return "ran"


def test_skipped_when_busy_logged_and_visible(caplog: Any) -> None:
    assert job("a") == "ran"
    with lock("job:a"), caplog.at_level(logging.INFO, logger="django_redlock.jobs"):
        result = job("a")
    assert was_skipped(result)
    assert result["lock"] == "job:a" and result["reason"] == "busy"
    assert "skipped: lock 'job:a' is busy" in caplog.text
    assert not was_skipped("ran") and not was_skipped({"redlock_skipped": "yes"})


def test_not_a_view_policy() -> None:
    @with_lock("view:<name>", timeout=0, on_busy=skip_if_busy)
    def view(request: Any, name: str) -> Any:  # pragma: no cover - never runs
        return None

    with lock("view:x"), pytest.raises(TypeError, match="not views"):
        view(RequestFactory().get("/"), name="x")
