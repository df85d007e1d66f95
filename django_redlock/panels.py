"""A django-debug-toolbar panel: the locks a request took.

::

    DEBUG_TOOLBAR_PANELS = [
        ...,
        "django_redlock.panels.LocksPanel",
    ]

For each lock the request asked for (in its own thread, or asyncio task): the
name, the outcome (acquired, busy, quorum unavailable), the wait, the hold time,
the fence, how many nodes had granted it when the acquire returned, how many
confirmed the release, the renewals made while it was held (the renewal thread's
too), and a loss if there was one. Built on :mod:`django_redlock.signals`.

Locks taken by other requests running at the same time are not shown: a lock
belongs to the request whose thread or task acquired it.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from asgiref.local import Local
from debug_toolbar.panels import Panel

from . import signals
from .transport import finalizers

__all__ = ["LocksPanel"]

#: The panel of the request running in this thread / asyncio task.
_current = Local()
#: Locks recorded by a panel whose request is still being processed, and
#: their records by hold (the signals' ``hold``: the object's acquisition
#: number, also without fencing, where every fence is 0): renewals and
#: losses are reported from the renewal thread, and a release a garbage
#: collection ran from the library's thread (transport/finalizers.py), maybe
#: after the same object was acquired again: by the object alone, the old
#: hold's release or loss was written into the new hold's record (a live
#: hold shown lost).
_live: weakref.WeakKeyDictionary[Any, dict[int, dict[str, Any]]] = \
    weakref.WeakKeyDictionary()
# A Guard (transport/finalizers.py): a collection in a lookup under it (a weak
# reference made) ran a generator's release, whose signal came back here and
# waited for the guard its own thread held; every release after it too.
_live_guard = finalizers.Guard()


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(max(0.0, seconds) * 1000.0, 2)


def _panel() -> LocksPanel | None:
    return getattr(_current, "panel", None)


def _on_acquired(sender: Any, *, lock: Any, name: str, fence: int, hold: int, wait: float,
                 **kwargs: Any) -> None:
    panel = _panel()
    if panel is None:
        return
    record = panel._new_record(lock, name, "acquired", wait)
    if record is None:
        return
    record["fence"] = fence
    record["hold"] = hold
    record["granted"] = getattr(lock, "granted_nodes", 0) or None
    record["acquired_at"] = time.monotonic()
    with _live_guard:
        _live.setdefault(lock, {})[hold] = record


def _on_not_acquired(sender: Any, *, lock: Any, name: str, wait: float, outcome: str,
                     **kwargs: Any) -> None:
    panel = _panel()
    if panel is not None:
        panel._new_record(lock, name, outcome, wait)


def _record_of(lock: Any, hold: int) -> dict[str, Any] | None:
    with _live_guard:
        return _live.get(lock, {}).get(hold)


def _on_released(sender: Any, *, lock: Any, hold: int, held: float, nodes: int,
                 **kwargs: Any) -> None:
    record = _record_of(lock, hold)
    if record is not None:
        record["hold_ms"] = _ms(held)
        record["released_nodes"] = nodes


def _on_extended(sender: Any, *, lock: Any, hold: int, **kwargs: Any) -> None:
    record = _record_of(lock, hold)
    if record is not None:
        record["renewals"] += 1


def _on_lost(sender: Any, *, lock: Any, hold: int, held: float, reason: str,
             **kwargs: Any) -> None:
    record = _record_of(lock, hold)
    if record is not None:
        record["lost"] = reason
        record["hold_ms"] = _ms(held)


_RECEIVERS = ((signals.lock_acquired, _on_acquired),
              (signals.lock_not_acquired, _on_not_acquired),
              (signals.lock_released, _on_released),
              (signals.lock_extended, _on_extended),
              (signals.lock_lost, _on_lost))


def _connect() -> None:
    """Connect the panel's receivers (done on import; idempotent)."""
    signals.connect_receivers(_RECEIVERS, "django_redlock.panels", loop_safe=True)


def _disconnect() -> None:
    signals.disconnect_receivers(_RECEIVERS, "django_redlock.panels")


_connect()


class LocksPanel(Panel):
    """The Redis locks the request asked for."""

    title = "Redis locks"
    nav_title = "Locks"
    template = "django_redlock/debug_toolbar_panel.html"
    is_async = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.records: list[dict[str, Any]] = []
        self._locks: list[Any] = []
        self._finished = False

    @property
    def nav_subtitle(self) -> str:
        stats = self.get_stats()  # type: ignore[no-untyped-call]  # debug-toolbar is untyped
        count = len(stats.get("locks", []))
        if not count:
            return "none"
        return f"{count} in {stats.get('total_wait_ms', 0):.1f} ms waiting"

    def _new_record(self, lock: Any, name: str, outcome: str,
                    wait: float) -> dict[str, Any] | None:
        """A record of this request's, None once the request is over: a task
        it started (which keeps its context, this panel with it) records
        nothing more; each of its later holds was kept here for good."""
        if self._finished:
            return None
        manager = getattr(lock, "manager", None)
        record: dict[str, Any] = {
            "name": name, "outcome": outcome, "wait_ms": _ms(wait), "hold_ms": None,
            "fence": None, "granted": None, "released_nodes": None,
            "nodes": len(getattr(manager, "nodes", ()) or ()) or None,
            "quorum": getattr(manager, "quorum", None), "renewals": 0, "lost": None,
            "label": getattr(lock, "label", None) or "",
        }
        self.records.append(record)
        self._locks.append(lock)
        return record

    def enable_instrumentation(self) -> None:
        _current.panel = self

    def disable_instrumentation(self) -> None:
        self._finished = True
        if getattr(_current, "panel", None) is self:
            del _current.panel

    def generate_stats(self, request: Any, response: Any) -> None:
        now = time.monotonic()
        locks = []
        with _live_guard:
            for lock, record in zip(self._locks, self.records):
                holds = _live.get(lock)
                if holds is not None and "hold" in record:
                    holds.pop(record["hold"], None)
                    if not holds:
                        del _live[lock]
                item = {k: v for k, v in record.items() if k not in ("acquired_at", "hold")}
                if record["outcome"] == "acquired" and record["hold_ms"] is None:
                    if getattr(lock, "_state", None) == "unlocked":
                        # Released with no confirmation to report: a semaphore's
                        # line handed on without waiting for the reply, or a
                        # release no node confirmed (logged).
                        item["unconfirmed"] = True
                    else:
                        item["hold_ms"] = _ms(now - record["acquired_at"])
                        item["still_held"] = True
                locks.append(item)
        self._locks = []
        self.record_stats({  # type: ignore[no-untyped-call]  # debug-toolbar is untyped
            "locks": locks,
            "total_wait_ms": round(sum(r["wait_ms"] or 0.0 for r in locks), 2),
            "total_hold_ms": round(sum(r["hold_ms"] or 0.0 for r in locks), 2),
        })
