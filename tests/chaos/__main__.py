"""``python -m tests.chaos --duration 60 [--seed N] [--schedule all|NAME[,NAME...]] [--json out]``

Schedules (``all`` runs every one but ``clock``): ``safe`` (minority node faults,
worker pauses), ``partition`` (partial partitions: a worker cut from nodes the
others reach, split groups, slow and lossy links per worker and per node),
``crash`` (holders SIGKILLed before and after their write, then restarted),
``majority`` (3-of-5 outages begun while acquisitions are in flight),
``dataloss`` (FLUSHALL on one node and on a majority, eviction under maxmemory,
restarts empty before and after the TTL), ``nofence`` (the contrast: resources
that do not check fences), ``single`` (one node), ``clock`` (clock jumps beyond
the model), ``family`` (read_lock / write_lock, semaphore, multi_lock and
segments holders under the safe faults, partial partitions and pauses past the
lease), ``failover`` (the node is a Sentinel group: forced failovers and a killed
master during holds, half the workers with ``REPLICA_ACKS`` 1, half with 0). See ``tests/chaos/checker.py`` (:func:`verdict`) for what each must
show.

Exit status: 0 when every schedule that ran passed its verdict, 1 when one did
not, 2 when the run itself failed (a server that would not start, a worker that
died in setup).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

from . import runner
from .checker import format_schedule, verdict
from .runner import ALL, SCHEDULES, Options, durations_for, run_schedule, setup_database


def _schedules(text: str) -> list[str]:
    if text == "all":
        return list(ALL)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown schedule(s) {', '.join(unknown) or text!r}; choose from "
            f"{', '.join(SCHEDULES)} or all")
    return names


def _terminate(signum: int, frame: Any) -> None:
    """SIGTERM: unwind (every server, proxy and worker is stopped in ``finally``)."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0,
                        help="seconds of workload under faults in total, split between the "
                             "schedules (runner.SHARES; default 60)")
    parser.add_argument("--seed", type=int, default=None, help="schedule seed (default: random)")
    parser.add_argument("--schedule", type=_schedules, default="all",
                        help=f"all, or a comma-separated list of: {', '.join(SCHEDULES)}")
    parser.add_argument("--json", metavar="PATH", help="write the full reports as JSON")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--ttl", type=float, default=1.5, help="lock TTL in seconds (default 1.5)")
    parser.add_argument("--keep", metavar="DIR", help="keep the raw history (JSONL) in DIR")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    if not 5 <= args.duration <= 3600:
        parser.error("--duration must be between 5 and 3600 seconds")
    if not 1 <= args.workers <= 16:
        parser.error("--workers must be between 1 and 16")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 1 << 31)
    names = args.schedule if isinstance(args.schedule, list) else _schedules(args.schedule)
    durations = durations_for(names, args.duration)
    opts = Options(seed=seed, workers=args.workers, ttl=args.ttl, keep=args.keep)
    print(f"chaos run: seed {seed}, schedules {', '.join(names)}, "
          f"{', '.join(f'{n} {d:.0f} s' for n, d in durations.items())}; "
          f"TTL {opts.ttl} s, timeout {opts.timeout} s, node timeout {opts.node_timeout} s, "
          f"{opts.workers} workers, 5 nodes (single: 1; failover: a Sentinel group, TTL "
          f"{runner.FAILOVER_TTL:g} s), each worker on its own links", flush=True)

    workdir = tempfile.mkdtemp(prefix="redlock-chaos-")
    reports = {}
    status = 0
    started = time.monotonic()
    try:
        db_path = setup_database(workdir)
        for name in names:
            reports[name] = run_schedule(name, durations[name], opts, db_path,
                                         log=lambda m: print(m, flush=True))
    except (RuntimeError, OSError) as e:
        print(f"chaos run failed: {e}", file=sys.stderr)
        status = 2
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    for name, r in reports.items():
        print()
        print(format_schedule(name, r))
        for reason in r.get("skipped", []):
            print(f"  note: {reason}")
        for err in r.get("nemesis_errors", [])[:10]:
            print(f"  nemesis error: {err}")
        ok, _ = verdict(r)
        r["verdict"] = "pass" if ok else "fail"
        if not ok and status == 0:
            status = 1
    if reports:
        print()
        print("summary: " + ", ".join(f"{n} {r['verdict'].upper()}" for n, r in reports.items()))
    print(f"seed {seed}; reproduce with: python -m tests.chaos --seed {seed} "
          f"--duration {args.duration:g} --schedule "
          f"{'all' if names == list(ALL) else ','.join(names)}"
          f" ({time.monotonic() - started:.0f} s)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"seed": seed, "status": status, "durations": durations,
                       "options": {"ttl": opts.ttl, "timeout": opts.timeout,
                                   "node_timeout": opts.node_timeout, "workers": opts.workers},
                       "reports": reports}, fh, indent=1, sort_keys=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
