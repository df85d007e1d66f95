"""URLs for tests/test_panels.py: views that take locks, and the toolbar's own."""

from __future__ import annotations

import time
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.urls import include, path

import django_redlock
from django_redlock.decorators import with_lock


def always(request: HttpRequest) -> bool:
    return True


PAGE = "<html><body><p>{}</p></body></html>"


@with_lock("page:<pk>", ttl=0.3, auto_renew=True)
def locked_page(request: HttpRequest, pk: int) -> HttpResponse:
    time.sleep(0.35)  # long enough for the renewal thread to renew (every ttl / 3)
    return HttpResponse(PAGE.format(request.redlock.fence))


def busy_page(request: HttpRequest) -> HttpResponse:
    lock: Any = django_redlock.lock("report:daily", timeout=0)
    got = lock.acquire()
    return HttpResponse(PAGE.format(got))


def semaphore_page(request: HttpRequest) -> HttpResponse:
    """Waits in the line of semaphore "panel-sem" (1 permit) until the test's
    holder lets go, then holds the permit."""
    sem: Any = django_redlock.semaphore("panel-sem", 1, timeout=10)
    got = sem.acquire()
    if got:
        sem.release()
    return HttpResponse(PAGE.format(got))


def plain_page(request: HttpRequest) -> HttpResponse:
    return HttpResponse(PAGE.format("nothing"))


urlpatterns = [
    path("page/<int:pk>/", locked_page),
    path("busy/", busy_page),
    path("plain/", plain_page),
    path("semaphore/", semaphore_page),
    # debug_toolbar_urls() adds nothing unless DEBUG: the same, unconditionally.
    path("__debug__/", include("debug_toolbar.urls")),
]
