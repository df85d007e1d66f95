"""Many held locks in one process: what their renewal costs as they grow.

1, 100, 1,000 and 10,000 locks held with auto-renew (1 node, TTL 3 s: each is
renewed every second): the renewal thread's CPU time over wall time, in % of
one core (read from ``/proc``: what holding the locks costs), the whole
process's CPU time beside it (in a full ``make bench`` the process also keeps
the other sections' clients, threads and objects alive, which a process that
only holds locks does not), and the script calls each renewal period costs the
node (INFO commandstats). Renewals are batched per node (``extend_many``), so
the calls per period stay about flat while the locks grow; the goal (issue 23)
is 10,000 held locks under 10 % of one CPU, judged on the renewal thread.
Each window starts on a collected heap (``gc.collect()`` before it): in a
full run the earlier sections leave garbage whose full collection would land
in the renewal thread's window (a renewal allocates, so the collector often
runs there), and that is the earlier sections' cost, not the locks'.
"""

from __future__ import annotations

import gc
import os
import random
import time
from typing import Any

import redis

from .stats import median

COUNTS = (1, 100, 1_000, 10_000)
TTL = 3.0
WINDOW = 3.0  # seconds measured per count and round: three renewal periods
#: Rounds measured at most (each takes about half a minute: 11,101 locks to
#: take and three windows); later rounds of the run skip this section.
MAX_ROUNDS = 2


def _thread_cpu(native_id: int | None) -> float | None:
    """CPU seconds (user + system) of one thread of this process, from
    ``/proc/self/task/<id>/stat``; None where that cannot be read (not Linux)."""
    if native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{native_id}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the ")" that ends the command name: state is fields[0], so
    # utime and stime (stat fields 14 and 15) are fields[11] and fields[12].
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _script_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


class HeldLocks:
    def __init__(self, urls1: list[str], counts: tuple[int, ...] = COUNTS) -> None:
        from django_redlock import LockManager

        self.url = urls1[0]
        self.counts = counts
        self.manager = LockManager(urls1, ttl=TTL, auto_renew=True)
        self.client = redis.Redis.from_url(self.url)
        self.rounds: list[dict[int, dict[str, float]]] = []

    def close(self) -> None:
        self.manager.close()
        self.client.close()

    def _measure(self, n: int) -> dict[str, float]:
        locks = [self.manager.lock(f"bench:held:{n}:{i}") for i in range(n)]
        for lock in locks:
            lock.acquire(timeout=5)
        try:
            time.sleep(TTL / 3)  # the first renewals settle
            # The garbage the earlier sections left is collected now: a full
            # collection runs in whichever thread allocates next, often this
            # renewal thread, and walks every object of the bench process
            # (0.4 s for 4 million), which is not what holding locks costs.
            gc.collect()
            watchdog = getattr(self.manager, "_watchdog", None)
            thread = getattr(watchdog, "_thread", None)
            tid = getattr(thread, "native_id", None)
            calls0, cpu0, wall0 = _script_calls(self.client), time.process_time(), \
                time.monotonic()
            thread0 = _thread_cpu(tid)
            time.sleep(WINDOW)
            thread1 = _thread_cpu(tid)
            calls = _script_calls(self.client) - calls0
            cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
            held = sum(lock.owned() for lock in locks)
        finally:
            for lock in locks:
                try:
                    lock.release()
                except Exception:  # noqa: BLE001 - the bench reports, never stops
                    pass
        periods = wall / (TTL / 3)
        renewal = None if thread0 is None or thread1 is None else thread1 - thread0
        return {"cpu_pct": 100.0 * cpu / wall,
                "renewal_cpu_pct": None if renewal is None else 100.0 * renewal / wall,
                "calls_per_period": calls / periods, "still_held": float(held)}

    def run_round(self, rng: random.Random) -> None:
        if len(self.rounds) >= MAX_ROUNDS:
            return
        order = list(self.counts)
        rng.shuffle(order)
        self.rounds.append({n: self._measure(n) for n in order})

    def summary(self) -> dict[str, Any]:
        rows: dict[str, Any] = {}
        for n in self.counts:
            per = [r[n] for r in self.rounds if n in r]
            rows[str(n)] = {"held": n,
                            "cpu_pct": median(p["cpu_pct"] for p in per),
                            "renewal_cpu_pct": _median_or_none(
                                p.get("renewal_cpu_pct") for p in per),
                            "calls_per_period": median(p["calls_per_period"] for p in per),
                            "lost": sum(n - p["still_held"] for p in per)}
        return {"rows": rows, "ttl_s": TTL, "window_s": WINDOW}


def _median_or_none(values: Any) -> float | None:
    known = [v for v in values if v is not None]
    return median(known) if known else None
