"""with_lock on every target: function views, class-based views (dispatch and a
handler), async views, model methods and plain functions; busy and quorum-loss
answers; atomic=True; signals. Real Redis (the session nodes) throughout."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db.models import F
from django.http import HttpResponse
from django.test import AsyncClient, Client, RequestFactory
from django.utils.decorators import method_decorator
from django.views import View

import django_redlock
from django_redlock import signals
from django_redlock.core.keys import InvalidLockName
from django_redlock.decorators import current_lock, with_lock
from django_redlock.exceptions import LockLost, LockNotAcquired, QuorumUnavailable
from tests.testapp import tasks, views
from tests.testapp.models import Product


def _has_alock() -> bool:
    return hasattr(django_redlock.LockManager, "alock")


needs_alock = pytest.mark.skipif(not _has_alock(), reason="LockManager.alock is not there yet")


@pytest.fixture
def client() -> Client:
    return Client()


@pytest.fixture
def held() -> Iterator[Any]:
    """Hold a lock from outside the request (another holder), released at teardown."""
    taken: list[Any] = []

    def hold(name: str, ttl: float = 5.0) -> Any:
        lock = django_redlock.lock(name, ttl=ttl, auto_renew=False)
        assert lock.acquire(timeout=0)
        taken.append(lock)
        return lock

    yield hold
    for lock in taken:
        if lock.owned():
            lock.release()


@pytest.fixture
def recorded() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """(signal name, kwargs) of every lock signal sent during the test."""
    seen: list[tuple[str, dict[str, Any]]] = []
    receivers = {}
    for sig_name in ("lock_acquired", "lock_released", "lock_lost"):
        def receiver(sender: Any, _n: str = sig_name, **kwargs: Any) -> None:
            seen.append((_n, kwargs))
        receivers[sig_name] = receiver
        getattr(signals, sig_name).connect(receiver, weak=False)
    yield seen
    for sig_name, receiver in receivers.items():
        getattr(signals, sig_name).disconnect(receiver)


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


# -- function views ----------------------------------------------------------------
@pytest.mark.django_db
def test_function_view_holds_the_lock_and_exposes_it(client: Client,
                                                     recorded: list[Any]) -> None:
    body = client.post("/counter/a/incr/").json()
    assert body["lock"] == "counter:a" and body["value"] == 1 and body["fence"] > 0
    assert body["same"] is True  # request.redlock is current_lock()
    kinds = [(k, kw["name"]) for k, kw in recorded]
    assert kinds == [("lock_acquired", "counter:a"), ("lock_released", "counter:a")]
    acquired, released = recorded[0][1], recorded[1][1]
    assert acquired["fence"] == released["fence"] == body["fence"]
    assert acquired["wait"] >= 0 and released["held"] >= 0
    assert acquired["lock"].label == "view:tests.testapp.views.counter_incr"
    assert not django_redlock.lock("counter:a").locked()
    second = client.post("/counter/a/incr/").json()
    assert second["value"] == 2 and second["fence"] > body["fence"]


def test_views_renew_by_default_even_when_settings_say_no(client: Client, settings: Any) -> None:
    # A node timeout well under the lease, so one slow round on this shared
    # machine cannot eat a whole lease.
    settings.REDLOCK = {"NODE_TIMEOUT": 0.1, "TTL": 10, "AUTO_RENEW": False}
    body = client.get("/slow/s/?sleep=1.5").json()  # > 2 leases of 0.6 s
    assert body == {"owned": True, "auto_renew": True, "label": "view:tests.testapp.views.slow"}


def test_busy_view_answers_423_json_with_retry_after(client: Client, held: Any) -> None:
    held("busy:x", ttl=5)
    response = client.get("/busy/x/", headers={"accept": "application/json"})
    assert response.status_code == 423
    assert response["Content-Type"] == "application/json"
    assert response["Retry-After"] == "5"  # ceil of the holder's ~4.99 s left
    assert response.json() == {"error": "locked", "lock": "busy:x", "retry_after": 5}


def test_busy_view_answers_text_to_browsers(client: Client, held: Any) -> None:
    held("busy:x", ttl=2)
    browser = "text/html,application/xhtml+xml,*/*;q=0.8"
    response = client.get("/busy/x/", headers={"accept": browser})
    assert response.status_code == 423
    assert response["Content-Type"].startswith("text/plain")
    assert 1 <= int(response["Retry-After"]) <= 2
    assert "busy:x" in response.content.decode()


def test_busy_json_request_body_gets_json(client: Client, held: Any) -> None:
    held("busy:x")
    response = client.post("/busy/x/", data=json.dumps({"a": 1}),
                           content_type="application/json")
    assert response.status_code == 423 and response.json()["error"] == "locked"


def test_busy_status_setting_and_free_lock(client: Client, held: Any, settings: Any) -> None:
    assert client.get("/busy/x/").content == b"ran"
    settings.REDLOCK = {"NODE_TIMEOUT": 0.5, "BUSY_STATUS": 429}
    held("busy:x")
    response = client.get("/busy/x/")
    assert response.status_code == 429 and "Retry-After" in response


def test_on_busy_overrides_the_answer(client: Client, held: Any) -> None:
    held("busy:y")
    response = client.get("/busy-custom/y/")
    assert response.status_code == 409
    assert response.content == b"custom busy: busy:y"


def test_quorum_loss_is_a_logged_503_not_a_500(client: Client, settings: Any,
                                               caplog: pytest.LogCaptureFixture) -> None:
    settings.REDLOCK_NODES = [_dead_url()]
    caplog.set_level(logging.INFO)
    started = time.monotonic()
    response = client.get("/busy/q/", headers={"accept": "application/json"})
    assert time.monotonic() - started < 5
    assert response.status_code == 503
    assert response["Retry-After"] == "5"
    assert response.json() == {"error": "unavailable", "lock": "busy:q", "retry_after": 5}
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]  # not again by django.request
    assert errors[0].name == "django_redlock.views" and "busy:q" in errors[0].getMessage()
    text = client.get("/busy/q/", headers={"accept": "text/plain"})
    assert text.status_code == 503 and text["Content-Type"].startswith("text/plain")


def test_the_503_log_line_cannot_be_forged_through_the_path(
        caplog: pytest.LogCaptureFixture) -> None:
    """A URL segment that is not part of the lock name reaches the 503's log
    line decoded: a line break and an escape sequence in it forged a log line
    ("FAKE INFO admin logged in"), and the response keeps django.request,
    which escapes the path, from logging it. The path is shown as a repr."""
    from django_redlock.responses import unavailable_response

    request = RequestFactory().post("/shop/1/x%0AFAKE%20INFO%20admin%20logged%20in%1b[31m/")
    assert "\n" in request.path
    exc = QuorumUnavailable("no quorum", lock_name="stock:1", answered=0, needed=2)
    with caplog.at_level(logging.ERROR, logger="django_redlock.views"):
        response = unavailable_response(request, exc)
    assert response.status_code == 503
    (line,) = [r.getMessage() for r in caplog.records]
    assert "\n" not in line and "\x1b" not in line and "\\n" in line, line


def test_a_client_value_cannot_name_a_member_of_a_lock_family(
        make_manager: Any, session_nodes: Any) -> None:
    """``?doc=5#line`` rendered ``doc:5#line``, the waiting line of
    ``semaphore("doc:5")``: a client held it, and the semaphore refused every
    acquirer with all its permits free (``#0``: a permit; ``[0]``: a
    segment). A value that ends like a family member's name is refused: the
    client's mistake, 400, and no lock is taken."""
    from django.core.exceptions import BadRequest

    mgr = make_manager(session_nodes)

    @with_lock("doc:<request.GET.doc>", manager=mgr, timeout=0)
    def view(request: Any) -> HttpResponse:
        return HttpResponse("ok")

    for bad in ("5#line", "5#0", "5#free", "x[0]", "x[free]"):
        with pytest.raises(BadRequest, match="family"):
            view(RequestFactory().get("/", {"doc": bad}))
    assert view(RequestFactory().get("/", {"doc": "5#draft"})).status_code == 200
    permits = mgr.semaphore("doc:5", 3, timeout=0.5)
    assert permits.acquire()  # its line was never taken
    permits.release()


