"""Measurements across processes: contended throughput and release -> acquire handoff.

Four worker processes are started once (spawn, so no thread or connection of the
parent leaks into them) and reused for every library and round; each builds its
own clients. Times shared between processes come from ``time.monotonic_ns()``,
the system-wide ``CLOCK_MONOTONIC`` on Linux.

Contended: the workers start together at an agreed instant and, for ``duration``
seconds, loop acquire -> GET counter -> SET counter + 1 -> release on one lock.
An acquisition counts when its ``acquire()`` returned inside the window. The
counter is a plain GET/SET (not INCR): any overlap of two holders loses an
increment, so ``counter == total acquisitions`` checks mutual exclusion.

Handoff: worker A holds the lock while worker B blocks in ``acquire()``; after a
random gap A takes ``t0`` and calls ``release()``; B takes ``t1`` the moment its
``acquire()`` returns. The gap is drawn over the library's poll period so a
polling waiter is caught at a random phase, as it would be in production.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from multiprocessing.connection import Connection
from typing import Any

import redis

from .libs import POLL_PERIOD, BenchError, Contestant, build, quiet_loggers
from .stats import median, percentile

WORKERS = 4
BARRIER_TIMEOUT = 20.0
HANDOFF_ACQUIRE_TIMEOUT = 5.0

CONTENDED = [
    ("drl-renew-1", "django-redlock (defaults: fencing, auto_renew)", 1),
    ("drl-renew-5", "django-redlock (defaults: fencing, auto_renew)", 5),
    ("prl-1", "python-redis-lock", 1),
    ("redispy-1", "redis-py Lock", 1),
    ("pottery-1", "pottery Redlock", 1),
    ("pottery-5", "pottery Redlock", 5),
]
HANDOFF = CONTENDED
#: Handoff samples per round: the polling peers cost ~0.1-0.2 s per sample.
HANDOFF_SAMPLES = {"drl-renew-1": 3, "drl-renew-5": 3, "prl-1": 3,
                   "redispy-1": 1, "pottery-1": 1, "pottery-5": 1}
HANDOFF_GAP_MIN = 0.015  # long enough for any waiter to be blocked
#: The second contended harness (issue 23): the libraries with a goal, a fixed
#: number of acquisitions per round (fewer in a quick run), stop when done.
COUNTED = [lib for lib in CONTENDED if lib[0] in ("drl-renew-1", "prl-1", "drl-renew-5",
                                                  "pottery-5")]
COUNTED_TARGET = {"quick": 1_000, "full": 2_000}
ATTEMPT_TIMEOUT = 5.0  # one acquire's wait, under every library's lease (10 s)
COUNT_TIMEOUT = 120.0  # a worker gives up after this long (pottery's worst round is ~10 s)


# -- worker side --------------------------------------------------------------------
class _Worker:
    def __init__(self, urls1: list[str], urls5: list[str], barrier: Any) -> None:
        self.urls1, self.urls5 = urls1, urls5
        self.barrier = barrier
        self.libs: dict[str, Contestant] = {}
        self.counter = redis.Redis.from_url(urls1[0])

    def lib(self, lib_id: str) -> Contestant:
        if lib_id not in self.libs:
            self.libs[lib_id] = build(lib_id, self.urls1, self.urls5)
        return self.libs[lib_id]

    def contend(self, lib_id: str, name: str, counter_key: str, start_at: float,
                duration: float) -> dict[str, Any]:
        lib = self.lib(lib_id)
        cnt = self.counter
        clock = time.monotonic
        delay = start_at - clock()
        if delay > 0:
            time.sleep(delay)
        deadline = start_at + duration
        total = in_window = 0
        errors: list[str] = []
        while True:
            now = clock()
            if now >= deadline:
                break
            lock = lib.new(name)
            try:
                got = lib.acquire(lock, deadline - now)
            except Exception as e:  # noqa: BLE001 - any library error is counted, not fatal
                errors.append(f"{type(e).__name__}: {e}"[:200])
                continue
            if not got:
                continue
            acquired_at = clock()
            try:
                value = cnt.get(counter_key)
                cnt.set(counter_key, int(value or 0) + 1)
            finally:
                total += 1
                try:
                    lib.release(lock)
                except Exception as e:  # noqa: BLE001 - counted (e.g. a lost lock), not fatal
                    errors.append(f"release: {type(e).__name__}: {e}"[:200])
            if acquired_at < deadline:
                in_window += 1
        return {"total": total, "in_window": in_window, "errors": errors[:5],
                "error_count": len(errors)}

    def contend_count(self, lib_id: str, name: str, counter_key: str, start_at: float,
                      target: int) -> dict[str, Any]:
        """Acquire -> GET counter -> SET counter + 1 -> release until the counter
        reached ``target`` (read under the lock, or before asking for it), then stop."""
        lib = self.lib(lib_id)
        cnt = self.counter
        clock = time.monotonic
        delay = start_at - clock()
        if delay > 0:
            time.sleep(delay)
        done = 0
        errors: list[str] = []
        give_up = clock() + COUNT_TIMEOUT
        while clock() < give_up:
            if int(cnt.get(counter_key) or 0) >= target:
                break
            lock = lib.new(name)
            try:
                # Bounded per attempt: python-redis-lock refuses a wait above its lease.
                got = lib.acquire(lock, min(ATTEMPT_TIMEOUT, max(0.1, give_up - clock())))
            except Exception as e:  # noqa: BLE001 - any library error is counted, not fatal
                errors.append(f"{type(e).__name__}: {e}"[:200])
                if len(errors) >= 100:
                    break  # a library that keeps failing: reported, not looped on
                continue
            if not got:
                continue
            try:
                value = int(cnt.get(counter_key) or 0)
                if value >= target:
                    break  # released in the finally below
                cnt.set(counter_key, value + 1)
                done += 1
            finally:
                try:
                    lib.release(lock)
                except Exception as e:  # noqa: BLE001 - counted (e.g. a lost lock), not fatal
                    errors.append(f"release: {type(e).__name__}: {e}"[:200])
        return {"done": done, "finished": clock(), "errors": errors[:5],
                "error_count": len(errors)}

    def hold(self, lib_id: str, name: str, samples: int, gap_max: float, seed: int) -> list[int]:
        lib = self.lib(lib_id)
        rng = random.Random(seed)
        t0s = []
        for _ in range(samples):
            lock = lib.new(name)
            if not lib.acquire(lock, HANDOFF_ACQUIRE_TIMEOUT):
                raise BenchError(f"{lib_id}: holder could not acquire")
            self.barrier.wait(BARRIER_TIMEOUT)  # the waiter may start waiting
            time.sleep(rng.uniform(HANDOFF_GAP_MIN, gap_max))
            t0s.append(time.monotonic_ns())
            lib.release(lock)
            self.barrier.wait(BARRIER_TIMEOUT)  # the waiter acquired and released
        return t0s

    def wait(self, lib_id: str, name: str, samples: int) -> list[int | None]:
        lib = self.lib(lib_id)
        t1s: list[int | None] = []
        for _ in range(samples):
            lock = lib.new(name)
            self.barrier.wait(BARRIER_TIMEOUT)
            ok = lib.acquire(lock, HANDOFF_ACQUIRE_TIMEOUT)
            t1s.append(time.monotonic_ns() if ok else None)
            if ok:
                lib.release(lock)
            self.barrier.wait(BARRIER_TIMEOUT)
        return t1s


def _worker_main(conn: Connection, urls1: list[str], urls5: list[str], barrier: Any) -> None:
    quiet_loggers()
    worker = _Worker(urls1, urls5, barrier)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        method, kwargs = msg
        try:
            conn.send(("ok", getattr(worker, method)(**kwargs)))
        except Exception as e:  # noqa: BLE001 - reported to the parent, which goes on
            conn.send(("error", f"{type(e).__name__}: {e}"[:300]))
    for lib in worker.libs.values():
        lib.close()


# -- parent side --------------------------------------------------------------------
class Workers:
    """Four long-lived worker processes, driven over pipes."""

    def __init__(self, urls1: list[str], urls5: list[str], count: int = WORKERS) -> None:
        ctx = mp.get_context("spawn")
        self.barrier = ctx.Barrier(2)
        self.conns: list[Connection] = []
        self.procs = []
        for _ in range(count):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(child, urls1, urls5, self.barrier),
                               daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.counter = redis.Redis.from_url(urls1[0])

    def call(self, calls: list[tuple[int, str, dict[str, Any]]], timeout: float) -> list[Any]:
        for idx, method, kwargs in calls:
            self.conns[idx].send((method, kwargs))
        out = []
        for idx, _, _ in calls:
            if not self.conns[idx].poll(timeout):
                raise BenchError(f"worker {idx} did not answer in {timeout:g} s")
            out.append(self.conns[idx].recv())
        return out

    def close(self) -> None:
        stop_workers(self.conns, self.procs)
        self.counter.close()


def stop_workers(conns: list[Connection], procs: list[Any]) -> None:
    """Tell each worker process to stop (``None`` on its pipe), wait for it
    (bounded), and terminate one that does not exit."""
    for conn in conns:
        try:
            conn.send(None)
        except OSError:
            pass
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.terminate()


def error_fields(row: dict[str, Any], ok: list[dict[str, Any]],
                 per: list[dict[str, Any]]) -> None:
    """The rounds' counter check, error count and first error samples, into ``row``."""
    row["per_worker_last"] = ok[-1]["per_worker"] if ok else []
    row["counter_exact"] = all(p["counter_exact"] for p in ok) if ok else None
    row["errors"] = sum(p["errors"] for p in ok)
    samples = [e for p in ok for e in p.get("error_sample", [])]
    samples += [p["error"] for p in per if "error" in p]
    if samples:
        row["error_sample"] = samples[:3]


