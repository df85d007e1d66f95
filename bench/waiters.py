"""Waiters on one lock: how a handoff's cost grows with the line (issue 23).

1, 10, 50 and 200 waiting threads on one lock, on 1 node and on 5: a holder
holds the lock while the waiters arrive one at a time (each starts once the
one before it stands in line), then lets go, and every waiter holds the lock
1 ms in turn. Reported per line length and node count:

* handoff p50 / p99: the k-th release to the (k+1)-th holder's grant;
* grants out of arrival order (the n-th waiter served n-th: 0 means FIFO);
* the bytes the line takes on a node (``MEMORY USAGE`` of its queue key, with
  every waiter in line);
* server commands per handoff (``INFO commandstats`` over the drain, per
  grant, summed over the nodes): flat as the line grows means no thundering
  herd (a release wakes the first in line, not everyone).

Goal: handoff p50 under 1.5 ms at 200 waiters on 1 node.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import redis

from .stats import median, out_of_order, percentile

COUNTS = (1, 10, 50, 200)
NODES = (1, 5)
HOLD = 0.001
#: Rounds measured at most (the 200-waiter lines take a few seconds each).
MAX_ROUNDS = 3


def _commands(clients: list[redis.Redis]) -> int:
    total = 0
    for client in clients:
        stats = client.info("commandstats")
        total += sum(v["calls"] for k, v in stats.items()
                     if k not in ("cmdstat_info", "cmdstat_llen", "cmdstat_memory"))
    return total


class Waiters:
    def __init__(self, urls1: list[str], urls5: list[str]) -> None:
        from django_redlock import LockManager

        self.urls = {1: urls1, 5: urls5}
        self.managers = {n: LockManager(urls, ttl=10.0) for n, urls in self.urls.items()}
        self.clients = {n: [redis.Redis.from_url(u) for u in urls]
                        for n, urls in self.urls.items()}
        self.rounds: list[dict[tuple[int, int], dict[str, Any]]] = []
        self.errors = 0
        self._seq = 0

    def close(self) -> None:
        for mgr in self.managers.values():
            mgr.close()
        for clients in self.clients.values():
            for client in clients:
                client.close()

    def _line(self, nodes: int, count: int) -> dict[str, Any]:
        from django_redlock.core.keys import waiters_key

        mgr, clients = self.managers[nodes], self.clients[nodes]
        self._seq += 1
        name = f"bench:waiters:{self._seq}"
        holder = mgr.lock(name)
        holder.acquire()
        queue = waiters_key(holder.key)
        served: list[tuple[float, int]] = []
        grants: list[float] = []
        releases: list[float] = []
        guard = threading.Lock()

        def waiter(i: int) -> None:
            lock = mgr.lock(name, timeout=60)
            try:
                if not lock.acquire():
                    self.errors += 1
                    return
            except Exception:  # noqa: BLE001 - counted, not fatal
                self.errors += 1
                return
            now = time.perf_counter()
            with guard:
                grants.append(now)
                served.append((lock._acquired_at, i))
            time.sleep(HOLD)
            with guard:
                releases.append(time.perf_counter())
            lock.release()

        threads = []
        for i in range(count):
            thread = threading.Thread(target=waiter, args=(i,), daemon=True)
            thread.start()
            threads.append(thread)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # in line before the next one comes
                if max(c.llen(queue) for c in clients) >= i + 1:
                    break
                time.sleep(0.001)
        memory = max(int(c.memory_usage(queue) or 0) for c in clients)
        before = _commands(clients)
        with guard:
            releases.append(time.perf_counter())
        holder.release()
        for thread in threads:
            thread.join(60)
        commands = _commands(clients) - before
        releases.sort()
        grants.sort()
        handoffs = [(g - r) * 1000 for r, g in zip(releases, grants)]
        return {"handoffs_ms": handoffs, "out_of_order": out_of_order(served, count),
                "queue_bytes": memory,
                "commands_per_handoff": commands / max(1, len(grants))}

    def run_round(self, rng: random.Random) -> None:
        if len(self.rounds) >= MAX_ROUNDS:
            return
        cases = [(n, c) for n in NODES for c in COUNTS]
        rng.shuffle(cases)
        self.rounds.append({case: self._line(*case) for case in cases})

    def summary(self) -> dict[str, Any]:
        rows: dict[str, Any] = {}
        for n in NODES:
            for c in COUNTS:
                runs = [r[(n, c)] for r in self.rounds if (n, c) in r]
                if not runs:
                    continue
                pooled = [h for run in runs for h in run["handoffs_ms"]]
                rows[f"{n}x{c}"] = {
                    "nodes": n, "waiters": c,
                    "handoff_p50_ms": percentile(pooled, 50),
                    "handoff_p99_ms": percentile(pooled, 99),
                    "out_of_order": sum(run["out_of_order"] for run in runs),
                    "queue_bytes": median(run["queue_bytes"] for run in runs),
                    "commands_per_handoff": median(run["commands_per_handoff"]
                                                   for run in runs),
                }
        return {"rows": rows, "errors": self.errors, "hold_s": HOLD}