def test_quorum_loss_in_a_plain_function_raises(settings: Any) -> None:
    settings.REDLOCK_NODES = [_dead_url()]
    with pytest.raises(QuorumUnavailable):
        tasks.build_report("mon")


# -- placeholders ------------------------------------------------------------------
def test_placeholders_from_request() -> None:
    rf = RequestFactory()
    request = rf.get("/per-user/")
    request.user = SimpleNamespace(pk=5)
    assert views.per_user(request).content == b"user:5"
    request = rf.get("/per-day/?day=mon")
    request.user = SimpleNamespace(pk=6)
    assert views.per_day(request).content == b"day:mon:6"
    assert not hasattr(request, "redlock")  # only while the view runs


def test_anonymous_user_is_rejected_not_locked_as_none() -> None:
    request = RequestFactory().get("/per-user/")
    request.user = SimpleNamespace(pk=None)
    with pytest.raises(InvalidLockName, match=r"<request.user.pk>.*resolved to None"):
        views.per_user(request)


def test_unresolvable_view_placeholder_names_it_and_the_view(client: Client) -> None:
    with pytest.raises(ImproperlyConfigured) as info:
        client.get("/broken/3/")
    message = str(info.value)
    assert "<nope>" in message and "tests.testapp.views.broken" in message
    assert "pk" in message  # the URL kwargs it did get


