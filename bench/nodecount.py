"""Uncontended acquire + release as the nodes grow: 1, 3, 5, 7 and 9 nodes.

A round asks every node in parallel and returns once a majority answered, so
going from 3 to 9 nodes should cost little: the goal (issue 23) is 9 nodes
within 1.3x of 3. Each round measures every node count in a shuffled order, in
several short batches (the machine is shared: batches spread its noise over
the counts); the ratio to 3 nodes is taken inside the round, and the report
gives the medians over rounds.

Beside each count, the physical floor for it (``libs.RawFloor``: SET NX PX and
the compare-and-delete on raw sockets, every node in parallel), measured in
the same batches: its growth from 3 to 9 nodes is what the machine allows.
On the 2-core machine these numbers come from, nine server processes cannot
answer at once, and the floor's own 9-node round costs about 3x its 3-node
one; the library's growth is read against that (``x floor growth``).
"""

from __future__ import annotations

import random
import time
from typing import Any

from .libs import RawFloor
from .stats import median, percentile

COUNTS = (1, 3, 5, 7, 9)
CHUNKS = 4


class NodeCount:
    def __init__(self, urls9: list[str], *, ops: int, warmup: int = 3) -> None:
        from django_redlock import LockManager

        self.managers = {n: LockManager(urls9[:n], ttl=10.0, auto_renew=False)
                         for n in COUNTS}
        self.floors = {n: RawFloor(urls9[:n], f"bench:nodes:floor:{n}") for n in COUNTS}
        self.ops = ops
        self.warmup = warmup
        self.rounds: list[dict[int, float]] = []
        self.floor_rounds: list[dict[int, float]] = []
        self.errors = 0

    def close(self) -> None:
        for mgr in self.managers.values():
            mgr.close()
        for floor in self.floors.values():
            floor.close()

    def _floor_batch(self, n: int, count: int, lat: list[float]) -> None:
        op = self.floors[n].op
        for i in range(self.warmup + count):
            t0 = time.perf_counter()
            try:
                op()
            except Exception:  # noqa: BLE001 - counted, never stops the bench
                self.errors += 1
                continue
            if i >= self.warmup:
                lat.append((time.perf_counter() - t0) * 1e6)

    def _batch(self, n: int, count: int, lat: list[float]) -> None:
        mgr = self.managers[n]
        for i in range(self.warmup + count):
            t0 = time.perf_counter()
            try:
                lock = mgr.lock(f"bench:nodes:{n}")
                lock.acquire(timeout=1)
                lock.release()
            except Exception:  # noqa: BLE001 - counted, never stops the bench
                self.errors += 1
                continue
            if i >= self.warmup:
                lat.append((time.perf_counter() - t0) * 1e6)

    def run_round(self, rng: random.Random) -> None:
        lat: dict[int, list[float]] = {n: [] for n in COUNTS}
        floor: dict[int, list[float]] = {n: [] for n in COUNTS}
        order = [(n, kind) for n in COUNTS for kind in ("lib", "floor")]
        for _ in range(CHUNKS):
            rng.shuffle(order)
            for n, kind in order:
                if kind == "lib":
                    self._batch(n, max(5, self.ops // CHUNKS), lat[n])
                else:
                    self._floor_batch(n, max(5, self.ops // CHUNKS), floor[n])
        self.rounds.append({n: percentile(lat[n], 50) for n in COUNTS if lat[n]})
        self.floor_rounds.append({n: percentile(floor[n], 50) for n in COUNTS if floor[n]})

    def summary(self) -> dict[str, Any]:
        rows: dict[str, Any] = {}
        for n in COUNTS:
            p50s = [r[n] for r in self.rounds if n in r]
            x3 = [r[n] / r[3] for r in self.rounds if n in r and r.get(3)]
            floor_p50s = [r[n] for r in self.floor_rounds if n in r]
            floor_x3 = [r[n] / r[3] for r in self.floor_rounds if n in r and r.get(3)]
            # Inside each round: the library's growth over the floor's.
            vs_floor = [lib[n] / lib[3] / (fl[n] / fl[3])
                        for lib, fl in zip(self.rounds, self.floor_rounds)
                        if n in lib and lib.get(3) and n in fl and fl.get(3)]
            rows[str(n)] = {"nodes": n, "p50_us": median(p50s), "x_3_nodes": median(x3),
                            "floor_p50_us": median(floor_p50s) if floor_p50s else None,
                            "floor_x_3_nodes": median(floor_x3) if floor_x3 else None,
                            "x_floor_growth": median(vs_floor) if vs_floor else None,
                            "per_round_p50_us": [round(v, 1) for v in p50s]}
        return {"rows": rows, "errors": self.errors}
