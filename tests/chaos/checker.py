"""Reads a run's history and says what happened: the figures and the verdicts.

Pure functions over records (no I/O), so they are tested on synthetic histories
(``tests/test_chaos.py``) as well as used on real runs.

What is checked, and from which side:

* **Lost updates** -- from the *resource's* own log: writes applied minus the
  final value (every write meant +1). Each write sets ``value = read + 1``; one
  whose value before (``old``) is not ``new - 1`` was computed from a stale read
  and erased ``old + 1 - new`` increments, attributed to a stale fence or to a
  stale read under an in-order fence (:func:`analyse_writes`).
* **Fence order at the resource** -- a write applied with a fence no higher than
  one applied before it. With fencing on that is a *fence violation* (must be 0);
  with the resource not checking, it is a *stale write that landed*, one that the
  fenced resource would have refused.
* **Refused by fence** -- client ops whose write the resource refused.
* **Fence regressions** -- an acquisition whose fence is not above the fence of
  an acquisition of the same lock that was complete before this operation even
  started (fences must grow strictly per name).
* **Acknowledged writes missing** -- a client was told its write was applied but
  the resource's log does not have its fence.
* **Overlaps** -- client-side hold intervals ``[acquired, release began]`` of one
  lock that intersect, split by whether the earlier holder was SIGSTOPped then
  (the case fencing is for) and whether it was told (``LockLost``, a refused
  write, ``lock_lost``).
* **Liveness** -- the longest stretch with a quorum of nodes healthy (not killed,
  paused, cut or slower than half the node timeout) and no acquisition anywhere.
* **Majority outages** -- inside windows where 3 of 5 nodes are down: no
  acquisition, and every failed call returned within its timeout (plus the node
  timeouts and a margin for a loaded machine).
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from .history import OUTCOMES, Event, Op, Write

#: Seconds allowed beyond ``timeout + 2 * node_timeout`` for a failed call to
#: return (the machine is shared and small; this is about "bounded", not fast).
TIMELINESS_SLACK = 2.0

DOWN_KINDS = ("kill", "pause", "cut", "latency")


# -- resource logs --------------------------------------------------------------------
def analyse_writes(writes: Sequence[Write], final: int) -> dict[str, Any]:
    """Lost updates and fence order for one resource, from its applied-write log.

    ``lost_updates`` is the net shortfall: writes applied minus the final value
    (each applied write meant +1). Per write, ``old + 1 - new`` increments were
    *erased* (a write computed from a stale read), split by the writer's fence:
    *stale fence* (not above one applied before: only possible when the resource
    does not check, or checks wrongly) or *stale read* (in order, but the value it
    incremented had been overwritten since it was read: the window a write-only
    fence check leaves open, see ``resources.py``). A write from a read *above* the
    current value (possible once a stale write rolled it back) gives some back:
    ``resurrected``. The log must add up: ``unexplained_value_gap`` is 0.
    """
    erased_read = erased_fence = resurrected = 0
    stale_reads = 0
    stale_fence = 0
    max_fence = 0
    examples: list[dict[str, int]] = []
    read_examples: list[dict[str, int]] = []
    for w in writes:
        in_order = w.fence > max_fence
        if w.new != w.old + 1:
            stale_reads += 1
            delta = w.old + 1 - w.new
            if delta < 0:
                resurrected -= delta
            elif in_order:
                erased_read += delta
            else:
                erased_fence += delta
            if len(read_examples) < 5:
                read_examples.append({"index": w.index, "fence": w.fence, "prev_fence": w.prev_fence,
                                      "old": w.old, "new": w.new})
        if not in_order:
            stale_fence += 1
            if len(examples) < 5:
                examples.append({"index": w.index, "fence": w.fence, "after": max_fence,
                                 "old": w.old, "new": w.new})
        max_fence = max(max_fence, w.fence)
    return {
        "applied": len(writes),
        "final": final,
        "lost_updates": len(writes) - final,
        "erased_stale_read": erased_read,
        "erased_stale_fence": erased_fence,
        "resurrected": resurrected,
        "unexplained_value_gap": len(writes) - erased_read - erased_fence + resurrected - final,
        "stale_read_writes": stale_reads,
        "stale_fence_writes": stale_fence,
        "stale_examples": examples,
        "stale_read_examples": read_examples,
    }


# -- node health timeline ---------------------------------------------------------------
def down_intervals(events: Sequence[Event], node_timeout: float, t_end: float
                   ) -> dict[str, list[tuple[float, float]]]:
    """Per node, the intervals during which it could not take part in a round."""
    open_: dict[tuple[str, str], float] = {}
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.kind not in DOWN_KINDS or not e.target.startswith("n"):
            continue
        if e.kind == "latency" and e.action == "start" and \
                float(e.params.get("latency", 0)) < node_timeout / 2:
            continue  # slow but answering within the node timeout
        key = (e.kind, e.target)
        if e.action == "start":
            open_[key] = e.t
        elif e.action == "end" and key in open_:
            out[e.target].append((open_.pop(key), e.t))
    for (_, target), t in open_.items():
        out[target].append((t, t_end))
    return dict(out)


def quorum_up_intervals(down: dict[str, list[tuple[float, float]]], n_nodes: int,
                        t0: float, t1: float) -> list[tuple[float, float]]:
    """Intervals within [t0, t1] where at most a minority of nodes is down."""
    quorum = n_nodes // 2 + 1
    marks: list[tuple[float, int]] = []
    for intervals in down.values():
        for s, e in intervals:
            marks.append((max(s, t0), +1))
            marks.append((min(max(e, t0), t1), -1))
    marks.sort()
    up: list[tuple[float, float]] = []
    level = 0
    start = t0
    for t, d in marks:
        was_up = n_nodes - level >= quorum
        level += d
        now_up = n_nodes - level >= quorum
        if was_up and not now_up:
            if t > start:
                up.append((start, t))
        elif now_up and not was_up:
            start = t
    if n_nodes - level >= quorum and t1 > start:
        up.append((start, t1))
    return up


def longest_gap(times: Iterable[float], windows: Sequence[tuple[float, float]]) -> float:
    """Longest sub-interval of ``windows`` containing none of ``times``."""
    ts = sorted(times)
    best = 0.0
    import bisect

    for s, e in windows:
        i = bisect.bisect_left(ts, s)
        j = bisect.bisect_right(ts, e)
        points = [s, *ts[i:j], e]
        for a, b in zip(points, points[1:]):
            best = max(best, b - a)
    return best


def pause_windows(events: Sequence[Event]) -> dict[int, list[tuple[float, float]]]:
    """Per worker index, the intervals it was SIGSTOPped."""
    out: dict[int, list[tuple[float, float]]] = defaultdict(list)
    open_: dict[str, float] = {}
    for e in events:
        if e.kind != "worker-pause":
            continue
        if e.action == "start":
            open_[e.target] = e.t
        elif e.action == "end" and e.target in open_:
            out[int(e.target[1:])].append((open_.pop(e.target), e.t))
    return dict(out)


def majority_windows(events: Sequence[Event]) -> list[tuple[float, float]]:
    out = []
    start = None
    for e in events:
        if e.kind != "majority":
            continue
        if e.action == "start":
            start = e.t
        elif e.action == "end" and start is not None:
            out.append((start, e.t))
            start = None
    return out


def _overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def fence_regressions(ops: Sequence[Op]) -> tuple[int, list[dict[str, Any]]]:
    """Acquisitions whose fence is not above that of an acquisition of the same lock
    that had returned before this operation started. (Operations that overlap in
    time are not compared: their order on the nodes is not known from the client.)"""
    by_lock: dict[str, list[Op]] = defaultdict(list)
    for o in ops:
        if o.acquired is not None and o.fence:
            by_lock[o.lock].append(o)
    count = 0
    examples: list[dict[str, Any]] = []
    for lock_ops in by_lock.values():
        done = sorted(lock_ops, key=lambda o: o.acquired or 0.0)
        starts = sorted(lock_ops, key=lambda o: o.start)
        best: Op | None = None
        j = 0
        for b in starts:
            while j < len(done) and (done[j].acquired or 0.0) < b.start:
                if best is None or done[j].fence > best.fence:
                    best = done[j]
                j += 1
            if best is not None and b.fence <= best.fence:
                count += 1
                if len(examples) < 5:
                    examples.append({"lock": b.lock, "earlier": [best.worker, best.seq, best.fence],
                                     "later": [b.worker, b.seq, b.fence],
                                     "behind_by": best.fence - b.fence})
    return count, examples


# -- the whole report --------------------------------------------------------------------
def check(*, schedule: str, fenced: bool, ops: Sequence[Op], events: Sequence[Event],
          writes: dict[str, Sequence[Write]], finals: dict[str, int], t0: float,
          duration: float, n_nodes: int, ttl: float, timeout: float,
          node_timeout: float) -> dict[str, Any]:
    t_end = t0 + duration
    outcomes = Counter(o.outcome for o in ops)
    errors = Counter(o.error for o in ops if o.outcome == "error")
    report: dict[str, Any] = {
        "schedule": schedule,
        "fenced": fenced,
        "attempted": len(ops),
        "outcomes": {k: outcomes.get(k, 0) for k in OUTCOMES},
        "error_types": dict(errors),
    }

    # Resources.
    per_resource = {r: analyse_writes(writes.get(r, []), finals.get(r, 0))
                    for r in sorted(set(writes) | set(finals))}
    report["resources"] = per_resource
    report["writes_applied"] = sum(v["applied"] for v in per_resource.values())
    report["lost_updates"] = sum(v["lost_updates"] for v in per_resource.values())
    report["erased_stale_read"] = sum(v["erased_stale_read"] for v in per_resource.values())
    report["erased_stale_fence"] = sum(v["erased_stale_fence"] for v in per_resource.values())
    report["lost_updates_by_kind"] = {
        kind: sum(v["lost_updates"] for r, v in per_resource.items() if r.split(":")[0] == kind)
        for kind in sorted({r.split(":")[0] for r in per_resource})}
    report["value_gaps"] = sum(abs(v["unexplained_value_gap"]) for v in per_resource.values())
    stale_fence = sum(v["stale_fence_writes"] for v in per_resource.values())
    report["fence_violations"] = stale_fence if fenced else 0
    report["stale_writes_landed"] = stale_fence
    report["refused_by_fence"] = sum(1 for o in ops if o.write is False)
    report["lost_before_write"] = sum(1 for o in ops if o.owned_before_write is False)
    report["lost_after_write"] = sum(1 for o in ops if o.outcome == "lost" and o.write)

    # Client vs resource.
    applied_fences: dict[str, Counter[int]] = {r: Counter(w.fence for w in ws)
                                               for r, ws in writes.items()}
    ack_missing = [o for o in ops if o.write is True
                   and applied_fences.get(o.resource, Counter())[o.fence] == 0]
    report["acknowledged_missing"] = len(ack_missing)
    acked = Counter((o.resource, o.fence) for o in ops if o.write is True)
    report["applied_unacknowledged"] = sum(
        max(0, n - acked[(r, f)]) for r, c in applied_fences.items() for f, n in c.items())

    # Fences per lock name.
    report["fence_regressions"], report["fence_regression_examples"] = fence_regressions(ops)

    # Overlapping holds (client side).
    paused = pause_windows(events)
    holds: dict[str, list[Op]] = defaultdict(list)
    for o in ops:
        if o.acquired is not None:
            holds[o.lock].append(o)
    overlaps = overlaps_paused = overlaps_silent = 0
    silent_examples: list[dict[str, Any]] = []
    for lock_ops in holds.values():
        lock_ops.sort(key=lambda o: o.acquired or 0.0)
        for i, a in enumerate(lock_ops):
            a_end = a.released if a.released is not None else a.end
            for b in lock_ops[i + 1:i + 50]:  # bounded: holds are sequential but for faults
                assert b.acquired is not None
                if b.acquired >= a_end:
                    break
                overlaps += 1
                a_span = (a.acquired or 0.0, a_end)
                if any(_overlaps(a_span, w) for w in paused.get(a.worker, [])):
                    overlaps_paused += 1
                told = (a.outcome in ("lost", "refused-by-fence") or a.lost_signal
                        or a.write is False or a.owned_before_write is False)
                if not told:
                    overlaps_silent += 1
                    if len(silent_examples) < 5:
                        silent_examples.append({"lock": a.lock, "earlier": [a.worker, a.seq, a.fence],
                                                "later": [b.worker, b.seq, b.fence],
                                                "overlap_s": round(a_end - b.acquired, 4)})
    report["overlaps"] = overlaps
    report["overlaps_while_paused"] = overlaps_paused
    report["overlaps_silent"] = overlaps_silent
    report["overlaps_silent_examples"] = silent_examples

    # Provoked worker pauses: the paused worker had not begun its write when it was
    # stopped (so the write leaves after the pause), and another holder of the same
    # lock wrote meanwhile. Its write is then certainly stale: refused with fencing,
    # landed without.
    provoked = 0
    worker_pauses = 0
    for w, windows in paused.items():
        for s, e in windows:
            worker_pauses += 1
            mine = [o for o in ops if o.worker == w and o.start <= s <= o.end]
            if not mine or mine[0].write_start is None or mine[0].write_start < s:
                continue
            lock = mine[0].lock
            if any(o.lock == lock and o.worker != w and o.write and o.write_end is not None
                   and s < o.write_end < e for o in ops):
                provoked += 1
    report["worker_pauses"] = worker_pauses
    report["worker_pauses_provoked"] = provoked

    # Liveness.
    down = down_intervals(events, node_timeout, t_end)
    live_end = t_end - 0.5
    up = quorum_up_intervals(down, n_nodes, t0, live_end)
    acquired_times = [o.acquired for o in ops if o.acquired is not None]
    report["quorum_up_s"] = round(sum(e - s for s, e in up), 2)
    report["longest_no_acquire_with_quorum_s"] = round(longest_gap(acquired_times, up), 3)
    per_res = {}
    for r in per_resource:
        per_res[r] = round(longest_gap([o.acquired for o in ops
                                        if o.resource == r and o.acquired is not None], up), 3)
    report["longest_no_acquire_per_resource_s"] = per_res

    # Timeliness of failures (every schedule), and majority outages.
    bound = timeout + 2 * node_timeout + TIMELINESS_SLACK
    failed = [o for o in ops if o.outcome in ("not-acquired", "quorum-unavailable")]
    durations = [o.end - o.start for o in failed]
    report["failure_bound_s"] = round(bound, 3)
    report["failed_calls"] = len(failed)
    report["failed_over_bound"] = sum(1 for d in durations if d > bound)
    report["failed_duration_max_s"] = round(max(durations), 3) if durations else 0.0
    report["failed_duration_p50_s"] = round(statistics.median(durations), 3) if durations else 0.0

    windows = majority_windows(events)
    report["majority_windows"] = len(windows)
    report["majority_down_s"] = round(sum(e - s for s, e in windows), 2)
    # An acquire round that began before the outage may end a little inside it (the
    # sync transport opens connections one node after another: up to n connect timeouts).
    margin = n_nodes * node_timeout + 0.25
    inside = [o for o in ops if any(s <= o.start and o.end <= e for s, e in windows)]
    report["calls_in_majority_outage"] = len(inside)
    report["outcomes_in_majority_outage"] = dict(Counter(o.outcome for o in inside))
    report["acquired_without_quorum"] = sum(
        1 for o in ops if o.acquired is not None
        and any(s + margin <= o.acquired <= e for s, e in windows))

    # Verdicts.
    report["safe_ok"] = (report["lost_updates"] == 0 and report["fence_violations"] == 0
                         and report["fence_regressions"] == 0 and report["acknowledged_missing"] == 0
                         and report["value_gaps"] == 0)
    report["majority_ok"] = (report["safe_ok"] and report["failed_over_bound"] == 0
                             and report["acquired_without_quorum"] == 0)
    return report


# -- output ----------------------------------------------------------------------------------
ROWS: list[tuple[str, str]] = [
    ("attempted", "operations attempted"),
    ("ok", "  ok (acquired, write applied, released)"),
    ("refused-by-fence", "  refused by fence"),
    ("not-acquired", "  LockNotAcquired (busy until timeout)"),
    ("quorum-unavailable", "  QuorumUnavailable"),
    ("lost", "  LockLost / lease over before write"),
    ("error", "  other errors"),
    ("writes_applied", "writes applied at the resources"),
    ("lost_updates", "LOST UPDATES"),
    ("lost:db", "  on db rows (fenced_save)"),
    ("lost:ctr", "  on ctr counters (fence > stored)"),
    ("lost:cas", "  on cas counters (+ unchanged since read)"),
    ("erased_stale_fence", "increments erased by a stale fence"),
    ("erased_stale_read", "increments erased by an in-order fence (stale read)"),
    ("fence_violations", "FENCE VIOLATIONS (lower fence applied after higher)"),
    ("stale_writes_landed", "stale writes that landed"),
    ("refused_by_fence", "stale writes refused by fencing"),
    ("lost_before_write", "lease over at the last check (write skipped)"),
    ("fence_regressions", "fence not above an earlier holder's"),
    ("acknowledged_missing", "acknowledged writes missing at the resource"),
    ("overlaps", "overlapping holds (client side)"),
    ("overlaps_while_paused", "  ... earlier holder SIGSTOPped"),
    ("overlaps_silent", "  ... earlier holder never told"),
    ("worker_pauses", "worker SIGSTOPs past the lease"),
    ("worker_pauses_provoked", "  ... another holder wrote meanwhile"),
    ("longest_no_acquire_with_quorum_s", "longest no-acquire gap, quorum up (s)"),
    ("failed_duration_p50_s", "failed call duration p50 (s)"),
    ("failed_duration_max_s", "failed call duration max (s)"),
    ("failed_over_bound", "failed calls over timeout bound"),
    ("majority_down_s", "time with a majority down (s)"),
    ("acquired_without_quorum", "acquired while a majority was down"),
]


def _cell(report: dict[str, Any], key: str) -> str:
    if key.startswith("lost:"):
        return str(report.get("lost_updates_by_kind", {}).get(key[5:], "-"))
    if key in report.get("outcomes", {}):
        return str(report["outcomes"][key])
    value = report.get(key, "")
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".") if value else "0"
    return str(value)


def format_table(reports: dict[str, dict[str, Any]]) -> str:
    names = list(reports)
    width = max(len(label) for _, label in ROWS) + 2
    col = max(10, *(len(n) + 2 for n in names))
    lines = ["".ljust(width) + "".join(n.rjust(col) for n in names),
             "-" * (width + col * len(names))]
    for key, label in ROWS:
        lines.append(label.ljust(width) + "".join(_cell(reports[n], key).rjust(col) for n in names))
    return "\n".join(lines)
