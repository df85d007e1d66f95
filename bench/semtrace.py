"""``python -m bench.semtrace``: where a semaphore handoff's time goes, step by step.

The semaphore section (:mod:`bench.semaphore`) gives one handoff number for 50
waiters on 5 permits (1 node, each holder 2 ms). This runs the same queue with
every step of the semaphore's plans timed (the plan generators are wrapped: a
diagnostic of the current code, not an API) and prints:

* each step's duration, p50/p90 (``Take(line)`` is the whole wait in line);
* how each head of the line spent its turn, e.g. ``Peek Take+ HandOn``: it
  read the permits, took a free one and handed the line on; ``Peek Notice
  Take+ HandOn``: every permit was busy, it slept until a release's notice,
  then took the permit named; a ``Take-`` is a try of a permit that was taken
  already (``Drop`` instead of ``HandOn``: the code before the line was handed
  on without waiting for the reply);
* the timeline of a grant on each of those two paths, from the holder's
  ``release()`` of the permit to the waiter's ``acquire()`` returning.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Generator
from typing import Any

from .nodes import running_nodes
from .semaphore import HOLD, PERMITS, WAITERS
from .stats import percentile

#: (thread name, step kind, its index or None, t0, t1, answer): one step each.
Mark = tuple[str, str, Any, float, float, Any]


def _traced(plan: Generator[Any, Any, Any], log: list[Mark]) -> Generator[Any, Any, Any]:
    """``plan``, each step's time and answer logged."""
    who = threading.current_thread().name
    step = next(plan)
    while True:
        t0 = time.perf_counter()
        try:
            answer = yield step
        except BaseException as exc:  # noqa: BLE001 - logged, then the plan's to handle
            log.append((who, type(step).__name__, getattr(step, "at", None), t0,
                        time.perf_counter(), exc))
            try:
                step = plan.throw(exc)
            except StopIteration as done:
                return done.value
            continue
        log.append((who, type(step).__name__, getattr(step, "at", None), t0,
                    time.perf_counter(), answer))
        try:
            step = plan.send(answer)
        except StopIteration as done:
            return done.value


def _queue(mgr: Any, url: str, name: str, log: list[Mark]) -> dict[str, float]:
    """The bench's queue; the grant time of each waiter thread (by name)."""
    import redis

    from django_redlock.core.keys import lock_key, waiters_key

    holders = [mgr.semaphore(name, PERMITS) for _ in range(PERMITS)]
    for h in holders:
        h.acquire()
    line_key = lock_key(mgr.key_prefix, f"{name}#line")
    queue = waiters_key(line_key)
    granted: dict[str, float] = {}

    def waiter() -> None:
        sem = mgr.semaphore(name, PERMITS, timeout=60)
        if not sem.acquire():
            return
        granted[threading.current_thread().name] = time.perf_counter()
        time.sleep(HOLD)
        sem.release()

    raw = redis.Redis.from_url(url)
    threads = []
    for i in range(WAITERS):
        t = threading.Thread(target=waiter, name=f"waiter-{i}", daemon=True)
        t.start()
        threads.append(t)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if raw.exists(line_key) if i == 0 else raw.llen(queue) >= i:
                break
            time.sleep(0.002)
    raw.close()
    log.clear()  # the handoffs only, not the arrivals
    for h in holders:
        h.release()
        time.sleep(HOLD)
    for t in threads:
        t.join(60)
    return granted


def _kind(mark: Mark) -> str:
    _, kind, at, _, _, answer = mark
    if kind == "Take":
        return "Take(line)" if at == PERMITS else "Take+" if answer is True else "Take-"
    return kind


