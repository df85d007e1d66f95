"""Cold burst: 200 concurrent first acquisitions on a freshly made manager.

What a process that just started meets when a burst of requests arrives: no
connection to any node yet. Each round makes a new :class:`LockManager` per
driver (threads, asyncio), starts 200 acquisitions of distinct names at once,
and times until the last one has acquired and released; it also counts the
acquisitions that failed (``QuorumUnavailable`` there would be a false outage:
every node is up). Connection set-up is shared per node, so the burst opens a
few connections in turn instead of 200 per node at once.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any

from .stats import median

BURST = 200
DRIVERS = ("threads", "asyncio")


class ColdBurst:
    def __init__(self, urls: list[str], burst: int = BURST) -> None:
        self.urls = urls
        self.burst = burst
        self.seconds: dict[str, list[float]] = {d: [] for d in DRIVERS}
        self.failed: dict[str, int] = {d: 0 for d in DRIVERS}

    def _threads(self, manager: Any) -> int:
        failed = 0
        guard = threading.Lock()
        start = threading.Barrier(self.burst)

        def one(k: int) -> None:
            nonlocal failed
            start.wait(timeout=30)
            try:
                with manager.lock(f"bench:cold:{k}", timeout=10):
                    pass
            except Exception:  # noqa: BLE001 - every failure is counted, whatever its type
                with guard:
                    failed += 1

        threads = [threading.Thread(target=one, args=(k,)) for k in range(self.burst)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        return failed

    def _asyncio(self, manager: Any) -> int:
        async def one(k: int) -> bool:
            try:
                async with manager.alock(f"bench:cold:{k}", timeout=10):
                    pass
            except Exception:  # noqa: BLE001 - every failure is counted, whatever its type
                return False
            return True

        async def burst() -> int:
            done = await asyncio.gather(*(one(k) for k in range(self.burst)))
            return sum(not ok for ok in done)

        return asyncio.run(burst())

    def run_round(self, rng: random.Random) -> None:
        from django_redlock import LockManager

        order = list(DRIVERS)
        rng.shuffle(order)
        for driver in order:
            manager = LockManager(self.urls)
            try:
                t = time.perf_counter()
                failed = self._threads(manager) if driver == "threads" else self._asyncio(manager)
                self.seconds[driver].append(time.perf_counter() - t)
                self.failed[driver] += failed
            finally:
                manager.close()

    def summary(self) -> dict[str, Any]:
        return {d: {"burst": self.burst, "nodes": len(self.urls),
                    "median_ms": median(self.seconds[d]) * 1000 if self.seconds[d] else None,
                    "worst_ms": max(self.seconds[d]) * 1000 if self.seconds[d] else None,
                    "failed": self.failed[d], "rounds": len(self.seconds[d])}
                for d in DRIVERS}
