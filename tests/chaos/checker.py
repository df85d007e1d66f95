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
* **The lock family** (``family`` schedule) -- from the resource server's set of
  those inside each resource, read atomically as each holder entered, and whether
  each holder's lease covered its whole section (``owned()`` after leaving it):
  a reader that met a writer, two writers that met, more semaphore holders
  inside at once than permits, a reader whose two reads differ, two multi-lock
  holders of one name, two holders of one segment; and how many sections of
  each kind were checked (:func:`family_sections`).
* **Failovers** (``failover`` schedule) -- per ``REPLICA_ACKS`` setting (each
  worker's, from the run's ``info`` event; the two halves use lock names of
  their own): the operations and their outcomes, the overlaps and whether the
  earlier holder was told, and the holds a failover began inside, ended ok or told
  (:func:`failover_figures`).
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

#: Outcomes that are a typed django-redlock error (or a refusal by the resource).
TYPED_OUTCOMES = ("refused-by-fence", "not-acquired", "quorum-unavailable", "lost")

#: Seconds allowed beyond ``timeout + 2 * node_timeout`` for a failed call to
#: return (the machine is shared and small; this is about "bounded", not fast).
TIMELINESS_SLACK = 2.0

DOWN_KINDS = ("kill", "pause", "cut", "latency")

