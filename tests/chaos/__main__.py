"""``python -m tests.chaos --duration 60 [--seed N] [--schedule safe|majority|nofence|single|all] [--json out]``

Exit status: 0 when every schedule that ran passed its check (safe, single and
nofence: zero lost updates, zero fence violations, no fence reused, no
acknowledged write missing; safe and single also no overlapping hold whose
earlier holder was never told; majority: the same, plus no acquisition while a
majority was down and every failed call back within its timeout bound); 1 when
one did not; 2 when the run itself failed (a server that would not start, a
worker that died in setup). The nofence schedule's lost updates are expected
(it is the demonstration of what fencing prevents) and do not fail the run.
``single`` runs on one node (its release hands the lock over). ``--schedule
clock`` (not part of ``all``) jumps one node's clock forward by more than the
TTL, outside the safety model; it is judged like the safe schedule.
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

from .checker import format_table
from .runner import ALL, SCHEDULES, SHARES, Options, run_schedule, setup_database


def _verdict(name: str, r: dict[str, Any]) -> tuple[bool, list[str]]:
    """(passed, reasons) for one schedule's report.

    Lost updates count against the safe and majority schedules on the resources
    written the way django-redlock recommends ("fence higher AND unchanged since
    read": the database rows through ``fenced_save`` and the ``cas`` counter),
    and on every resource when a stale fence erased them. The ``ctr`` counter
    checks only "fence higher" on write, on purpose: its stale-read losses are
    the demonstration of why ``fenced_save`` checks more, reported, not failed.
    """
    checks = [("fence_regressions", "fence(s) not above an earlier holder's"),
              ("acknowledged_missing", "acknowledged write(s) missing at the resource"),
              ("value_gaps", "value gap(s) the write log does not explain")]
    reasons = [f"{r[key]} {label}" for key, label in checks if r.get(key)]
    if name != "nofence":  # without fencing, lost updates are the demonstration
        by_kind = r.get("lost_updates_by_kind", {})
        guarded = by_kind.get("db", 0) + by_kind.get("cas", 0)
        if guarded:
            reasons.append(f"{guarded} lost update(s) on fenced_save rows / cas counters")
        if r.get("erased_stale_fence"):
            reasons.append(f"{r['erased_stale_fence']} update(s) erased by a stale fence")
        if r.get("fence_violations"):
            reasons.append(f"{r['fence_violations']} fence violation(s)")
        if r.get("overlaps_silent") and name != "clock":  # clock: outside the model
            reasons.append(f"{r['overlaps_silent']} overlapping hold(s) whose earlier holder "
                           f"was never told")
    if name == "majority":
        reasons += [f"{r[key]} {label}" for key, label in (
            ("failed_over_bound", "failed call(s) over the timeout bound"),
            ("acquired_without_quorum", "acquisition(s) while a majority was down")) if r.get(key)]
    return not reasons, reasons


def _terminate(signum: int, frame: Any) -> None:
    """SIGTERM: unwind (every server, proxy and worker is stopped in ``finally``)."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0,
                        help="seconds of workload under faults in total; with --schedule all "
                             "split safe 50%%, majority 20%%, nofence 30%% (default 60)")
    parser.add_argument("--seed", type=int, default=None, help="schedule seed (default: random)")
    parser.add_argument("--schedule", choices=(*SCHEDULES, "all"), default="all")
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
    names = list(ALL) if args.schedule == "all" else [args.schedule]
    durations = {n: max(5.0, args.duration * SHARES[n]) if len(names) > 1 else args.duration
                 for n in names}
    opts = Options(seed=seed, workers=args.workers, ttl=args.ttl, keep=args.keep)
    print(f"chaos run: seed {seed}, schedules {', '.join(names)}, "
          f"{', '.join(f'{n} {d:.0f} s' for n, d in durations.items())}; "
          f"TTL {opts.ttl} s, timeout {opts.timeout} s, node timeout {opts.node_timeout} s, "
          f"{opts.workers} workers, 5 nodes (single: 1)", flush=True)

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

    if reports:
        print()
        print(format_table(reports))
        print()
    for name, r in reports.items():
        ok, reasons = _verdict(name, r)
        extra = ""
        if name == "nofence":
            extra = (f" ({r['stale_writes_landed']} stale writes landed, {r['lost_updates']} "
                     f"updates lost without fencing)")
        print(f"{name}: {'PASS' if ok else 'FAIL: ' + '; '.join(reasons)}{extra}; "
              f"faults applied: {r['faults_applied']}")
        for reason in r.get("skipped", []):
            print(f"  note: {reason}")
        for err in r.get("nemesis_errors", []):
            print(f"  nemesis error: {err}")
        if not ok and status == 0:
            status = 1
    print(f"seed {seed}; reproduce with: python -m tests.chaos --seed {seed} "
          f"--duration {args.duration:g} --schedule {args.schedule}"
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
