"""The demo shop (testproject/inventory) and ``make demo``.

In-process: the views with Django's test client against the suite's Redis
nodes (decrement, sold out, the fenced write refusing a stale holder, the lock
name, renewal past the TTL, the unsafe and striped purchases). Live: the
``--quick`` demo end to end, i.e. gunicorn with several worker processes, the
load from several client processes, and the JSON last line with no oversell.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_redlock import LockManager
from testproject.inventory.models import Product, ProductSegment

ROOT = Path(__file__).resolve().parent.parent
JSON = {"HTTP_ACCEPT": "application/json"}

pytestmark = pytest.mark.urls("testproject.urls")


@pytest.fixture(autouse=True)
def _demo_settings(settings: Any) -> None:
    settings.TEMPLATES = [{
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {"context_processors": ["django.template.context_processors.request"]},
    }]
    settings.DEMO_WORK = 0.0
    settings.DEMO_DELAY = 0.0
    settings.DEMO_ALLOW_DELAY_PARAM = True


@pytest.fixture
def manager(session_nodes: Any) -> Any:
    made = LockManager(list(session_nodes.urls), node_timeout=0.5)
    yield made
    made.close()


def make_product(stock: int, *, stripes: int = 0, sku: str = "SKU-1") -> Product:
    product = Product.objects.create(sku=sku, name="Thing")
    product.reset_stock(stock, stripes=stripes)
    return product


# -- protected purchase ---------------------------------------------------------------

@pytest.mark.django_db
def test_list_page_shows_stock_and_buy_buttons(client: Any) -> None:
    product = make_product(7)
    striped = make_product(9, stripes=3, sku="HOT-1")
    page = client.get("/").content.decode()
    assert f'id="stock-{product.pk}">7<' in page
    assert f'id="stock-{striped.pk}">9<' in page  # the sum over the segments
    assert "buy one" in page and "csrfmiddlewaretoken" in page
    assert f"/products/{striped.pk}/decrement-striped/" in page


@pytest.mark.django_db
def test_decrement_sells_one_with_a_fenced_write(client: Any) -> None:
    product = make_product(3)
    first = client.post(f"/products/{product.pk}/decrement/", **JSON)
    assert first.status_code == 200, first.content
    body = first.json()
    assert body["stock"] == 2 and body["fence"] > 0
    product.refresh_from_db()
    assert (product.stock, product.fence) == (2, body["fence"])
    second = client.post(f"/products/{product.pk}/decrement/", **JSON).json()
    assert second["stock"] == 1 and second["fence"] > body["fence"]


@pytest.mark.django_db
def test_sold_out_answers_409_and_never_goes_below_zero(client: Any) -> None:
    product = make_product(1)
    assert client.post(f"/products/{product.pk}/decrement/", **JSON).status_code == 200
    sold_out = client.post(f"/products/{product.pk}/decrement/", **JSON)
    assert sold_out.status_code == 409
    assert sold_out.json() == {"error": "sold out", "stock": 0}
    product.refresh_from_db()
    assert product.stock == 0


@pytest.mark.django_db
def test_fenced_write_refuses_a_holder_older_than_the_last_write(client: Any) -> None:
    product = make_product(5)
    # A newer holder already wrote the row (its fence is above any fence we get).
    Product.objects.filter(pk=product.pk).update(fence=2**62)
    stale = client.post(f"/products/{product.pk}/decrement/", **JSON)
    assert stale.status_code == 409
    assert stale.json()["error"] == "stale"
    product.refresh_from_db()
    assert (product.stock, product.fence) == (5, 2**62)


@pytest.mark.django_db
def test_decrement_takes_the_lock_named_stock_pk(client: Any, settings: Any,
                                                 manager: Any) -> None:
    settings.REDLOCK = {"NODE_TIMEOUT": 0.5, "TIMEOUT": 0.2}
    product = make_product(5)
    with manager.lock(f"stock:{product.pk}", ttl=10):
        busy = client.post(f"/products/{product.pk}/decrement/", **JSON)
    assert busy.status_code == 423
    assert busy.json()["lock"] == f"stock:{product.pk}"
    product.refresh_from_db()
    assert product.stock == 5
    assert client.post(f"/products/{product.pk}/decrement/", **JSON).status_code == 200


@pytest.mark.django_db
def test_a_purchase_longer_than_the_ttl_keeps_its_lock(client: Any, settings: Any) -> None:
    settings.REDLOCK = {"NODE_TIMEOUT": 0.05, "TTL": 0.5}
    product = make_product(2)
    answer = client.post(f"/products/{product.pk}/decrement/", {"delay": "1.2"}, **JSON)
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert body["ttl"] == 0.5 and body["held"] >= 1.2  # the lease was renewed, never lost
    assert body["lease_left"] > 0
    product.refresh_from_db()
    assert product.stock == 1


@pytest.mark.django_db
def test_delay_param_is_ignored_unless_allowed(client: Any, settings: Any) -> None:
    settings.DEMO_ALLOW_DELAY_PARAM = False
    product = make_product(2)
    body = client.post(f"/products/{product.pk}/decrement/", {"delay": "5"}, **JSON).json()
    assert body["held"] < 2


@pytest.mark.django_db
def test_plain_form_post_redirects_back_to_the_page(client: Any) -> None:
    product = make_product(2)
    answer = client.post(f"/products/{product.pk}/decrement/", {"next": "/"},
                         HTTP_ACCEPT="text/html")
    assert answer.status_code == 302 and answer["Location"] == "/"
    product.refresh_from_db()
    assert product.stock == 1


@pytest.mark.django_db
def test_get_is_not_a_purchase(client: Any) -> None:
    product = make_product(2)
    assert client.get(f"/products/{product.pk}/decrement/").status_code == 405
    assert client.post("/products/999999/decrement/", **JSON).status_code == 404


# -- unprotected and striped -------------------------------------------------------

@pytest.mark.django_db
def test_unsafe_decrement_sells_without_a_lock(client: Any, manager: Any) -> None:
    product = make_product(1)
    with manager.lock(f"stock:{product.pk}", ttl=10):  # it does not even look
        answer = client.post(f"/products/{product.pk}/decrement-unsafe/", **JSON)
    assert answer.status_code == 200 and answer.json() == {"stock": 0}
    assert client.post(f"/products/{product.pk}/decrement-unsafe/", **JSON).status_code == 409
    product.refresh_from_db()
    assert (product.stock, product.fence) == (0, 0)  # never fenced


@pytest.mark.django_db
def test_striped_purchases_sell_every_unit_once(client: Any) -> None:
    product = make_product(5, stripes=3)
    assert sorted(ProductSegment.objects.filter(product=product).values_list("stock", flat=True)) \
        == [1, 2, 2]
    left = [client.post(f"/products/{product.pk}/decrement-striped/", **JSON) for _ in range(5)]
    assert [a.status_code for a in left] == [200] * 5
    assert sorted(a.json()["stock"] for a in left) == [0, 1, 2, 3, 4]
    sold_out = client.post(f"/products/{product.pk}/decrement-striped/", **JSON)
    assert sold_out.status_code == 409 and sold_out.json()["error"] == "sold out"
    assert product.available() == 0
    assert all(s.fence > 0 for s in product.segments.all())


@pytest.mark.django_db
def test_striped_purchase_takes_the_free_segment(client: Any, manager: Any) -> None:
    product = make_product(6, stripes=3)
    with manager.lock(f"stock:{product.pk}[0]", ttl=10), \
            manager.lock(f"stock:{product.pk}[2]", ttl=10):
        answer = client.post(f"/products/{product.pk}/decrement-striped/", **JSON)
    assert answer.status_code == 200
    assert answer.json()["segment"] == 1
    assert dict(product.segments.values_list("index", "stock")) == {0: 2, 1: 1, 2: 2}


@pytest.mark.django_db
def test_striped_purchase_answers_busy_when_every_segment_stays_locked(
        client: Any, manager: Any, settings: Any) -> None:
    settings.DEMO_STRIPE_TIMEOUT = 0.3
    product = make_product(2, stripes=2)
    with manager.lock(f"stock:{product.pk}[0]", ttl=10), \
            manager.lock(f"stock:{product.pk}[1]", ttl=10):
        answer = client.post(f"/products/{product.pk}/decrement-striped/", **JSON)
    assert answer.status_code == 423 and answer.json()["error"] == "locked"
    assert product.available() == 2


@pytest.mark.django_db
def test_striped_buyer_that_reads_a_segment_empty_skips_it(
        client: Any, manager: Any, settings: Any) -> None:
    """The race of docs/howto/lock-family.rst: buyer B reads segment 0
    stocked (its last unit) and segment 1 empty, and waits for segment 0,
    which A holds; A sells that unit and releases. B, woken, reads segment 0
    empty under its lock and skips it: every segment is skipped, so B answers
    "sold out" at once, instead of taking segment 0 again and again until its
    timeout (423, 10 s here)."""
    import threading

    from django_redlock import signals

    settings.DEMO_STRIPE_TIMEOUT = 10.0
    product = make_product(2, stripes=2)
    ProductSegment.objects.filter(product=product, index=0).update(stock=1)
    ProductSegment.objects.filter(product=product, index=1).update(stock=0)
    name = f"stock:{product.pk}[0]"
    seller = manager.lock(name, ttl=10)  # A
    assert seller.acquire(timeout=1)
    main = threading.get_ident()
    taken: list[int] = []

    def on_acquired(sender: Any, name: str, **kwargs: Any) -> None:
        if name == f"stock:{product.pk}[0]" and threading.get_ident() == main:
            taken.append(1)
            if len(taken) == 1:  # A's sale, committed before B reads the row
                ProductSegment.objects.filter(product=product, index=0).update(stock=0)

    timer = threading.Timer(0.3, seller.release)
    signals.lock_acquired.connect(on_acquired)
    try:
        timer.start()
        started = time.monotonic()
        answer = client.post(f"/products/{product.pk}/decrement-striped/", **JSON)
        took = time.monotonic() - started
    finally:
        signals.lock_acquired.disconnect(on_acquired)
        timer.join(5)
    assert answer.status_code == 409 and answer.json()["error"] == "sold out", answer.content
    assert taken == [1]  # segment 0 taken once, then skipped
    assert took < 3.0, took
    assert product.available() == 0


@pytest.mark.django_db
def test_each_endpoint_refuses_the_other_kind_of_product(client: Any) -> None:
    plain, striped = make_product(2), make_product(2, stripes=2, sku="HOT-1")
    assert client.post(f"/products/{striped.pk}/decrement/", **JSON).status_code == 400
    assert client.post(f"/products/{striped.pk}/decrement-unsafe/", **JSON).status_code == 400
    assert client.post(f"/products/{plain.pk}/decrement-striped/", **JSON).status_code == 400


@pytest.mark.django_db
def test_reset_stock_keeps_the_fence(client: Any) -> None:
    product = make_product(2)
    fence = client.post(f"/products/{product.pk}/decrement/", **JSON).json()["fence"]
    product.refresh_from_db()
    product.reset_stock(10)
    product.refresh_from_db()
    assert (product.stock, product.fence) == (10, fence)


def test_commands_reject_bad_arguments() -> None:
    with pytest.raises(CommandError, match="unknown mode"):
        call_command("load", "--modes", "bogus")
    with pytest.raises(CommandError, match="at least 1"):
        call_command("racelab", "--clients", "0")


# -- live: the quick demo end to end -----------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(150)
def test_quick_demo_runs_end_to_end_without_oversell() -> None:
    pytest.importorskip("gunicorn", reason="the demo extra (gunicorn) is not installed")
    env = dict(os.environ, DEMO_WORK="0.01", PYTHONPATH=str(ROOT))
    env.pop("DJANGO_SETTINGS_MODULE", None)
    proc = subprocess.run([sys.executable, "-m", "testproject.demo", "--quick", "--workers", "3"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=140,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    last = json.loads(lines[-1])
    assert set(last) == {"protected", "unprotected", "striped"}
    stock = 50  # QUICK.stock
    for mode, row in last.items():
        assert set(row) == {"requests", "sold", "stock_left", "oversold"}, mode
        assert row["requests"] == 120
    for mode in ("protected", "striped"):
        row = last[mode]
        assert row["oversold"] == 0 and row["sold"] + row["stock_left"] == stock, (mode, row)
        assert row["sold"] > stock // 2  # 120 buyers for 50 units (a few may get 423 busy)
    unprotected = last["unprotected"]
    assert unprotected["oversold"] == max(0, unprotected["sold"] + unprotected["stock_left"] - stock)
    out = proc.stdout
    assert "Race lab" in out and "WATCH/MULTI/EXEC" in out and "django-redlock" in out
    assert "renewed, never lost" in out
    assert "Everything stopped" in out


# -- live: `make serve` stopped from outside ---------------------------------------------

def _serve(argv_prefix: list[str]) -> tuple[subprocess.Popen[str], list[str], str, list[str]]:
    """Start ``demo --serve`` (behind ``argv_prefix``); wait for its URL (bounded).

    Returns the process, the demo's stdout lines so far, the shop URL and the node URLs.
    """
    import queue
    import re
    import threading

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("DJANGO_SETTINGS_MODULE", None)
    proc = subprocess.Popen([*argv_prefix, sys.executable, "-m", "testproject.demo", "--serve",
                             "--workers", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or ()],
                              daemon=True)
    reader.start()
    proc.reader = reader  # type: ignore[attr-defined]
    seen: list[str] = []
    url, nodes = "", []
    deadline = time.monotonic() + 90
    while not url and time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            assert proc.poll() is None, "".join(seen)
            continue
        seen.append(line)
        if m := re.search(r"Redis: 3 nodes started \((.*)\)", line):
            nodes = m.group(1).split(", ")
        if m := re.search(r"The shop is at (http://\S+?)/ ", line):
            url = m.group(1)
    assert url and len(nodes) == 3, "".join(seen)
    return proc, seen, url, nodes


def _close(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)
    proc.reader.join(timeout=30)  # type: ignore[attr-defined]  # EOF once the demo is gone
    if proc.stdout is not None:
        proc.stdout.close()


def _refuses(url: str) -> bool:
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((parts.hostname or "127.0.0.1", parts.port or 0)) != 0


def _wait_everything_stopped(shop: str, nodes: list[str]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(_refuses(u) for u in [shop, *nodes]):
        time.sleep(0.2)
    assert _refuses(shop), "gunicorn is still serving"
    assert all(_refuses(u) for u in nodes), "a Redis node is still running"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_serve_stopped_by_sigterm_stops_redis_and_gunicorn() -> None:
    pytest.importorskip("gunicorn", reason="the demo extra (gunicorn) is not installed")
    import signal

    proc, _, shop, nodes = _serve([])
    try:
        assert not _refuses(shop) and not any(_refuses(u) for u in nodes)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 0
        _wait_everything_stopped(shop, nodes)
    finally:
        _close(proc)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_serve_stops_when_its_parent_is_killed() -> None:
    """``make serve`` killed: make does not pass the signal on; the demo notices its
    parent is gone and stops its servers."""
    pytest.importorskip("gunicorn", reason="the demo extra (gunicorn) is not installed")
    # A shell stands in for make: it runs the demo as a child and waits for it.
    proc, _, shop, nodes = _serve(["sh", "-c", '"$@"; exit $?', "sh"])
    try:
        proc.kill()  # the parent dies without a word, as make on SIGKILL
        proc.wait(timeout=10)
        _wait_everything_stopped(shop, nodes)
    finally:
        _close(proc)
