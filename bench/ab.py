"""``python -m bench.ab --base REV``: this checkout against an earlier revision, interleaved.

The full benchmark compares libraries; this compares two versions of
django-redlock, which is how a change to the engine is judged here. On a
shared, noisy machine a change of 10-20% is invisible between two runs of
``make bench`` made minutes apart, and plain within one run that interleaves.

``REV`` is checked out into a temporary git worktree. Every round runs each
variant (this checkout, ``REV``, and python-redis-lock as a yardstick) in
fresh spawned processes that put that variant's tree first on ``sys.path``
(and check that the package really came from there), in a shuffled order:

``uncontended``
    one process, acquire + release in a loop on 1 or 5 nodes: p50 µs;
``asyncio``
    the same with ``alock()``, timed inside one running event loop;
``contended``
    four processes, one lock on 1 or 5 nodes (``--nodes``), a GET/SET counter
    inside (as in ``python -m bench``): acquisitions per second, client CPU
    per acquisition, and the fair split (smallest worker / mean);
``handoff``
    two processes on 1 or 5 nodes (``--nodes``): one holds, waits a random
    3-13 ms (the other is blocked, its CPU idle) and releases; the median
    time from ``release()`` to the other's ``acquire()`` returning, in µs.

It prints each round, then per variant the median and the median of the
per-round ratios to ``REV``. Nothing is written to ``bench/results``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import redis

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 4
START_DELAY = 1.5  # spawned workers import Django and connect before the start


def _load(root: str, variant: str, urls: list[str], flavour: str = "drl-renew") -> Any:
    """The contestant for ``variant``, built from the tree at ``root``
    (``flavour``: the benchmark's contestant id without its node count)."""
    sys.path.insert(0, root)
    from bench.libs import build, quiet_loggers

    quiet_loggers()
    if variant == "python-redis-lock":
        return build("prl-1", urls, urls)
    import django_redlock

    where = str(Path(django_redlock.__file__).resolve())
    if not where.startswith(root):
        raise RuntimeError(f"django_redlock came from {where}, not from {root}")
    return build(f"{flavour}-{1 if len(urls) == 1 else 5}", urls, urls)


def _uncontended(root: str, variant: str, urls: list[str], ops: int, flavour: str,
                 out: Any) -> None:
    lib = _load(root, variant, urls, flavour)
    try:
        lat: list[int] = []
        if flavour == "drl-async":
            # Timed inside one running loop, as python -m bench times it.
            def failed(e: Exception) -> None:
                raise e

            lib.make_op("bench:ab:u").timed_chunk(ops, ops // 5, lat, failed)
            out.put(statistics.median(lat) / 1000.0)
            return
        for i in range(ops + ops // 5):
            lock = lib.new("bench:ab:u")
            t0 = time.perf_counter_ns()
            if not lib.acquire(lock, 5.0):
                raise RuntimeError("uncontended acquire failed")
            lib.release(lock)
            if i >= ops // 5:  # the first fifth warms up
                lat.append(time.perf_counter_ns() - t0)
        out.put(statistics.median(lat) / 1000.0)
    finally:
        lib.close()


def _contend(root: str, variant: str, urls: list[str], name: str, start_at: float,
             duration: float, out: Any) -> None:
    lib = _load(root, variant, urls)
    counter = redis.Redis.from_url(urls[0])
    try:
        warm = lib.new(name + ":warm")
        lib.acquire(warm, 5.0)
        lib.release(warm)
        time.sleep(max(0.0, start_at - time.monotonic()))
        end = start_at + duration
        done = 0
        cpu = os.times()
        while time.monotonic() < end:
            lock = lib.new(name)
            if not lib.acquire(lock, max(0.0, end - time.monotonic())):
                continue
            value = counter.get(name + ":n")
            counter.set(name + ":n", int(value or 0) + 1)
            lib.release(lock)
            done += 1
        after = os.times()
        out.put((done, after.user - cpu.user + after.system - cpu.system))
    finally:
        counter.close()
        lib.close()


HANDOFF_GAP = (0.003, 0.013)  # the holder's hold before release(), as in bench.trace
HANDOFF_TIMEOUT = 10.0


def _hand_hold(root: str, variant: str, urls: list[str], name: str, samples: int, seed: int,
               barrier: Any, out: Any) -> None:
    lib = _load(root, variant, urls)
    rng = random.Random(seed)
    released = []
    try:
        for _ in range(samples):
            lock = lib.new(name)
            if not lib.acquire(lock, HANDOFF_TIMEOUT):
                raise RuntimeError(f"{variant}: the holder could not acquire")
            barrier.wait(HANDOFF_TIMEOUT)  # the waiter starts its acquire()
            time.sleep(rng.uniform(*HANDOFF_GAP))
            released.append(time.monotonic_ns())
            lib.release(lock)
            barrier.wait(HANDOFF_TIMEOUT)  # the waiter got it and let it go
        out.put(("hold", released))
    finally:
        lib.close()


def _hand_wait(root: str, variant: str, urls: list[str], name: str, samples: int,
               barrier: Any, out: Any) -> None:
    lib = _load(root, variant, urls)
    returned: list[int | None] = []
    try:
        for _ in range(samples):
            lock = lib.new(name)
            barrier.wait(HANDOFF_TIMEOUT)
            ok = lib.acquire(lock, HANDOFF_TIMEOUT)
            returned.append(time.monotonic_ns() if ok else None)
            if ok:
                lib.release(lock)
            barrier.wait(HANDOFF_TIMEOUT)
        out.put(("wait", returned))
    finally:
        lib.close()


def _handoff(ctx: Any, root: str, variant: str, urls: list[str], name: str, samples: int,
             seed: int) -> float:
    """Median µs from release() to the blocked acquire() returning."""
    barrier = ctx.Barrier(2)
    results = dict(_run_procs(ctx, _hand_hold, [(root, variant, urls, name, samples, seed,
                                                 barrier)], samples * 0.1 + 60,
                              also=[(_hand_wait, (root, variant, urls, name, samples, barrier))]))
    gaps = [(t1 - t0) / 1000 for t0, t1 in zip(results["hold"], results["wait"])
            if t1 is not None]
    if len(gaps) < samples:
        raise RuntimeError(f"{variant}: {samples - len(gaps)} handoffs timed out")
    return statistics.median(gaps)


def _run_procs(ctx: Any, target: Any, args_list: list[tuple[Any, ...]], timeout: float,
               also: Sequence[tuple[Any, tuple[Any, ...]]] = ()) -> list[Any]:
    """Run ``target(*args, out)`` per args (and each ``(other, args)`` of ``also``)
    in spawned processes; the values they put on ``out``, waiting at most ``timeout``."""
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, out), daemon=True) for args in args_list]
    procs += [ctx.Process(target=other, args=(*args, out), daemon=True) for other, args in also]
    for p in procs:
        p.start()
    try:
        return [out.get(timeout=timeout) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()


def _worktree(rev: str, into: str) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", into, rev],
                   check=True)