def analyse(log: list[Mark], granted: dict[str, float], steps: dict[str, list[float]],
            shapes: Counter[str], paths: dict[str, list[float]]) -> None:
    """Add one queue's marks to the tallies (durations in ms)."""
    for mark in log:
        steps[_kind(mark)].append((mark[4] - mark[3]) * 1000)
    releases = [m for m in log if m[1] == "Drop" and m[2] != PERMITS]  # of permits
    by_thread: dict[str, list[Mark]] = defaultdict(list)
    for mark in log:
        by_thread[mark[0]].append(mark)
    for who, marks in by_thread.items():
        line = [m for m in marks if m[1] == "Take" and m[2] == PERMITS]
        take = [m for m in marks if _kind(m) == "Take+"]
        if not line or not take or who not in granted:
            continue
        became_head = line[0][4]
        # Its turn as the head: its steps from then on, but its own release
        # of the permit (after its hold).
        turn = sorted((m for m in marks if m[3] >= became_head
                       and not (m[1] == "Drop" and m[2] != PERMITS)), key=lambda m: m[3])
        shapes[" ".join(_kind(m) for m in turn)] += 1
        got = take[-1]
        freed = [r for r in releases if r[2] == got[2] and r[3] <= got[3]]
        if not freed:
            continue
        release = max(freed, key=lambda r: r[3])
        notices = [m for m in turn if m[1] == "Notice"]
        drop = [m for m in turn if m[1] in ("Drop", "HandOn")]
        path = "notice" if notices else "peek"
        rows = paths
        rows[f"{path}|release() of the permit: its round trip"].append(
            (release[4] - release[3]) * 1000)
        if notices:
            rows[f"{path}|release() -> the head woken by its notice"].append(
                (notices[-1][4] - release[3]) * 1000)
            rows[f"{path}|woken -> its try of the permit answered"].append(
                (got[4] - notices[-1][4]) * 1000)
        else:
            rows[f"{path}|release() -> a head holds the line (the permit waits)"].append(
                (became_head - release[3]) * 1000)
            rows[f"{path}|holds the line -> read + try answered"].append(
                (got[4] - became_head) * 1000)
        if drop:
            rows[f"{path}|try answered -> the line handed on"].append(
                (drop[-1][4] - got[4]) * 1000)
        rows[f"{path}|total: release() -> acquire() returned"].append(
            (granted[who] - release[3]) * 1000)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.semtrace",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="queues of 50 waiters")
    args = ap.parse_args(argv)

    from django_redlock import LockManager
    from django_redlock.engine import semaphore

    log: list[Mark] = []
    base = semaphore.SemaphoreBase
    acquire_plan, release_plan = base._acquire_plan, base._release_plan
    base._acquire_plan = lambda self, wait: _traced(acquire_plan(self, wait), log)  # type: ignore[method-assign]
    base._release_plan = lambda self: _traced(release_plan(self), log)  # type: ignore[method-assign]
    steps: dict[str, list[float]] = defaultdict(list)
    shapes: Counter[str] = Counter()
    paths: dict[str, list[float]] = defaultdict(list)
    try:
        with running_nodes(1) as urls:
            mgr = LockManager(urls, ttl=10.0)
            try:
                for r in range(args.rounds):
                    granted = _queue(mgr, urls[0], f"bench:semtrace{r}", log)
                    analyse(list(log), granted, steps, shapes, paths)
            finally:
                mgr.close()
    finally:
        base._acquire_plan, base._release_plan = acquire_plan, release_plan  # type: ignore[method-assign]
    print(f"=== semaphore steps, {args.rounds} queues of {WAITERS} waiters on {PERMITS} "
          f"permits, 1 node (ms)")
    print(f"{'step':44s} {'n':>5s} {'p50':>7s} {'p90':>7s}")
    for kind, values in sorted(steps.items()):
        print(f"{kind:44s} {len(values):5d} {percentile(values, 50):7.3f} "
              f"{percentile(values, 90):7.3f}")
    print("=== each head's turn, from holding the line (count)")
    for shape, count in shapes.most_common(8):
        print(f"{count:5d}  {shape}")
    print("=== a grant's timeline by path (ms)")
    for key in sorted(paths, key=lambda k: (k.split("|")[0], "total" in k)):
        path, label = key.split("|")
        values = paths[key]
        print(f"{path:6s} {label:56s} {len(values):5d} {percentile(values, 50):7.3f} "
              f"{percentile(values, 90):7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
