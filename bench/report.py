"""The goals of issue 7, and the tables: markdown (results.md), reST (the docs) and JSON."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .procs import CONTENDED, COUNTED, HANDOFF
from .slownode import CONTESTANTS as SLOW_CONTESTANTS
from .uncontended import FIVE_NODES, ONE_NODE
from .view import VARIANTS

# id -> (what, target text, test on the measured value)
GOALS: dict[str, tuple[str, str, Callable[[float], bool]]] = {
    "uncontended-1": ("1 node: acquire + release p50 vs raw-socket floor", "<= 1.15x",
                      lambda v: v <= 1.15),
    "uncontended-5": ("5 nodes: acquire + release p50 vs raw 5-node parallel floor", "<= 1.20x",
                      lambda v: v <= 1.20),
    # The uncontended path as issue 23 words it: against redis-py's Lock, and
    # against our own two scripts on raw sockets (libs.ScriptsFloor).
    "uncontended-redispy-1": ("1 node: acquire + release p50 vs redis-py Lock", "<= 1.0x",
                              lambda v: v <= 1.0),
    "uncontended-scripts-1": ("1 node: acquire + release p50 vs our scripts on raw sockets",
                              "<= 1.15x", lambda v: v <= 1.15),
    "uncontended-scripts-5": ("5 nodes: acquire + release p50 vs our scripts on raw sockets",
                              "<= 1.15x", lambda v: v <= 1.15),
    "handoff-1": ("handoff p50, 1 node", "< 1.5 ms", lambda v: v < 1.5),
    "handoff-5": ("handoff p50, 5 nodes", "< 1.5 ms", lambda v: v < 1.5),
    "contended-1": ("contended acquisitions/s, 1 node, vs python-redis-lock", ">= 1.2x",
                    lambda v: v >= 1.2),
    "fairness-1": ("contended fairness, 1 node: min worker / mean", ">= 0.5",
                   lambda v: v >= 0.5),
    "contended-5": ("contended acquisitions/s, 5 nodes, vs pottery", ">= 4x",
                    lambda v: v >= 4.0),
    "view": ("@with_lock view overhead (p50), 1 node", "< 0.5 ms", lambda v: v < 500.0),
    # The lock family (issue 20): each against lock() in the same run.
    "read-lock-1": ("1 node: read_lock acquire + release p50 vs lock()", "<= 1.2x",
                    lambda v: v <= 1.2),
    "semaphore-1": ("1 node: semaphore acquire + release p50 vs lock()", "<= 1.2x",
                    lambda v: v <= 1.2),
    "semaphore-fifo": ("50 waiters on 5 permits: grants out of arrival order", "0",
                       lambda v: v == 0),
    "semaphore-handoff": ("50 waiters on 5 permits: handoff p50", "< 2 ms", lambda v: v < 2.0),
    # asyncio (issue 23): as fast as the sync flavour, and settled like it.
    "asyncio-1": ("1 node: asyncio acquire + release p50 vs sync", "<= 1.1x",
                  lambda v: v <= 1.1),
    "asyncio-slow-5": ("5 nodes, one 2 ms slower: asyncio p50 vs sync", "<= 1.1x",
                       lambda v: v <= 1.1),
    "waiters-200": ("200 waiters on one lock, 1 node: handoff p50", "< 1.5 ms",
                    lambda v: v < 1.5),
    "waiters-fifo": ("waiters on one lock, 1 node (every line): grants out of arrival order",
                     "0", lambda v: v == 0),
    # Node kinds (issue 21): each one Redlock node, against a plain master.
    "kinds-cluster": ("Cluster node: uncontended acquire + release p50 vs a plain node",
                      "<= 1.3x", lambda v: v <= 1.3),
    "kinds-sentinel": ("Sentinel node: uncontended acquire + release p50 vs a plain node",
                       "<= 1.3x", lambda v: v <= 1.3),
    "kinds-acks": ("REPLICA_ACKS=1: extra time vs one round trip (half the plain p50)",
                   "<= 1.0x", lambda v: v <= 1.0),
    "kinds-failover": ("Sentinel failover under load: lock back vs the sentinels' failover "
                       "(the worst of the kills)", "< 2x", lambda v: v < 2.0),
    "nodes-9": ("9 nodes: uncontended acquire + release p50 vs 3 nodes", "<= 1.3x",
                lambda v: v <= 1.3),
    "held-10k": ("10,000 held locks renewing, 1 node: renewal thread CPU", "< 10 %",
                 lambda v: v < 10.0),
    # The second contended harness (issue 23): a fixed count, GET + SET inside.
    "contended2-1": ("fixed-count contended harness, 1 node: acquisitions/s vs "
                     "python-redis-lock", ">= 1.2x", lambda v: v >= 1.2),
    "contended2-5": ("fixed-count contended harness, 5 nodes: acquisitions/s vs pottery",
                     ">= 4x", lambda v: v >= 4.0),
    "http-oversold": ("demo under gunicorn + wrk, protected and striped, a node killed or "
                      "not: units oversold", "0", lambda v: v == 0),
}


def _over(section: dict[str, Any], row: str, base: str) -> float | None:
    """Row ``row``'s p50 over row ``base``'s (the medians over rounds), or None."""
    top, bottom = section.get(row, {}).get("p50_us"), section.get(base, {}).get("p50_us")
    return None if not top or not bottom else float(top) / float(bottom)


def _field(results: dict[str, Any], section: str, field: str) -> float | None:
    value = results.get(section, {}).get(field)
    return None if value is None else float(value)


def _out_of_order(results: dict[str, Any]) -> float | None:
    sem = results.get("semaphore")
    return None if not sem else float(sum(sem["out_of_order"]))


def _nodes9(results: dict[str, Any]) -> float | None:
    row = results.get("nodecount", {}).get("rows", {}).get("9")
    return None if not row or row.get("x_3_nodes") is None else float(row["x_3_nodes"])


def _held10k(results: dict[str, Any]) -> float | None:
    row = results.get("heldlocks", {}).get("rows", {}).get("10000")
    if not row:
        return None
    # The renewal thread's own CPU (bench.heldlocks); the process's where /proc
    # could not be read, and in results recorded before it was measured.
    value = row.get("renewal_cpu_pct", row.get("cpu_pct"))
    if value is None:
        value = row.get("cpu_pct")
    return None if value is None else float(value)


def _waiters(results: dict[str, Any], row: str, field: str) -> float | None:
    value = results.get("waiters", {}).get("rows", {}).get(row, {}).get(field)
    return None if value is None else float(value)


def _waiters_late(results: dict[str, Any], nodes: int) -> float | None:
    rows = [r for r in results.get("waiters", {}).get("rows", {}).values()
            if r["nodes"] == nodes]
    return float(sum(r["out_of_order"] for r in rows)) if rows else None


def _kinds(results: dict[str, Any], row: str, field: str) -> float | None:
    value = results.get("nodekinds", {}).get(row, {}).get(field)
    return None if value is None else float(value)


def _acks(results: dict[str, Any]) -> float | None:
    extra, plain = _kinds(results, "acks1", "extra_us"), _kinds(results, "plain", "p50_us")
    return None if extra is None or not plain else extra / (plain / 2.0)


def _contended2(results: dict[str, Any], row: str, field: str) -> float | None:
    value = results.get("contended2", {}).get("rows", {}).get(row, {}).get(field)
    return None if value is None else float(value)


def _oversold(results: dict[str, Any]) -> float | None:
    rows = [r for r in results.get("http", {}).get("rows", {}).values() if r.get("rounds")]
    return float(sum(r["oversold"] for r in rows)) if rows else None


def _status(goal: str, value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return "PASS" if GOALS[goal][2](value) else "MISS"


def evaluate(results: dict[str, Any]) -> list[dict[str, Any]]:
    unc = results.get("uncontended", {})
    con = results.get("contended", {})
    hand = results.get("handoff", {})
    view = results.get("view", {})

    def get(section: dict[str, Any], row: str, field: str) -> float | None:
        value = section.get(row, {}).get(field)
        return None if value is None else float(value)

    measured = [
        ("uncontended-1", "drl-1", get(unc, "drl-1", "x_raw"), "x"),
        ("uncontended-1", "drl-renew-1", get(unc, "drl-renew-1", "x_raw"), "x"),
        ("uncontended-5", "drl-5", get(unc, "drl-5", "x_raw"), "x"),
        ("uncontended-5", "drl-renew-5", get(unc, "drl-renew-5", "x_raw"), "x"),
        ("uncontended-redispy-1", "drl-1", _over(unc, "drl-1", "redispy-1"), "x"),
        ("uncontended-scripts-1", "drl-1", get(unc, "drl-1", "x_scripts"), "x"),
        ("uncontended-scripts-5", "drl-5", get(unc, "drl-5", "x_scripts"), "x"),
        ("handoff-1", "drl-renew-1", get(hand, "drl-renew-1", "p50_ms"), "ms"),
        ("handoff-5", "drl-renew-5", get(hand, "drl-renew-5", "p50_ms"), "ms"),
        ("contended-1", "drl-renew-1", get(con, "drl-renew-1", "x_prl"), "x"),
        ("fairness-1", "drl-renew-1", get(con, "drl-renew-1", "fairness"), ""),
        ("contended-5", "drl-renew-5", get(con, "drl-renew-5", "x_pottery"), "x"),
        ("view", "with_lock", get(view, "with_lock", "overhead_us"), "us"),
        ("read-lock-1", "drl-read-1", _over(unc, "drl-read-1", "drl-1"), "x"),
        ("semaphore-1", "semaphore", _field(results, "semaphore", "ratio"), "x"),
        ("semaphore-fifo", "semaphore", _out_of_order(results), ""),
        ("semaphore-handoff", "semaphore", _field(results, "semaphore", "handoff_p50_ms"), "ms"),
        ("asyncio-1", "drl-async-1", _over(unc, "drl-async-1", "drl-1"), "x"),
        ("asyncio-slow-5", "drl-async-5", _over(results.get("slow_node", {}), "drl-async-5",
                                                 "drl-5"), "x"),
        ("waiters-200", "1 node x 200", _waiters(results, "1x200", "handoff_p50_ms"), "ms"),
        ("waiters-fifo", "1 node, every line", _waiters_late(results, 1), ""),
        ("kinds-cluster", "cluster", _kinds(results, "cluster", "x_plain"), "x"),
        ("kinds-sentinel", "sentinel", _kinds(results, "sentinel", "x_plain"), "x"),
        ("kinds-acks", "acks1", _acks(results), "x"),
        ("kinds-failover", "failover", _kinds(results, "failover", "x_sentinel_max")
         or _kinds(results, "failover", "x_sentinel"), "x"),  # (one kill, before)
        ("nodes-9", "9 nodes", _nodes9(results), "x"),
        ("held-10k", "10,000 held", _held10k(results), "%"),
        ("contended2-1", "drl-renew-1", _contended2(results, "drl-renew-1", "x_prl"), "x"),
        ("contended2-5", "drl-renew-5", _contended2(results, "drl-renew-5", "x_pottery"), "x"),
        ("http-oversold", "every run", _oversold(results), ""),
    ]
    out = []
    for goal, row, value, unit in measured:
        what, target, _ = GOALS[goal]
        out.append({"goal": goal, "what": what, "row": row, "target": target,
                    "value": value, "unit": unit, "status": _status(goal, value)})
    return out


# -- formatting --------------------------------------------------------------------
def _num(value: Any, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def _goal_cell(goals: list[dict[str, Any]], goal: str, row: str) -> str:
    for g in goals:
        if g["goal"] == goal and g["row"] == row:
            return g["status"]
    return ""


def _value_text(g: dict[str, Any]) -> str:
    v = g["value"]
    if v is None:
        return "-"
    if g["unit"] == "x":
        return f"{v:.2f}x"
    if g["unit"] == "ms":
        return f"{v:.2f} ms"
    if g["unit"] == "us":
        return f"{v / 1000:.3f} ms"
    return f"{v:.2f}"


def _with_errors(row: dict[str, Any]) -> str:
    n = row.get("errors") or 0
    return f"{row['label']} ({n} failed)" if n else row["label"]


def tables(results: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) for every table, shared by the markdown and reST output."""
    goals = results["goals"]
    out: list[tuple[str, list[str], list[list[str]]]] = []
    out.append(("Goals (issue 7)", ["goal", "row", "target", "measured", "status"],
                [[g["what"], g["row"], g["target"], _value_text(g), g["status"]] for g in goals]))

    unc = results.get("uncontended")
    if unc:
        for title, group, goal in (("Uncontended acquire + release, 1 node", ONE_NODE,
                                    "uncontended-1"),
                                   ("Uncontended acquire + release, 5 nodes", FIVE_NODES,
                                    "uncontended-5")):
            rows = []
            for cid, _, _ in group:
                r = unc.get(cid)
                if not r:
                    continue
                rows.append([_with_errors(r), _num(r["p50_us"]), _num(r["p99_us"]), _num(r["ops_s"]),
                             _num(r["x_raw"], 2), _num(r["x_redispy"], 2),
                             _goal_cell(goals, goal, cid)])
            out.append((title, ["library", "p50 µs", "p99 µs", "ops/s", "x raw floor",
                                "x redis-py floor", "goal"], rows))

    slow = results.get("slow_node")
    if slow:
        rows = []
        for cid, _ in SLOW_CONTESTANTS:
            r = slow.get(cid)
            if r:
                rows.append([_with_errors(r), _num(r["p50_us"]), _num(r["p99_us"]),
                             _num(r["x_raw"], 2)])
        delay = slow.get("latency_ms_one_way", 0)
        out.append((f"Uncontended acquire + release, 5 nodes, one of them {2 * delay:g} ms "
                    f"slower per round trip",
                    ["library", "p50 µs", "p99 µs", "x raw floor (waits for all)"], rows))

    con = results.get("contended")
    if con:
        rows = []
        for lib, _, n in CONTENDED:
            r = con.get(lib)
            if not r:
                continue
            ratio = ""
            if "x_prl" in r:
                ratio = f"{r['x_prl']:.2f}x python-redis-lock"
            elif "x_pottery" in r:
                ratio = f"{r['x_pottery']:.2f}x pottery"
            goal = "contended-1" if lib == "drl-renew-1" else "contended-5"
            cell = _goal_cell(goals, goal, lib)
            if lib == "drl-renew-1":
                cell = f"{cell} / fair {_goal_cell(goals, 'fairness-1', lib)}"
            rows.append([r["label"], str(n), _num(r.get("acq_s")),
                         " / ".join(str(c) for c in r.get("per_worker_last", [])),
                         _num(r.get("fairness"), 2), _num(r.get("min_fairness"), 2),
                         {True: "yes", False: "NO", None: "-"}[r.get("counter_exact")],
                         str(r.get("errors", 0)), ratio, cell])
        out.append(("Contended: 4 processes, one lock, GET/SET counter inside",
                    ["library", "nodes", "acq/s", "per worker (last round)", "min/mean",
                     "worst round min/mean", "counter exact", "errors", "ratio", "goal"], rows))

    hand = results.get("handoff")
    if hand:
        rows = []
        for lib, _, n in HANDOFF:
            r = hand.get(lib)
            if not r:
                continue
            goal = {"drl-renew-1": "handoff-1", "drl-renew-5": "handoff-5"}.get(lib, "")
            rows.append([r["label"], str(n), _num(r["p50_ms"], 2), _num(r["p90_ms"], 2),
                         _num(r["p99_ms"], 2), str(r["samples"]),
                         _goal_cell(goals, goal, lib) if goal else ""])
        out.append(("Handoff: release() in one process -> blocked acquire() returns in another",
                    ["library", "nodes", "p50 ms", "p90 ms", "p99 ms", "samples", "goal"], rows))

    view = results.get("view")
    if view:
        rows = []
        for variant, _ in VARIANTS:
            r = view.get(variant)
            if not r:
                continue
            rows.append([_with_errors(r), _num(r["p50_us"]), _num(r["p99_us"]),
                         _num(r.get("overhead_us")),
                         _goal_cell(goals, "view", variant) if variant == "with_lock" else ""])
        if view.get("skipped"):
            rows.append([f"skipped: {view['skipped']}", "-", "-", "-", "n/a"])
        out.append(("Decorated view through the Django test client, 1 node",
                    ["view", "p50 µs", "p99 µs", "overhead µs", "goal"], rows))

    cold = results.get("cold_burst")
    if cold:
        rows = [[driver, str(r["nodes"]), str(r["burst"]), _num(r["median_ms"], 1),
                 _num(r["worst_ms"], 1), str(r["failed"])]
                for driver, r in cold.items()]
        out.append(("Cold burst: concurrent first acquisitions on a new manager",
                    ["driver", "nodes", "acquisitions", "median ms", "worst ms", "failed"],
                    rows))

    held = results.get("heldlocks")
    if held:
        out.append((f"Held locks renewing in one process, 1 node (TTL {held['ttl_s']:g} s: "
                    "renewed every second)",
                    ["held locks", "renewal thread CPU % of one core",
                     "process CPU % of one core", "script calls per period", "lost"],
                    [[f"{r['held']:,}", _num(r.get("renewal_cpu_pct"), 1),
                      _num(r["cpu_pct"], 1), _num(r["calls_per_period"], 1),
                      _num(r["lost"])] for r in held["rows"].values()]))

    nodes = results.get("nodecount")
    if nodes:
        out.append(("Uncontended acquire + release by node count (rounds ask the nodes in "
                    "parallel)", ["nodes", "p50 µs", "x 3 nodes", "floor p50 µs",
                                  "floor x 3 nodes", "x floor growth"],
                    [[str(r["nodes"]), _num(r["p50_us"]), _num(r["x_3_nodes"], 2),
                      _num(r.get("floor_p50_us")), _num(r.get("floor_x_3_nodes"), 2),
                      _num(r.get("x_floor_growth"), 2)]
                     for r in nodes["rows"].values()]))

    kinds = results.get("nodekinds")
    if kinds:
        rows = [[kinds[cid]["label"], _num(kinds[cid]["p50_us"]), _num(kinds[cid]["x_plain"], 2),
                 _num(kinds[cid]["extra_us"]), str(kinds[cid]["errors"])]
                for cid in ("plain", "acks1", "sentinel", "cluster") if cid in kinds]
        out.append(("Node kinds: one Redlock node of each kind, uncontended acquire + release",
                    ["node", "p50 µs", "x plain", "extra µs", "errors"], rows))
        fo = kinds.get("failover") or {}
        if fo:
            samples = fo.get("samples") or [fo]  # (one kill per run before)
            rows = [[f"kill {i + 1}", _num(r.get("sentinel_failover_s"), 2),
                     _num(r.get("lock_back_s"), 2), _num(r.get("x_sentinel"), 2)]
                    if "error" not in r else [f"kill {i + 1}", r["error"], "", ""]
                    for i, r in enumerate(samples)]
            if len(samples) > 1:
                rows.append(["median", _num(fo.get("sentinel_failover_s"), 2),
                             _num(fo.get("lock_back_s"), 2), _num(fo.get("x_sentinel"), 2)])
            out.append(("Sentinel node: the master killed under load",
                        ["sample", "sentinels' failover s", "lock acquired again after s",
                         "x sentinels' failover"], rows))

    line = results.get("waiters")
    if line:
        out.append(("Waiters on one lock: handoffs as the line grows (each holds "
                    f"{line['hold_s'] * 1000:g} ms)",
                    ["nodes", "waiters", "handoff p50 ms", "handoff p99 ms",
                     "grants out of order", "queue bytes", "server commands per handoff"],
                    [[str(r["nodes"]), str(r["waiters"]), _num(r["handoff_p50_ms"], 2),
                      _num(r["handoff_p99_ms"], 2), str(r["out_of_order"]),
                      _num(r["queue_bytes"]), _num(r["commands_per_handoff"], 1)]
                     for r in line["rows"].values()]))

    con2 = results.get("contended2")
    if con2:
        rows = []
        for lib, _, n in COUNTED:
            r = con2["rows"].get(lib)
            if not r:
                continue
            ratio = ""
            if "x_prl" in r:
                ratio = (f"{r['x_prl']:.2f}x python-redis-lock "
                         f"(time {r.get('time_x_prl', float('nan')):.2f}x)")
            elif "x_pottery" in r:
                ratio = (f"{r['x_pottery']:.2f}x pottery "
                         f"(time {r.get('time_x_pottery', float('nan')):.2f}x)")
            goal = {"drl-renew-1": "contended2-1", "drl-renew-5": "contended2-5"}.get(lib)
            rows.append([r["label"], str(n), _num(r.get("seconds"), 2), _num(r.get("acq_s")),
                         " / ".join(str(c) for c in r.get("per_worker_last", [])),
                         _num(r.get("fairness"), 2),
                         {True: "yes", False: "NO", None: "-"}[r.get("counter_exact")],
                         str(r.get("errors", 0)), ratio,
                         _goal_cell(goals, goal, lib) if goal else ""])
        out.append((f"Contended, second harness: 4 processes until {con2['target']:,} "
                    "acquisitions (GET + SET inside), stop when done",
                    ["library", "nodes", "seconds", "acq/s", "per worker (last round)",
                     "min/mean", "counter exact", "errors", "ratio", "goal"], rows))

    names = results.get("distinct")
    if names:
        ceiling = names.get("ceiling", {})
        out.append((f"Distinct names, 1 node: processes each acquiring and releasing new "
                    f"names for {names['seconds']:g} s",
                    ["processes", "acquisitions/s (all)", "x redis-benchmark ceiling",
                     "server µs per acquire + release"],
                    [[str(r["processes"]), _num(r["acq_s"]), _num(r["x_ceiling"], 2),
                      _num(r["server_us_per_pair"], 1)] for r in names["rows"].values()]))
        if "pair_s" in ceiling:
            out.append(("Distinct names: the server's ceiling for the same script calls "
                        "(redis-benchmark, 8 connections, random names)",
                        ["acquire script/s", "release script/s", "acquire + release pairs/s",
                         "pairs/s at the server time measured (one core)"],
                        [[_num(ceiling["acquire_rps"]), _num(ceiling["release_rps"]),
                          _num(ceiling["pair_s"]), _num(ceiling.get("server_time_pair_s"))]]))
        mem = names.get("memory") or {}
        if mem:
            out.append((f"Distinct names: Redis memory per name, {mem['names']:,} names used "
                        f"once (counter grace cut to {mem['grace_ms'] / 1000:g} s)",
                        ["bytes per name after use", "keys left after use",
                         "MEMORY USAGE of a fence counter", "bytes per name after expiry",
                         "keys left after expiry"],
                        [[_num(mem["bytes_per_name_used"], 1), str(mem["keys_after_use"]),
                          str(mem["fence_key_bytes"]), _num(mem["bytes_per_name_expired"], 1),
                          str(mem["keys_after_expiry"])]]))

    web = results.get("http")
    if web:
        if web.get("skipped"):
            out.append(("Real HTTP: the demo under gunicorn, driven by wrk", ["skipped"],
                        [[web["skipped"]]]))
        else:
            rows = []
            for r in web["rows"].values():
                ratio = ""
                if r.get("x_up") is not None:
                    ratio = f"{r['x_up']:.2f}x every node up"
                elif r.get("x_protected") is not None:
                    ratio = f"{r['x_protected']:.2f}x protected"
                p50, p99 = r.get("p50_us"), r.get("p99_us")
                rows.append([r["endpoint"], "yes" if r["node_killed"] else "no",
                             _num(r.get("rps")), ratio,
                             "-" if p50 is None else _num(p50 / 1000, 2),
                             "-" if p99 is None else _num(p99 / 1000, 2),
                             str(r["s200"]), str(r["s409"]), str(r["s5xx"] + r["sother"]),
                             str(r["socket_errors"]), str(r["sold_db"]), str(r["oversold"]),
                             str(r["unanswered"])])
            out.append((f"Real HTTP: the demo under gunicorn ({web['gunicorn_workers']} sync "
                        f"workers, {web['nodes']} nodes, SQLite), wrk with "
                        f"{web['connections']} connections, {web['seconds_per_run']:g} s "
                        "per run; a killed node dies half-way",
                        ["endpoint", "node killed", "requests/s", "ratio", "p50 ms", "p99 ms",
                         "200", "409", "other", "socket errors", "sold (database)", "oversold",
                         "unanswered"], rows))

    sem = results.get("semaphore")
    if sem:
        out.append(("Semaphore, 1 node: acquire + release against lock(), and a queue of "
                    f"{sem['waiters']} waiters on {sem['permits']} permits",
                    ["semaphore p50 µs", "lock() p50 µs", "x lock()", "grants out of order",
                     "handoff p50 ms", "handoff p99 ms"],
                    [[_num(sem["semaphore_p50_us"]), _num(sem["lock_p50_us"]),
                      _num(sem["ratio"], 2), str(sum(sem["out_of_order"])),
                      _num(sem["handoff_p50_ms"], 2), _num(sem["handoff_p99_ms"], 2)]]))
        if sem.get("reentrant_p50_us") is not None:  # runs before these rows had none
            lock_us = sem["lock_p50_us"]
            out.append(("The lock family, 1 node: acquire + release p50 against lock() in "
                        "the same rounds (multi_lock of two names)",
                        ["member", "p50 µs", "x lock()"],
                        [[member, _num(sem[key]), _num(sem[key] / lock_us, 2) if lock_us
                          else "-"]
                         for member, key in (("lock()", "lock_p50_us"),
                                             ("reentrant lock", "reentrant_p50_us"),
                                             ("multi_lock (2 names)", "multi_lock_p50_us"),
                                             ("semaphore", "semaphore_p50_us"))]))
    return out


