"""``python -m bench.layers``: an uncontended acquire + release, taken apart layer by layer.

Where the time between the raw floor and a ``Lock`` goes, measured in one run
with the layers interleaved round by round (medians; ratios inside a round):

``raw floor``
    ``SET NX PX`` then an ``EVALSHA`` compare-and-delete over raw sockets
    (the benchmark's floor).
``our scripts, raw``
    django-redlock's own acquire and release scripts, with the arguments the
    engine sends, over the same kind of raw socket and a ``hiredis`` reader:
    what the scripts cost with no client code at all.
``transport.round``
    the same two calls through the engine's transport (connection handling,
    deadlines, the settled-round reading), no ``Lock`` object.
``Lock``
    ``manager.lock(name)``, ``acquire()``, ``release()``: everything.

Then the ``Lock`` layer with the transport faked out (pure Python: names, token,
owner, tallies, state, signals), and each script's server time from ``INFO
commandstats``. On 5 nodes the raw rows send to every node before reading any
reply, like the floor.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import redis

from .libs import RawFloor, ScriptsFloor
from .nodes import running_nodes

KEY, FKEY, WKEY = b"redlock:layers", b"{redlock:layers}:fence", b"{redlock:layers}:waiters"



def _measure(ops: dict[str, Callable[[], None]], rounds: int, per: int) -> dict[str, list[float]]:
    med: dict[str, list[float]] = {k: [] for k in ops}
    names = list(ops)
    rng = random.Random(7)
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            op = ops[name]
            for _ in range(20):
                op()
            lat = []
            for _ in range(per):
                t0 = time.perf_counter_ns()
                op()
                lat.append(time.perf_counter_ns() - t0)
            med[name].append(statistics.median(lat) / 1000.0)
    return med


def _pure_python_us(ops: int = 20000) -> float:
    """The Lock layer alone: every round answered at once by a fake transport."""
    from django_redlock.engine.manager import LockManager

    mgr = LockManager(["redis://127.0.0.1:1/0"], auto_renew=False)
    acquired = [[1, b"1795310000000"]]

    def fake(requests: Any, **_: Any) -> list[Any]:
        return acquired if requests[0].script.name == "acquire" else [1]

    mgr.transport.round = fake  # type: ignore[method-assign]
    try:
        for _ in range(2000):
            lock = mgr.lock("layers")
            lock.acquire()
            lock.release()
        t0 = time.perf_counter()
        for _ in range(ops):
            lock = mgr.lock("layers")
            lock.acquire()
            lock.release()
        return (time.perf_counter() - t0) / ops * 1e6
    finally:
        mgr.close()


def _server_us(url: str) -> dict[str, float]:
    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return {k.removeprefix("cmdstat_"): v["usec_per_call"] for k, v in stats.items()
            if k in ("cmdstat_evalsha", "cmdstat_set")}


def run(n: int, rounds: int, per: int) -> None:
    from django_redlock.core.owner import new_token, owner_json
    from django_redlock.engine.manager import LockManager
    from django_redlock.engine.rounds import acquire_call, release_requests

    with running_nodes(n) as urls:
        floor = RawFloor(urls, "bench:layers:floor")
        raw = ScriptsFloor(urls, "layers")
        mgr = LockManager(urls, auto_renew=False)
        owner = owner_json(None)

        def transport_op() -> None:
            token = new_token()
            replies = mgr.transport.round(
                [acquire_call(KEY, FKEY, WKEY, token, 10000, owner, True)] * n,
                tag=token)
            fence = max(int(r[1]) for r in replies if isinstance(r, list))
            mgr.transport.round(release_requests(n, KEY, FKEY, WKEY, token, fence, None),
                                tag=token, final=True)

        def lock_op() -> None:
            lock = mgr.lock("layers")
            lock.acquire()
            lock.release()

        ops = {"raw floor": floor.op, "our scripts, raw": raw.op,
               "transport.round": transport_op, "Lock": lock_op}
        try:
            med = _measure(ops, rounds, per)
        finally:
            floor.close()
            raw.close()
            mgr.close()
        server = _server_time_line(urls[0])
        print(f"=== {n} node(s): {rounds} rounds x {per} ops, medians")
        base = med["raw floor"]
        print(f"{'layer':<22}{'p50 µs':>9}{'x raw floor':>13}")
        for name, values in med.items():
            ratio = statistics.median(v / b for v, b in zip(values, base))
            print(f"{name:<22}{statistics.median(values):>9.0f}{ratio:>13.2f}")
        print(f"server time per call (node 1, INFO commandstats): {server}")


def _server_time_line(url: str) -> str:
    """Server µs per call: the floor's SET and compare-and-delete, then our two scripts."""
    floor = RawFloor([url], "bench:layers:server")
    raw = ScriptsFloor([url], "layers")
    client = redis.Redis.from_url(url)
    try:
        client.config_resetstat()
        for _ in range(3000):
            floor.op()
        f = _server_us(url)
        client.config_resetstat()
        for _ in range(3000):
            raw.op()
        o = _server_us(url)
    finally:
        floor.close()
        raw.close()
        client.close()
    return (f"floor SET {f.get('set', 0):.1f} + compare-and-delete {f.get('evalsha', 0):.1f}; "
            f"our acquire + release scripts {o.get('evalsha', 0):.1f} each on average")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.layers", description=__doc__.split("\n")[0])
    p.add_argument("--nodes", default="1,5", help="node counts (default 1,5)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--ops", type=int, default=200, help="operations per layer and round")
    args = p.parse_args(argv)
    for n in [int(x) for x in args.nodes.split(",")]:
        run(n, args.rounds, args.ops)
    print(f"=== the Lock layer alone (transport faked out): {_pure_python_us():.1f} µs "
          f"per acquire + release")
    return 0


if __name__ == "__main__":
    sys.exit(main())
