"""Prometheus metrics for the locks of this process (needs ``prometheus_client``).

Importing this module registers the collectors below in ``prometheus_client``'s
default registry and connects them to :mod:`django_redlock.signals`; import it
once at start-up (``AppConfig.ready()``), so that what happens before the first
request, or in a Celery worker, is counted too::

    # myproject/apps.py
    class MyConfig(AppConfig):
        def ready(self):
            import django_redlock.metrics  # noqa: F401

Every metric name starts with ``redlock_``:

================================================  =========  ===============================
metric                                            type       labels
================================================  =========  ===============================
``redlock_acquire_wait_seconds``                  histogram  ``lock``, ``outcome``:
                                                             ``acquired``, ``busy``,
                                                             ``quorum_unavailable``
``redlock_hold_seconds``                          histogram  ``lock`` (acquire to release)
``redlock_renewals_total``                        counter    ``lock``
``redlock_lost_total``                            counter    ``lock``
``redlock_waiters_woken_total``                   counter    ``lock``
``redlock_fenced_writes_rejected_total``          counter    ``lock``, ``model``
``redlock_node_errors_total``                     counter    ``node``: no answer in time,
                                                             refused, a failed set-up
``redlock_node_replies_total``                    counter    ``node``
``redlock_node_round_trip_seconds``               histogram  ``node``: from a request sent
                                                             to its reply read (by the
                                                             round that sent it)
================================================  =========  ===============================

The ``node`` label is a node as ``manage.py locks health`` names it (its URL
with the password masked, or ``cache:<alias>``); the node metrics add up the
managers alive in the process, and are read from the transport's own counters
at scrape time (nothing is done per request for them).

The ``lock`` label is bounded, never the concrete lock name (``stock:42`` would
make one time series per row): see :func:`metrics_label`.
"""

from __future__ import annotations

from typing import Any

try:
    import prometheus_client
except ImportError as e:  # pragma: no cover - the extra is installed in the tests
    raise ImportError("django_redlock.metrics needs prometheus_client: "
                      "pip install 'django-redlock[prometheus]'") from e

from django.http import HttpRequest, HttpResponse

from . import signals
from .engine import manager as _manager
from .transport import finalizers
from .transport.sync import ROUND_TRIP_BUCKETS

__all__ = ["MAX_LABELS", "OTHER", "metrics_label", "metrics_view"]

#: Distinct ``lock`` label values one process reports; later ones are counted as
#: :data:`OTHER`. A safety net: a well-chosen label never comes near it.
MAX_LABELS = 200
#: The ``lock`` label of everything past :data:`MAX_LABELS`.
OTHER = "other"

WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0)
HOLD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                300.0, 900.0, 3600.0)

ACQUIRE_WAIT = prometheus_client.Histogram(
    "redlock_acquire_wait_seconds", "Time spent acquiring a lock, by outcome.",
    ["lock", "outcome"], buckets=WAIT_BUCKETS)
HOLD = prometheus_client.Histogram(
    "redlock_hold_seconds", "Time a lock was held, from acquire to release.",
    ["lock"], buckets=HOLD_BUCKETS)
RENEWALS = prometheus_client.Counter(
    "redlock_renewals", "Lease renewals (and extend() calls) a quorum applied.", ["lock"])
LOST = prometheus_client.Counter(
    "redlock_lost", "Held locks found lost (renewal failed, lease ran out, force release).",
    ["lock"])
WAITERS_WOKEN = prometheus_client.Counter(
    "redlock_waiters_woken", "Waiting acquirers woken by a release notice.", ["lock"])
FENCED_REJECTED = prometheus_client.Counter(
    "redlock_fenced_writes_rejected", "Claims and fenced writes refused by the database.",
    ["lock", "model"])

class NodeCollector:
    """The per-node metrics, read from each live manager's nodes at scrape time."""

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        errors = CounterMetricFamily("redlock_node_errors",
                                     "Node failures: no answer in time, refused, failed set-up.",
                                     labels=["node"])
        replies = CounterMetricFamily("redlock_node_replies", "Replies read from the node.",
                                      labels=["node"])
        trips = HistogramMetricFamily("redlock_node_round_trip_seconds",
                                      "Time from a request sent to its reply read.",
                                      labels=["node"])
        by_node: dict[str, list[Any]] = {}
        for mgr in list(_manager._managers):
            for node in mgr.nodes:
                total = by_node.setdefault(node.name, [0, 0, [0] * len(node.round_trips), 0.0])
                total[0] += node.errors
                total[1] += node.answers
                total[2] = [a + b for a, b in zip(total[2], node.round_trips)]
                total[3] += node.round_trip_sum
        for name, (err, ans, counts, total_s) in sorted(by_node.items()):
            errors.add_metric([name], err)
            replies.add_metric([name], ans)
            buckets, running = [], 0
            for bound, count in zip((*map(str, ROUND_TRIP_BUCKETS), "+Inf"), counts):
                running += count
                buckets.append((bound, running))
            trips.add_metric([name], buckets, total_s)
        return [errors, replies, trips]

    def describe(self) -> list[Any]:
        return []  # described at collection: no sample is read at registration


