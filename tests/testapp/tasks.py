"""Plain functions decorated with with_lock (what a Celery task body looks like)."""

from __future__ import annotations

from typing import Any

from django_redlock.decorators import current_lock, with_lock

#: What the functions saw, for the tests to check.
SEEN: list[dict[str, Any]] = []


@with_lock("report:<day>", timeout=0)
def build_report(day: str, *, kind: str = "daily") -> str:
    lock = current_lock()
    SEEN.append({"name": lock.name, "fence": lock.fence, "kind": kind})
    return f"{kind}:{day}"


@with_lock("report:<kind>:<day>", timeout=0)
def build_kind_report(day: str, kind: str = "weekly") -> str:
    return current_lock().name


@with_lock("order:<payload.order_id>", timeout=0, on_busy=lambda request, exc: "skipped")
def handle_payload(payload: dict[str, Any], **options: Any) -> str:
    return current_lock().name


@with_lock("opt:<flavour>", timeout=0)
def with_var_kwargs(**options: Any) -> str:
    return current_lock().name


@with_lock("broken:<missing>", timeout=0)
def broken(day: str) -> str:  # pragma: no cover - never runs
    return day


@with_lock("unsafe:<value>", timeout=0)
def unsafe(value: Any) -> Any:  # pragma: no cover - never runs
    return value
