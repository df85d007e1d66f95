"""The HTTP answers of a decorated view that could not get its lock.

Two different situations, two different answers (peers fold them into one, and
their users keep asking to tell them apart):

* **busy**: someone else holds the lock past the view's ``timeout``. The client
  should retry later: ``REDLOCK["BUSY_STATUS"]`` (423 Locked by default) with
  ``Retry-After`` = the holder's remaining lease, rounded up, at least 1 s.
* **unavailable**: fewer than a quorum of Redis nodes answered. That is an
  outage, not contention: 503 with ``Retry-After``, logged once at ERROR on
  ``django_redlock.views`` (and not a second time by ``django.request``), never
  a 500 traceback page.

The body fits the client: JSON (``{"error": "locked", "lock": ..., "retry_after":
...}``) when the ``Accept`` header prefers JSON, or when there is no preference
and the request itself is JSON; short plain text otherwise.
"""

from __future__ import annotations

import json
import math
from typing import Any

from django.http import HttpRequest, HttpResponse

from .exceptions import LockNotAcquired, QuorumUnavailable
from .transport.finalizers import get_logger

__all__ = [
    "UNAVAILABLE_RETRY_AFTER",
    "busy_response",
    "retry_after_seconds",
    "unavailable_response",
    "wants_json",
]

logger = get_logger("django_redlock.views")

#: ``Retry-After`` (seconds) of the 503 answered when Redis has no quorum: long
#: enough not to hammer nodes that are down, short enough for a blip.
UNAVAILABLE_RETRY_AFTER = 5

_JSON_TYPES = ("application/json",)
_TEXT_TYPES = ("text/html", "text/plain", "text/*", "application/xhtml+xml")


def retry_after_seconds(seconds: float | None) -> int:
    """Whole seconds for ``Retry-After``: rounded up, never below 1."""
    if seconds is None or not math.isfinite(seconds):
        return 1
    return max(1, math.ceil(seconds))


def _quality(params: str) -> float:
    for param in params.split(";"):
        key, _, value = param.strip().partition("=")
        if key.strip().lower() == "q":
            try:
                return max(0.0, min(1.0, float(value)))
            except ValueError:
                return 0.0
    return 1.0


def wants_json(request: Any) -> bool:
    """Whether the client prefers a JSON body.

    ``Accept`` decides when it names JSON or text/HTML (the higher ``q`` wins,
    a tie goes to text); ``*/*`` expresses no preference, and then a request whose
    own body is JSON is answered in JSON.
    """
    headers = getattr(request, "headers", {}) or {}
    accept = headers.get("Accept", "") or ""
    json_q = text_q = 0.0
    for item in accept.split(","):
        media, _, params = item.partition(";")
        media = media.strip().lower()
        if not media:
            continue
        q = _quality(params)
        if media in _JSON_TYPES or media.endswith("+json"):
            json_q = max(json_q, q)
        elif media in _TEXT_TYPES:
            text_q = max(text_q, q)
    if json_q or text_q:
        return json_q > text_q
    content_type = (getattr(request, "content_type", "") or "").lower()
    return content_type in _JSON_TYPES or content_type.endswith("+json")


def _response(request: Any, status: int, retry_after: int, payload: dict[str, Any],
              text: str) -> HttpResponse:
    if wants_json(request):
        response = HttpResponse(json.dumps(payload), status=status,
                                content_type="application/json")
    else:
        response = HttpResponse(text, status=status, content_type="text/plain; charset=utf-8")
    response["Retry-After"] = str(retry_after)
    response["Cache-Control"] = "no-store"
    # We logged it ourselves with the lock's name; keep django.request from adding
    # a second, context-free line for the same event.
    response._has_been_logged = True  # type: ignore[attr-defined]
    return response


def busy_response(request: HttpRequest | Any, exc: LockNotAcquired, *,
                  status: int = 423, lock_name: str | None = None) -> HttpResponse:
    """The answer to "the lock stayed busy past the timeout": ``status`` + ``Retry-After``."""
    name = lock_name or exc.lock_name or ""
    seconds = retry_after_seconds(exc.retry_after)
    logger.info("lock %r busy; answered %d, retry after %d s", name, status, seconds)
    return _response(
        request, status, seconds,
        {"error": "locked", "lock": name, "retry_after": seconds},
        f"Locked: {name} is busy, retry after {seconds} s.\n")


def unavailable_response(request: HttpRequest | Any, exc: QuorumUnavailable, *,
                         lock_name: str | None = None,
                         retry_after: int = UNAVAILABLE_RETRY_AFTER) -> HttpResponse:
    """The answer to "Redis has no quorum": 503 + ``Retry-After``, logged once at ERROR."""
    name = lock_name or exc.lock_name or ""
    path = getattr(request, "path", "?")
    # The message names nodes by their masked display name, never a password.
    # The path is the client's (a decoded URL may hold a line break or an
    # escape sequence, which would forge log lines): shown as a repr, as
    # django.request escapes it in the line this response keeps it from writing.
    logger.error("lock %r for %r: Redis quorum unavailable (%d answered, %d needed); "
                 "answered 503: %s", name, path, exc.answered, exc.needed, exc)
    return _response(
        request, 503, retry_after,
        {"error": "unavailable", "lock": name, "retry_after": retry_after},
        f"Service unavailable: the lock service cannot be reached, retry after "
        f"{retry_after} s.\n")