#: Acquisitions of *other* locks, after a crashed holder's lease ran out, that make
#: a late recovery of its lock a lock-specific stall (checker.check, crashes).
CRASH_PROGRESS_ELSEWHERE = 5


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
        # Stale: not above a fence applied before it, or applied over a newer
        # holder's claim (the stored fence was higher than the writer's).
        in_order = w.fence > max_fence and w.prev_fence <= w.fence
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
                examples.append({"index": w.index, "fence": w.fence,
                                 "after": max(max_fence, w.prev_fence),
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
    """(in place, healing) of each majority outage: from the moment its last fault
    was applied to the moment the heal began."""
    return [(s, e) for _, s, e in majority_outages(events)]


def majority_outages(events: Sequence[Event]) -> list[tuple[float, float, float]]:
    """(began, in place, healing) of each majority outage: ``began`` is when the
    nemesis started applying its faults (``params['begin']``, else the start)."""
    out = []
    start: Event | None = None
    for e in events:
        if e.kind != "majority":
            continue
        if e.action == "start":
            start = e
        elif e.action == "end" and start is not None:
            out.append((float(start.params.get("begin", start.t)), start.t, e.t))
            start = None
    return out


def overlapping_holds(ops: Sequence[Op], paused: dict[int, list[tuple[float, float]]]
                      ) -> dict[str, Any]:
    """Every pair of holds of one lock whose client-side intervals ``[acquired,
    release began]`` intersect (all pairs, not a window of neighbours), classified
    by what the *earlier* holder knew:

    ``told``       it was told it had lost the lock (``LockLost``, ``lock_lost``, a
                   refused write or claim, ``owned()`` false) and no write of its
                   landed after the later holder had acquired ("in time")
    ``told_late``  it was told, but only after a write of its landed while the later
                   holder held the lock (harmless only if the resource refused
                   nothing it should have: see the stale-write counts)
    ``untold``     it was never told

    Two holds of a read lock (``mode == "read"``) are shared by design and are not
    a pair; a reader and a writer are.
    """
    holds: dict[str, list[Op]] = defaultdict(list)
    for o in ops:
        if o.acquired is not None:
            holds[o.lock].append(o)
    out: dict[str, Any] = {"overlaps": 0, "overlaps_while_paused": 0, "overlaps_told": 0,
                           "overlaps_told_late": 0, "overlaps_untold": 0,
                           "overlaps_untold_examples": [], "overlaps_told_late_examples": []}
    import bisect

    for lock_ops in holds.values():
        lock_ops.sort(key=lambda o: o.acquired or 0.0)
        starts = [o.acquired or 0.0 for o in lock_ops]
        for i, a in enumerate(lock_ops):
            a_end = a.released if a.released is not None else a.end
            j_end = bisect.bisect_left(starts, a_end, lo=i + 1)
            for b in lock_ops[i + 1:j_end]:
                assert b.acquired is not None
                if b.acquired >= a_end or (a.mode == "read" and b.mode == "read"):
                    continue
                out["overlaps"] += 1
                a_span = (a.acquired or 0.0, a_end)
                if any(_overlaps(a_span, w) for w in paused.get(a.worker, [])):
                    out["overlaps_while_paused"] += 1
                told = (a.outcome in ("lost", "refused-by-fence") or a.lost_signal
                        or a.write is False or a.owned_before_write is False)
                wrote_late = (a.write is True and a.write_end is not None
                              and a.write_end > b.acquired)
                example = {"lock": a.lock, "earlier": [a.worker, a.seq, a.fence],
                           "later": [b.worker, b.seq, b.fence],
                           "overlap_s": round(a_end - b.acquired, 4)}
                if not told:
                    out["overlaps_untold"] += 1
                    if len(out["overlaps_untold_examples"]) < 5:
                        out["overlaps_untold_examples"].append(example)
                elif wrote_late:
                    out["overlaps_told_late"] += 1
                    if len(out["overlaps_told_late_examples"]) < 5:
                        out["overlaps_told_late_examples"].append(example)
                else:
                    out["overlaps_told"] += 1
    return out


#: The lock family's kinds of hold (``Op.mode``); each must have run (family_reasons).
FAMILY_KINDS = ("read", "write", "permit", "multi", "segment")


def family_sections(ops: Sequence[Op], permits: int) -> dict[str, Any]:
    """The lock family's verdict figures, from the critical sections as the resource
    server ordered them (``Op.present``: who was inside when this one entered,
    read atomically with entering; of two sections that meet, the later one sees
    the earlier) and ``Op.valid`` (``owned()`` asked after leaving: the lease
    covered the whole section).

    Only *valid* sections are held to exclusion: a holder SIGSTOPped past its lease
    is still inside when the next one enters, which no lock can prevent (fencing
    is for that, and its late write is refused: see the stale-write counts); it
    learns it at ``owned()``, so its section is not valid. Two valid sections that
    meet both held a lease at once, which the lock must never allow:

    ``reader_overlapped_writer``    a valid read and a valid write section met
    ``writers_overlapped``          two valid write sections met
    ``semaphore_above_permits``     sections that entered with ``permits`` or more
                                    valid permit sections inside (so more than
                                    ``permits`` at once); ``semaphore_max_inside``
                                    is the most valid ones seen at once
    ``read_changed``                a valid reader whose two reads differ (a write
                                    landed inside its section)
    ``writer_fence_regressions``    :func:`fence_regressions` among the writers
    ``multi_overlapped``            a valid multi-lock section met another whose
                                    names it shares (two holders of one name)
    ``segment_shared``              two valid sections of one segment met

    and, so that no rule passes because its kind never ran, the sections checked
    per kind (``sections_read``, ``sections_write``, ``sections_permit``,
    ``sections_multi``, ``sections_segment``: valid ones), how many reads were
    shared with another valid reader, how many permit sections met another (the
    semaphore admitted more than one), how many multi-lock sections had to wait
    (``multi_contended``: a holder of a shared name was inside when its
    acquisition began, so the exclusion was put to the test) and how many segment
    sections met a holder of the other segment (``segments_parallel``: the
    segments served two at once).
    Sections whose neighbour's record is missing are counted (``unknown``).
    """
    by_id = {f"w{o.worker}.{o.seq}": o for o in ops if o.enter is not None}
    out: dict[str, Any] = {"reader_overlapped_writer": 0, "writers_overlapped": 0,
                           "semaphore_above_permits": 0, "semaphore_max_inside": 0,
                           "read_changed": 0, "sections_read": 0, "sections_write": 0,
                           "sections_permit": 0, "sections_invalid": 0,
                           "reads_shared": 0, "permits_shared": 0, "sections_unknown": 0,
                           "sections_multi": 0, "sections_segment": 0, "multi_overlapped": 0,
                           "segment_shared": 0, "multi_contended": 0, "segments_parallel": 0,
                           "family_examples": []}
    ops_by_mode: Counter[str] = Counter()
    ok_by_mode: Counter[str] = Counter()
    for o in ops:
        if o.mode:
            ops_by_mode[o.mode] += 1
            ok_by_mode[o.mode] += o.outcome == "ok"

    def example(what: str, x: Op, others: Sequence[Op]) -> None:
        if len(out["family_examples"]) < 5:
            out["family_examples"].append(
                {"what": what, "resource": x.resource, "section": [x.worker, x.seq, x.fence],
                 "met": [[o.worker, o.seq, o.mode, o.fence] for o in others]})

    for x in by_id.values():
        if not x.valid:
            out["sections_invalid"] += 1
            continue
        out[f"sections_{x.mode}"] = out.get(f"sections_{x.mode}", 0) + 1
        met = []
        for ident in x.present:
            o = by_id.get(ident)
            if o is None:
                out["sections_unknown"] += 1
            elif o.valid and (o.resource == x.resource or x.mode in ("multi", "segment")):
                # (multi and segment sections share one set per resource: who is
                # inside which name or segment is sorted out below)
                met.append(o)
        readers = [o for o in met if o.mode == "read"]
        writers = [o for o in met if o.mode == "write"]
        if x.mode == "read":
            out["reads_shared"] += bool(readers)
            if writers:
                out["reader_overlapped_writer"] += len(writers)
                example("reader met writer", x, writers)
            if x.read_again is not None and x.read_again != x.read:
                out["read_changed"] += 1
                example(f"read {x.read} then {x.read_again}", x, met)
        elif x.mode == "write":
            if readers:
                out["reader_overlapped_writer"] += len(readers)
                example("writer met reader", x, readers)
            if writers:
                out["writers_overlapped"] += len(writers)
                example("writer met writer", x, writers)
        elif x.mode == "permit":
            holders = [o for o in met if o.mode == "permit"]
            inside = 1 + len(holders)
            out["semaphore_max_inside"] = max(out["semaphore_max_inside"], inside)
            out["permits_shared"] += bool(holders)
            if inside > permits:
                out["semaphore_above_permits"] += 1
                example(f"{inside} holders, {permits} permits", x, holders)
        elif x.mode == "multi":
            mine = set(x.names)
            clash = [o for o in met if o.mode == "multi" and mine & set(o.names)]
            if clash:
                out["multi_overlapped"] += len(clash)
                example("multi-lock holders met on a name", x, clash)
            waited = [by_id[i] for i in x.before if i in by_id]
            out["multi_contended"] += any(o.mode == "multi" and mine & set(o.names)
                                          for o in waited)
        elif x.mode == "segment":
            same = [o for o in met if o.mode == "segment" and o.resource == x.resource]
            if same:
                out["segment_shared"] += len(same)
                example("two holders of one segment", x, same)
            out["segments_parallel"] += any(o.mode == "segment" and o.resource != x.resource
                                            for o in met)
    out["writer_fence_regressions"], _ = fence_regressions([o for o in ops if o.mode == "write"])
    out["family_ops"] = {m: ops_by_mode.get(m, 0) for m in FAMILY_KINDS}
    out["family_ok"] = {m: ok_by_mode.get(m, 0) for m in FAMILY_KINDS}
    out["permits"] = permits
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


# -- failovers (the failover schedule) ---------------------------------------------------
#: The Sentinel faults (nemesis.SENTINEL_KINDS).
FAILOVER_KINDS = ("failover", "kill-master")


def failover_figures(ops: Sequence[Op], events: Sequence[Event]) -> dict[str, Any]:
    """The ``failover`` schedule's figures.

    ``failovers`` the Sentinel faults begun (a forced failover or a killed
    master), ``failovers_during_holds`` those begun while a worker held a lock
    (the nemesis waits for one), ``master_moved_s`` how long each took until the
    sentinels agreed on the new master (``end`` of a failover, ``elected`` after
    a kill). Then per ``REPLICA_ACKS`` setting (``by_acks["1"]``, ``["0"]``):
    ``ops``, ``ok``, ``lost`` (told: ``LockLost`` or ``owned()`` false),
    ``refused`` (a fenced write refused), ``overlaps`` and ``overlaps_untold``
    (:func:`overlapping_holds` over that half alone), ``held_across`` (holds a
    failover began inside) and of those ``ended_ok`` (outcome ``ok``: the
    holder was told of no loss; its lock survived the failover, or was lost
    without anyone else taking it before the hold ended, e.g. released while
    the node had no master) and ``told`` (``lost`` or refused).
    """
    acks: list[int] = []
    for e in events:
        if e.kind == "run" and e.action == "info" and "replica_acks" in e.params:
            acks = [int(a) for a in e.params["replica_acks"]]
    starts = [e for e in events if e.kind in FAILOVER_KINDS and e.action == "start"]
    out: dict[str, Any] = {
        "failovers": len(starts),
        "failovers_by_kind": dict(Counter(e.kind for e in starts)),
        "failovers_during_holds": sum(1 for e in starts if e.params.get("holders")),
        # Workers that took a lock while the replicas lagged, right before a kill.
        "fresh_holders": sum(len(e.params.get("fresh", ())) for e in events
                             if e.kind == "kill-master" and e.action == "killed"),
        "master_moved_s": [],
        "by_acks": {},
    }
    for e in starts:
        done = next((x for x in events if x.kind == e.kind and x.target == e.target
                     and x.t >= e.t and x.action == ("end" if e.kind == "failover" else "elected")),
                    None)
        if done is not None:
            out["master_moved_s"].append(round(done.t - e.t, 3))
    paused = pause_windows(events)
    for a in sorted(set(acks), reverse=True):
        mine = [o for o in ops if o.worker < len(acks) and acks[o.worker] == a]
        over = overlapping_holds(mine, paused)
        across = [o for o in mine if o.acquired is not None and any(
            o.acquired < e.t < (o.released if o.released is not None else o.end)
            for e in starts)]
        out["by_acks"][str(a)] = {
            "ops": len(mine),
            "ok": sum(1 for o in mine if o.outcome == "ok"),
            "lost": sum(1 for o in mine if o.outcome == "lost"),
            "refused": sum(1 for o in mine if o.write is False),
            "overlaps": over["overlaps"],
            "overlaps_untold": over["overlaps_untold"],
            "held_across": len(across),
            "ended_ok": sum(1 for o in across if o.outcome == "ok"),
            "told": sum(1 for o in across if o.outcome in ("lost", "refused-by-fence")),
        }
    return out


def failover_reasons(r: dict[str, Any]) -> list[str]:
    """Why a ``failover`` report fails besides the ``safe`` rules (which hold for
    both halves: no lost update, no stale write landed, no overlap whose earlier
    holder was never told): no Sentinel fault of each kind, none begun while a
    lock was held, a ``REPLICA_ACKS`` half missing or with fewer successful
    operations than a quarter of ``r['min_ok']`` (it proved nothing)."""
    fo = r.get("failover")
    if not fo:
        return ["no failover was recorded"]
    reasons = []
    by_kind = fo.get("failovers_by_kind", {})
    for kind in FAILOVER_KINDS:
        if not by_kind.get(kind):
            reasons.append(f"no {kind} took place")
    if fo.get("failovers") and not fo.get("failovers_during_holds"):
        reasons.append("no failover began while a lock was held")
    need = max(1, int(r.get("min_ok", 0)) // 4)
    for a in ("1", "0"):
        half = fo.get("by_acks", {}).get(a)
        if half is None:
            reasons.append(f"no worker ran with REPLICA_ACKS={a}")
        elif half["ok"] < need:
            reasons.append(f"REPLICA_ACKS={a}: only {half['ok']} successful operation(s), "
                           f"fewer than {need}")
    return reasons


def failover_lines(r: dict[str, Any]) -> list[str]:
    """The failover figures for :func:`format_schedule`."""
    fo = r.get("failover") or {}
    moved = fo.get("master_moved_s", [])
    lines = [f"failovers {fo.get('failovers', 0)} ("
             + ", ".join(f"{k} {v}" for k, v in sorted(fo.get("failovers_by_kind", {}).items()))
             + f"), {fo.get('failovers_during_holds', 0)} begun during a hold, "
             + f"{fo.get('fresh_holders', 0)} lock(s) taken while the replicas lagged; "
             + "new master after "
             + ", ".join(f"{m:g}" for m in moved) + " s"]
    for a, half in sorted(fo.get("by_acks", {}).items(), reverse=True):
        lines.append(f"REPLICA_ACKS={a}: ops {half['ops']}, ok {half['ok']}, lost (told) "
                     f"{half['lost']}, refused {half['refused']}; overlaps {half['overlaps']} "
                     f"(never told {half['overlaps_untold']}); holds across a failover "
                     f"{half['held_across']}: ended ok {half['ended_ok']}, told {half['told']}")
    return lines


# -- the whole report --------------------------------------------------------------------
def check(*, schedule: str, fenced: bool, ops: Sequence[Op], events: Sequence[Event],
          writes: dict[str, Sequence[Write]], finals: dict[str, int], t0: float,
          duration: float, n_nodes: int, ttl: float, timeout: float,
          node_timeout: float, permits: int = 0) -> dict[str, Any]:
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

    # Overlapping holds (client side), every pair.
    paused = pause_windows(events)
    report.update(overlapping_holds(ops, paused))
    # Names kept for the earlier readers of the report.
    report["overlaps_silent"] = report["overlaps_untold"]
    report["overlaps_silent_examples"] = report["overlaps_untold_examples"]
    if any(o.mode for o in ops):
        report["family"] = family_sections(ops, permits)
    if any(e.kind in FAILOVER_KINDS for e in events) or schedule == "failover":
        report["failover"] = failover_figures(ops, events)

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

    # Majority outages, with no grace window. An acquisition is one without a
    # quorum when its whole final round lay inside an outage: it returned before the
    # heal began, and that round began after the outage was in place (the round
    # began no earlier than the call and no earlier than Op.lease_start, the lease's
    # start by the holder's own clock). Every call that started inside an outage
    # must end in a typed error within its bound, or acquire after the heal.
    outages = majority_outages(events)
    report["majority_windows"] = len(outages)
    report["majority_down_s"] = round(sum(e - s for _, s, e in outages), 2)
    inside = [o for o in ops if any(s <= o.start < e for _, s, e in outages)]
    report["calls_started_in_majority_outage"] = len(inside)
    within = [o for o in inside if any(s <= o.start and o.end <= e for _, s, e in outages)]
    report["calls_in_majority_outage"] = len(within)  # begun and ended inside
    report["outcomes_in_majority_outage"] = dict(Counter(o.outcome for o in within))
    report["outcomes_started_in_majority_outage"] = dict(Counter(o.outcome for o in inside))
    untyped_inside = [o for o in inside if o.outcome in ("error", "ok", "lost")
                      and not any(o.acquired is not None and o.acquired >= e
                                  for _, s, e in outages if s <= o.start < e)]
    report["outage_calls_without_typed_error"] = len(untyped_inside)
    report["outage_calls_without_typed_error_examples"] = [
        [o.worker, o.seq, o.outcome, o.error, round(o.end - o.start, 3)]
        for o in untyped_inside[:5]]
    report["outage_calls_over_bound"] = sum(
        1 for o in inside if o.outcome not in ("ok",) and o.end - o.start > bound)
    bad = [o for o in ops if o.acquired is not None and any(
        max(o.start, o.lease_start or o.start) >= s and o.acquired < e
        for _, s, e in outages)]
    report["acquired_without_quorum"] = len(bad)
    report["acquired_without_quorum_examples"] = [
        [o.worker, o.seq, o.lock, round((o.lease_start or o.acquired or 0.0) - t0, 3)]
        for o in bad[:5]]
    report["outage_inflight"] = sum(
        1 for e in events if e.kind == "majority" and e.action == "start"
        and e.params.get("inflight"))

    # Typed and untyped errors (every schedule).
    report["typed_errors"] = sum(outcomes.get(k, 0) for k in TYPED_OUTCOMES)
    report["untyped_errors"] = outcomes.get("error", 0)

    # Holder crashes: the lock the dead worker held is acquired again by someone
    # (recovery by expiry) within TTL + timeout + slack. A lock that stays out of
    # reach longer while other locks are being acquired (at least
    # CRASH_PROGRESS_ELSEWHERE times after its lease ran out) is a lock-specific
    # stall, and fails; a stall of every lock at once (the machine starved, e.g.
    # by the replacement workers starting up) is reported, not failed.
    lock_of = {o.resource: o.lock for o in ops}
    crashes = [e for e in events if e.kind in ("crash-before", "crash-after")
               and e.action == "start"]
    recoveries: list[float] = []
    unrecovered = 0
    stalled_everywhere = 0
    recover_bound = ttl + timeout + TIMELINESS_SLACK
    acquisitions = sorted((o.acquired, o.lock) for o in ops if o.acquired is not None)
    for c in crashes:
        lock = lock_of.get(str(c.params.get("resource", "")))
        if lock is None:
            continue
        after = [a for a, name in acquisitions if name == lock and a > c.t]
        if after:
            recoveries.append(after[0] - c.t)
        if (after and after[0] - c.t <= recover_bound) or (
                not after and c.t + recover_bound >= t_end):
            continue
        until = after[0] if after else t_end
        elsewhere = sum(1 for a, name in acquisitions
                        if name != lock and c.t + ttl < a < until)
        if elsewhere >= CRASH_PROGRESS_ELSEWHERE:
            unrecovered += 1
        else:
            stalled_everywhere += 1
    report["crashes"] = len(crashes)
    report["crash_recovery_max_s"] = round(max(recoveries), 3) if recoveries else 0.0
    report["crash_recovery_bound_s"] = round(recover_bound, 3)
    report["crashes_unrecovered"] = unrecovered
    report["crashes_recovered_late_in_a_global_stall"] = stalled_everywhere

    # Verdicts.
    report["safe_ok"] = (report["lost_updates"] == 0 and report["fence_violations"] == 0
                         and report["fence_regressions"] == 0 and report["acknowledged_missing"] == 0
                         and report["value_gaps"] == 0)
    report["majority_ok"] = (report["safe_ok"] and report["failed_over_bound"] == 0
                             and report["acquired_without_quorum"] == 0
                             and report["outage_calls_without_typed_error"] == 0)
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


# -- the verdict ----------------------------------------------------------------------------
def verdict(r: dict[str, Any]) -> tuple[bool, list[str]]:
    """(passed, reasons) for one schedule's report; ``r['expect']`` names the rules
    (``runner.EXPECT``): ``safe``, ``dataloss``, ``majority``, ``nofence``, ``clock``.

    Every schedule fails when it proved nothing or could not be run as planned:
    fewer successful operations than ``r['min_ok']``, a worker that hung or died
    without the nemesis killing it, a planned fault that was not applied, an
    untyped error, a fence regression, an acknowledged write missing, a value the
    write log does not explain. Then, by kind: ``safe`` and ``majority`` no lost
    update on any resource, no stale write landed, no overlap whose earlier holder
    was never told; ``majority`` also no lease begun inside an outage, every call
    started in one a typed error within its bound (or an acquisition after the
    heal); ``dataloss`` overlaps allowed, but no lost update and no stale write
    landed (fencing refused them all); ``nofence`` must show stale writes landing
    and updates lost (else the contrast detected nothing); ``clock`` is ``safe``
    without the overlap rule; ``family`` is ``safe`` plus :func:`family_reasons`;
    ``failover`` is ``safe`` (for the workers of both ``REPLICA_ACKS`` settings)
    plus :func:`failover_reasons`.
    """
    expect = r.get("expect", "safe")
    reasons: list[str] = []
    ok = r.get("outcomes", {}).get("ok", 0)
    if ok < r.get("min_ok", 0):
        reasons.append(f"only {ok} successful operation(s), fewer than {r['min_ok']}")
    if r.get("hung_workers"):
        reasons.append(f"worker(s) hung: {', '.join(r['hung_workers'])}")
    if r.get("died_workers"):
        reasons.append(f"worker(s) died unexpectedly: {', '.join(r['died_workers'])}")
    if r.get("nemesis_errors"):
        reasons.append(f"{len(r['nemesis_errors'])} planned fault(s) not injected "
                       f"({r['nemesis_errors'][0]})")
    planned, applied = r.get("faults_planned", {}), r.get("faults_applied", {})
    short = {k: (n, applied.get(k, 0)) for k, n in planned.items() if applied.get(k, 0) < n}
    if short:
        reasons.append("faults applied short of the plan: " + ", ".join(
            f"{k} {a} of {n}" for k, (n, a) in sorted(short.items())))
    checks = [("untyped_errors", "call(s) ended in an untyped error"),
              ("fence_regressions", "fence(s) not above an earlier holder's"),
              ("acknowledged_missing", "acknowledged write(s) missing at the resource"),
              ("value_gaps", "value gap(s) the write log does not explain")]
    reasons += [f"{r[key]} {label}" for key, label in checks if r.get(key)]
    if expect in ("safe", "majority", "dataloss", "clock", "family", "failover"):
        if r.get("lost_updates"):
            by_kind = r.get("lost_updates_by_kind", {})
            reasons.append(f"{r['lost_updates']} lost update(s) ("
                           + ", ".join(f"{k} {v}" for k, v in by_kind.items() if v) + ")")
        if r.get("stale_writes_landed"):
            reasons.append(f"{r['stale_writes_landed']} stale write(s) landed")
    if expect in ("safe", "majority", "family", "failover") and r.get("overlaps_untold"):
        reasons.append(f"{r['overlaps_untold']} overlapping hold(s) whose earlier holder "
                       f"was never told")
    if expect == "majority":
        reasons += [f"{r[key]} {label}" for key, label in (
            ("failed_over_bound", "failed call(s) over the timeout bound"),
            ("outage_calls_over_bound", "call(s) in an outage over the timeout bound"),
            ("outage_calls_without_typed_error",
             "call(s) started in an outage without a typed error"),
            ("acquired_without_quorum", "lease(s) begun while a majority was down"))
            if r.get(key)]
        if not r.get("majority_windows"):
            reasons.append("no majority outage took place")
    if expect == "family":
        reasons += family_reasons(r)
    if expect == "failover":
        reasons += failover_reasons(r)
    if expect == "nofence" and not (r.get("stale_writes_landed") and r.get("lost_updates")):
        reasons.append(f"the contrast detected nothing ({r.get('stale_writes_landed', 0)} "
                       f"stale writes landed, {r.get('lost_updates', 0)} updates lost)")
    if r.get("crashes_unrecovered"):
        reasons.append(f"{r['crashes_unrecovered']} crashed holder's lock(s) not recovered "
                       f"within {r.get('crash_recovery_bound_s')} s")
    return not reasons, reasons


#: The lock family's violations (family_sections), each must be 0.
FAMILY_VIOLATIONS: list[tuple[str, str]] = [
    ("reader_overlapped_writer", "reader overlapped a writer"),
    ("writers_overlapped", "writers overlapped"),
    ("semaphore_above_permits", "semaphore holders above permits"),
    ("read_changed", "reader saw a write inside its section"),
    ("writer_fence_regressions", "writer fence regressions"),
    ("multi_overlapped", "multi-lock holders met on a name"),
    ("segment_shared", "two holders of one segment"),
]


def family_reasons(r: dict[str, Any]) -> list[str]:
    """Why a ``family`` report fails: a violation of :data:`FAMILY_VIOLATIONS`, or a
    kind that proved nothing -- fewer checked sections of read, write or permit
    than ``r['family_min_sections']``, no read shared with another reader, no
    permit section that met another (then the set of those inside never showed
    two holders at once, and no overlap could have been seen either)."""
    fam = r.get("family")
    if not fam:
        return ["no lock-family operation was recorded"]
    reasons = [f"{fam[key]} {label}" for key, label in FAMILY_VIOLATIONS if fam.get(key)]
    need = max(1, int(r.get("family_min_sections", 1)))
    for kind in FAMILY_KINDS:
        n = fam.get(f"sections_{kind}", 0)
        if n < need:
            reasons.append(f"only {n} checked {kind} section(s), fewer than {need} "
                           f"({fam.get('family_ops', {}).get(kind, 0)} {kind} operation(s))")
    if fam.get("permits", 0) < 2:
        reasons.append(f"semaphore of {fam.get('permits', 0)} permit(s): no sharing to check")
    if not fam.get("reads_shared"):
        reasons.append("no read section met another reader (sharing never checked)")
    if not fam.get("permits_shared"):
        reasons.append("no permit section met another holder (the count never checked)")
    if not fam.get("multi_contended"):
        reasons.append("no multi-lock waited for another holder of its names (the "
                       "exclusion never tested)")
    if not fam.get("segments_parallel"):
        reasons.append("no segment section met a holder of another segment (the segments "
                       "never served two at once)")
    return reasons


def family_lines(r: dict[str, Any]) -> list[str]:
    """The family's verdict lines for :func:`format_schedule`."""
    fam = r.get("family") or {}
    ops, ok = fam.get("family_ops", {}), fam.get("family_ok", {})
    lines = [f"{label}: {fam.get(key, 0)}" for key, label in FAMILY_VIOLATIONS]
    lines.append(f"most semaphore holders inside at once: {fam.get('semaphore_max_inside', 0)} "
                 f"of {fam.get('permits', 0)} permits")
    lines.append(f"sections checked: read {fam.get('sections_read', 0)} (shared "
                 f"{fam.get('reads_shared', 0)}), write {fam.get('sections_write', 0)}, permit "
                 f"{fam.get('sections_permit', 0)} (shared {fam.get('permits_shared', 0)}), "
                 f"multi {fam.get('sections_multi', 0)} (waited "
                 f"{fam.get('multi_contended', 0)}), segment {fam.get('sections_segment', 0)} "
                 f"(beside the other {fam.get('segments_parallel', 0)}); "
                 f"lease over in the section {fam.get('sections_invalid', 0)}; at least "
                 f"{r.get('family_min_sections', 0)} of each")
    lines.append("operations (ok): " + ", ".join(
        f"{kind} {ops.get(kind, 0)} ({ok.get(kind, 0)})" for kind in FAMILY_KINDS))
    return lines


SCHEDULE_ROWS: list[tuple[str, str]] = [
    ("attempted", "operations"),
    ("ok", "ok"),
    ("refused_by_fence", "refused by fence"),
    ("typed_errors", "typed errors (incl. refused)"),
    ("untyped_errors", "untyped errors"),
    ("lost_updates", "lost updates"),
    ("overlaps", "overlapping holds"),
    ("overlaps_told_split", "  earlier holder told in time / late / never"),
    ("stale_writes_landed", "stale writes landed"),
    ("fence_regressions", "fence regressions"),
    ("acknowledged_missing", "acknowledged writes missing"),
    ("workers_split", "workers hung / died / crashed by the nemesis"),
    ("faults_split", "faults applied / planned / failed"),
]


def _schedule_cell(r: dict[str, Any], key: str) -> str:
    if key == "overlaps_told_split":
        return f"{r.get('overlaps_told', 0)} / {r.get('overlaps_told_late', 0)} / " \
               f"{r.get('overlaps_untold', 0)}"
    if key == "workers_split":
        return f"{len(r.get('hung_workers', []))} / {len(r.get('died_workers', []))} / " \
               f"{r.get('crashed_workers', 0)}"
    if key == "faults_split":
        return f"{sum(r.get('faults_applied', {}).values())} / " \
               f"{sum(r.get('faults_planned', {}).values())} / {len(r.get('nemesis_errors', []))}"
    return _cell(r, key)


def format_schedule(name: str, r: dict[str, Any]) -> str:
    """One schedule's table: the figures a person reads first, and its verdict."""
    passed, reasons = verdict(r)
    width = max(len(label) for _, label in SCHEDULE_ROWS) + 2
    head = (f"{name} ({r.get('expect', '?')}, {r.get('duration_s', 0):.0f} s, "
            f"at least {r.get('min_ok', 0)} ok)")
    lines = [head, "-" * max(len(head), width + 16)]
    for key, label in SCHEDULE_ROWS:
        lines.append(label.ljust(width) + _schedule_cell(r, key).rjust(16))
    extra = []
    if r.get("expect") == "majority":
        extra.append(f"outages {r.get('majority_windows', 0)} ({r.get('majority_down_s', 0)} s, "
                     f"{r.get('outage_inflight', 0)} begun with an acquisition in flight), "
                     f"{r.get('calls_started_in_majority_outage', 0)} calls begun inside, leases begun "
                     f"inside {r.get('acquired_without_quorum', 0)}, slowest failure "
                     f"{r.get('failed_duration_max_s', 0)} s (bound {r.get('failure_bound_s')} s)")
    if r.get("crashes"):
        extra.append(f"holder crashes {r['crashes']}, lock recovered within "
                     f"{r.get('crash_recovery_max_s')} s (bound {r.get('crash_recovery_bound_s')} s"
                     f"; late while every lock stalled: "
                     f"{r.get('crashes_recovered_late_in_a_global_stall', 0)})")
    if r.get("expect") == "family" or r.get("family"):
        extra += family_lines(r)
    if r.get("expect") == "failover" or r.get("failover"):
        extra += failover_lines(r)
    applied = r.get("faults_applied", {})
    if applied:
        extra.append("faults: " + ", ".join(f"{k} {v}" for k, v in sorted(applied.items())))
    lines += [f"  {x}" for x in extra]
    lines.append("PASS" if passed else "FAIL: " + "; ".join(reasons))
    return "\n".join(lines)
