"""Uncontended acquire + release on 5 nodes when one node is slow.

One of the five nodes sits behind a :class:`~django_redlock.testing.FaultProxy`
that delays every byte by ``SLOW_NODE_LATENCY`` each way, as a node across a
congested link, on a busy host, or in a GC-like stall would be. A Redlock client
needs a majority, so it need not wait for that node; a client that waits for
every reply pays the delay on every operation. The raw 5-node floor (which
waits for every node) is measured through the same proxy, so the ratio shows
what waiting costs. Like the uncontended section: shuffled short chunks per
round, medians over rounds.
"""

from __future__ import annotations

import multiprocessing as mp
import random
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from .libs import contestant_op
from .stats import median, percentile
from .uncontended import timed_chunk

#: One-way delay added to the slow node's traffic (seconds): 2 ms per round trip.
SLOW_NODE_LATENCY = 0.001

CONTESTANTS = [
    ("raw-5", "floor: raw sockets, 5 nodes in parallel (waits for all)"),
    ("drl-5", "django-redlock (fencing + owner)"),
    ("drl-async-5", "django-redlock asyncio (fencing + owner), in one running loop"),
    ("pottery-5", "pottery Redlock"),
]
SLOW = {"pottery-5": 4}
CHUNKS = 5


def _serve_proxy(host: str, port: int, conn: Connection) -> None:
    """The proxy runs in a process of its own: in the benchmark's process its
    forwarding thread would take the GIL from whatever is being measured."""
    from django_redlock.testing import FaultProxy

    proxy = FaultProxy(host, port).start()
    proxy.set_latency(SLOW_NODE_LATENCY)
    conn.send(proxy.url)
    conn.recv()  # until the benchmark is done
    proxy.stop()


class SlowNode:
    def __init__(self, urls5: list[str], *, ops: int, warmup: int) -> None:
        self.ops = ops
        self.warmup = warmup
        host, port = urls5[0].split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        here, there = mp.get_context("spawn").Pipe()
        self._proxy = mp.get_context("spawn").Process(
            target=_serve_proxy, args=(host, int(port), there), daemon=True)
        self._proxy.start()
        if not here.poll(30):
            raise RuntimeError("the latency proxy did not start")
        urls = [here.recv()] + list(urls5[1:])
        self._closers: list[Callable[[], None]] = [lambda: self._stop_proxy(here)]
        self.op: dict[str, Callable[[], None]] = {}
        for cid, _ in CONTESTANTS:
            self.op[cid], close = contestant_op(cid, urls, f"bench:slow:{cid}")
            self._closers.append(close)
        self.rounds: list[dict[str, dict[str, float]]] = []
        self.errors: dict[str, int] = {}

    def _failed(self, cid: str) -> None:
        self.errors[cid] = self.errors.get(cid, 0) + 1

    def _stop_proxy(self, conn: Connection) -> None:
        conn.send(None)
        self._proxy.join(10)
        if self._proxy.is_alive():
            self._proxy.kill()

    def close(self) -> None:
        for close in reversed(self._closers):
            close()

    def run_round(self, rng: random.Random) -> None:
        ids = [cid for cid, _ in CONTESTANTS]
        lat: dict[str, list[int]] = {cid: [] for cid in ids}
        for _ in range(CHUNKS):
            rng.shuffle(ids)
            for cid in ids:
                count = max(5, self.ops // SLOW.get(cid, 1) // CHUNKS)
                timed_chunk(self.op[cid], count, self.warmup, lat[cid],
                            lambda e, cid=cid: self._failed(cid))
        res: dict[str, dict[str, float]] = {}
        for cid in ids:
            if lat[cid]:
                us = [x / 1000.0 for x in lat[cid]]
                res[cid] = {"p50_us": percentile(us, 50), "p99_us": percentile(us, 99)}
        floor = res.get("raw-5", {}).get("p50_us")
        for cid in res:
            if floor:
                res[cid]["x_raw"] = res[cid]["p50_us"] / floor
        self.rounds.append(res)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"latency_ms_one_way": SLOW_NODE_LATENCY * 1000}
        for cid, label in CONTESTANTS:
            ok = [r[cid] for r in self.rounds if cid in r]
            out[cid] = {"label": label, "rounds": len(ok), "errors": self.errors.get(cid, 0),
                        **{f: median(p[f] for p in ok if f in p)
                           for f in ("p50_us", "p99_us", "x_raw")}}
        return out