def test_bad_template_fails_at_decoration_time() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"with_lock\('stock:<pk'\).*unbalanced"):
        with_lock("stock:<pk")
    with pytest.raises(TypeError, match="on_busy"):
        with_lock("x", on_busy="nope")  # type: ignore[arg-type]


# -- class-based views ---------------------------------------------------------------
@pytest.mark.django_db
def test_cbv_dispatch(client: Client) -> None:
    body = client.get("/cbv/k/").json()
    assert body == {"lock": "cbv:k", "label": "view:tests.testapp.views.CounterView.dispatch",
                    "owned": True}
    assert client.post("/cbv/k/").json()["value"] == 1
    assert client.post("/cbv/k/").json()["value"] == 2


def test_cbv_method(client: Client, held: Any) -> None:
    body = client.post("/cbv-method/k/").json()
    assert body == {"lock": "cbvm:k:m", "label": "view:tests.testapp.views.MethodLockedView.post"}
    assert client.get("/cbv-method/k/").json() == {"locked": False}
    held("cbvm:k:m")
    assert client.post("/cbv-method/k/").status_code == 423


# -- model methods and plain functions ------------------------------------------------
@pytest.mark.django_db
def test_model_method_resolves_from_self(recorded: list[Any], held: Any) -> None:
    product = Product.objects.create(name="p", stock=1)
    assert product.restock(4) == 5
    assert Product.objects.get(pk=product.pk).stock == 5
    names = [kw["name"] for k, kw in recorded if k == "lock_acquired"]
    assert names == [f"restock:{product.pk}"]
    assert recorded[0][1]["lock"].label == "func:tests.testapp.models.Product.restock"
    held(f"restock:{product.pk}", ttl=3)
    with pytest.raises(LockNotAcquired) as info:
        product.restock(1)
    assert info.value.lock_name == f"restock:{product.pk}" and info.value.retry_after > 1


def test_plain_function_from_bound_arguments(held: Any) -> None:
    tasks.SEEN.clear()
    assert tasks.build_report("mon") == "daily:mon"
    assert tasks.build_report(day="tue", kind="hourly") == "hourly:tue"
    assert [s["name"] for s in tasks.SEEN] == ["report:mon", "report:tue"]
    assert all(s["fence"] > 0 for s in tasks.SEEN)
    assert current_lock() is None  # only inside the call
    assert tasks.build_kind_report("mon") == "report:weekly:mon"  # defaults applied
    assert tasks.with_var_kwargs(flavour="mint") == "opt:mint"  # **kwargs searched too
    assert tasks.handle_payload({"order_id": 9}) == "order:9"  # mapping keys
    held("order:9")
    assert tasks.handle_payload({"order_id": 9}) == "skipped"  # on_busy(None, exc)
    held("report:wed")
    with pytest.raises(LockNotAcquired):
        tasks.build_report("wed")


def test_plain_function_errors() -> None:
    with pytest.raises(ImproperlyConfigured) as info:
        tasks.broken("mon")
    assert "<missing>" in str(info.value) and "tests.testapp.tasks.broken" in str(info.value)
    assert "day" in str(info.value)
    for bad, message in ((None, "resolved to None"), ("", "empty"), ("x" * 300, "limit is 200"),
                         ("a\nb", "control character")):
        with pytest.raises(InvalidLockName, match=message):
            tasks.unsafe(bad)


