"""The nemesis: a seeded, logged schedule of faults, planned first and then applied.

The whole schedule is drawn from ``random.Random(f"{seed}:{schedule}")`` *before*
the run starts, so a seed names the schedule: the same seed gives the same
faults, on the same nodes, at the same offsets, for the same durations (what
the workers happen to be doing at those moments differs from run to run; it is
a real system). The plan is logged as ``plan`` events and every action applied
as ``start``/``end`` events with its real time.

Faults (node ``i`` is always behind its own :class:`FaultProxy`):

==============  ===================================================================
``kill``        ``kill -9`` node ``i``; after a downtime *longer than the TTL* (the
                "delayed restart" rule of the Redis docs) restart it **empty**
``pause``       SIGSTOP node ``i``, SIGCONT later (a stalled node)
``latency``     50-500 ms each way on node ``i``'s proxy (over half the node
                timeout the node counts as down: its replies come too late)
``cut``         black-hole node ``i``'s proxy, heal later (a partition)
``clock``       step node ``i``'s clock forward (libfaketime reading its offset
                from a file while the server runs): by 0.3-0.8 TTL and back after
                1-3 s (keys near the end of their lease expire early); in the
                ``clock`` schedule by more than the TTL, for good (every lock key
                on it expires at once)
``worker-pause`` SIGSTOP a worker *between its last ownership check and its
                write*, for longer than the lease, then SIGCONT
==============  ===================================================================

Schedules:

``safe``      at most 2 of 5 nodes faulty at any moment (a node whose clock
              jumped counts as faulty for a TTL after the jump), plus worker pauses
``nofence``   the same kind of schedule (its own draw), more worker pauses, and
              resources that do not check fences
``majority``  cycles of: healthy for a while, then 3 of 5 nodes killed / paused /
              cut at once for 2.5-4 s, then all healed
``clock``     (not part of ``all``) the safe schedule with forward clock jumps larger
              than the TTL, which the safety model rules out; it shows what
              happens to fences then (docs/reliability.rst, "Known issues")
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

NODE_KINDS = ("kill", "pause", "latency", "cut", "clock")
MAX_PLAN = 5000  # faults per plan, whatever the duration
WORKER_CRITICAL_WAIT = 2.0  # how long to wait for a worker to reach its write


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
    kinds = [k for k in NODE_KINDS if k != "clock" or clock_node is not None]
    weights = weights or {"kill": 2, "pause": 2, "latency": 2, "cut": 2, "clock": 1}
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
    """Alternate healthy stretches with 3-of-5 outages (kills stay down past the TTL)."""
    plan: list[Fault] = []
    t = rng.uniform(1.5, 3.0)
    quorum = n_nodes // 2 + 1
    for _ in range(MAX_PLAN):
        d = rng.uniform(max(2.5, ttl + 0.5), 4.0)
        if t + d > duration - 1.0:
            break
        targets = tuple(sorted(rng.sample(range(n_nodes), quorum)))
        kinds = tuple(rng.choice(("kill", "pause", "cut")) for _ in targets)
        plan.append(Fault(round(t, 3), "majority", targets, round(d, 3), kinds=kinds))
        t += d + rng.uniform(2.0, 3.5)
    return plan


def plan_worker_pauses(rng: random.Random, *, duration: float, ttl: float, every: tuple[float, float]
                       ) -> list[Fault]:
    plan: list[Fault] = []
    t = rng.uniform(*every)
    for _ in range(MAX_PLAN):
        d = ttl + rng.uniform(0.3, 1.5)
        if t + WORKER_CRITICAL_WAIT + d > duration - 1.0:
            break
        plan.append(Fault(round(t, 3), "worker-pause", (), round(d, 3),
                          {"order_seed": rng.randrange(1 << 30)}))
        t += d + rng.uniform(*every)
    return plan


# -- applying ------------------------------------------------------------------------------
class Nemesis:
    """Applies plans to the nodes, proxies and workers of a run, and logs it all.

    Two threads: one for node faults, one for worker pauses (waiting for a worker
    to reach its write must not delay a node heal). Every wait is bounded;
    :meth:`heal_all` undoes whatever is still in place and is safe to call twice.
    """

    def __init__(self, *, nodes: Any, proxies: Sequence[Any], worker_pids: Callable[[], list[int]],
                 phase: Any, critical: int, clock_file: str | None, log: JsonlWriter,
                 t0: float) -> None:
        self.nodes = nodes
        self.proxies = list(proxies)
        self.worker_pids = worker_pids
        self.phase = phase
        self.critical = critical
        self.clock_file = clock_file
        self.clock_offset = 0.0
        self.log = log
        self.t0 = t0
        self._log_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stopped_workers: set[int] = set()
        self.errors: list[str] = []

    def event(self, kind: str, action: str, target: str = "", **params: Any) -> None:
        with self._log_lock:
            try:
                self.log.write(Event(time.monotonic(), time.time(), kind, action, target, params))
            except ValueError:  # the log is closed: a last heal during cleanup, after the checker
                pass

    # -- node faults ---------------------------------------------------------------
    def _fault_start(self, kind: str, i: int, params: dict[str, Any]) -> None:
        if kind == "kill":
            self.nodes[i].kill()
        elif kind == "pause":
            self.nodes[i].pause()
        elif kind == "latency":
            self.proxies[i].set_latency(params["latency"])
        elif kind == "cut":
            self.proxies[i].cut()
        elif kind == "clock":
            assert self.clock_file is not None
            self.clock_offset += params["jump"]
            write_clock_offset(self.clock_file, self.clock_offset)
            params = {**params, "offset": round(self.clock_offset, 3)}
        self.event(kind, "start", f"n{i}", **params)

    def _fault_end(self, kind: str, i: int) -> None:
        if kind == "kill":
            self.nodes[i].restart(empty=True)
        elif kind == "pause":
            self.nodes[i].resume()
        elif kind == "latency":
            self.proxies[i].set_latency(0.0)
        elif kind == "cut":
            self.proxies[i].heal()
        elif kind == "clock":
            assert self.clock_file is not None
            self.clock_offset = 0.0
            write_clock_offset(self.clock_file, 0.0)
        else:
            return
        self.event(kind, "end", f"n{i}")

    def _sleep_until(self, offset: float) -> bool:
        """Sleep until t0 + offset; False when told to stop."""
        delay = self.t0 + offset - time.monotonic()
        return not (delay > 0 and self._stop.wait(delay))

    def _run_nodes(self, plan: Sequence[Fault]) -> None:
        actions: list[tuple[float, int, str, Fault]] = []
        for n, f in enumerate(plan):
            actions.append((f.at, n, "start", f))
            if f.kind != "clock" or f.duration > 0:
                actions.append((f.at + f.duration, n, "end", f))
        actions.sort(key=lambda a: (a[0], 0 if a[2] == "end" else 1, a[1]))
        for at, _, what, f in actions:
            if not self._sleep_until(at):
                return
            try:
                if f.kind == "majority":
                    if what == "start":
                        for i, k in zip(f.targets, f.kinds):
                            self._fault_start(k, i, {})
                        self.event("majority", "start", ",".join(f"n{i}" for i in f.targets),
                                   kinds=list(f.kinds))
                    else:
                        self.event("majority", "end", ",".join(f"n{i}" for i in f.targets))
                        for i, k in zip(f.targets, f.kinds):
                            self._fault_end(k, i)
                elif what == "start":
                    self._fault_start(f.kind, f.targets[0], dict(f.params))
                else:
                    self._fault_end(f.kind, f.targets[0])
            except (OSError, RuntimeError) as e:  # a fault that could not be applied is logged
                self.errors.append(f"{f.kind} {what} n{f.targets}: {e}")
                self.event(f.kind, "error", ",".join(f"n{i}" for i in f.targets), error=str(e)[:200])

    # -- worker pauses ---------------------------------------------------------------
    def _run_workers(self, plan: Sequence[Fault]) -> None:
        for f in plan:
            if not self._sleep_until(f.at):
                return
            pids = self.worker_pids()
            order = list(range(len(pids)))
            random.Random(f.params["order_seed"]).shuffle(order)
            target = None
            deadline = time.monotonic() + WORKER_CRITICAL_WAIT
            for _ in range(int(WORKER_CRITICAL_WAIT / 0.002) + 1):
                target = next((w for w in order if self.phase[w] == self.critical), None)
                if target is not None or time.monotonic() >= deadline or self._stop.is_set():
                    break
                time.sleep(0.002)
            if target is None:
                self.event("worker-pause", "skip", "", reason="no worker reached its write in time")
                continue
            pid = pids[target]
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            self._stopped_workers.add(pid)
            self.event("worker-pause", "start", f"w{target}", duration=f.duration)
            self._stop.wait(f.duration)
            self._cont(pid)
            self.event("worker-pause", "end", f"w{target}")

    def _cont(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        self._stopped_workers.discard(pid)

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, node_plan: Sequence[Fault], worker_plan: Sequence[Fault]) -> None:
        for f in node_plan:
            self.event("plan", "info", ",".join(f"n{i}" for i in f.targets), at=f.at, fault=f.kind,
                       duration=f.duration, params=f.params, kinds=list(f.kinds))
        for f in worker_plan:
            self.event("plan", "info", "", at=f.at, fault=f.kind, duration=f.duration)
        for name, fn, plan in (("nemesis-nodes", self._run_nodes, node_plan),
                               ("nemesis-workers", self._run_workers, worker_plan)):
            th = threading.Thread(target=fn, args=(plan,), name=name, daemon=True)
            th.start()
            self._threads.append(th)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for th in self._threads:
            th.join(max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        self.join(10.0)

    def heal_all(self) -> None:
        """Undo every fault still in place (each step on its own: one failure does not
        stop the others)."""
        for pid in list(self._stopped_workers):
            self._cont(pid)
        for pid in self.worker_pids():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for proxy in self.proxies:
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
            except (OSError, RuntimeError) as e:
                self.errors.append(f"heal node {i}: {e}")


def write_clock_offset(path: str, seconds: float) -> None:
    """libfaketime's offset file: '+12.500' seconds (re-read at every clock call)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="ascii") as fh:
        fh.write(f"+{seconds:.3f}\n")
    os.replace(tmp, path)
