"""Busy policies for jobs that must not run twice (Celery tasks, cron'd functions).

``with_lock(..., on_busy=skip_if_busy)`` turns "the lock is busy" into a skipped
run instead of an exception::

    @shared_task
    @with_lock("report:<day>", timeout=0, on_busy=skip_if_busy)
    def nightly_report(day):
        ...

    result = nightly_report.delay("2024-05-01").get()
    if was_skipped(result):
        ...   # another worker was already building that report

The skip is logged (logger ``django_redlock.jobs``, level INFO) and the call
returns a plain ``dict`` (see :func:`skipped_result`), so it survives any Celery
result serializer (JSON included) and the caller, a chained task or Flower can
see that nothing ran and why. Only "busy" is skipped: no Redis quorum still
raises :class:`~django_redlock.QuorumUnavailable` (retry that, do not hide it).
"""

from __future__ import annotations

from typing import Any

from .exceptions import LockNotAcquired
from .transport.finalizers import get_logger

__all__ = ["SKIPPED_MARKER", "skip_if_busy", "skipped_result", "was_skipped"]

logger = get_logger("django_redlock.jobs")

#: The key that marks a skipped run's result.
SKIPPED_MARKER = "redlock_skipped"


def skipped_result(exc: LockNotAcquired) -> dict[str, Any]:
    """What a skipped run returns::

        {"redlock_skipped": True, "reason": "busy", "lock": "report:2024-05-01",
         "retry_after": 12.5}

    ``retry_after``: seconds left on the holder's lease when the run was skipped
    (None when unknown).
    """
    retry_after = getattr(exc, "retry_after", None)
    return {SKIPPED_MARKER: True, "reason": "busy", "lock": exc.lock_name,
            "retry_after": None if retry_after is None else round(float(retry_after), 3)}


def skip_if_busy(request: Any, exc: LockNotAcquired) -> Any:
    """An ``on_busy`` policy: log the skip and return :func:`skipped_result`.

    On a view (``request`` is not None) it is not what you want (the view must
    answer with a response); it is meant for tasks and other functions.
    """
    if request is not None:
        raise TypeError("skip_if_busy is a busy policy for tasks and functions, not views; "
                        "leave on_busy out for a 423 response")
    result = skipped_result(exc)
    logger.info("skipped: lock %r is busy (its lease has %s s left); nothing ran",
                exc.lock_name, result["retry_after"])
    return result


def was_skipped(result: Any) -> bool:
    """Whether ``result`` is the return value of a run skipped by :func:`skip_if_busy`."""
    return isinstance(result, dict) and result.get(SKIPPED_MARKER) is True