def test_explicit_manager_and_nesting(make_manager: Any, session_nodes: Any) -> None:
    other = make_manager(session_nodes, key_prefix="other")

    @with_lock("inner:<x>", manager=other, timeout=0)
    def inner(x: int) -> str:
        return current_lock().key

    @with_lock("outer:<x>", timeout=0, label="custom-label")
    def outer(x: int) -> tuple[str, str, str]:
        before = current_lock()
        key = inner(x)
        assert current_lock() is before  # restored after the inner call
        return before.name, before.label, key

    assert outer(1) == ("outer:1", "custom-label", "other:inner:1")


def test_a_derived_label_longer_than_the_limit_is_cut_not_refused(make_manager: Any,
                                                                   session_nodes: Any) -> None:
    """A label given to with_lock is checked when it decorates; the one it
    derives from the function's module and qualified name is not the
    caller's input: a long one is cut to the limit, never a refused request."""
    from django_redlock.core.arguments import LABEL_MAX

    mgr = make_manager(session_nodes)

    def body() -> str:
        return str(current_lock().label)

    body.__qualname__ = "Very" * 60 + ".body"
    locked = with_lock("long-label", manager=mgr, timeout=0)(body)
    label = locked()
    assert len(label) == LABEL_MAX and label.startswith("func:") and label.endswith("...")


def test_body_exception_propagates_and_releases() -> None:
    @with_lock("boom:<x>", timeout=0)
    def boom(x: int) -> None:
        raise KeyError(x)

    with pytest.raises(KeyError):
        boom(1)
    assert not django_redlock.lock("boom:1").locked()


# -- atomic=True ----------------------------------------------------------------------
@pytest.mark.django_db
def test_atomic_commits_while_held_and_rolls_back_after_a_lost_lease(
        client: Client, recorded: list[Any]) -> None:
    product = Product.objects.create(name="p", stock=0)
    assert client.post(f"/product/{product.pk}/atomic-restock/").content == b"100"
    assert Product.objects.get(pk=product.pk).stock == 100
    with pytest.raises(LockLost):  # the 0.4 s lease ran out during a 0.7 s body
        client.post(f"/product/{product.pk}/atomic-restock/?sleep=0.7")
    assert Product.objects.get(pk=product.pk).stock == 100  # rolled back
    assert [k for k, kw in recorded].count("lock_lost") == 1


@pytest.mark.django_db
def test_atomic_rolls_back_when_the_lock_is_taken_away(make_manager: Any,
                                                       session_nodes: Any) -> None:
    operator = make_manager(session_nodes)
    product = Product.objects.create(name="p", stock=0)

    @with_lock("taken:<pk>", atomic=True, ttl=0.3, auto_renew=True, timeout=0)
    def adjust(pk: int) -> None:
        Product.objects.filter(pk=pk).update(stock=7)
        operator.force_release(f"taken:{pk}")
        time.sleep(0.3)  # the renewal (every 0.1 s) finds the key gone

    with pytest.raises(LockLost):
        adjust(product.pk)
    assert Product.objects.get(pk=product.pk).stock == 0


@pytest.mark.django_db
def test_atomic_refuses_to_run_inside_an_open_transaction(
        client: Client, recorded: list[Any], caplog: pytest.LogCaptureFixture) -> None:
    """Inside a transaction already open (an outer atomic(), ATOMIC_REQUESTS)
    the body's writes commit after the lock is released: another holder could
    read the old stock meanwhile and a sale was lost (a review drove it with
    two requests). ``atomic=True`` refuses before the lock is taken; a body
    without it runs, with a warning once per function."""
    from django.db import connection, transaction

    product = Product.objects.create(name="p", stock=0)

    @with_lock("nested:<pk>", atomic=True, timeout=0)
    def adjust(pk: int) -> None:  # pragma: no cover - never runs
        Product.objects.filter(pk=pk).update(stock=7)

    with transaction.atomic(), pytest.raises(RuntimeError, match="open transaction"):
        adjust(product.pk)
    saved = connection.settings_dict["ATOMIC_REQUESTS"]
    connection.settings_dict["ATOMIC_REQUESTS"] = True
    try:
        with pytest.raises(RuntimeError, match="ATOMIC_REQUESTS"):
            client.post(f"/product/{product.pk}/atomic-restock/")
    finally:
        connection.settings_dict["ATOMIC_REQUESTS"] = saved
    assert Product.objects.get(pk=product.pk).stock == 0
    assert [k for k, _ in recorded].count("lock_acquired") == 0  # nothing was sent

    @with_lock("nested-plain:<pk>", timeout=0)
    def plain(pk: int) -> None:
        Product.objects.filter(pk=pk).update(stock=F("stock") + 1)

    with caplog.at_level(logging.WARNING, logger="django_redlock.decorators"):
        with transaction.atomic():
            plain(product.pk)
            plain(product.pk)
    assert Product.objects.get(pk=product.pk).stock == 2
    warned = [r for r in caplog.records if "open transaction" in r.getMessage()]
    assert len(warned) == 1 and "fenced writes" in warned[0].getMessage()