NODES = NodeCollector()
prometheus_client.REGISTRY.register(NODES)

_seen: set[str] = set()
_seen_guard = finalizers.Guard()  # a section: see transport/finalizers.py


def metrics_label(lock: Any = None, *, name: str | None = None) -> str:
    """The ``lock`` label for a lock object (or, without one, a lock name).

    1. ``lock.metrics_label`` when set: ``@with_lock("stock:<pk>")`` sets it to the
       template, ``"stock:<pk>"``; set it yourself on a lock from ``lock()`` for
       a name of your own (``lk = lock(f"import-{day}"); lk.metrics_label = "import"``).
    2. Otherwise the name up to its first ``:``: ``stock:42`` and ``stock:43``
       are both ``stock``; ``inventory.item:42`` (``Model.lock_template()``) is
       ``inventory.item``. A name without ``:`` is its own label, so keep such
       names constant, or put the variable part after a ``:``.

    Past :data:`MAX_LABELS` distinct values in a process, new ones are
    reported as :data:`OTHER`: a metric's series stay bounded whatever names
    the application makes.
    """
    label = getattr(lock, "metrics_label", None) if lock is not None else None
    if not isinstance(label, str) or not label:
        text = name if name is not None else getattr(lock, "name", "") or ""
        label = text.split(":", 1)[0] or "-"
    if label in _seen:
        return label
    with _seen_guard:
        if label in _seen:
            return label
        if len(_seen) >= MAX_LABELS:
            return OTHER
        _seen.add(label)
        return label


# ---------------------------------------------------------------- receivers
def _acquired(sender: Any, *, lock: Any, wait: float, **kwargs: Any) -> None:
    ACQUIRE_WAIT.labels(metrics_label(lock), "acquired").observe(max(0.0, wait))


def _not_acquired(sender: Any, *, lock: Any, wait: float, outcome: str, **kwargs: Any) -> None:
    ACQUIRE_WAIT.labels(metrics_label(lock), outcome).observe(max(0.0, wait))


def _released(sender: Any, *, lock: Any, held: float, **kwargs: Any) -> None:
    HOLD.labels(metrics_label(lock)).observe(max(0.0, held))


def _extended(sender: Any, *, lock: Any, **kwargs: Any) -> None:
    RENEWALS.labels(metrics_label(lock)).inc()


def _lost(sender: Any, *, lock: Any, **kwargs: Any) -> None:
    LOST.labels(metrics_label(lock)).inc()


def _woken(sender: Any, *, lock: Any, **kwargs: Any) -> None:
    WAITERS_WOKEN.labels(metrics_label(lock)).inc()


def _rejected(sender: Any, *, model: Any, lock_name: str | None, **kwargs: Any) -> None:
    meta = getattr(model, "_meta", None)
    FENCED_REJECTED.labels(metrics_label(name=lock_name or "-"),
                           meta.label if meta is not None else str(model)).inc()


_RECEIVERS = (
    (signals.lock_acquired, _acquired),
    (signals.lock_not_acquired, _not_acquired),
    (signals.lock_released, _released),
    (signals.lock_extended, _extended),
    (signals.lock_lost, _lost),
    (signals.lock_waiter_woken, _woken),
    (signals.fenced_write_rejected, _rejected),
)


def _connect() -> None:
    """Connect the collectors to the signals (done on import; idempotent)."""
    signals.connect_receivers(_RECEIVERS, "django_redlock.metrics", loop_safe=True)


def _disconnect() -> None:
    """Stop counting (the tests use it to leave other tests' locks alone)."""
    signals.disconnect_receivers(_RECEIVERS, "django_redlock.metrics")


_connect()


def metrics_view(request: HttpRequest) -> HttpResponse:
    """The default registry in the Prometheus text format (a ``/metrics`` view).

    Not protected: route it where only your scraper reaches it, or wrap it
    (``staff_member_required``, an IP allow-list). With django-prometheus,
    use its ``/metrics`` instead: it serves the same default registry.
    """
    return HttpResponse(prometheus_client.generate_latest(prometheus_client.REGISTRY),
                        content_type=prometheus_client.CONTENT_TYPE_LATEST)