def _drop_worktree(path: str) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", path],
                   check=False, capture_output=True)


def _summary(title: str, per_round: dict[str, list[float]], base: str, unit: str,
             higher_is_better: bool) -> None:
    print(f"\n{title} ({'higher' if higher_is_better else 'lower'} is better)")
    print(f"{'variant':<22}{'median ' + unit:>16}   x {base}")
    for variant, values in per_round.items():
        ratio = statistics.median(v / b for v, b in zip(values, per_round[base]))
        print(f"{variant:<22}{statistics.median(values):>16.1f}   {ratio:.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="the git revision to compare against")
    p.add_argument("--only", default="uncontended,contended",
                   help="sections: uncontended, asyncio, contended, handoff "
                        "(default: uncontended,contended)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--nodes", type=int, default=1,
                   help="1 or 5 nodes (default 1)")
    p.add_argument("--samples", type=int, default=40, help="handoffs per round")
    p.add_argument("--ops", type=int, default=2000, help="uncontended ops per round")
    p.add_argument("--duration", type=float, default=3.0, help="contended seconds per round")
    args = p.parse_args(argv)
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    from .nodes import running_nodes

    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="redlock-ab-")
    base_tree = os.path.join(tmp, "base")
    _worktree(args.base, base_tree)
    here, base = "this checkout", f"base {args.base}"
    roots = {here: str(ROOT), base: base_tree}
    rng = random.Random()
    try:
        for section, flavour, what in (("uncontended", "drl-renew", "acquire + release"),
                                       ("asyncio", "drl-async", "asyncio acquire + release")):
            if section not in sections:
                continue
            lat: dict[str, list[float]] = {here: [], base: []}
            with running_nodes(args.nodes) as urls:
                for rnd in range(args.rounds):
                    order = list(lat)
                    rng.shuffle(order)
                    for variant in order:
                        [p50] = _run_procs(ctx, _uncontended,
                                           [(roots[variant], variant, urls, args.ops, flavour)],
                                           120)
                        lat[variant].append(p50)
                    print(f"{section} round {rnd + 1}: " + ", ".join(
                        f"{v} {lat[v][-1]:.0f} µs" for v in lat), flush=True)
            _summary(f"uncontended {what} p50, {args.nodes} node(s)", lat, base,
                     "µs", higher_is_better=False)
        if "contended" in sections:
            rate: dict[str, list[float]] = {here: [], base: []}
            if args.nodes == 1:  # python-redis-lock is a 1-node lock
                rate["python-redis-lock"] = []
                roots["python-redis-lock"] = str(ROOT)
            cpu: dict[str, list[float]] = {v: [] for v in rate}
            fair: dict[str, list[float]] = {v: [] for v in rate}
            with running_nodes(args.nodes) as urls:
                for rnd in range(args.rounds):
                    order = list(rate)
                    rng.shuffle(order)
                    for variant in order:
                        name = f"bench:ab:c:{rnd}:{order.index(variant)}"
                        start_at = time.monotonic() + START_DELAY
                        results = _run_procs(
                            ctx, _contend, [(roots[variant], variant, urls, name, start_at,
                                             args.duration)] * WORKERS,
                            START_DELAY + args.duration + 60)
                        done = sum(r[0] for r in results)
                        rate[variant].append(done / args.duration)
                        cpu[variant].append(sum(r[1] for r in results) / max(done, 1) * 1e6)
                        fair[variant].append(min(r[0] for r in results) * WORKERS / max(done, 1))
                    print(f"contended round {rnd + 1}: " + ", ".join(
                        f"{v} {rate[v][-1]:.0f}/s" for v in rate), flush=True)
            _summary(f"contended acquisitions/s, 4 processes, {args.nodes} node(s)", rate, base,
                     "acq/s", higher_is_better=True)
            _summary("client CPU per contended acquisition", cpu, base, "µs",
                     higher_is_better=False)
            print("\nfair split, smallest worker / mean (the benchmark's goal: >= 0.5)")
            for variant, values in fair.items():
                print(f"{variant:<22}median {statistics.median(values):.2f}, "
                      f"worst round {min(values):.2f}")
        if "handoff" in sections:
            hand: dict[str, list[float]] = {here: [], base: [], "python-redis-lock": []}
            roots["python-redis-lock"] = str(ROOT)
            variants = list(hand) if args.nodes == 1 else [here, base]
            with running_nodes(args.nodes) as urls:
                for rnd in range(args.rounds):
                    order = variants[:]
                    rng.shuffle(order)
                    for variant in order:
                        name = f"bench:ab:h:{rnd}:{order.index(variant)}"
                        hand[variant].append(_handoff(ctx, roots[variant], variant, urls, name,
                                                      args.samples, rng.randrange(1 << 30)))
                    print(f"handoff round {rnd + 1}: " + ", ".join(
                        f"{v} {hand[v][-1]:.0f} µs" for v in variants), flush=True)
            _summary(f"handoff p50, release() to acquire() returning, {args.nodes} node(s)",
                     {v: hand[v] for v in variants}, base, "µs", higher_is_better=False)
    finally:
        _drop_worktree(base_tree)
    return 0


if __name__ == "__main__":
    sys.exit(main())