@pytest.mark.django_db  # response.close() sends request_finished (closes old connections)
def test_a_streaming_view_holds_its_lock_until_the_stream_ends(
        make_manager: Any, session_nodes: Any) -> None:
    """A view's streaming body runs after the view returned: it used to run
    with the lock already released, and another client took it while the
    rows were still being sent. The lock is released when the stream ends,
    or when the response is closed before the first chunk."""
    from django.http import StreamingHttpResponse

    mgr = make_manager(session_nodes)
    other = make_manager(session_nodes)
    seen: list[bool] = []

    @with_lock("export:<pk>", manager=mgr, timeout=0)
    def export(request: Any, pk: int) -> StreamingHttpResponse:
        def rows() -> Iterator[bytes]:
            seen.append(other.lock(f"export:{pk}").acquire(timeout=0))
            yield b"row\n"
        return StreamingHttpResponse(rows())

    response = export(RequestFactory().get("/x"), pk=1)
    assert other.lock("export:1").acquire(timeout=0) is False  # held while not yet sent
    assert b"".join(response.streaming_content) == b"row\n"
    assert seen == [False]  # nobody else inside while it streamed
    probe = other.lock("export:1")
    assert probe.acquire(timeout=0)  # released once it ended
    probe.release()
    response.close()  # closing after the end releases nothing twice

    unsent = export(RequestFactory().get("/x"), pk=2)
    assert other.lock("export:2").acquire(timeout=0) is False
    unsent.close()  # the client went away before the first chunk
    probe = other.lock("export:2")
    assert probe.acquire(timeout=0)
    probe.release()


def test_atomic_is_refused_on_async_functions() -> None:
    with pytest.raises(ImproperlyConfigured, match="atomic=True"):
        @with_lock("a:<x>", atomic=True)
        async def f(x: int) -> None:  # pragma: no cover - never runs
            pass


def test_atomic_is_refused_on_async_class_based_views() -> None:
    @method_decorator(with_lock("acbv-atomic", atomic=True), name="dispatch")
    class AtomicAsyncView(View):
        async def get(self, request: Any) -> HttpResponse:  # pragma: no cover - never runs
            return HttpResponse("ran")

    with pytest.raises(ImproperlyConfigured, match="the view is async"):
        AtomicAsyncView.as_view()(RequestFactory().get("/"))


# -- async -------------------------------------------------------------------------------
@needs_alock
def test_async_view_and_busy(held: Any) -> None:
    async def run() -> list[Any]:
        client = AsyncClient()
        first = await client.get("/async/counter/z/")
        held("abusy:z", ttl=3)
        busy = await client.get("/async/busy/z/", headers={"accept": "application/json"})
        method = await client.get("/async/cbv-method/z/")
        return [first, busy, method]

    first, busy, method = asyncio.run(run())
    body = first.json()
    assert body["lock"] == "acounter:z" and body["fence"] > 0 and body["same"] is True
    assert body["label"] == "view:tests.testapp.views.acounter"
    assert busy.status_code == 423 and busy.json()["lock"] == "abusy:z"
    assert 1 <= int(busy["Retry-After"]) <= 3
    assert method.json() == {"lock": "acbvm:z"}


@needs_alock
def test_async_quorum_loss_is_503(settings: Any) -> None:
    settings.REDLOCK_NODES = [_dead_url()]
    response = asyncio.run(AsyncClient().get("/async/busy/q/"))
    assert response.status_code == 503 and response["Retry-After"] == "5"