def machine_line(results: dict[str, Any]) -> str:
    m = results["machine"]
    c = results["config"]
    pk = m["packages"]
    return (f"{m['date']}; {m['nproc']} CPUs ({m['cpu']}), {m['os']}, {m['python']}, "
            f"{m['server']} on loopback; redis-py {pk['redis']}, hiredis {pk['hiredis']}, "
            f"python-redis-lock {pk['python-redis-lock']}, pottery {pk['pottery']}, "
            f"Django {pk['Django']}; load average {m['loadavg_start']} at start, "
            f"{m.get('loadavg_end')} at end; {c['rounds']} rounds"
            f"{' (--quick)' if c['quick'] else ''}, {c['elapsed_s']:.0f} s.")


def markdown(results: dict[str, Any]) -> str:
    lines = ["# django-redlock benchmark", "", f"Machine: {machine_line(results)}", "",
             ("Medians over rounds; within a round every library and its floor are measured "
              "back to back in a shuffled order, and ratios are taken inside the round. "
              "Reproduce with `make bench` (or `python -m bench`)."), ""]
    for title, header, rows in tables(results):
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |",
                  "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines.append("")
    return "\n".join(lines)


def _rst_cell(text: str) -> str:
    text = text.replace("\\", "\\\\").replace("*", "\\*").replace("|", "\\|").replace("`", "\\`")
    return "\\" + text if text.startswith(("-", "+", "#")) else text


def rst(results: dict[str, Any]) -> str:
    """The tables as reST, included by docs/performance.rst (valid under sphinx -W)."""
    lines = [".. Generated by python -m bench; do not edit by hand.", "",
             f"Measured {_rst_cell(machine_line(results))}", ""]
    for title, header, rows in tables(results):
        lines += [f".. list-table:: {_rst_cell(title)}", "   :header-rows: 1", ""]
        for row in [header, *rows]:
            for i, cell in enumerate(row):
                prefix = "   * - " if i == 0 else "     - "
                lines.append((prefix + _rst_cell(cell)).rstrip())
        lines.append("")
    return "\n".join(lines)
