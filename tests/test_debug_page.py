"""Django's debug page (and error e-mails) never show a node's password.

Django hides settings by name only, so ``REDLOCK_NODES`` is shown as written
unless ``DEFAULT_EXCEPTION_REPORTER_FILTER`` is django-redlock's filter (the
documented setting). Frame locals are masked at the source, filter or not.
"""

from __future__ import annotations

import sys
from typing import Any, Iterator
from urllib.parse import quote

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse
from django.test import Client, RequestFactory
from django.urls import path
from django.views.debug import (
    ExceptionReporter,
    get_default_exception_reporter_filter,
    technical_500_response,
)

import django_redlock
from django_redlock.conf import get_manager
from django_redlock.debug import RedlockExceptionReporterFilter, mask_credentials

# Built at run time: the debug page also shows this file's source lines.
PASSWORD = "".join(["Dbg7", "s3c", "ret"])
SPECIAL = "".join(["Dbg7", "/sl", "#sh"])
ENCODED_SPECIAL = quote(SPECIAL, safe="")


def boom(request: HttpRequest) -> HttpResponse:
    with django_redlock.lock("debug-page", timeout=0):
        return HttpResponse("unreachable with these settings")


urlpatterns = [path("boom/", boom)]


def _nodes(valid: bool) -> list[Any]:
    nodes: list[Any] = [f"redis://:{PASSWORD}@127.0.0.1:1/0",
                        {"URL": "redis://127.0.0.1:2/0", "OPTIONS": {"password": PASSWORD}},
                        f"redis://127.0.0.1:3/0?password={ENCODED_SPECIAL}"]
    if not valid:
        nodes.append(f"redis//:{PASSWORD}@127.0.0.1:4/0")  # a mistyped scheme: E004
    return nodes


@pytest.fixture
def redlock_filter(settings: Any) -> Iterator[None]:
    settings.DEFAULT_EXCEPTION_REPORTER_FILTER = (
        "django_redlock.debug.RedlockExceptionReporterFilter")
    get_default_exception_reporter_filter.cache_clear()  # Django caches the filter
    yield
    get_default_exception_reporter_filter.cache_clear()


def _assert_hidden(text: str) -> None:
    for secret in (PASSWORD, ENCODED_SPECIAL, SPECIAL):
        assert secret not in text


def _config_error() -> Any:
    try:
        get_manager()
    except ImproperlyConfigured:
        return sys.exc_info()
    raise AssertionError("the settings should be refused")


def test_the_debug_page_of_a_request_hides_node_passwords(settings: Any,
                                                          redlock_filter: None) -> None:
    settings.DEBUG = True
    settings.ROOT_URLCONF = __name__
    settings.REDLOCK_NODES = _nodes(valid=False)
    settings.CACHES = {**settings.CACHES, "locks": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": f"redis://:{PASSWORD}@127.0.0.1:5/1"}}
    response = Client(raise_request_exception=False).get("/boom/")
    assert response.status_code == 500
    html = response.content.decode()
    assert "ImproperlyConfigured" in html and "REDLOCK_NODES" in html
    assert "redis://:***@127.0.0.1:1/0" in html  # shown, masked
    _assert_hidden(html)


@pytest.mark.parametrize("valid", [True, False])
def test_technical_500_and_the_text_report_hide_node_passwords(settings: Any, redlock_filter: None,
                                                               valid: bool) -> None:
    settings.REDLOCK_NODES = _nodes(valid)
    request = RequestFactory().get("/")
    if valid:
        try:
            node = get_manager().nodes[0]
            kwargs = dict(node.spec.options)  # what the pool is built from
            raise RuntimeError(f"failed on {node.name} with {sorted(kwargs)}")
        except RuntimeError:
            exc_info = sys.exc_info()
    else:
        exc_info = _config_error()
    html = technical_500_response(request, *exc_info).content.decode()
    assert "REDLOCK_NODES" in html
    _assert_hidden(html)
    _assert_hidden(ExceptionReporter(request, *exc_info).get_traceback_text())


def test_frames_hold_no_password_even_with_djangos_own_filter(settings: Any) -> None:
    get_default_exception_reporter_filter.cache_clear()
    settings.REDLOCK_NODES = _nodes(valid=False)
    request = RequestFactory().get("/")
    frames = ExceptionReporter(request, *_config_error()).get_traceback_data()["frames"]
    assert frames
    for frame in frames:
        for _name, value in frame["vars"]:
            _assert_hidden(str(value))


def test_the_filter_masks_url_strings_in_frames_and_leaves_other_text_alone() -> None:
    url = f"redis://:{PASSWORD}@10.0.0.1:6379/0"
    node = {"URL": "redis://10.0.0.2:6379/0", "OPTIONS": {"password": PASSWORD, "max_connections": 4}}
    masked = mask_credentials({"nodes": [url, (f":{PASSWORD}@h",), node], "n": 3,
                               "mail": "ops@example.com", "note": "at 12:00 ask ops@example.com"})
    assert masked == {"nodes": ["redis://:***@10.0.0.1:6379/0", ("***@h",),
                                {"URL": "redis://10.0.0.2:6379/0",
                                 "OPTIONS": {"password": "***", "max_connections": 4}}],
                      "n": 3, "mail": "ops@example.com", "note": "at 12:00 ask ops@example.com"}
    cleansed = RedlockExceptionReporterFilter().cleanse_setting(
        "DATABASES", {"default": {"URL": f"postgres://app:{PASSWORD}@db/app", "PASSWORD": "x"}})
    assert cleansed["default"]["URL"] == "postgres://***@db/app"
    assert cleansed["default"]["PASSWORD"] != "x"  # Django's own rule still applies
