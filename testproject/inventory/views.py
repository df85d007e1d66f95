"""The shop's views: one safe purchase, one racy purchase, one striped purchase.

Why the protected view re-reads the row *inside* the lock: a value read before
the lock was taken may already be stale when the lock is granted::

    t0  worker A reads stock 5            t0  worker B reads stock 5
    t1  A takes stock:1, writes 4         t2  B takes stock:1, writes 4   <- one sale lost

Reading after acquiring closes that gap; the claim and the fenced save close the
other one: right after acquiring, the view claims the row with its fence
(``claim_and_get``: ``UPDATE ... SET fence = F WHERE fence < F``, then the read),
and its write is conditional on that claim, so a worker that paused past its
lease and lost the lock to a newer holder (who claimed the row since) writes
nothing. ``decrement_unsafe`` keeps the
gap open on purpose, so the demo can count the sales it loses.
"""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.db.models import Sum
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET, require_POST

from django_redlock import (
    FencedWriteRejected,
    LockLost,
    LockNotAcquired,
    QuorumUnavailable,
    RedlockError,
    get_manager,
)
from django_redlock.decorators import with_lock
from django_redlock.responses import busy_response, unavailable_response, wants_json

from .models import Product, ProductSegment


def _setting(name: str, default: Any) -> Any:
    return getattr(settings, name, default)


def _work() -> None:
    """The simulated work of a purchase (``DEMO_WORK`` seconds): a payment call, say."""
    seconds = float(_setting("DEMO_WORK", 0.0))
    if seconds > 0:
        time.sleep(seconds)


def _delay(request: HttpRequest) -> float:
    """Extra seconds inside the protected critical section (``DEMO_DELAY`` or POST ``delay``)."""
    delay = float(_setting("DEMO_DELAY", 0.0))
    if _setting("DEMO_ALLOW_DELAY_PARAM", False) and request.POST.get("delay"):
        try:
            delay = float(request.POST["delay"])
        except ValueError:
            delay = 0.0
    return max(0.0, min(delay, float(_setting("DEMO_MAX_DELAY", 10.0))))


def _answer(request: HttpRequest, payload: dict[str, Any], status: int = 200) -> HttpResponse:
    """JSON for scripts and the page's fetch(); a redirect back for a plain HTML form post.

    The page's form carries a ``next`` field; without JavaScript the browser
    submits it and expects a page, not a JSON document.
    """
    next_url = request.POST.get("next")
    if next_url and not wants_json(request) and url_has_allowed_host_and_scheme(
            next_url, allowed_hosts={request.get_host()}):
        if status == 200:
            text = f"Bought one: {payload['stock']} left."
            level = messages.SUCCESS
        else:
            text = f"Not bought: {payload.get('error', status)}."
            level = messages.WARNING
        messages.add_message(request, level, text, fail_silently=True)
        return redirect(next_url)
    return JsonResponse(payload, status=status)


def _not_striped(request: HttpRequest, product: Product) -> HttpResponse | None:
    if product.striped:
        return _answer(request, {
            "error": "striped",
            "detail": f"{product.sku}'s stock is split into segments; buy it at "
                      f"{reverse('inventory:decrement-striped', args=[product.pk])}"}, 400)
    return None


# -- pages ---------------------------------------------------------------------------

@require_GET
def product_list(request: HttpRequest) -> HttpResponse:
    products = list(Product.objects.annotate(segment_stock=Sum("segments__stock")).order_by("pk"))
    for product in products:
        product.left = (product.segment_stock or 0) if product.striped else product.stock
    return render(request, "inventory/product_list.html", {"products": products})


@require_GET
def product_detail(request: HttpRequest, pk: int) -> JsonResponse:
    product = get_object_or_404(Product, pk=pk)
    segments = [{"index": s.index, "stock": s.stock, "fence": s.fence}
                for s in product.segments.all()]
    return JsonResponse({"id": product.pk, "sku": product.sku, "name": product.name,
                         "stock": product.available(), "fence": product.fence,
                         "stripes": product.stripes, "segments": segments})


@require_GET
def health(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"ok": True, "products": Product.objects.count()})


# -- purchases -----------------------------------------------------------------------

