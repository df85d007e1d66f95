"""Node kinds (issue 21): what a Cluster node, a Sentinel node and replica
acknowledgement cost, and how fast a Sentinel node is back after a failover.

One Redlock node of each kind on loopback, started by the test harness
(``django_redlock.testing``): a plain master (the Sentinel group's master,
asked directly), the same master with ``REPLICA_ACKS=1`` (its replica
confirms each grant), the Sentinel group as a ``{"SENTINELS": ...}`` node, and
a 3-master Redis Cluster as a ``{"CLUSTER": ...}`` node. Uncontended acquire +
release p50 of each, interleaved in shuffled chunks per round as in the
uncontended section; ratios to the plain master inside each round.

Failover (after the rounds, :data:`FAILOVER_SAMPLES` times): a thread
acquires and releases on the Sentinel node in a loop while the master is
killed (``kill -9``); reported: the sentinels' own failover time (kill to the
sentinels agreeing on a new master) and the lock's (kill to the first acquire
that succeeds afterwards), each sample's and the medians, and the worst
sample's ratio.

Goals: a Cluster node and a Sentinel node within 1.3x of a plain node;
``REPLICA_ACKS=1`` at most one replica round trip more (reported as the extra
µs beside the plain node's p50, which is two round trips); the lock back
within 2x of the sentinels' failover.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from .stats import median
from .uncontended import timed_chunk

CONTESTANTS = [
    ("plain", "plain master"),
    ("acks1", "plain master, REPLICA_ACKS=1"),
    ("sentinel", "Sentinel node (same master)"),
    ("cluster", "Cluster node (3 masters)"),
]
CHUNKS = 5
#: Failovers measured per run (each kills the master of the moment).
FAILOVER_SAMPLES = 3


class NodeKinds:
    def __init__(self, *, ops: int, warmup: int) -> None:
        from django_redlock import LockManager
        from django_redlock.testing import RedisClusterGroup, SentinelGroup

        self.ops = ops
        self.warmup = warmup
        self.group = SentinelGroup(replicas=1, sentinels=3).start()
        self.cluster = RedisClusterGroup(3).start()
        master = self.group.master.url
        self.managers = {
            "plain": LockManager([master], ttl=10.0),
            "acks1": LockManager([master], ttl=10.0, replica_acks=1),
            "sentinel": LockManager([self.group.node_setting()], ttl=10.0),
            "cluster": LockManager([self.cluster.node_setting()], ttl=10.0),
        }
        self.rounds: list[dict[str, float]] = []
        self.errors: dict[str, int] = {}
        self.failover: dict[str, Any] = {}

    def _op(self, cid: str) -> Any:
        mgr = self.managers[cid]
        name = f"bench:kinds:{cid}"

        def op() -> None:
            lock = mgr.lock(name)
            if not lock.acquire(timeout=5):
                raise RuntimeError(f"{cid}: uncontended acquire failed")
            lock.release()
        return op

    def run_round(self, rng: random.Random) -> None:
        ids = [cid for cid, _ in CONTESTANTS]
        lat: dict[str, list[int]] = {cid: [] for cid in ids}
        for _ in range(CHUNKS):
            rng.shuffle(ids)
            for cid in ids:
                timed_chunk(self._op(cid), max(5, self.ops // CHUNKS), self.warmup, lat[cid],
                            lambda e, cid=cid: self._failed(cid))
        p50 = {cid: median(x / 1000.0 for x in lat[cid]) for cid in ids if lat[cid]}
        self.rounds.append(p50)

    def _failed(self, cid: str) -> None:
        self.errors[cid] = self.errors.get(cid, 0) + 1

    def measure_failover(self, samples: int = FAILOVER_SAMPLES) -> None:
        """The master killed under load, ``samples`` times (each time the
        killed master comes back as the new master's replica before the
        next kill): the sentinels' failover time and the time until the lock
        (a Sentinel node) is acquired again, each sample's and their medians.
        One kill is one draw: where it lands in the loop (a hold, an attempt,
        the gap between) decides whether a key must be released again."""
        runs = []
        for _ in range(samples):
            try:
                runs.append(self._one_failover())
            except Exception as exc:  # noqa: BLE001 - reported, the other samples stand
                runs.append({"error": f"{type(exc).__name__}: {exc}"})
                break
        done = [r for r in runs if "error" not in r]
        ratios = [r["x_sentinel"] for r in done if r.get("x_sentinel") is not None]
        backs = [r["lock_back_s"] for r in done if r.get("lock_back_s") is not None]
        self.failover = {
            "samples": runs,
            "sentinel_failover_s": median([r["sentinel_failover_s"] for r in done])
            if done else None,
            "lock_back_s": median(backs) if backs else None,
            "x_sentinel": median(ratios) if ratios else None,
            "x_sentinel_max": max(ratios) if ratios else None,
        }

    def _one_failover(self) -> dict[str, Any]:
        mgr = self.managers["sentinel"]
        stop = threading.Event()
        oks: list[float] = []
        failed: list[float] = []

        def loop() -> None:
            while not stop.is_set():
                lock = mgr.lock("bench:kinds:failover", timeout=0.5)
                try:
                    if lock.acquire():
                        oks.append(time.monotonic())
                        lock.release()
                    else:
                        failed.append(time.monotonic())
                except Exception:  # noqa: BLE001 - the outage is what is measured
                    failed.append(time.monotonic())
                    time.sleep(0.01)

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        time.sleep(1.0)  # the loop runs
        old = self.group.master
        killed = time.monotonic()
        self.group.kill_master()
        try:
            new = self.group.wait_master(other_than=old, timeout=30)
            elected = time.monotonic() - killed
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(
                    t > killed + elected for t in oks):
                time.sleep(0.01)
        finally:
            stop.set()
            thread.join(10)
        # The outage as the lock saw it: from the kill to the first acquire
        # that succeeded after the first one that failed (or the longest gap
        # between acquires, had none failed).
        first_fail = next((t for t in failed if t > killed), None)
        after = [t for t in oks if first_fail is not None and t > first_fail]
        if after:
            back: float | None = after[0] - killed
        else:
            times = [killed] + [t for t in oks if t > killed]
            gaps = [b - a for a, b in zip(times, times[1:])]
            back = max(gaps) if gaps else None
        # The old master back as the new one's replica (what the sentinels
        # do about 10 s later), synced, for the next sample's kill.
        old.restart()
        old.execute("REPLICAOF", new.host, new.port)
        synced = time.monotonic() + 20
        while time.monotonic() < synced and b"master_link_status:up" not in old.execute(
                "INFO", "replication"):
            time.sleep(0.05)
        return {"sentinel_failover_s": elected, "lock_back_s": back,
                "x_sentinel": None if back is None else back / elected}

    def close(self) -> None:
        for mgr in self.managers.values():
            mgr.close()
        self.cluster.stop()
        self.group.stop()

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"failover": self.failover}
        for cid, label in CONTESTANTS:
            p50s = [r[cid] for r in self.rounds if cid in r]
            ratios = [r[cid] / r["plain"] for r in self.rounds if cid in r and r.get("plain")]
            extra = [r[cid] - r["plain"] for r in self.rounds if cid in r and r.get("plain")]
            out[cid] = {"label": label, "p50_us": median(p50s), "x_plain": median(ratios),
                        "extra_us": median(extra), "errors": self.errors.get(cid, 0)}
        return out
