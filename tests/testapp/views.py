"""Views of the test app: every kind of target with_lock decorates."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.decorators import method_decorator
from django.views import View

from django_redlock.decorators import current_lock, with_lock

from .models import Counter, Product


def _increment(request: HttpRequest, name: str) -> dict[str, Any]:
    """A deliberately non-atomic read-modify-write: only the lock keeps it exact."""
    counter, _ = Counter.objects.get_or_create(name=name)
    value = counter.value
    delay = float(request.GET.get("delay", 0))
    if delay:
        time.sleep(delay)
    counter.value = value + 1
    counter.save(update_fields=["value"])
    lock = request.redlock  # type: ignore[attr-defined]
    return {"value": counter.value, "fence": lock.fence, "lock": lock.name,
            "same": current_lock() is lock}


@with_lock("counter:<name>", timeout=20)
def counter_incr(request: HttpRequest, name: str) -> JsonResponse:
    return JsonResponse(_increment(request, name))


@with_lock("busy:<name>", timeout=0)
def busy(request: HttpRequest, name: str) -> HttpResponse:
    return HttpResponse("ran")


def _custom_busy(request: HttpRequest, exc: Exception) -> HttpResponse:
    return HttpResponse(f"custom busy: {exc.lock_name}", status=409)  # type: ignore[attr-defined]


@with_lock("busy:<name>", timeout=0, on_busy=_custom_busy)
def busy_custom(request: HttpRequest, name: str) -> HttpResponse:
    return HttpResponse("ran")


@with_lock("user:<request.user.pk>", timeout=0)
def per_user(request: HttpRequest) -> HttpResponse:
    return HttpResponse(request.redlock.name)  # type: ignore[attr-defined]


@with_lock("day:<request.GET.day>:<user.pk>", timeout=0)
def per_day(request: HttpRequest) -> HttpResponse:
    return HttpResponse(request.redlock.name)  # type: ignore[attr-defined]


@with_lock("q:<request.GET.day>", timeout=0)
def per_query(request: HttpRequest) -> HttpResponse:
    return HttpResponse(request.redlock.name)  # type: ignore[attr-defined]


@with_lock("aq:<request.GET.day>", timeout=0)
async def aper_query(request: HttpRequest) -> HttpResponse:
    return HttpResponse(request.redlock.name)  # type: ignore[attr-defined]


@with_lock("broken:<nope>", timeout=0)
def broken(request: HttpRequest, pk: int) -> HttpResponse:  # pragma: no cover - never runs
    return HttpResponse("ran")


@with_lock("product:<pk>", atomic=True, ttl=0.4, auto_renew=False, timeout=5)
def atomic_restock(request: HttpRequest, pk: int) -> HttpResponse:
    """Adds 100 inside transaction.atomic(); ?sleep=... outlives the 0.4 s lease."""
    product = Product.objects.get(pk=pk)
    product.stock += 100
    product.save(update_fields=["stock"])
    time.sleep(float(request.GET.get("sleep", 0)))
    return HttpResponse(str(product.stock))


@with_lock("slow:<name>", ttl=0.6, timeout=5)
def slow(request: HttpRequest, name: str) -> HttpResponse:
    """Outlives several 0.6 s leases: views renew by default, so the lock holds."""
    time.sleep(float(request.GET.get("sleep", 0)))
    lock = request.redlock  # type: ignore[attr-defined]
    return JsonResponse({"owned": lock.owned(), "auto_renew": lock.auto_renew,
                         "label": lock.label})


@method_decorator(with_lock("cbv:<name>", timeout=20), name="dispatch")
class CounterView(View):
    """A class-based view locked around dispatch()."""

    def get(self, request: HttpRequest, name: str) -> JsonResponse:
        lock = request.redlock  # type: ignore[attr-defined]
        return JsonResponse({"lock": lock.name, "label": lock.label, "owned": lock.owned()})

    def post(self, request: HttpRequest, name: str) -> JsonResponse:
        return JsonResponse(_increment(request, name))


class MethodLockedView(View):
    """A class-based view with the decorator directly on one handler."""

    suffix = "m"

    @with_lock("cbvm:<name>:<self.suffix>", timeout=0)
    def post(self, request: HttpRequest, name: str) -> JsonResponse:
        lock = request.redlock  # type: ignore[attr-defined]
        return JsonResponse({"lock": lock.name, "label": lock.label})

    def get(self, request: HttpRequest, name: str) -> JsonResponse:
        return JsonResponse({"locked": hasattr(request, "redlock")})


#: The async views' counters: an in-process read-modify-write with an await in the middle.
ASYNC_COUNTS: dict[str, int] = {}


@with_lock("acounter:<name>", timeout=20)
async def acounter(request: HttpRequest, name: str) -> JsonResponse:
    value = ASYNC_COUNTS.get(name, 0)
    await asyncio.sleep(float(request.GET.get("delay", 0)))
    ASYNC_COUNTS[name] = value + 1
    lock = request.redlock  # type: ignore[attr-defined]
    return JsonResponse({"value": value + 1, "fence": lock.fence, "lock": lock.name,
                         "label": lock.label, "same": current_lock() is lock})


async def acounter_unlocked(request: HttpRequest, name: str) -> JsonResponse:
    """The same body without the lock: concurrent requests lose updates."""
    value = ASYNC_COUNTS.get(name, 0)
    await asyncio.sleep(float(request.GET.get("delay", 0)))
    ASYNC_COUNTS[name] = value + 1
    return JsonResponse({"value": value + 1})


@with_lock("abusy:<name>", timeout=0)
async def abusy(request: HttpRequest, name: str) -> HttpResponse:
    return HttpResponse("ran")


@method_decorator(with_lock("acbv:<name>", timeout=20), name="dispatch")
class AsyncCounterView(View):
    """An async class-based view locked around dispatch()."""

    async def post(self, request: HttpRequest, name: str) -> JsonResponse:
        value = ASYNC_COUNTS.get(name, 0)
        await asyncio.sleep(float(request.GET.get("delay", 0)))
        ASYNC_COUNTS[name] = value + 1
        lock = request.redlock  # type: ignore[attr-defined]
        return JsonResponse({"value": value + 1, "lock": lock.name})


class AsyncMethodView(View):
    """An async class-based view with the decorator on the handler."""

    @with_lock("acbvm:<name>", timeout=0)
    async def get(self, request: HttpRequest, name: str) -> JsonResponse:
        return JsonResponse({"lock": request.redlock.name})  # type: ignore[attr-defined]