@require_POST
@with_lock(Product.lock_template(), auto_renew=True)  # "stock:<pk>", the row's own name
def decrement(request: HttpRequest, pk: int) -> HttpResponse:
    """Sell one unit, under the lock ``stock:<pk>`` (renewed while the work runs)."""
    lock = request.redlock  # type: ignore[attr-defined]
    started = time.monotonic()
    try:  # claim the row with our fence, *then* read it
        product = Product.objects.claim_and_get(lock, pk=pk)
    except Product.DoesNotExist:
        raise Http404("no such product") from None
    except FencedWriteRejected as exc:  # a newer holder claimed it: we are the stale one
        return _answer(request, {"error": "stale", "detail": str(exc), "fence": lock.fence}, 409)
    wrong = _not_striped(request, product)
    if wrong is not None:
        return wrong
    if product.stock <= 0:
        return _answer(request, {"error": "sold out", "stock": 0}, 409)
    _work()
    delay = _delay(request)
    if delay:
        time.sleep(delay)  # longer than the TTL: only the renewal keeps the lock ours
    product.stock -= 1
    try:
        product.fenced_save(lock, update_fields=["stock"])
    except FencedWriteRejected as exc:
        # A newer holder wrote this row: our lease ran out while we worked.
        return _answer(request, {"error": "stale", "detail": str(exc), "fence": lock.fence}, 409)
    return _answer(request, {
        "stock": product.stock,
        "fence": lock.fence,
        "held": round(time.monotonic() - started, 3),
        "ttl": lock.ttl,
        "lease_left": round(lock.validity, 3),
    })


@require_POST
def decrement_unsafe(request: HttpRequest, pk: int) -> HttpResponse:
    """Sell one unit WITHOUT a lock: read, work, write. Concurrent buyers lose updates."""
    product = get_object_or_404(Product, pk=pk)
    wrong = _not_striped(request, product)
    if wrong is not None:
        return wrong
    if product.stock <= 0:
        return _answer(request, {"error": "sold out", "stock": 0}, 409)
    _work()  # meanwhile another worker reads the same stock...
    product.stock -= 1
    product.save(update_fields=["stock"])  # ...and both write stock - 1
    return _answer(request, {"stock": product.stock})


@require_POST
def decrement_striped(request: HttpRequest, pk: int) -> HttpResponse:
    """Sell one unit of a striped product: take any free segment that has stock.

    The stock is split over ``stripes`` rows; ``segments()`` holds any one of
    their locks (``stock:<pk>[<i>]``, each row's own lock name), so ``stripes``
    purchases proceed at once, and waiting buyers are woken by releases. A
    segment read empty is skipped (``seg.skip``), so "sold out" is exact: a
    segment counts as empty when read empty under its lock, or read empty at
    all (the stock of a product on sale never goes back up). The segment's
    row is claimed with the stripe's fence before it is read, and the write is
    fenced (``fenced_save``): a holder paused past its lease cannot overwrite a
    newer sale.
    """
    product = get_object_or_404(Product, pk=pk)
    if not product.striped:
        return _answer(request, {"error": "not striped",
                                 "detail": "use the decrement endpoint"}, 400)
    stripes = product.stripes
    # A segment read empty without its lock IS empty: a sold-out answer costs
    # one query, not a lock round per segment.
    stocked = set(product.segments.filter(stock__gt=0).values_list("index", flat=True))
    seg = get_manager().segments(f"stock:{pk}", stripes, auto_renew=True,
                                 timeout=float(_setting("DEMO_STRIPE_TIMEOUT", 10.0)))
    seg.skip = set(range(stripes)) - stocked
    while len(seg.skip) < stripes:
        try:
            got = seg.acquire()
        except QuorumUnavailable as exc:
            return unavailable_response(request, exc, lock_name=f"stock:{pk}")
        if not got:
            exc = LockNotAcquired(f"every segment of {product.sku} stayed busy",
                                  lock_name=f"stock:{pk}", retry_after=seg.retry_after or 1.0)
            return busy_response(request, exc, status=get_manager().busy_status,
                                 lock_name=exc.lock_name)
        index = seg.index
        assert index is not None
        fence = 0  # set once the sale is written (fenced and committed)
        try:
            try:  # claim the segment's row with the stripe's fence, *then* read it
                segment = ProductSegment.objects.claim_and_get(
                    seg.lock, product_id=pk, index=index)
            except ProductSegment.DoesNotExist:
                segment = None
            if segment is not None and segment.stock > 0:
                _work()
                segment.stock -= 1
                segment.fenced_save(seg.lock, update_fields=["stock"])
                fence = seg.fence
        except FencedWriteRejected as exc:
            _release_quietly(seg)
            return _answer(request, {"error": "stale", "detail": str(exc)}, 409)
        except BaseException:
            _release_quietly(seg)
            raise
        try:
            seg.release()
        except LockLost as exc:
            if not fence:  # lost before the sale was written: nothing was sold
                return _answer(request, {"error": "lost", "detail": str(exc)}, 409)
            # Lost after the fenced write committed (the fence vouched for it
            # when it landed): the sale is recorded, so it is answered as one,
            # as with_lock does (docs: views how-to, "a recorded sale").
        if fence:
            assert segment is not None
            return _answer(request, {"stock": product.available(), "segment": index,
                                     "segment_stock": segment.stock, "fence": fence})
        seg.skip.add(index)  # read empty under its lock
    return _answer(request, {"error": "sold out", "stock": 0}, 409)


def _release_quietly(held: Any) -> None:
    """Release ``held`` on the way out of an error that is answered anyway."""
    try:
        held.release()
    except RedlockError:
        pass
