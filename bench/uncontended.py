"""Uncontended acquire + release, one process: latency p50/p99, ops/s, ratio to the floors.

One round runs a batch of operations for every contestant, in a shuffled order;
each contestant's p50 is divided by the floor's p50 *of the same round* (same
node count), and the report gives the median over rounds of each figure.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from .libs import contestant_op
from .stats import median, percentile

#: (id, label, node count, floor it is compared with). Order = table order.
ONE_NODE = [
    ("raw-1", "floor: raw sockets, hand-encoded RESP", 1),
    ("redispy-floor-1", "floor: redis-py client", 1),
    ("raw-async-1", "floor: raw asyncio streams, hand-encoded RESP, in one running loop", 1),
    ("raw-protocol-1", "floor: an asyncio Protocol, a future per reply, in one running loop", 1),
    ("scripts-raw-1", "floor: our acquire and release scripts on raw sockets (hiredis)", 1),
    ("drl-1", "django-redlock (fencing + owner)", 1),
    ("drl-renew-1", "django-redlock (fencing + owner, auto_renew on)", 1),
    ("drl-async-1", "django-redlock asyncio (fencing + owner), in one running loop", 1),
    ("drl-async-call-1", "django-redlock asyncio (fencing + owner), a loop run per operation",
     1),
    ("drl-read-1", "django-redlock read_lock (fencing + owner)", 1),
    ("drl-write-1", "django-redlock write_lock (fencing + owner)", 1),
    ("redispy-1", "redis-py Lock", 1),
    ("prl-1", "python-redis-lock", 1),
    ("pottery-1", "pottery Redlock", 1),
]
FIVE_NODES = [
    ("raw-5", "floor: raw sockets, 5 nodes in parallel", 5),
    ("redispy-floor-5", "floor: redis-py, 5 nodes in parallel", 5),
    ("scripts-raw-5", "floor: our scripts on raw sockets, 5 nodes in parallel (hiredis)", 5),
    ("drl-5", "django-redlock (fencing + owner)", 5),
    ("drl-renew-5", "django-redlock (fencing + owner, auto_renew on)", 5),
    ("drl-async-5", "django-redlock asyncio (fencing + owner), in one running loop", 5),
    ("drl-async-call-5", "django-redlock asyncio (fencing + owner), a loop run per operation",
     5),
    ("pottery-5", "pottery Redlock", 5),
]
CONTESTANTS = ONE_NODE + FIVE_NODES
#: Slow contestants run fewer operations per batch so a round stays short.
SLOW = {"pottery-1": 2, "pottery-5": 4}
#: Passes over all contestants per round (see run_round).
CHUNKS = 5


def timed_chunk(op: Callable[[], None], count: int, warmup: int, lat: list[int],
                on_error: Callable[[Exception], None]) -> int:
    """Run ``warmup + count`` operations, append the last ``count`` latencies (ns);
    return the span (ns).

    A failed operation (a node timing out on a loaded machine, say) goes to
    ``on_error`` and is left out of the latencies; it never stops the benchmark.
    An ``op`` with a ``timed_chunk`` of its own (an asyncio contestant timed
    inside its running loop, ``libs.DjangoRedlockAsync``) runs the batch itself.
    """
    inside = getattr(op, "timed_chunk", None)
    if inside is not None:
        span: int = inside(count, warmup, lat, on_error)
        return span
    clock = time.perf_counter_ns
    begin = clock()
    for i in range(warmup + count):
        t0 = clock()
        try:
            op()
        except Exception as e:  # noqa: BLE001 - counted and reported, not fatal
            on_error(e)
            continue
        if i >= warmup:
            lat.append(clock() - t0)
    return clock() - begin


class Uncontended:
    def __init__(self, urls1: list[str], urls5: list[str], *, ops: int, warmup: int) -> None:
        self.ops = ops
        self.warmup = warmup
        self._closers: list[Callable[[], None]] = []
        self.op: dict[str, Callable[[], None]] = {}
        for cid, _, n in CONTESTANTS:
            self.op[cid], close = contestant_op(cid, urls1 if n == 1 else urls5,
                                                f"bench:u:{cid}")
            self._closers.append(close)
        self.rounds: list[dict[str, dict[str, float]]] = []
        self.errors: dict[str, int] = {}
        self.error_sample: dict[str, str] = {}

    def close(self) -> None:
        for close in self._closers:
            close()

    def _failed(self, cid: str, e: Exception) -> None:
        self.errors[cid] = self.errors.get(cid, 0) + 1
        self.error_sample.setdefault(cid, f"{type(e).__name__}: {e}"[:200])

    def run_round(self, rng: random.Random) -> dict[str, dict[str, float]]:
        """One round: ``CHUNKS`` passes over all contestants, each pass in a new order.

        On a small shared VM the round-trip time flips between two modes (client
        and server on one core, or a sleeping core to wake), sometimes from one
        batch to the next; running every contestant in several short chunks
        spreads those modes evenly over the contestants of a round.
        """
        ids = [cid for cid, _, _ in CONTESTANTS]
        lat: dict[str, list[int]] = {cid: [] for cid in ids}
        span = dict.fromkeys(ids, 0)
        for _ in range(CHUNKS):
            rng.shuffle(ids)
            for cid in ids:
                count = max(5, self.ops // SLOW.get(cid, 1) // CHUNKS)
                span[cid] += timed_chunk(self.op[cid], count, self.warmup, lat[cid],
                                         lambda e, cid=cid: self._failed(cid, e))
        res: dict[str, dict[str, float]] = {}
        for cid in ids:
            if not lat[cid]:
                res[cid] = {}
                continue
            us = [x / 1000.0 for x in lat[cid]]
            res[cid] = {"p50_us": percentile(us, 50), "p99_us": percentile(us, 99),
                        "ops_s": len(us) / (span[cid] / 1e9)}
        for cid, _, n in CONTESTANTS:
            raw, rpy = res.get(f"raw-{n}", {}), res.get(f"redispy-floor-{n}", {})
            scripts = res.get(f"scripts-raw-{n}", {})
            if "p50_us" in res.get(cid, {}):
                if "p50_us" in raw:
                    res[cid]["x_raw"] = res[cid]["p50_us"] / raw["p50_us"]
                if "p50_us" in rpy:
                    res[cid]["x_redispy"] = res[cid]["p50_us"] / rpy["p50_us"]
                if "p50_us" in scripts:
                    res[cid]["x_scripts"] = res[cid]["p50_us"] / scripts["p50_us"]
        self.rounds.append(res)
        return res

    def summary(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for cid, label, n in CONTESTANTS:
            per = [r[cid] for r in self.rounds if cid in r]
            ok = [p for p in per if "p50_us" in p]
            row: dict[str, Any] = {"label": label, "nodes": n, "rounds": len(ok)}
            for field in ("p50_us", "p99_us", "ops_s", "x_raw", "x_redispy", "x_scripts"):
                row[field] = median(p[field] for p in ok if field in p)
            row["per_round_p50_us"] = [round(p["p50_us"], 1) for p in ok]
            row["per_round_x_raw"] = [round(p["x_raw"], 3) for p in ok if "x_raw" in p]
            row["errors"] = self.errors.get(cid, 0)
            if cid in self.error_sample:
                row["error_sample"] = self.error_sample[cid]
            out[cid] = row
        return out
