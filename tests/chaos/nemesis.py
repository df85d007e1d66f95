"""The nemesis: a seeded, logged schedule of faults, planned first and then applied.

The whole schedule is drawn from ``random.Random(f"{seed}:{schedule}")`` *before*
the run starts, so a seed names the schedule: the same seed gives the same
faults, on the same nodes, at the same offsets, for the same durations (what
the workers happen to be doing at those moments differs from run to run; it is
a real system). The plan is logged as ``plan`` events and every action applied
as ``start``/``end`` events with its real time; a planned fault that could not
be applied is an ``error`` or ``skip`` event and fails the schedule.

Every worker reaches every node through its *own* :class:`FaultProxy` (a link),
so a fault can hit one node for everybody (all its links) or one worker's links
only: a worker can be cut from nodes that the others still reach.

Node faults (all links of node ``i``, or the server itself):

=================  ==================================================================
``kill``           ``kill -9`` node ``i``; after a downtime *longer than the TTL* (the
                   "delayed restart" rule of the Redis docs) restart it **empty**
``restart-early``  the same, restarted empty *before* the TTL has passed: the node
                   forgets locks that are still running (data loss)
``flush``          ``FLUSHALL`` on one node or on a majority at once (data loss)
``evict``          ``maxmemory`` just above the node's use and an evicting policy
                   (``allkeys-random``, ``volatile-ttl`` or ``volatile-lru``) under
                   background cache traffic, so lock keys get evicted (data loss)
``pause``          SIGSTOP node ``i``, SIGCONT later (a stalled node)
``latency``        50-500 ms each way on node ``i``'s links (over half the node
                   timeout the node counts as down: its replies come too late)
``lossy``          node ``i``'s connections dropped every 50-300 ms (a lossy link:
                   requests in flight are lost, the client reconnects)
``cut``            black-hole node ``i``'s links, heal later (a partition)
``clock``          step node ``i``'s clock forward (libfaketime reading its offset
                   from a file while the server runs): by 0.3-0.8 TTL and back after
                   1-3 s; in the ``clock`` schedule by more than the TTL, for good
``majority``       3 of 5 nodes killed / paused / cut at once, started while a worker
                   is in the middle of an acquisition
=================  ==================================================================

Sentinel faults (the ``failover`` schedule: node ``i`` is a
:class:`~django_redlock.testing.SentinelGroup`, master + replicas + sentinels),
each begun while a worker holds a lock (between its acquire and its write, up
to :data:`HOLD_WAIT`); the holders are logged with the fault:

=================  ==================================================================
``failover``       ``SENTINEL FAILOVER``, graceful: the old master's writes paused
                   (``CLIENT PAUSE WRITE``), a replica promoted, the old master made
                   its replica once the sentinels agree (``end``), then unpaused
``kill-master``    the replicas SIGSTOPped and their links closed
                   (``CLIENT KILL TYPE replica``) for 0.2-0.35 s (``lag``: what the
                   master grants meanwhile reaches no replica) and until a worker took a
                   lock meanwhile (up to :data:`FRESH_WAIT` more; ``killed`` names
                   them, ``fresh``), then ``kill -9`` the master and SIGCONT the
                   replicas; the fresh holders SIGSTOPped until the new master is
                   elected and 0.4 s more (3 s at most, inside their lease: logged
                   as worker pauses), so that another may be granted their lock; the sentinels see it down (0.6 s) and
                   elect a replica (``elected``); the old master is restarted empty
                   after the planned downtime (the sentinels make it a replica)
=================  ==================================================================

Link faults (one worker's links):

=================  ==================================================================
``wcut``           cut worker ``w`` from 1-3 nodes that the others still reach (cut
                   from 3 it is on the minority side: it keeps running while its
                   renewals fail)
``split``          the workers in two groups, one cut from nodes {0, 1}, the other
                   from {3, 4}: each side reaches a majority through node 2 alone
``wslow``          50-400 ms each way on all of worker ``w``'s links
``wlossy``         worker ``w``'s connections dropped every 50-300 ms
=================  ==================================================================

Worker faults (the nemesis waits up to :data:`WORKER_WAIT` for a worker to reach
the moment named; none reaching it is a failed injection):

=================  ==================================================================
``worker-pause``   SIGSTOP a worker *between its last ownership check and its
                   write*, for longer than the lease, then SIGCONT
``crash-before``   SIGKILL a worker holding a lock, before its write; restart it
``crash-after``    SIGKILL a worker holding a lock, after its write was applied and
                   before its release; restart it (recovery by expiry)
=================  ==================================================================
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .history import Event, JsonlWriter

NODE_KINDS = ("kill", "pause", "latency", "cut", "clock", "lossy")
DATALOSS_KINDS = ("flush", "evict", "restart-early", "kill")
LINK_KINDS = ("wcut", "split", "wslow", "wlossy")
WORKER_KINDS = ("worker-pause", "crash-before", "crash-after")
SENTINEL_KINDS = ("failover", "kill-master")
MAX_PLAN = 5000  # faults per plan, whatever the duration
WORKER_WAIT = 4.0  # how long to wait for a worker to reach the moment a fault needs
INFLIGHT_WAIT = 1.0  # how long a majority outage waits for an acquisition in flight
#: The margin worker pauses are planned with before the end of a run.
WORKER_CRITICAL_WAIT = 2.0
#: How long a Sentinel fault waits for a worker holding a lock (then it goes ahead:
#: a failover with nobody holding is still one, and is logged with no holders).
HOLD_WAIT = 1.5
#: How long a ``kill-master`` waits, after its lag, for a worker to take a lock:
#: the replicas stay frozen meanwhile, and must be back before the sentinels
#: call them down (their down-after is 0.6 s in the failover schedule).
FRESH_WAIT = 0.2
#: How long those fresh holders stay stopped after the new master is elected (so
#: that the others may take the lock there first), and at most in all (well
#: inside the failover schedule's 4 s lease).
FRESH_AFTER = 0.4
FRESH_PAUSE_MAX = 3.0
#: Bound on the sentinels agreeing on a new master (a forced failover takes about
#: 1 s here, a killed master about 2 s: 0.6 s to be called down, then the election).
ELECT_WAIT = 15.0
#: Seconds a plan reserves for each Sentinel fault before the next may begin.
FAILOVER_COST = {"failover": 1.5, "kill-master": 3.0}


@dataclasses.dataclass
class Fault:
    at: float  # seconds after the run's start
    kind: str
    targets: tuple[int, ...]  # node indexes (one, or three for a majority)
    duration: float
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    kinds: tuple[str, ...] = ()  # per target, for a majority fault


# -- planning ----------------------------------------------------------------------------
def plan_minority(rng: random.Random, *, duration: float, n_nodes: int, ttl: float,
                  clock_node: int | None, max_faulty: int = 2, big_jumps: bool = False,
                  weights: dict[str, int] | None = None) -> list[Fault]:
    """Node faults with at most ``max_faulty`` nodes faulty at any planned moment.

    Clock faults: by default a forward step of 0.3-0.8 TTL, stepped back after
    1-3 s, so the node's clock never differs from the others' by a TTL or more
    (the operating rule the safety model states). ``big_jumps``: forward jumps of
    more than the TTL that accumulate and are never undone (the ``clock``
    schedule, outside that rule).
    """
    faulty_until = [0.0] * n_nodes
    weights = weights or {"kill": 2, "pause": 2, "latency": 2, "cut": 2, "clock": 1}
    kinds = [k for k in NODE_KINDS if weights.get(k, 0) > 0
             and (k != "clock" or clock_node is not None)]
    last_ok = duration - 1.0  # every fault is over one second before the end
    plan: list[Fault] = []
    t = rng.uniform(0.3, 1.0)
    for _ in range(MAX_PLAN):
        if t >= last_ok - 0.3:
            break
        busy = [i for i in range(n_nodes) if faulty_until[i] > t]
        if len(busy) >= max_faulty:
            t = min(faulty_until[i] for i in busy) + 0.01
            continue
        kind = rng.choices(kinds, [weights[k] for k in kinds])[0]
        free = [i for i in range(n_nodes) if faulty_until[i] <= t]
        if kind == "clock":
            if clock_node not in free:
                kind = "pause"
                target = rng.choice(free)
            else:
                target = clock_node
        else:
            target = rng.choice(free)
        params: dict[str, Any] = {}
        if kind == "kill":
            d = rng.uniform(ttl + 0.2, ttl + 2.0)
        elif kind == "pause":
            d = rng.uniform(0.3, 3.0)
        elif kind == "latency":
            d = rng.uniform(0.5, 4.0)
            params["latency"] = round(rng.uniform(0.05, 0.5), 3)
        elif kind == "cut":
            d = rng.uniform(0.3, 3.0)
        elif kind == "lossy":
            d = rng.uniform(0.5, 4.0)
            params["every"] = round(rng.uniform(0.05, 0.3), 3)
        elif big_jumps:  # clock: instantaneous and for good
            d = 0.0
            params["jump"] = round(rng.uniform(ttl + 0.5, 4 * ttl), 3)
        else:  # clock: a step forward, back after a while
            d = rng.uniform(1.0, 3.0)
            params["jump"] = round(rng.uniform(0.3 * ttl, 0.8 * ttl), 3)
        if t + d > last_ok:
            if kind == "kill":
                t += 0.1  # a kill must stay down past the TTL; try something else later
                continue
            d = max(0.0, last_ok - t)
        plan.append(Fault(round(t, 3), kind, (target,), round(d, 3), params))
        # A clock step matters for a TTL after it: the keys it dropped early.
        faulty_until[target] = t + (d if kind != "clock" else d + ttl + 0.2)
        t += rng.uniform(0.2, 1.2)
    return plan


def plan_majority(rng: random.Random, *, duration: float, n_nodes: int, ttl: float
                  ) -> list[Fault]:
    """Alternate healthy stretches with 3-of-5 outages (kills stay down past the TTL),
    each started while an acquisition is in flight (``inflight``)."""
    plan: list[Fault] = []
    t = rng.uniform(1.5, 3.0)
    quorum = n_nodes // 2 + 1
    for _ in range(MAX_PLAN):
        d = rng.uniform(max(2.5, ttl + 0.5), 4.0)
        if t + d > duration - 1.0:
            break
        targets = tuple(sorted(rng.sample(range(n_nodes), quorum)))
        kinds = tuple(rng.choice(("kill", "pause", "cut")) for _ in targets)
        plan.append(Fault(round(t, 3), "majority", targets, round(d, 3), {"inflight": True},
                          kinds=kinds))
        t += d + rng.uniform(2.0, 3.5)
    return plan


def plan_dataloss(rng: random.Random, *, duration: float, n_nodes: int, ttl: float
                  ) -> list[Fault]:
    """Faults that lose lock data on the servers, one at a time, each followed by a
    quiet stretch: ``flush`` of one node and of a majority, ``evict`` on one node
    and on a majority, ``restart-early`` (empty, before the TTL) and ``kill``
    (empty, after it), in a seeded order that cycles through all six."""
    quorum = n_nodes // 2 + 1
    phases = [("flush", 1), ("flush", quorum), ("evict", 1), ("evict", quorum),
              ("restart-early", 1), ("kill", 1)]
    plan: list[Fault] = []
    t = rng.uniform(0.5, 1.5)
    order: list[tuple[str, int]] = []
    for _ in range(MAX_PLAN):
        if not order:
            order = list(phases)
            rng.shuffle(order)
        kind, n = order.pop()
        n = min(n, n_nodes)
        params: dict[str, Any] = {"phase": f"{kind}-{'one' if n == 1 else 'majority'}"}
        if kind == "flush":
            d = 0.0
        elif kind == "evict":
            d = rng.uniform(1.5, 3.0)
            params["policy"] = rng.choice(("allkeys-random", "volatile-ttl", "volatile-lru"))
        elif kind == "restart-early":
            d = rng.uniform(0.05, 0.5) * ttl
        else:
            d = rng.uniform(ttl + 0.2, ttl + 1.0)
        if t + d > duration - 1.0:
            break
        targets = tuple(sorted(rng.sample(range(n_nodes), n)))
        plan.append(Fault(round(t, 3), kind, targets, round(d, 3), params))
        t += d + rng.uniform(1.0, 2.0)
    return plan


def plan_failover(rng: random.Random, *, duration: float, ttl: float) -> list[Fault]:
    """Sentinel faults on node 0, one at a time: a forced ``failover`` first, then a
    ``kill-master`` (replicas lagging for 0.2-0.35 s before it, the old master
    restarted empty 1-3 s after the kill, once a new one is elected),
    alternating, each given :data:`FAILOVER_COST` and a quiet stretch of 1-2 s
    after it."""
    plan: list[Fault] = []
    t = rng.uniform(1.0, 2.0)
    for n in range(MAX_PLAN):
        kind = SENTINEL_KINDS[n % 2]
        d = rng.uniform(1.0, 3.0) if kind == "kill-master" else 0.0
        params = {"lag": round(rng.uniform(0.2, 0.35), 3)} if kind == "kill-master" else {}
        if t + max(d, FAILOVER_COST[kind]) > duration - 1.0:
            break
        plan.append(Fault(round(t, 3), kind, (0,), round(d, 3), params))
        t += max(d, FAILOVER_COST[kind]) + rng.uniform(1.0, 2.0)
    return plan


def plan_links(rng: random.Random, *, duration: float, n_nodes: int, n_workers: int
               ) -> list[Fault]:
    """Link faults on single workers (``targets`` are nodes; ``params['worker']``)."""
    weights = {"wcut": 3, "split": 2, "wslow": 2, "wlossy": 2}
    plan: list[Fault] = []
    t = rng.uniform(0.3, 1.0)
    for _ in range(MAX_PLAN):
        kind = rng.choices(LINK_KINDS, [weights[k] for k in LINK_KINDS])[0]
        d = rng.uniform(0.5, 3.0)
        if t + d > duration - 1.0:
            break
        w = rng.randrange(n_workers)
        params: dict[str, Any] = {"worker": w}
        targets: tuple[int, ...] = tuple(range(n_nodes))
        if kind == "wcut":
            k = rng.choice((1, 2, 2, n_nodes // 2 + 1)) if n_nodes > 1 else 1
            targets = tuple(sorted(rng.sample(range(n_nodes), min(k, n_nodes))))
        elif kind == "split":
            if n_nodes < 5 or n_workers < 2:
                kind, targets = "wcut", (rng.randrange(n_nodes),)
            else:
                group = sorted(rng.sample(range(n_workers), n_workers // 2))
                params = {"cuts": [[x, [0, 1] if x in group else [n_nodes - 2, n_nodes - 1]]
                                   for x in range(n_workers)]}
        elif kind == "wslow":
            params["latency"] = round(rng.uniform(0.05, 0.4), 3)
        else:
            params["every"] = round(rng.uniform(0.05, 0.3), 3)
        plan.append(Fault(round(t, 3), kind, targets, round(d, 3), params))
        t += d + rng.uniform(0.2, 1.0)
    return plan


def plan_worker_pauses(rng: random.Random, *, duration: float, ttl: float, every: tuple[float, float],
                       extra: tuple[float, float] = (0.3, 1.5)) -> list[Fault]:
    """Worker pauses of TTL + ``extra`` seconds, one every ``every`` seconds."""
    plan: list[Fault] = []
    t = rng.uniform(*every)
    for _ in range(MAX_PLAN):
        d = ttl + rng.uniform(*extra)
        if t + WORKER_CRITICAL_WAIT + d > duration - 1.0:
            break
        plan.append(Fault(round(t, 3), "worker-pause", (), round(d, 3),
                          {"order_seed": rng.randrange(1 << 30)}))
        t += d + rng.uniform(*every)
    return plan


def plan_crashes(rng: random.Random, *, duration: float, ttl: float, every: tuple[float, float]
                 ) -> list[Fault]:
    """Holder crashes (SIGKILL before or after the write, then a restart), with a
    worker pause now and then; at most one at a time."""
    plan: list[Fault] = []
    t = rng.uniform(0.5, 1.5)
    for _ in range(MAX_PLAN):
        kind = rng.choices(WORKER_KINDS, [1, 2, 2])[0]
        d = ttl + rng.uniform(0.3, 1.5) if kind == "worker-pause" else 0.0
        if t + WORKER_WAIT + d > duration - 1.0:
            break
        plan.append(Fault(round(t, 3), kind, (), round(d, 3),
                          {"order_seed": rng.randrange(1 << 30)}))
        t += d + rng.uniform(*every)
    return plan


# -- applying ------------------------------------------------------------------------------
class Nemesis:
    """Applies plans to the nodes, links and workers of a run, and logs it all.

    Three threads: node faults, link faults, worker faults (waiting for a worker to
    reach its write must not delay a node heal). Faults that act over time (lossy
    links, cache traffic) run a small thread each. Every wait is bounded;
    :meth:`heal_all` undoes whatever is still in place and is safe to call twice.

    ``links[w][i]`` is worker ``w``'s proxy to node ``i``. ``workers`` gives the
    current pid of each worker; ``respawn(w)`` starts a new process for worker
    ``w`` after a crash and returns its pid.
    """

    def __init__(self, *, nodes: Any, links: Sequence[Sequence[Any]],
                 worker_pids: Callable[[], list[int]], phase: Any, phases: dict[str, int],
                 clock_file: str | None, log: JsonlWriter, t0: float,
                 respawn: Callable[[int], None] | None = None,
                 current: Any = None, resources: Sequence[str] = (),
                 groups: Sequence[Any] = ()) -> None:
        self.nodes = nodes
        #: Sentinel groups (the ``failover`` schedule): node ``i`` is ``groups[i]``.
        self.groups = list(groups)
        self._killed: dict[int, Any] = {}
        self.links = [list(row) for row in links]
        self.worker_pids = worker_pids
        self.phase = phase
        self.phases = phases
        self.clock_file = clock_file
        self.clock_offset = 0.0
        self.log = log
        self.t0 = t0
        self.respawn = respawn
        self.current = current
        self.resources = list(resources)
        self._log_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stopped_workers: set[int] = set()
        self._background: dict[tuple[str, str], threading.Event] = {}
        self._evicting: set[int] = set()
        self._evict_base: dict[int, int] = {}
        self.errors: list[str] = []
        self.applied = 0

    def event(self, kind: str, action: str, target: str = "", **params: Any) -> None:
        with self._log_lock:
            try:
                self.log.write(Event(time.monotonic(), time.time(), kind, action, target, params))
            except ValueError:  # the log is closed: a last heal during cleanup, after the checker
                pass
            if action == "start":
                self.applied += 1

    def _fail(self, kind: str, target: str, what: str) -> None:
        self.errors.append(f"{kind} {target}: {what}")
        self.event(kind, "error", target, error=what[:200])

    def node_links(self, i: int) -> list[Any]:
        return [row[i] for row in self.links]

    # -- background faults (lossy links, cache traffic) ------------------------------
    def _start_background(self, key: tuple[str, str], fn: Callable[[threading.Event], None]
                          ) -> None:
        stop = threading.Event()
        self._background[key] = stop
        th = threading.Thread(target=fn, args=(stop,), name=f"nemesis-{key[0]}-{key[1]}",
                              daemon=True)
        th.start()
        self._threads.append(th)

    def _stop_background(self, key: tuple[str, str]) -> None:
        stop = self._background.pop(key, None)
        if stop is not None:
            stop.set()

    def _lossy(self, proxies: list[Any], every: float) -> Callable[[threading.Event], None]:
        def run(stop: threading.Event) -> None:
            for _ in range(100_000):
                if stop.wait(every) or self._stop.is_set():
                    return
                for p in proxies:
                    try:
                        p.reset()
                    except RuntimeError:
                        pass
        return run

    def _cache_traffic(self, i: int) -> Callable[[threading.Event], None]:
        def run(stop: threading.Event) -> None:
            import redis

            server = self.nodes[i]
            client = redis.Redis(host=server.host, port=server.port, password=server.password,
                                 socket_timeout=1.0, socket_connect_timeout=1.0)
            payload = b"x" * 2048
            n = 0
            try:
                for _ in range(1_000_000):
                    if stop.is_set() or self._stop.is_set():
                        return
                    pipe = client.pipeline(transaction=False)
                    for _ in range(50):
                        n += 1
                        pipe.set(f"cache:{i}:{n}", payload, ex=60)
                    try:
                        pipe.execute(raise_on_error=False)
                    except redis.RedisError:
                        stop.wait(0.01)
                    stop.wait(0.002)
            finally:
                client.close()
        return run

    def _evicted(self, i: int) -> int:
        info = self.nodes[i].execute("INFO", "stats")
        text = info.decode() if isinstance(info, bytes) else str(info)
        for line in text.splitlines():
            if line.startswith("evicted_keys:"):
                return int(line.split(":", 1)[1])
        return 0

    # -- node faults ---------------------------------------------------------------
    def _holders(self) -> list[int]:
        """Wait up to :data:`HOLD_WAIT` for a worker between its acquire and its write;
        return every worker holding a lock now (in its critical section or just
        after its write)."""
        n = len(self.phase)
        self._wait_phase(self.phases["critical"], list(range(n)), HOLD_WAIT)
        held = (self.phases["critical"], self.phases["written"])
        return [w for w in range(n) if self.phase[w] in held]

    def _fresh_holders(self, lag: float) -> list[int]:
        """Wait ``lag`` seconds, then up to :data:`FRESH_WAIT` more for a worker seen
        without a lock since the wait began to be in its critical section;
        return those (a lock taken during the wait)."""
        held = (self.phases["critical"], self.phases["written"])
        n = len(self.phase)
        free: set[int] = set()
        begin = time.monotonic()
        for _ in range(int((lag + FRESH_WAIT) / 0.001) + 1):
            free.update(w for w in range(n) if self.phase[w] not in held)
            now = time.monotonic() - begin
            fresh = [w for w in sorted(free) if self.phase[w] == self.phases["critical"]]
            if (now >= lag and fresh) or now >= lag + FRESH_WAIT or self._stop.is_set():
                return fresh
            time.sleep(0.001)
        return []

    def _sentinel_start(self, kind: str, i: int, params: dict[str, Any]) -> None:
        group = self.groups[i]
        holders = self._holders()
        old = group.master
        self.event(kind, "start", f"n{i}", holders=holders, old=old.port, **params)
        if kind == "failover":
            # A graceful forced failover, the way an operator runs one (and Redis'
            # own FAILOVER command): the old master's writes paused first, so that
            # it grants nothing the promoted replica will not have; demoted once
            # the sentinels agree, then let go. Without the pause it would be a
            # split brain, which one Sentinel node does not promise to survive
            # (docs/safety.rst, "Sentinel and Cluster nodes").
            old.execute("CLIENT", "PAUSE", int(ELECT_WAIT * 1000), "WRITE")
            try:
                new = group.failover(timeout=ELECT_WAIT, demote=False)
                old.execute("REPLICAOF", new.host, new.port)
            finally:
                old.execute("CLIENT", "UNPAUSE")
            self.event(kind, "end", f"n{i}", new=new.port)
            return
        # The replicas frozen and cut off for a moment first: what the master
        # grants then is on no replica when it dies (the window REPLICA_ACKS
        # closes).
        # The kill waits (up to FRESH_WAIT more) for a worker that took a lock
        # during the lag: with REPLICA_ACKS = 0 that grant dies with the master.
        replicas = [r for r in group.servers if r is not old and r.is_running()]
        for r in replicas:
            r.pause()
        try:
            # Their links closed too: a frozen replica would still find in its
            # socket what the master sent meanwhile, and replay it.
            old.execute("CLIENT", "KILL", "TYPE", "replica")
            fresh = self._fresh_holders(float(params.get("lag", 0.0)))
            old.kill()
        finally:
            for r in replicas:
                r.resume()
        self.event(kind, "killed", f"n{i}", fresh=fresh)
        self._killed[i] = old
        # Those fresh holders are stopped until the new master is elected, and
        # FRESH_AFTER more (at most FRESH_PAUSE_MAX in all, well inside their
        # lease): their grant is on no replica, so the new master may give the
        # lock to another worker meanwhile. A holder whose lease is still valid
        # must then be told (its renewal finds the key gone, its release too),
        # and its fenced write refused if the other claimed first.
        stopped = self._stop_workers(fresh, reason="held a lock its master took down")
        begin = time.monotonic()
        try:
            new = group.wait_master(other_than=old, timeout=FRESH_PAUSE_MAX if stopped
                                    else ELECT_WAIT, majority=True)
            if stopped:
                self._stop.wait(max(0.0, min(FRESH_AFTER,
                                             begin + FRESH_PAUSE_MAX - time.monotonic())))
        except RuntimeError:
            if not stopped:
                raise
            new = None
        finally:
            for w, pid in stopped:
                self._cont(pid)
                self.event("worker-pause", "end", f"w{w}")
        if new is None:
            new = group.wait_master(other_than=old, timeout=ELECT_WAIT, majority=True)
        self.event(kind, "elected", f"n{i}", new=new.port)

    def _stop_workers(self, workers: Sequence[int], reason: str) -> list[tuple[int, int]]:
        """SIGSTOP ``workers`` (logged as worker pauses); returns (worker, pid) of each."""
        stopped = []
        for w in workers:
            pid = self.worker_pids()[w]
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            self._stopped_workers.add(pid)
            self.event("worker-pause", "start", f"w{w}", reason=reason)
            stopped.append((w, pid))
        return stopped

    def _sentinel_end(self, kind: str, i: int) -> None:
        old = self._killed.pop(i, None)
        if kind == "kill-master" and old is not None:
            old.restart(empty=True)
            self.event(kind, "end", f"n{i}", restarted=old.port)

    def _fault_start(self, kind: str, i: int, params: dict[str, Any], *, log: bool = True
                     ) -> None:
        if kind in SENTINEL_KINDS:
            self._sentinel_start(kind, i, params)
            return
        if kind in ("kill", "restart-early"):
            self.nodes[i].kill()
        elif kind == "pause":
            self.nodes[i].pause()
        elif kind == "latency":
            for p in self.node_links(i):
                p.set_latency(params["latency"])
        elif kind == "cut":
            for p in self.node_links(i):
                p.cut()
        elif kind == "lossy":
            self._start_background(("lossy", f"n{i}"), self._lossy(self.node_links(i),
                                                                  params["every"]))
        elif kind == "flush":
            self.nodes[i].execute("FLUSHALL")
        elif kind == "evict":
            used = 0
            info = self.nodes[i].execute("INFO", "memory")
            for line in (info.decode() if isinstance(info, bytes) else str(info)).splitlines():
                if line.startswith("used_memory:"):
                    used = int(line.split(":", 1)[1])
            self._evict_base[i] = self._evicted(i)
            self.nodes[i].execute("CONFIG", "SET", "maxmemory-policy", params["policy"])
            self.nodes[i].execute("CONFIG", "SET", "maxmemory", str(used + 256 * 1024))
            self._evicting.add(i)
            self._start_background(("evict", f"n{i}"), self._cache_traffic(i))
        elif kind == "clock":
            assert self.clock_file is not None
            self.clock_offset += params["jump"]
            write_clock_offset(self.clock_file, self.clock_offset)
            params = {**params, "offset": round(self.clock_offset, 3)}
        if log:
            self.event(kind, "start", f"n{i}", **params)

    def _fault_end(self, kind: str, i: int, params: dict[str, Any] | None = None) -> None:
        extra: dict[str, Any] = {}
        if kind in SENTINEL_KINDS:
            self._sentinel_end(kind, i)
            return
        if kind in ("kill", "restart-early"):
            self.nodes[i].restart(empty=True)
        elif kind == "pause":
            self.nodes[i].resume()
        elif kind == "latency":
            for p in self.node_links(i):
                p.set_latency(0.0)
        elif kind == "cut":
            for p in self.node_links(i):
                p.heal()
        elif kind == "lossy":
            self._stop_background(("lossy", f"n{i}"))
        elif kind == "evict":
            self._stop_background(("evict", f"n{i}"))
            self.nodes[i].execute("CONFIG", "SET", "maxmemory", "0")
            self._evicting.discard(i)
            extra["evicted"] = self._evicted(i) - self._evict_base.pop(i, 0)
            if extra["evicted"] <= 0:
                self._fail("evict", f"n{i}", "no key was evicted")
        elif kind == "clock":
            assert self.clock_file is not None
            self.clock_offset = 0.0
            write_clock_offset(self.clock_file, 0.0)
        else:
            return
        self.event(kind, "end", f"n{i}", **extra)

    def _link_start(self, f: Fault) -> None:
        if f.kind == "split":
            for w, nodes in f.params["cuts"]:
                for i in nodes:
                    self.links[w][i].cut()
            self.event("split", "start", "all", cuts=f.params["cuts"])
            return
        w = f.params["worker"]
        row = self.links[w]
        if f.kind == "wcut":
            for i in f.targets:
                row[i].cut()
        elif f.kind == "wslow":
            for i in f.targets:
                row[i].set_latency(f.params["latency"])
        elif f.kind == "wlossy":
            self._start_background(("wlossy", f"w{w}"),
                                   self._lossy([row[i] for i in f.targets], f.params["every"]))
        self.event(f.kind, "start", f"w{w}", nodes=list(f.targets), **f.params)

    def _link_end(self, f: Fault) -> None:
        if f.kind == "split":
            for w, nodes in f.params["cuts"]:
                for i in nodes:
                    self.links[w][i].heal()
            self.event("split", "end", "all")
            return
        w = f.params["worker"]
        row = self.links[w]
        if f.kind == "wcut":
            for i in f.targets:
                row[i].heal()
        elif f.kind == "wslow":
            for i in f.targets:
                row[i].set_latency(0.0)
        elif f.kind == "wlossy":
            self._stop_background(("wlossy", f"w{w}"))
        self.event(f.kind, "end", f"w{w}")

    def _sleep_until(self, offset: float) -> bool:
        """Sleep until t0 + offset; False when told to stop."""
        delay = self.t0 + offset - time.monotonic()
        return not (delay > 0 and self._stop.wait(delay))

    def _wait_phase(self, wanted: int, order: Sequence[int], wait: float) -> int | None:
        """The first worker (in ``order``) found in phase ``wanted`` within ``wait`` s."""
        deadline = time.monotonic() + wait
        for _ in range(int(wait / 0.001) + 1):
            target = next((w for w in order if self.phase[w] == wanted), None)
            if target is not None or time.monotonic() >= deadline or self._stop.is_set():
                return target
            time.sleep(0.001)
        return None

    def _majority_start(self, f: Fault) -> None:
        inflight: list[int] = []
        if f.params.get("inflight"):
            order = list(range(len(self.links)))
            first = self._wait_phase(self.phases["acquiring"], order, INFLIGHT_WAIT)
            if first is None:
                self._fail("majority", ",".join(f"n{i}" for i in f.targets),
                           f"no acquisition in flight within {INFLIGHT_WAIT} s")
            inflight = [w for w in order if self.phase[w] == self.phases["acquiring"]]
        begin = time.monotonic()
        for i, k in zip(f.targets, f.kinds):
            self._fault_start(k, i, {}, log=False)
        self.event("majority", "start", ",".join(f"n{i}" for i in f.targets),
                   kinds=list(f.kinds), begin=begin, inflight=inflight)

    def _run_timed(self, plan: Sequence[Fault], start: Callable[[Fault], None],
                   end: Callable[[Fault], None]) -> None:
        actions: list[tuple[float, int, str, Fault]] = []
        for n, f in enumerate(plan):
            actions.append((f.at, n, "start", f))
            if f.duration > 0 or f.kind in ("kill", "restart-early", "kill-master"):
                actions.append((f.at + f.duration, n, "end", f))
        actions.sort(key=lambda a: (a[0], 0 if a[2] == "end" else 1, a[1]))
        for at, _, what, f in actions:
            if not self._sleep_until(at):
                return
            try:
                (start if what == "start" else end)(f)
            except (OSError, RuntimeError, ValueError) as e:  # logged; fails the schedule
                self._fail(f.kind, ",".join(f"n{i}" for i in f.targets), f"{what}: {e}")

    def _node_start(self, f: Fault) -> None:
        if f.kind == "majority":
            self._majority_start(f)
        else:  # one node, or the same fault on several at once (flush, evict a majority)
            for i in f.targets:
                self._fault_start(f.kind, i, dict(f.params))

    def _node_end(self, f: Fault) -> None:
        if f.kind == "majority":
            self.event("majority", "end", ",".join(f"n{i}" for i in f.targets))
            for i, k in zip(f.targets, f.kinds):
                self._fault_end(k, i)
            return
        for i in f.targets:
            self._fault_end(f.kind, i, f.params)

    # -- worker faults ---------------------------------------------------------------
    def _run_workers(self, plan: Sequence[Fault], end: float | None = None) -> None:
        for n, f in enumerate(plan):
            if not self._sleep_until(f.at):
                return
            pids = self.worker_pids()
            order = list(range(len(pids)))
            random.Random(f.params["order_seed"]).shuffle(order)
            moment = "written" if f.kind == "crash-after" else "critical"
            # No worker at that moment (every one waiting out a node outage, say): the
            # fault is deferred, not dropped, until the next one is due or the run's
            # end leaves no room for it; only then is it a failed injection.
            wait = WORKER_WAIT
            if end is not None:
                limit = plan[n + 1].at if n + 1 < len(plan) else end - 1.0 - f.duration
                wait = max(WORKER_WAIT, self.t0 + limit - time.monotonic())
            target = self._wait_phase(self.phases[moment], order, wait)
            if self._stop.is_set():
                return
            if target is None:
                self._fail(f.kind, "", f"no worker reached its "
                                       f"{'release' if moment == 'written' else 'write'} "
                                       f"within {wait:.1f} s")
                continue
            pid = self.worker_pids()[target]
            resource = (self.resources[self.current[target]]
                        if self.current is not None and self.resources else "")
            if f.kind == "worker-pause":
                try:
                    os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    self._fail(f.kind, f"w{target}", "worker gone")
                    continue
                self._stopped_workers.add(pid)
                self.event("worker-pause", "start", f"w{target}", duration=f.duration,
                           resource=resource)
                self._stop.wait(f.duration)
                self._cont(pid)
                self.event("worker-pause", "end", f"w{target}")
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                self._fail(f.kind, f"w{target}", "worker gone")
                continue
            self.phase[target] = self.phases["dead"]
            self.event(f.kind, "start", f"w{target}", resource=resource, pid=pid)
            if self.respawn is not None:
                try:
                    self.respawn(target)
                except (OSError, RuntimeError) as e:
                    self._fail(f.kind, f"w{target}", f"restart: {e}")
                    continue
            self.event(f.kind, "end", f"w{target}")

    def _cont(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        self._stopped_workers.discard(pid)

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, node_plan: Sequence[Fault], worker_plan: Sequence[Fault],
              link_plan: Sequence[Fault] = (), duration: float | None = None) -> None:
        for f in (*node_plan, *link_plan, *worker_plan):
            self.event("plan", "info", ",".join(f"n{i}" for i in f.targets), at=f.at,
                       fault=f.kind, duration=f.duration, params=f.params, kinds=list(f.kinds))
        for name, fn, args in (
                ("nemesis-nodes", self._run_timed, (node_plan, self._node_start, self._node_end)),
                ("nemesis-links", self._run_timed, (link_plan, self._link_start, self._link_end)),
                ("nemesis-workers", self._run_workers, (worker_plan, duration))):
            th = threading.Thread(target=fn, args=args, name=name, daemon=True)
            th.start()
            self._threads.append(th)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for th in list(self._threads):
            th.join(max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        for key in list(self._background):
            self._stop_background(key)
        self.join(10.0)

    def heal_all(self) -> None:
        """Undo every fault still in place (each step on its own: one failure does not
        stop the others)."""
        for key in list(self._background):
            self._stop_background(key)
        for pid in list(self._stopped_workers):
            self._cont(pid)
        for pid in self.worker_pids():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for row in self.links:
            for proxy in row:
                for fn in (lambda p=proxy: p.set_latency(0.0), lambda p=proxy: p.heal()):
                    try:
                        fn()
                    except RuntimeError as e:
                        self.errors.append(f"heal proxy: {e}")
        for i, node in enumerate(self.nodes):
            try:
                if node.paused:
                    node.resume()
                    self.event("pause", "end", f"n{i}", cleanup=True)
                elif not node.is_running():
                    node.restart(empty=True)
                    self.event("kill", "end", f"n{i}", cleanup=True)
                if i in self._evicting:
                    node.execute("CONFIG", "SET", "maxmemory", "0")
                    self._evicting.discard(i)
            except (OSError, RuntimeError) as e:
                self.errors.append(f"heal node {i}: {e}")
        for i, group in enumerate(self.groups):
            for server in group.servers:  # a killed master: back, empty (a replica then)
                try:
                    if not server.is_running():
                        server.restart(empty=True)
                        self.event("kill-master", "end", f"n{i}", restarted=server.port,
                                   cleanup=True)
                except (OSError, RuntimeError) as e:
                    self.errors.append(f"heal group {i}: {e}")
            self._killed.pop(i, None)
        if self.clock_file is not None and self.clock_offset:
            self.clock_offset = 0.0
            write_clock_offset(self.clock_file, 0.0)


def write_clock_offset(path: str, seconds: float) -> None:
    """libfaketime's offset file: '+12.500' seconds (re-read at every clock call)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="ascii") as fh:
        fh.write(f"+{seconds:.3f}\n")
    os.replace(tmp, path)
