"""``python -m bench``: every measurement, interleaved round by round, then the tables.

Options come from the command line and from ``BENCH_ARGS`` in the environment
(``BENCH_ARGS=--quick make bench``). A full run writes ``bench/results/results.md``,
``results.json`` and ``results.rst`` (included by the docs' Performance page); a
``--quick`` run only prints, unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from . import machine, plots, report
from .coldburst import ColdBurst
from .distinct import DistinctNames
from .heldlocks import HeldLocks
from .libs import quiet_loggers
from .nodecount import NodeCount
from .nodekinds import NodeKinds
from .nodes import running_nodes, server_version
from .procs import Contended, CountedContended, Handoff, Workers
from .realhttp import RealHttp
from .semaphore import SemaphoreBench
from .slownode import SlowNode
from .uncontended import Uncontended
from .view import ViewOverhead
from .waiters import Waiters

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SECTIONS = ("uncontended", "slownode", "view", "contended", "handoff", "coldburst",
            "semaphore", "nodecount", "heldlocks", "waiters", "nodekinds", "contended2",
            "distinct", "http")

#: (rounds, uncontended ops per batch, view requests per variant, contended seconds,
#: handoff sample scale). A full run takes about 10 minutes on 2 shared cores
#: (the http, distinct and contended2 sections take about 2 minutes each).
PROFILES = {"full": (8, 500, 300, 2.0, 10), "quick": (3, 150, 100, 0.6, 4)}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a short run (a few minutes)")
    p.add_argument("--rounds", type=int, help="rounds (default: 8, or 3 with --quick)")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections to run (default: all of {','.join(SECTIONS)})")
    p.add_argument("--out", type=Path,
                   help=f"where to write results.{{md,json,rst}} (default: {RESULTS_DIR} for a "
                        f"full run, nowhere for --quick)")
    p.add_argument("--seed", type=int, default=None, help="shuffle seed (default: random)")
    return p.parse_args(argv)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def run(args: argparse.Namespace) -> dict[str, Any]:
    rounds, ops, requests, duration, scale = PROFILES["quick" if args.quick else "full"]
    rounds = args.rounds or rounds
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown section(s): {', '.join(sorted(unknown))}")
    rng = random.Random(args.seed)
    quiet_loggers()
    began = time.monotonic()
    log = sys.stderr
    with running_nodes(1) as urls1, running_nodes(5) as urls5, \
            running_nodes(9 if "nodecount" in sections else 0) as urls9:
        info = machine.describe(server_version(urls1[0]))
        print(f"bench: {rounds} rounds on {info['nproc']} CPUs, {info['server']}, "
              f"sections {','.join(sections)}", file=log, flush=True)
        unc = Uncontended(urls1, urls5, ops=ops, warmup=3) \
            if "uncontended" in sections else None
        slow = SlowNode(urls5, ops=ops // 2, warmup=3) if "slownode" in sections else None
        view = ViewOverhead(urls1[0], requests=requests, warmup=3) if "view" in sections else None
        workers = Workers(urls1, urls5) \
            if {"contended", "handoff", "contended2"} & set(sections) else None
        con = Contended(workers, duration=duration) if workers and "contended" in sections \
            else None
        hand = Handoff(workers, scale=scale) if workers and "handoff" in sections else None
        con2 = CountedContended(workers, quick=args.quick) \
            if workers and "contended2" in sections else None
        cold = ColdBurst(urls5) if "coldburst" in sections else None
        sem = SemaphoreBench(urls1, ops=ops // 2) if "semaphore" in sections else None
        nodes = NodeCount(urls9, ops=ops // 2) if "nodecount" in sections else None
        held = HeldLocks(urls1) if "heldlocks" in sections else None
        line = Waiters(urls1, urls5) if "waiters" in sections else None
        kinds = NodeKinds(ops=ops // 2, warmup=3) if "nodekinds" in sections else None
        names = DistinctNames(urls1, quick=args.quick) if "distinct" in sections else None
        web = RealHttp(quick=args.quick) if "http" in sections else None
        try:
            for r in range(rounds):
                t = time.monotonic()
                for part in (unc, slow, view, con, hand, cold, sem, nodes, held, line, kinds,
                             con2, names, web):
                    if part is not None:
                        part.run_round(rng)
                print(f"bench: round {r + 1}/{rounds} done in {time.monotonic() - t:.1f} s",
                      file=log, flush=True)
        finally:
            if unc is not None:
                unc.close()
            if slow is not None:
                slow.close()
            if workers is not None:
                workers.close()
            if sem is not None:
                sem.close()
            if nodes is not None:
                nodes.close()
            if held is not None:
                held.close()
            if line is not None:
                line.close()
            if names is not None:
                names.close()
            if web is not None:
                web.close()
            if kinds is not None:
                try:
                    kinds.measure_failover()  # once, after the rounds: it kills a master
                finally:
                    kinds.close()
    info["loadavg_end"] = machine.loadavg()
    results: dict[str, Any] = {
        "machine": info,
        "config": {"rounds": rounds, "quick": args.quick, "uncontended_ops": ops,
                   "view_requests": requests, "contended_seconds": duration,
                   "handoff_scale": scale, "ttl_s": 10.0, "sections": sections,
                   "elapsed_s": time.monotonic() - began},
    }
    if unc is not None:
        results["uncontended"] = unc.summary()
    if slow is not None:
        results["slow_node"] = slow.summary()
    if con is not None:
        results["contended"] = con.summary()
    if hand is not None:
        results["handoff"] = hand.summary()
    if view is not None:
        results["view"] = view.summary()
    if cold is not None:
        results["cold_burst"] = cold.summary()
    if sem is not None:
        results["semaphore"] = sem.summary()
    if nodes is not None:
        results["nodecount"] = nodes.summary()
    if held is not None:
        results["heldlocks"] = held.summary()
    if line is not None:
        results["waiters"] = line.summary()
    if kinds is not None:
        results["nodekinds"] = kinds.summary()
    if con2 is not None:
        results["contended2"] = con2.summary()
    if names is not None:
        results["distinct"] = names.summary()
    if web is not None:
        results["http"] = web.summary()
    results["goals"] = report.evaluate(results)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = shlex.split(os.environ.get("BENCH_ARGS", "")) + list(sys.argv[1:] if argv is None
                                                             else argv)
    args = parse_args(argv)
    results = _json_safe(run(args))
    text = report.markdown(results)
    print(text)
    out = args.out if args.out is not None else (None if args.quick else RESULTS_DIR)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.md").write_text(text, encoding="utf-8")
        (out / "results.rst").write_text(report.rst(results), encoding="utf-8")
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        print(f"bench: wrote {out}/results.{{md,json,rst}}", file=sys.stderr)
        for path in plots.draw(results, out):
            print(f"bench: wrote {path}", file=sys.stderr)
    for section in ("view", "http"):
        skipped = (results.get(section) or {}).get("skipped")
        if skipped:
            print(f"skipped: {skipped}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
