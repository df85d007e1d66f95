"""PNG plots of the benchmark's curves (issue 23): how a cost grows with the
work, one picture per curve, drawn from ``results.json``.

``python -m bench`` draws them next to the tables when it writes its results;
``python -m bench.plots [results.json] [out dir]`` draws them again from a
saved run. matplotlib comes with the ``bench`` extra; without it the plots are
skipped with a note (the tables are the measurement, the plots show its shape).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

#: The curves drawn, by file name: (section, title, x label, y label, x field,
#: y field, log x).
CURVES: dict[str, tuple[str, str, str, str, str, str, bool]] = {
    "heldlocks.png": ("heldlocks", "Held locks renewing in one process (1 node)",
                      "locks held", "renewal thread CPU, % of one core", "held",
                      "renewal_cpu_pct", True),
    "heldlocks-calls.png": ("heldlocks", "Renewal script calls per period (1 node)",
                            "locks held", "script calls per renewal period", "held",
                            "calls_per_period", True),
    "waiters.png": ("waiters", "Handoff p50 by waiters in line (1 and 5 nodes)",
                    "waiters in line", "handoff p50, ms", "waiters", "handoff_p50_ms", True),
    "waiters-commands.png": ("waiters", "Server commands per handoff by waiters in line",
                             "waiters in line", "commands per handoff (all nodes)", "waiters",
                             "commands_per_handoff", True),
    "distinct.png": ("distinct", "Distinct names: acquisitions/s of all processes (1 node)",
                     "processes", "acquire + release per second", "processes", "acq_s",
                     False),
    "distinct-ceiling.png": ("distinct", "Distinct names: share of the server's ceiling",
                             "processes", "x redis-benchmark ceiling", "processes",
                             "x_ceiling", False),
    "nodecount.png": ("nodecount", "Uncontended acquire + release by node count",
                      "nodes", "p50 µs", "nodes", "p50_us", False),
}


def draw(results: dict[str, Any], out: Path) -> list[Path]:
    """Write one PNG per curve ``results`` has; return the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no screen: files only
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed; no plots (pip install -e .[bench])",
              file=sys.stderr)
        return []
    written = []
    for name, (section, title, xlabel, ylabel, xf, yf, logx) in CURVES.items():
        rows = (results.get(section) or {}).get("rows") or {}
        # One line per node count when the rows have several (the waiters).
        groups: dict[str, list[tuple[float, float]]] = {}
        for r in rows.values():
            if r.get(xf) is None or r.get(yf) is None:
                continue
            label = f"{r['nodes']} node(s)" if xf != "nodes" and "nodes" in r else ""
            groups.setdefault(label, []).append((float(r[xf]), float(r[yf])))
        if not any(len(points) >= 2 for points in groups.values()):
            continue
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
        for label, points in sorted(groups.items()):
            points.sort()
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o",
                    label=label or None)
        if any(groups):
            ax.legend()
        if logx:
            ax.set_xscale("log")
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        date = (results.get("machine") or {}).get("date", "")
        fig.text(0.99, 0.01, f"python -m bench, {date}", ha="right", va="bottom",
                 fontsize=7, alpha=0.6)
        fig.tight_layout()
        path = out / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str]) -> int:
    source = Path(argv[0]) if argv else Path(__file__).parent / "results" / "results.json"
    out = Path(argv[1]) if len(argv) > 1 else source.parent
    for path in draw(json.loads(source.read_text(encoding="utf-8")), out):
        print(f"bench: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