class Contended:
    def __init__(self, workers: Workers, *, duration: float) -> None:
        self.workers = workers
        self.duration = duration
        self.rounds: list[dict[str, dict[str, Any]]] = []

    def _one(self, lib_id: str, rnd: int) -> dict[str, Any]:
        name = f"bench:c:{lib_id}:{rnd}"
        counter_key = f"bench:counter:{lib_id}:{rnd}"
        self.workers.counter.delete(counter_key)
        start_at = time.monotonic() + 0.15
        calls = [(i, "contend", {"lib_id": lib_id, "name": name, "counter_key": counter_key,
                                 "start_at": start_at, "duration": self.duration})
                 for i in range(len(self.workers.conns))]
        replies = self.workers.call(calls, timeout=self.duration + 30)
        failed = [r[1] for r in replies if r[0] != "ok"]
        if failed:
            return {"error": failed[0]}
        per = [r[1] for r in replies]
        counts = [p["in_window"] for p in per]
        total = sum(p["total"] for p in per)
        counter = int(self.workers.counter.get(counter_key) or 0)
        mean = sum(counts) / len(counts)
        res: dict[str, Any] = {
            "acq_s": sum(counts) / self.duration,
            "per_worker": counts,
            "fairness": (min(counts) / mean) if mean else 0.0,
            "counter_exact": counter == total,
            "counter": counter, "total": total,
            "errors": sum(p["error_count"] for p in per),
        }
        sample = [e for p in per for e in p["errors"]]
        if sample:
            res["error_sample"] = sample[:2]
        return res

    def run_round(self, rng: random.Random) -> dict[str, dict[str, Any]]:
        rnd = len(self.rounds)
        order = [lib for lib, _, _ in CONTENDED]
        rng.shuffle(order)
        res = {lib: self._one(lib, rnd) for lib in order}
        drl1, prl, drl5, pot5 = (res.get(k, {}) for k in
                                 ("drl-renew-1", "prl-1", "drl-renew-5", "pottery-5"))
        if drl1.get("acq_s") and prl.get("acq_s"):
            drl1["x_prl"] = drl1["acq_s"] / prl["acq_s"]
        if drl5.get("acq_s") and pot5.get("acq_s"):
            drl5["x_pottery"] = drl5["acq_s"] / pot5["acq_s"]
        self.rounds.append(res)
        return res

    def summary(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for lib, label, n in CONTENDED:
            per = [r[lib] for r in self.rounds if lib in r]
            ok = [p for p in per if "acq_s" in p]
            row: dict[str, Any] = {"label": label, "nodes": n, "rounds": len(ok)}
            for field in ("acq_s", "fairness", "x_prl", "x_pottery"):
                vals = [p[field] for p in ok if field in p]
                if vals:
                    row[field] = median(vals)
            row["min_fairness"] = min((p["fairness"] for p in ok), default=float("nan"))
            row["per_round_acq_s"] = [round(p["acq_s"], 1) for p in ok]
            row["per_round_fairness"] = [round(p["fairness"], 3) for p in ok]
            error_fields(row, ok, per)
            out[lib] = row
        return out


class Handoff:
    def __init__(self, workers: Workers, *, scale: int) -> None:
        self.workers = workers
        self.scale = scale
        self.samples: dict[str, list[float]] = {lib: [] for lib, _, _ in HANDOFF}
        self.round_p50: dict[str, list[float]] = {lib: [] for lib, _, _ in HANDOFF}
        self.failures: dict[str, list[str]] = {lib: [] for lib, _, _ in HANDOFF}

    def _one(self, lib_id: str, rng: random.Random) -> None:
        name = f"bench:h:{lib_id}"
        poll = POLL_PERIOD.get(lib_id, 0.0)
        count = HANDOFF_SAMPLES[lib_id] * self.scale
        gap_max = HANDOFF_GAP_MIN + max(poll, 0.01)
        calls = [(0, "hold", {"lib_id": lib_id, "name": name, "samples": count,
                              "gap_max": gap_max, "seed": rng.randrange(1 << 30)}),
                 (1, "wait", {"lib_id": lib_id, "name": name, "samples": count})]
        timeout = count * (gap_max + HANDOFF_ACQUIRE_TIMEOUT) + 30
        (s0, t0s), (s1, t1s) = self.workers.call(calls, timeout=timeout)
        if s0 != "ok" or s1 != "ok":
            self.failures[lib_id].append(t0s if s0 != "ok" else t1s)
            self.workers.barrier.reset()
            return
        ms = [(t1 - t0) / 1e6 for t0, t1 in zip(t0s, t1s) if t1 is not None]
        missed = sum(1 for t1 in t1s if t1 is None)
        if missed:
            self.failures[lib_id].append(f"{missed} waiter(s) timed out")
        self.samples[lib_id].extend(ms)
        if ms:
            self.round_p50[lib_id].append(percentile(ms, 50))

    def run_round(self, rng: random.Random) -> None:
        order = [lib for lib, _, _ in HANDOFF]
        rng.shuffle(order)
        for lib in order:
            self._one(lib, rng)

    def summary(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for lib, label, n in HANDOFF:
            ms = self.samples[lib]
            row: dict[str, Any] = {"label": label, "nodes": n, "samples": len(ms),
                                   "p50_ms": percentile(ms, 50), "p90_ms": percentile(ms, 90),
                                   "p99_ms": percentile(ms, 99),
                                   "round_p50_median_ms": median(self.round_p50[lib])}
            if self.failures[lib]:
                row["errors"] = self.failures[lib][:3]
            out[lib] = row
        return out


def counted_ratios(res: dict[str, dict[str, Any]]) -> None:
    """Within one round: django-redlock's throughput over its peer's (1 node:
    python-redis-lock; 5 nodes: pottery), and its time over the peer's."""
    for ours, peer, field in (("drl-renew-1", "prl-1", "x_prl"),
                              ("drl-renew-5", "pottery-5", "x_pottery")):
        a, b = res.get(ours, {}), res.get(peer, {})
        if a.get("acq_s") and b.get("acq_s"):
            a[field] = a["acq_s"] / b["acq_s"]
            a[f"time_{field}"] = a["seconds"] / b["seconds"]


class CountedContended:
    """The contended comparison in a second harness: the four workers run until
    the counter reached a fixed total (``target`` acquisitions, each doing a
    GET and a SET under the lock), and the time is from the agreed start to the
    last worker's stop. Throughput is ``target / time``; the counter must end
    at exactly ``target`` with the workers' counts summing to it (an overlap
    of two holders would lose an increment and need more acquisitions)."""

    def __init__(self, workers: Workers, *, quick: bool) -> None:
        self.workers = workers
        self.target = COUNTED_TARGET["quick" if quick else "full"]
        self.rounds: list[dict[str, dict[str, Any]]] = []

    def _one(self, lib_id: str, rnd: int) -> dict[str, Any]:
        name = f"bench:cc:{lib_id}:{rnd}"
        counter_key = f"bench:ccounter:{lib_id}:{rnd}"
        self.workers.counter.delete(counter_key)
        start_at = time.monotonic() + 0.15
        calls = [(i, "contend_count", {"lib_id": lib_id, "name": name,
                                       "counter_key": counter_key, "start_at": start_at,
                                       "target": self.target})
                 for i in range(len(self.workers.conns))]
        replies = self.workers.call(calls, timeout=COUNT_TIMEOUT + 30)
        failed = [r[1] for r in replies if r[0] != "ok"]
        if failed:
            return {"error": failed[0]}
        per = [r[1] for r in replies]
        counts = [p["done"] for p in per]
        seconds = max(p["finished"] for p in per) - start_at
        counter = int(self.workers.counter.get(counter_key) or 0)
        mean = sum(counts) / len(counts)
        res: dict[str, Any] = {
            "seconds": seconds, "acq_s": sum(counts) / seconds if seconds > 0 else 0.0,
            "per_worker": counts, "fairness": (min(counts) / mean) if mean else 0.0,
            "counter_exact": counter == sum(counts) == self.target,
            "errors": sum(p["error_count"] for p in per),
        }
        sample = [e for p in per for e in p["errors"]]
        if sample:
            res["error_sample"] = sample[:2]
        return res

    def run_round(self, rng: random.Random) -> None:
        rnd = len(self.rounds)
        order = [lib for lib, _, _ in COUNTED]
        rng.shuffle(order)
        res = {lib: self._one(lib, rnd) for lib in order}
        counted_ratios(res)
        self.rounds.append(res)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for lib, label, n in COUNTED:
            per = [r[lib] for r in self.rounds if lib in r]
            ok = [p for p in per if "acq_s" in p]
            row: dict[str, Any] = {"label": label, "nodes": n, "rounds": len(ok)}
            for field in ("seconds", "acq_s", "fairness", "x_prl", "x_pottery",
                          "time_x_prl", "time_x_pottery"):
                vals = [p[field] for p in ok if field in p]
                if vals:
                    row[field] = median(vals)
            error_fields(row, ok, per)
            out[lib] = row
        return {"rows": out, "target": self.target}