@needs_alock
def test_async_plain_function(held: Any) -> None:
    @with_lock("af:<x>", timeout=0)
    async def af(x: int) -> str:
        await asyncio.sleep(0)
        return current_lock().name

    assert asyncio.run(af(1)) == "af:1"
    held("af:2")
    with pytest.raises(LockNotAcquired):
        asyncio.run(af(2))


# -- the lock lost after the view's protected write ------------------------------------
def _wait_lost(lock: Any) -> None:
    deadline = time.monotonic() + 5
    while lock.owned() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not lock.owned()


@pytest.mark.django_db
def test_a_committed_fenced_write_keeps_the_views_response_when_the_nodes_lose_the_lock(
        session_nodes: Any, recorded: list[Any], caplog: pytest.LogCaptureFixture) -> None:
    """FLUSHALL on the nodes while a view runs: its fenced save committed, so the
    client is told the sale happened (200), not 500; the loss is signalled and logged."""
    product = Product.objects.create(name="p", stock=5)

    @with_lock(Product.lock_template(), ttl=0.4, auto_renew=True)
    def sell(request: Any, pk: int) -> HttpResponse:
        row = Product.objects.claim_and_get(request.redlock, pk=pk)
        row.stock -= 1
        row.fenced_save(request.redlock, update_fields=["stock"])
        session_nodes.flushall()   # the nodes lose their data
        _wait_lost(request.redlock)  # the renewal finds out
        return HttpResponse(str(row.stock))

    with caplog.at_level(logging.WARNING, logger="django_redlock.decorators"):
        response = sell(RequestFactory().post("/"), pk=product.pk)
    assert (response.status_code, response.content) == (200, b"4")
    assert Product.objects.get(pk=product.pk).stock == 4
    assert [k for k, _ in recorded].count("lock_lost") == 1
    assert "response stands" in caplog.text and "fenced write" in caplog.text


@pytest.mark.django_db
def test_a_view_without_a_protected_write_still_raises_lock_lost(session_nodes: Any) -> None:
    product = Product.objects.create(name="p", stock=5)

    @with_lock(Product.lock_template(), ttl=0.4, auto_renew=True)
    def sell(request: Any, pk: int) -> HttpResponse:
        Product.objects.filter(pk=pk).update(stock=4)  # not fenced: nothing vouches for it
        session_nodes.flushall()
        _wait_lost(request.redlock)
        return HttpResponse("ok")

    with pytest.raises(LockLost):
        sell(RequestFactory().post("/"), pk=product.pk)

    @with_lock(Product.lock_template(), ttl=0.4, auto_renew=True)
    def refused(request: Any, pk: int) -> HttpResponse:
        row = Product.objects.get(pk=pk)
        Product.objects.filter(pk=pk).update(fence=2**62)  # a "newer holder" wrote
        row.stock -= 1
        with pytest.raises(django_redlock.FencedWriteRejected):
            row.fenced_save(request.redlock)
        session_nodes.flushall()
        _wait_lost(request.redlock)
        return HttpResponse("refused", status=409)

    with pytest.raises(LockLost):  # a refused write vouches for nothing either
        refused(RequestFactory().post("/"), pk=product.pk)


@pytest.mark.django_db(transaction=True)
def test_an_atomic_view_that_committed_keeps_its_response(session_nodes: Any) -> None:
    product = Product.objects.create(name="p", stock=5)

    @with_lock(Product.lock_template(), ttl=5, auto_renew=True, atomic=True)
    def sell(request: Any, pk: int) -> HttpResponse:
        Product.objects.filter(pk=pk).update(stock=4)
        session_nodes.flushall()  # owned() still true: the commit goes ahead...
        return HttpResponse("ok")  # ...and the release finds the lock gone

    response = sell(RequestFactory().post("/"), pk=product.pk)
    assert response.status_code == 200
    assert Product.objects.get(pk=product.pk).stock == 4


@needs_alock
@pytest.mark.django_db(transaction=True)
def test_async_view_keeps_its_response_after_a_committed_fenced_write(
        session_nodes: Any) -> None:
    product = Product.objects.create(name="p", stock=5)

    @with_lock(Product.lock_template(), ttl=0.4, auto_renew=True)
    async def sell(request: Any, pk: int) -> HttpResponse:
        row = await Product.objects.aclaim_and_get(request.redlock, pk=pk)
        row.stock -= 1
        await row.afenced_save(request.redlock, update_fields=["stock"])
        session_nodes.flushall()
        deadline = time.monotonic() + 5
        while request.redlock.owned() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return HttpResponse(str(row.stock))

    response = asyncio.run(sell(RequestFactory().post("/"), pk=product.pk))
    assert (response.status_code, response.content) == (200, b"4")
    assert Product.objects.get(pk=product.pk).stock == 4


