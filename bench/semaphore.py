"""The semaphore, 1 node: its cost next to ``lock()``, and how it serves a queue.

* cost: uncontended ``semaphore(name, 5)`` acquire + release against ``lock()``
  acquire + release, batches interleaved in a shuffled order within each round;
  the ratio of the two p50s is taken inside the round, the report gives the
  median over rounds;
* the other members made of plain locks, measured the same way in the same
  rounds: ``lock(name, reentrant=True)`` and ``multi_lock`` of two names (its
  cost is about two locks': one acquire and one release per name);
* queue: 5 holders hold the 5 permits while 50 waiters arrive one at a time
  (each starts once the one before it is in line); then the holders let go and
  every waiter holds its permit 2 ms. Reported: grants out of arrival order (a
  grant to a waiter that arrived before one already served, in the order the
  permits were acquired), and the handoff
  latency (the k-th release to the k-th grant after the holders let go) p50/p99.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from .stats import median, out_of_order, percentile

PERMITS = 5
WAITERS = 50
HOLD = 0.002
#: The members measured against lock() in each round.
KINDS = ("lock", "semaphore", "reentrant", "multi_lock")


class SemaphoreBench:
    def __init__(self, urls1: list[str], ops: int, warmup: int = 3) -> None:
        from django_redlock import LockManager

        self.manager = LockManager(urls1, ttl=10.0)
        self.url = urls1[0]
        self.ops = ops
        self.warmup = warmup
        self.ratios: list[float] = []
        self.p50: dict[str, list[float]] = {kind: [] for kind in KINDS}
        self.out_of_order: list[int] = []
        self.handoff_ms: list[float] = []
        self.errors = 0
        self._round = 0

    # -- cost --------------------------------------------------------------------
    def _batch(self, kind: str) -> float:
        lat: list[float] = []
        for i in range(self.warmup + self.ops):
            held = self._member(kind)
            t0 = time.perf_counter()
            try:
                held.acquire()
                held.release()
            except Exception:  # noqa: BLE001 - counted, not fatal
                self.errors += 1
                continue
            if i >= self.warmup:
                lat.append(time.perf_counter() - t0)
        return percentile(lat, 50)

    def _member(self, kind: str) -> Any:
        mgr = self.manager
        if kind == "lock":
            return mgr.lock("bench:sem-lock")
        if kind == "reentrant":
            return mgr.lock("bench:sem-re", reentrant=True)
        if kind == "multi_lock":
            return mgr.multi_lock(["bench:sem-m1", "bench:sem-m2"])
        return mgr.semaphore("bench:sem", PERMITS)

    # -- queue -------------------------------------------------------------------
    def _queue(self) -> None:
        from django_redlock.core.keys import lock_key, waiters_key

        mgr = self.manager
        name = f"bench:semq{self._round}"
        holders = [mgr.semaphore(name, PERMITS) for _ in range(PERMITS)]
        for h in holders:
            h.acquire()
        line_key = lock_key(mgr.key_prefix, f"{name}#line")
        queue = waiters_key(line_key)
        served: list[tuple[float, int]] = []
        grants: list[float] = []
        releases: list[float] = []
        guard = threading.Lock()

        def waiter(i: int) -> None:
            sem = mgr.semaphore(name, PERMITS, timeout=60)
            if not sem.acquire():
                return
            now = time.perf_counter()
            # The order of the grants is the order of the permits' acquisitions
            # (each before its line was handed on), not the order in which the
            # threads got to run this line afterwards.
            with guard:
                grants.append(now)
                served.append((sem.lock._acquired_at, i))
            time.sleep(HOLD)
            with guard:
                releases.append(time.perf_counter())
            sem.release()

        import redis

        raw = redis.Redis.from_url(self.url)
        threads = []
        for i in range(WAITERS):
            t = threading.Thread(target=waiter, args=(i,), daemon=True)
            t.start()
            threads.append(t)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the head holds the line; the rest queue
                if (raw.exists(line_key) if i == 0 else raw.llen(queue) >= i):
                    break
                time.sleep(0.002)
        for h in holders:
            with guard:
                releases.append(time.perf_counter())
            h.release()
            time.sleep(HOLD)
        for t in threads:
            t.join(60)
        raw.close()
        releases.sort()
        grants.sort()
        # The k-th release frees the permit of the k-th grant (the last PERMITS
        # releases find nobody waiting).
        self.handoff_ms += [(g - r) * 1000 for r, g in zip(releases, grants)]
        self.out_of_order.append(out_of_order(served, WAITERS))

    def run_round(self, rng: random.Random) -> None:
        self._round += 1
        order = list(KINDS)
        rng.shuffle(order)
        p50 = {kind: self._batch(kind) for kind in order}
        for kind, value in p50.items():
            self.p50[kind].append(value * 1e6)
        self.ratios.append(p50["semaphore"] / p50["lock"])
        self._queue()

    def close(self) -> None:
        self.manager.close()

    def summary(self) -> dict[str, Any]:
        return {
            "lock_p50_us": median(self.p50["lock"]),
            "semaphore_p50_us": median(self.p50["semaphore"]),
            "ratio": median(self.ratios),
            "reentrant_p50_us": median(self.p50["reentrant"]),
            "multi_lock_p50_us": median(self.p50["multi_lock"]),
            "ratios": self.ratios,
            "waiters": WAITERS, "permits": PERMITS,
            "out_of_order": self.out_of_order,
            "handoff_p50_ms": percentile(self.handoff_ms, 50),
            "handoff_p99_ms": percentile(self.handoff_ms, 99),
            "errors": self.errors,
        }

