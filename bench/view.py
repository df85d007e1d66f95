"""Decorated-view overhead: a trivial view with and without ``@with_lock``.

Both views go through Django's test client (URL resolving, the request handler,
no middleware); the difference of their p50 latencies in the same round is what
``@with_lock`` costs a request: template resolution, one acquire round, one
release round, the signals. The lock name comes from the URL (``<pk>``), as in
the docs' examples. This module is also the ``ROOT_URLCONF`` of the benchmark.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from typing import Any

from .stats import median, percentile

urlpatterns: list[Any] = []


class ViewFailed(RuntimeError):
    """A request answered something else than 200."""


CHUNKS = 5

VARIANTS = [
    ("plain", "trivial view, no lock"),
    ("with_lock", "@with_lock('bench:view:<pk>'), settings' defaults (auto_renew on)"),
    ("with_lock_norenew", "@with_lock('bench:view:<pk>', auto_renew=False)"),
]


def _configure(url: str) -> None:
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            DEBUG=False, SECRET_KEY="bench-only", ALLOWED_HOSTS=["testserver"],
            ROOT_URLCONF="bench.view", INSTALLED_APPS=["django_redlock"], MIDDLEWARE=[],
            DATABASES={}, USE_TZ=True, LOGGING_CONFIG=None,
            REDLOCK_NODES=[url], REDLOCK={"TTL": 10.0},
        )
        django.setup()


class ViewOverhead:
    def __init__(self, url1: str, *, requests: int, warmup: int) -> None:
        self.requests = requests
        self.warmup = warmup
        self.skipped = ""
        self.rounds: list[dict[str, dict[str, float]]] = []
        self.errors: dict[str, int] = {}
        self.error_sample: dict[str, str] = {}
        _configure(url1)
        from django.http import HttpResponse
        from django.test import Client
        from django.urls import clear_url_caches, path

        def plain(request: Any, pk: int) -> HttpResponse:
            return HttpResponse(b"ok")

        urlpatterns.clear()
        urlpatterns.append(path("plain/<int:pk>/", plain))
        try:
            from django_redlock.decorators import with_lock
        except ImportError:
            self.skipped = "with_lock not available"
        else:
            urlpatterns.append(path("with_lock/<int:pk>/", with_lock("bench:view:<pk>")(plain)))
            urlpatterns.append(path("with_lock_norenew/<int:pk>/",
                                    with_lock("bench:view:<pk>", auto_renew=False)(plain)))
        clear_url_caches()
        self.client = Client()
        self.variants = ["plain"] if self.skipped else [v for v, _ in VARIANTS]
        for variant in list(self.variants[1:]):
            try:
                self._get(variant)()
            except Exception as e:  # noqa: BLE001 - a half-built decorator must not stop the bench
                self.skipped = f"with_lock failed: {type(e).__name__}: {e}"[:200]
                self.variants = ["plain"]
                break

    def _get(self, variant: str) -> Callable[[], None]:
        client, url = self.client, f"/{variant}/1/"

        def get() -> None:
            response = client.get(url)
            if response.status_code != 200:
                raise ViewFailed(f"{url} answered {response.status_code}")
        return get

    def run_round(self, rng: random.Random) -> dict[str, dict[str, float]]:
        """Several short passes over the variants, each in a new order (as uncontended.py)."""
        order = list(self.variants)
        lat: dict[str, list[float]] = {v: [] for v in order}
        clock = time.perf_counter_ns
        for _ in range(CHUNKS):
            rng.shuffle(order)
            for variant in order:
                get = self._get(variant)
                for _ in range(self.warmup):
                    with contextlib.suppress(ViewFailed):
                        get()
                for _ in range(max(5, self.requests // CHUNKS)):
                    t0 = clock()
                    try:
                        get()
                    except ViewFailed as e:
                        # e.g. 503 when a node timed out on a loaded machine: counted.
                        self.errors[variant] = self.errors.get(variant, 0) + 1
                        self.error_sample.setdefault(variant, str(e))
                        continue
                    lat[variant].append((clock() - t0) / 1000.0)
        res = {v: {"p50_us": percentile(x, 50), "p99_us": percentile(x, 99)}
               for v, x in lat.items() if x}
        for variant in self.variants[1:]:
            if variant in res and "plain" in res:
                res[variant]["overhead_us"] = res[variant]["p50_us"] - res["plain"]["p50_us"]
        self.rounds.append(res)
        return res

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"skipped": self.skipped}
        for variant, label in VARIANTS:
            per = [r[variant] for r in self.rounds if variant in r]
            if not per:
                continue
            row = {"label": label, "rounds": len(per),
                   "p50_us": median(p["p50_us"] for p in per),
                   "p99_us": median(p["p99_us"] for p in per)}
            if variant != "plain":
                row["overhead_us"] = median(p["overhead_us"] for p in per if "overhead_us" in p)
            row["errors"] = self.errors.get(variant, 0)
            if variant in self.error_sample:
                row["error_sample"] = self.error_sample[variant]
            out[variant] = row
        return out