# -- placeholders fed by the client -------------------------------------------------

@pytest.mark.parametrize("url", ["/per-query/", "/async/per-query/"])
@pytest.mark.parametrize("query", ["", "?day=", "?day=a%0Ab", "?day=" + "x" * 2000],
                         ids=["missing", "empty", "newline", "too-long"])
def test_a_bad_query_string_in_a_placeholder_is_a_400_not_a_500(
        client: Client, url: str, query: str) -> None:
    """What the client sends cannot make the server fail: the request is bad."""
    response = client.get(url + query)
    assert response.status_code == 400, response.content[:300]
    assert client.get(url + "?day=mon").content == (b"aq:mon" if "async" in url else b"q:mon")


def test_a_too_long_url_argument_in_a_placeholder_is_a_400(client: Client) -> None:
    assert client.get("/counter/" + "n" * 2000 + "/incr/").status_code == 400
    assert client.get("/async/counter/" + "n" * 2000 + "/").status_code == 400


def test_a_placeholder_the_urlconf_never_provides_is_still_a_server_error(
        client: Client) -> None:
    """The URLconf (not the client) lacks <nope>: ImproperlyConfigured, a 500."""
    with pytest.raises(ImproperlyConfigured, match="nope"):
        client.get("/broken/1/")


# -- what a decorator cannot hold its lock around ------------------------------------
def _family() -> list[Any]:
    from django_redlock.decorators import with_multi_lock, with_segments, with_semaphore

    return [with_lock("gen:<n>", timeout=0), with_lock("gen:<n>", mode="read"),
            with_lock("gen:<n>", reentrant=True), with_semaphore("gen:<n>", 2),
            with_segments("gen:<n>", 2), with_multi_lock(["gen:<n>", "gen2:<n>"])]


@pytest.mark.parametrize("index", range(6))
def test_a_generator_function_is_refused_at_decoration_time(index: int) -> None:
    """The lock was held for the call, which only returns the generator object:
    the body ran afterwards with current_lock() None, and another holder got in."""
    decorate = _family()[index]

    def produce(n: int) -> Iterator[int]:  # pragma: no cover - never runs
        yield n

    with pytest.raises(TypeError, match=r"generator function .*lock would be released before"
                                        r".*with django_redlock\.lock\(.*StreamingHttpResponse"):
        decorate(produce)


@pytest.mark.parametrize("index", range(6))
def test_an_async_generator_function_is_refused_at_decoration_time(index: int) -> None:
    """Not a coroutine function, so it took the sync path: the lock was released
    as soon as the async generator object was returned."""
    decorate = _family()[index]

    async def produce(n: int) -> Any:  # pragma: no cover - never runs
        yield n

    with pytest.raises(TypeError, match=r"async generator function .*lock would be released"
                                        r".*async with django_redlock\.alock\("):
        decorate(produce)


def test_a_sync_view_streaming_a_generator_is_still_accepted() -> None:
    """The advice of the generator refusal: a view that returns a stream."""
    from django.http import StreamingHttpResponse

    @with_lock("gen-view:<n>")
    def view(request: Any, n: int) -> StreamingHttpResponse:
        return StreamingHttpResponse(iter([b"a"]))

    assert b"".join(view(RequestFactory().get("/"), n=1)) == b"a"


@pytest.mark.parametrize("index", range(6))
def test_a_view_class_decorated_directly_is_refused(index: int) -> None:
    """It became a function: as_view() failed later with a bare AttributeError."""
    decorate = _family()[index]

    class Direct(View):  # pragma: no cover - never served
        def get(self, request: Any, n: int) -> HttpResponse:
            return HttpResponse("ok")

    with pytest.raises(TypeError, match=r"class cannot be decorated directly.*"
                                        r"@method_decorator\(with_lock\('gen.*:<n>'\), "
                                        r"name=\"dispatch\"\)"):
        decorate(Direct)
