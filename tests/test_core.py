"""Unit tests of the pure core: no Redis, no clock, no randomness of their own."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from django_redlock.core import quorum as q
from django_redlock.core.keys import (
    MAX_NAME_LENGTH,
    InvalidLockName,
    fence_key,
    lock_key,
    name_from_key,
    validate_name,
)
from django_redlock.core.owner import new_token, owner_json, parse_value
from django_redlock.core.retry import jittered_delay, next_wait
from django_redlock.transport.resp import ACQUIRE, pack


@pytest.mark.parametrize("n,need", [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (6, 4), (7, 4)])
def test_quorum_is_an_integer_majority(n: int, need: int) -> None:
    assert q.quorum(n) == need
    assert isinstance(q.quorum(n), int)
    assert q.max_failures(n) == n - need


def test_quorum_of_three_is_two_not_three() -> None:
    # redlock-py's float `len / 2 + 1` demands 2.5 -> all three nodes.
    assert q.has_quorum(2, 3)
    assert not q.has_quorum(1, 3)


def test_quorum_rejects_zero_nodes() -> None:
    with pytest.raises(ValueError):
        q.quorum(0)


def test_validity_subtracts_elapsed_and_drift() -> None:
    # ttl 10 s, drift factor 0.01 -> drift 0.1 + 0.002 s
    assert q.drift(10.0, 0.01) == pytest.approx(0.102)
    assert q.validity(10.0, 0.5, 0.01) == pytest.approx(10.0 - 0.5 - 0.102)


def test_validity_can_be_negative_when_the_round_was_too_slow() -> None:
    assert q.validity(1.0, 0.999, 0.01) < 0


class FixedRandom:
    """Returns the upper bound: makes the schedule deterministic."""

    def uniform(self, a: float, b: float) -> float:
        return b


class LowRandom:
    def uniform(self, a: float, b: float) -> float:
        return a


def test_jitter_stays_within_half_to_full_delay() -> None:
    rng = random.Random(7)
    draws = [jittered_delay(0.2, rng) for _ in range(200)]
    assert min(draws) >= 0.1 and max(draws) <= 0.2
    assert len({round(d, 6) for d in draws}) > 100  # actually random


def test_next_wait_is_bounded_by_deadline_and_holder_lease() -> None:
    assert next_wait(remaining=None, max_delay=0.2, holder_ttl=None, rng=FixedRandom()) == 0.2
    assert next_wait(remaining=0.05, max_delay=0.2, holder_ttl=None, rng=FixedRandom()) == 0.05
    # The holder's lease ends in 30 ms: no reason to sleep the full delay.
    assert next_wait(remaining=None, max_delay=0.2, holder_ttl=0.03,
                     rng=FixedRandom()) == pytest.approx(0.031)
    assert next_wait(remaining=-1.0, max_delay=0.2, holder_ttl=None, rng=LowRandom()) == 0.0


def test_lock_key_and_fence_key_share_a_cluster_slot() -> None:
    assert lock_key("redlock", "stock:1") == "redlock:stock:1"
    assert fence_key("redlock:stock:1") == "{redlock:stock:1}:fence"
    # A name with its own hash tag keeps it: the first {...} decides the slot
    # (the whole lock key follows the role, so no other name can reach it).
    assert fence_key("redlock:{user1}:cart") == "{user1}:fence:redlock:{user1}:cart"
    assert name_from_key("redlock", "redlock:stock:1") == "stock:1"
    assert name_from_key("redlock", "other:stock:1") is None


@pytest.mark.parametrize("bad,why", [
    ("", "empty"),
    ("x" * (MAX_NAME_LENGTH + 1), "limit"),
    ("stock:\n1", "control"),
    ("stock:\x001", "control"),
    (" stock:1", "whitespace"),
    (42, "str"),
])
def test_bad_names_are_rejected_with_a_reason(bad: object, why: str) -> None:
    with pytest.raises(InvalidLockName, match=why):
        validate_name(bad)


def test_good_names_pass_unchanged() -> None:
    for name in ["stock:1", "order:abc@example.com", "a" * MAX_NAME_LENGTH, "café:1"]:
        assert validate_name(name) == name


def test_tokens_are_random_and_separator_free() -> None:
    tokens = {new_token() for _ in range(1000)}
    assert len(tokens) == 1000
    assert all(len(t) == 22 and "|" not in t for t in tokens)


def test_value_round_trip() -> None:
    owner = owner_json("view:shop.buy", since=1700000000.25)
    stored = parse_value(f"tok|42|{owner}".encode())
    assert stored is not None
    assert stored.token == "tok" and stored.fence == 42
    assert stored.owner["label"] == "view:shop.buy" and stored.owner["since"] == 1700000000.25
    assert {"host", "pid", "thread"} <= set(stored.owner)
    assert parse_value(b"garbage") is None
    assert parse_value(b"tok|notanumber|{}") is None


def test_pack_is_resp2() -> None:
    assert pack(b"SET", "k", 1) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n1\r\n"
    with pytest.raises(TypeError):
        pack(True)


def test_an_evalsha_with_its_head_packed_once_is_the_plain_packing() -> None:
    from django_redlock.transport.resp import RELEASE

    keys = (b"redlock:a", b"{redlock:a}:fence", b"{redlock:a}:waiters")
    for args in ((b"tok", 0, b"3600000", b"1"), (b"tok", 7, b"3600000", b"1", b"in|tok"),
                 ("tök", 12.5, b"x", b"1")):  # str, float: the slow path
        for _ in range(2):  # the second time from the kept head
            assert RELEASE.evalsha(keys, args) == pack(b"EVALSHA", RELEASE.sha, 3, *keys, *args)
    assert RELEASE.evalsha(keys[:1], (b"t",)) == pack(b"EVALSHA", RELEASE.sha, 1, keys[0], b"t")
    with pytest.raises(TypeError):
        RELEASE.evalsha(keys, (True,))


def test_script_sha_matches_source() -> None:
    import hashlib

    assert ACQUIRE.sha == hashlib.sha1(ACQUIRE.source).hexdigest().encode()
    assert b"KEYS[1]" in ACQUIRE.source


def test_fences_disagree_only_when_granting_nodes_are_far_apart() -> None:
    from django_redlock.engine.rounds import fences_disagree, tally_acquire

    names = ["a", "b", "c"]
    near = tally_acquire([[1, 1_000_000], [1, 1_000_003], [0, 500]], names)
    assert near.ok == 2 and near.fence == 1_000_003 and near.clock_min == 1_000_000
    assert not fences_disagree(near, ttl=10.0)
    # One node's clock 5 s ahead with a 1 s lease: write the maximum back first.
    far = tally_acquire([[1, 1_000_000], [1, 1_005_000], [1, 1_000_001]], names)
    assert fences_disagree(far, ttl=1.0)
    assert not fences_disagree(tally_acquire([[1, 7], [0, 5], [0, 5]], names), ttl=0.001)
    # Close fences, one of them 10 s ahead of its node's clock (its counter was
    # written back from a fast node): its clock is what counts, not its fence.
    ahead = tally_acquire([[1, 1_010_000], [1, 1_010_150, 0, 10_000]], names[:2])
    assert ahead.clock_min == 1_000_150 and fences_disagree(ahead, ttl=3.0)


def test_gate_node_is_stable_per_name_and_skips_a_failing_node() -> None:
    from django_redlock.engine.rounds import busy_at_gate, gate_node

    class Node:
        def __init__(self, down: bool = False) -> None:
            self.down = down

        def backing_off(self, now: float) -> bool:
            return self.down

    nodes = [Node() for _ in range(5)]
    first = gate_node(b"redlock:stock:1", nodes, 0.0)
    assert first is not None and first == gate_node(b"redlock:stock:1", nodes, 0.0)
    assert len({gate_node(b"redlock:n%d" % i, nodes, 0.0) for i in range(50)}) > 1  # spread
    nodes[first].down = True
    assert gate_node(b"redlock:stock:1", nodes, 0.0) is None  # ask everyone at once
    assert gate_node(b"redlock:x", [Node()], 0.0) is None  # one node: nothing to gate
    busy = busy_at_gate([0, 1500], 10.0)
    assert busy is not None and not busy.acquired and busy.holder_ttl == 1.5
    assert busy.queued_ms == 0  # not queued: no clock to time a handover from
    queued = busy_at_gate([0, 1500, 123_456], 10.0)
    assert queued is not None and (queued.asked_at, queued.queued_ms) == (10.0, 123_456)
    assert busy_at_gate([1, 7], 10.0) is None


class _Node:
    name = "n"

    def backing_off(self, now: float) -> bool:
        return False


class _BackingOff(_Node):
    def backing_off(self, now: float) -> bool:
        return True


class _Ctx3:
    """Three healthy nodes on a clock the test sets."""

    nodes = [_Node() for _ in range(3)]
    quorum = 2
    drift_factor = 0.01
    replica_acks = 0
    now = 0.0

    def clock(self) -> float:
        return self.now


class _Ctx3GateDown(_Ctx3):
    """Three nodes that all back off (so no gate): every node asked at once."""

    nodes = [_BackingOff() for _ in range(3)]


def test_a_woken_waiter_keeps_the_front_of_the_line_at_the_gate_only() -> None:
    """Its place at the front is where the release popped it: the gate. On the
    other nodes it joins at the back, so a release that reaches one of them
    late wakes whoever stands first there, not this waiter (served by then)."""
    from django_redlock.engine.rounds import Ask, acquire_steps, gate_node

    Ctx = _Ctx3

    def modes(ask: Ask) -> list[bytes | None]:
        return [None if call is None else call.args[5] for call in ask.requests]

    key = b"redlock:line"
    gate = gate_node(key, Ctx.nodes, 0.0)
    assert gate is not None
    for woken, at_gate, elsewhere in ((True, b"2", b"1"), (False, b"1", b"1")):
        steps = acquire_steps(Ctx(), key, b"f", b"w", "tok", 1000, "{}", True, 1.0,
                              lock_name="line", waiter=b"inbox|tok", woken=woken)
        first = next(steps)
        assert modes(first) == [at_gate if i == gate else None for i in range(3)]
        rest = steps.send([[1, 5] if i == gate else None for i in range(3)])  # gate granted
        assert modes(rest) == [None if i == gate else elsewhere for i in range(3)]
    # Asking every node at once (no gate: it backs off), a woken waiter keeps
    # the front everywhere.
    steps = acquire_steps(_Ctx3GateDown(), key, b"f", b"w", "tok", 1000, "{}", True, 1.0,
                          lock_name="line", waiter=b"inbox|tok", woken=True)
    assert modes(next(steps)) == [b"2", b"2", b"2"]
    # A retry past the gate (ask_all) still asks the gate first; its plain
    # "busy" does not end the round (a copy a release may never have reached),
    # its "someone goes first" does.
    from django_redlock.engine.rounds import BEHIND_IN_LINE, HANDED_FIRST

    steps = acquire_steps(Ctx(), key, b"f", b"w", "tok", 1000, "{}", True, 1.0,
                          lock_name="line", waiter=b"inbox|tok", ask_all=True)
    assert modes(next(steps)) == [b"1" if i == gate else None for i in range(3)]
    rest = steps.send([[0, 900, 1] if i == gate else None for i in range(3)])  # plain busy
    assert modes(rest) == [None if i == gate else b"1" for i in range(3)]
    for flag in (HANDED_FIRST, BEHIND_IN_LINE):
        steps = acquire_steps(Ctx(), key, b"f", b"w", "tok", 1000, "{}", True, 1.0,
                              lock_name="line", waiter=b"inbox|tok", ask_all=True)
        next(steps)
        try:
            steps.send([[0, 900, 1, flag] if i == gate else None for i in range(3)])
        except StopIteration as done:
            assert done.value.acquired is False and done.value.at_gate
            assert done.value.obstacle == ""  # not "something other than a lock"
        else:
            raise AssertionError(f"flag {flag} at the gate did not end the round")


def test_only_the_hand_over_node_gets_the_hand_over_form_of_an_entry() -> None:
    from django_redlock.engine.rounds import acquire_steps, hand_over_node, waiter_entries

    key = b"redlock:forms"
    h = hand_over_node(key, 3)
    assert waiter_entries(key, 3, b"plain", b"handover") == \
        [b"handover" if i == h else b"plain" for i in range(3)]
    assert waiter_entries(key, 1, b"plain", b"handover") == [b"handover"]
    # Every node asked at once (no gate: it backs off): each gets its own form.
    steps = acquire_steps(_Ctx3GateDown(), key, b"f", b"w", "tok", 1000, "{}", True, 1.0,
                          lock_name="forms", waiter=b"plain", hand_over=b"handover")
    ask = next(steps)
    assert [call.args[7] for call in ask.requests] == waiter_entries(key, 3, b"plain", b"handover")


def test_a_gate_handover_asks_only_the_other_nodes_and_keeps_the_earlier_lease() -> None:
    from django_redlock.engine.rounds import AcquireResult, acquire_steps, gate_node

    key = b"redlock:handed"
    ctx = _Ctx3()
    gate = gate_node(key, ctx.nodes, 0.0)
    assert gate is not None
    ctx.now = 50.0
    handed = AcquireResult(True, fence=77, valid_until=55.0)  # the gate's lease, as proved
    steps = acquire_steps(ctx, key, b"f", b"w", "tok", 10_000, "{}", True, 10.0,
                          lock_name="handed", waiter=b"plain", hand_over=b"handover",
                          woken=True, handed=handed)
    rest = next(steps)
    # The gate is not asked again; the others are asked at the back of their lines.
    assert [r is None for r in rest.requests] == [i == gate for i in range(3)]
    assert all(r.args[5] == b"1" and r.args[7] == b"plain" for r in rest.requests if r)
    ctx.now = 50.1
    try:
        steps.send([None if i == gate else [1, 70] for i in range(3)])
    except StopIteration as done:
        won = done.value
    assert won.acquired and won.fence == 77
    assert won.valid_until == 55.0  # the handover's lease began before this round's
    # A handover on one node is the whole result: no request at all.
    one = acquire_steps(type("One", (_Ctx3,), {"nodes": [_Node()], "quorum": 1})(), key, b"f",
                        b"w", "tok", 10_000, "{}", True, 10.0, lock_name="handed",
                        waiter=b"plain", hand_over=b"handover", woken=True, handed=handed)
    with pytest.raises(StopIteration) as done:
        next(one)
    assert done.value.value is handed


def test_a_release_goes_to_the_hand_over_node_last() -> None:
    """The gate's release hands the lock to a waiter that then asks the other
    nodes at once: their releases are sent first, so they are not behind it."""
    from django_redlock.engine.rounds import gate_node, release_steps

    key = b"redlock:order"
    ask = next(release_steps(_Ctx3(), key, b"f", b"w", "tok", 7))
    assert ask.last == gate_node(key, _Ctx3.nodes, 0.0) is not None
    assert all(r is not None for r in ask.requests)


def test_a_lost_round_after_a_gate_handover_hands_the_gates_lock_on() -> None:
    from django_redlock.engine.rounds import AcquireResult, acquire_steps, gate_node

    key = b"redlock:handed-lost"
    ctx = _Ctx3()
    gate = gate_node(key, ctx.nodes, 0.0)
    assert gate is not None
    handed = AcquireResult(True, fence=77, valid_until=5.0)
    steps = acquire_steps(ctx, key, b"f", b"w", "tok", 10_000, "{}", True, 10.0,
                          lock_name="handed-lost", waiter=b"plain", hand_over=b"handover",
                          woken=True, handed=handed)
    next(steps)
    cleanup = steps.send([None if i == gate else [0, 900, 1] for i in range(3)])  # both busy
    # Released where it is ours, the gate only; there, with the wake flag: the
    # waiters queued behind us get the lock (a plain clean-up wakes nobody).
    assert [r is not None for r in cleanup.requests] == [i == gate for i in range(3)]
    assert cleanup.requests[gate].args[3] == b"1"
    try:
        steps.send([1 if i == gate else None for i in range(3)])
    except StopIteration as done:
        lost = done.value
    assert not lost.acquired


def test_scripts_inline_their_shared_function() -> None:
    from django_redlock.transport.resp import EXTEND, RELEASE

    for script in (RELEASE, EXTEND):
        assert b"--#include" not in script.source
        assert script.source.count(b"local function write_back_fence") == 1
        assert b"write_back_fence(KEYS[2]" in script.source
    for script in (ACQUIRE, RELEASE):  # both issue fences: the acquire, and a handover
        assert script.source.count(b"local function issue_fence") == 1
        assert b"issue_fence(KEYS[2], ARGV[" in script.source


# -- a lock handed over by a release (one node) ------------------------------------------
def test_a_handover_is_timed_from_the_waiters_last_attempt() -> None:
    # The attempt left at t=100 and the node queued it at 5_000 ms; the node
    # handed over at 7_001 ms, i.e. at least 2 s (less 1 ms resolution, less 1 %
    # for the clocks' rates) after the attempt left: at t >= 101.98. Read at
    # t=102.5, 0.52 s of a 10 s lease are gone, as if a round took that long.
    valid = q.handover_validity(10.0, 2.5, 2_001, 0.01)
    assert valid == pytest.approx(q.validity(10.0, 2.5 - 2.0 * 0.99, 0.01))
    # The bound never credits more than the node's clock says passed.
    assert q.handover_validity(10.0, 2.5, 1, 0.01) == pytest.approx(q.validity(10.0, 2.5, 0.01))


def test_a_handover_is_used_only_when_it_is_provably_fresh_and_long_enough() -> None:
    from django_redlock.engine.rounds import handed_over

    def take(notice: bytes, *, now: float = 102.5, queued_ms: int = 5_000,
             ttl: float = 10.0, drift: float = 0.01) -> Any:
        return handed_over(notice, asked_at=100.0, queued_ms=queued_ms, now=now, ttl=ttl,
                           drift_factor=drift)

    won = take(b"42|7001")
    assert won is not None and won.acquired and won.fence == 42
    assert won.valid_until == pytest.approx(102.5 + q.handover_validity(10.0, 2.5, 2_001, 0.01))
    # Stale: the node's clock puts the handover before the refused attempt,
    # whose lease then ran out unseen.
    assert take(b"42|4999") is None and take(b"42|4000") is None
    # In the same millisecond: after the attempt (or the attempt had found
    # the key ours), timed from the attempt's start.
    same = take(b"42|5000")
    assert same is not None and same.valid_until == pytest.approx(100.0 + q.validity(10.0, 0.0, 0.01))
    # Unknown attempt time (no refused attempt timed by the node).
    assert take(b"42|7001", queued_ms=0) is None
    # Less than half the lease provable: an attempt renews it instead.
    assert take(b"42|7001", ttl=1.0, drift=0.4) is None
    assert take(b"42|7001", now=110.0) is None
    # Not a handover notice at all; nor what an older version's release
    # publishes when it pops an entry in the hand-over form (the entry's rest).
    assert take(b"garbage") is None and take(b"42|") is None
    assert take(b'10000|1|{"host":"web-3","since":1795301668.316}') is None


def test_a_hand_over_entry_carries_lease_fencing_first_time_and_owner() -> None:
    from django_redlock.engine.rounds import first_ms, hand_over_entry

    owner = owner_json("with|bar")
    assert hand_over_entry(1500, True, owner) == b"1500|1|0|" + owner.encode()
    assert hand_over_entry(1500, False, owner).startswith(b"1500|0|0|")
    assert hand_over_entry(1500, True, owner, 200) == b"1500|1|200|" + owner.encode()
    # Two node timeouts, at least one retry delay, at least 1 ms.
    assert first_ms(0.1, 0.2) == 200 and first_ms(0.5, 0.2) == 1000
    assert first_ms(0.0001, 0.0) == 1


# -- the waiting rules of an acquire, without I/O (LockBase._acquire_plan) ----------------
class _PlanClock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def plan_manager() -> Iterator[tuple[Any, _PlanClock]]:
    """A manager that never connects, on a clock the test moves."""
    from django_redlock import LockManager

    clock = _PlanClock()
    mgr = LockManager(["redis://127.0.0.1:1/0"], clock=clock, retry_delay=0.2,
                      node_timeout=0.5, rng=random.Random(1), auto_renew=False)
    yield mgr, clock
    mgr.close()


def test_the_acquire_plan_subscribes_before_its_final_attempt_then_waits(
        plan_manager: tuple[Any, _PlanClock]) -> None:
    from django_redlock.engine.protocol import Attempt, Subscribe, Wait
    from django_redlock.engine.rounds import AcquireResult

    mgr, clock = plan_manager
    lock = mgr.lock("plan", timeout=1.0)
    plan = lock._acquire_plan(deadline=101.0, in_line=False)
    # Each attempt is numbered (written into the lock value: rounds.attempt_owner).
    assert next(plan) == Attempt(woken=False, ask_all=False, number=1)  # not queued
    busy = AcquireResult(False, holder_ttl=5.0)
    # Refused: subscribe (confirm within the node timeout), then try again, queued.
    assert plan.send(busy) == Subscribe(0.5)
    assert plan.send(None) == Attempt(woken=False, ask_all=False, number=2)
    step = plan.send(busy)
    assert isinstance(step, Wait) and 0.1 <= step.seconds <= 0.2  # the jittered retry delay
    # Woken by a notice: the next attempt says so.
    assert plan.send(True) == Attempt(woken=True, ask_all=False, number=3)
    # Refused at the gate with no notice since: the next attempt asks every node.
    step = plan.send(AcquireResult(False, holder_ttl=5.0, at_gate=True))
    assert isinstance(step, Wait)
    assert plan.send(False) == Attempt(woken=False, ask_all=True, number=4)
    # The deadline passes: the plan gives up and says when to come back.
    clock.now = 101.5
    with pytest.raises(StopIteration) as done:
        plan.send(AcquireResult(False, holder_ttl=3.0))
    assert done.value.value is None
    assert lock.retry_after == 3.0


def test_the_acquire_plan_goes_straight_into_line_and_returns_the_win(
        plan_manager: tuple[Any, _PlanClock]) -> None:
    from django_redlock.engine.protocol import Attempt, Subscribe
    from django_redlock.engine.rounds import AcquireResult

    mgr, _ = plan_manager
    plan = mgr.lock("plan")._acquire_plan(deadline=None, in_line=True)
    assert next(plan) == Subscribe(0.5)  # handed over just now: no attempt outside the line
    assert plan.send(None) == Attempt(woken=False, ask_all=False, number=1)
    won = AcquireResult(True, fence=7, valid_until=110.0)
    with pytest.raises(StopIteration) as done:
        plan.send(won)
    assert done.value.value is won


def test_a_plan_that_may_not_wait_tries_once(plan_manager: tuple[Any, _PlanClock]) -> None:
    from django_redlock.engine.protocol import Attempt
    from django_redlock.engine.rounds import AcquireResult

    mgr, _ = plan_manager
    lock = mgr.lock("plan")
    plan = lock._acquire_plan(deadline=100.0, in_line=False)  # timeout=0
    assert next(plan) == Attempt(woken=False, ask_all=False, number=1)
    with pytest.raises(StopIteration) as done:
        plan.send(AcquireResult(False, holder_ttl=None))
    assert done.value.value is None
    assert lock.retry_after == 0.2  # no holder lease known: the retry delay


# -- the retry rule after a missed quorum (engine.protocol, I/O-free) ----------
class _Counted:
    def __init__(self, name: str, answers: int,
                 set_up: tuple[float, float, float] | None = None) -> None:
        self.name = name
        self.answers = answers
        if set_up is not None:  # when its newest set-up began, answered, failed
            self.set_up_began, self.set_up_answered, self.set_up_failed = set_up


def test_a_missed_round_is_asked_again_only_while_a_quorum_shows_life() -> None:
    from django_redlock.engine.protocol import _quorum_alive
    from django_redlock.exceptions import QuorumUnavailable

    def missed(*names: str) -> QuorumUnavailable:
        return QuorumUnavailable("missed", answered=3 - len(names), needed=2,
                                 errors={n: "no answer within 0.1 s" for n in names})

    before = [5, 5, 5]
    # b and c missed our round but answered others meanwhile: we were slow.
    nodes = [_Counted("a", 6), _Counted("b", 9), _Counted("c", 7)]
    assert _quorum_alive(missed("b", "c"), nodes, before, 2)
    # One of them answered nobody since (paused): a and b make the quorum.
    nodes = [_Counted("a", 6), _Counted("b", 9), _Counted("c", 5)]
    assert _quorum_alive(missed("b", "c"), nodes, before, 2)
    # Both silent for everyone (a paused majority): no quorum shows life.
    nodes = [_Counted("a", 6), _Counted("b", 5), _Counted("c", 5)]
    assert not _quorum_alive(missed("b", "c"), nodes, before, 2)
    # Five nodes, three missed, one of them alive elsewhere: 3 of 5 is a quorum.
    nodes = [_Counted(n, 1) for n in "vwxyz"]
    assert _quorum_alive(missed("x", "y", "z"), nodes, [1, 1, 0, 1, 1], 3)
    assert not _quorum_alive(missed("x", "y", "z"), nodes, [1, 1, 1, 1, 1], 3)
    # A node that answered with an error (a replica's READONLY) answered: its
    # reply count grew by that very reply, yet it is no reason to ask again.
    readonly = QuorumUnavailable("missed", answered=1, needed=2, errors={
        "b": "answered with an error (it is a read-only replica): READONLY ...",
        "c": "answered with an error (it is a read-only replica): READONLY ..."})
    nodes = [_Counted("a", 6), _Counted("b", 6), _Counted("c", 6)]
    assert not _quorum_alive(readonly, nodes, before, 2)


def test_a_set_up_that_answers_shows_life_only_for_a_round_missed_waiting_for_it() -> None:
    """A single caller, one node of three down: the other live node missed
    the round waiting for its new connection, whose set-up answered since it
    began. That node lives, its set-up slower than the round; a paused node's
    set-up never answers, one that failed after its last reply is not alive,
    and a node whose request came late, or that sat out a back-off, is not
    alive for its set-ups' replies (engine.protocol._quorum_alive)."""
    from django_redlock.engine.protocol import _quorum_alive
    from django_redlock.exceptions import QuorumUnavailable

    def missed(reason: str) -> QuorumUnavailable:
        return QuorumUnavailable("missed", answered=1, needed=2, errors={
            "a": "Error 111 connecting to 127.0.0.1:1. Connection refused.", "b": reason})

    before = [5, 5, 5]
    answering = [_Counted("a", 5), _Counted("b", 5, (10.0, 10.1, 9.0)), _Counted("c", 6)]
    paused = [_Counted("a", 5), _Counted("b", 5, (10.0, 9.5, 9.0)), _Counted("c", 6)]
    # answered, then stopped mid-way: its set-up failed since
    stopped = [_Counted("a", 5), _Counted("b", 5, (10.0, 10.1, 11.1)), _Counted("c", 6)]
    never = [_Counted("a", 5), _Counted("b", 5), _Counted("c", 6)]  # no set-up stamps
    waited = ["no connection yet (set-up under way, up to 1 s per step)",
              "no connection yet for an earlier request of this lock",
              "an earlier attempt's clean-up is still on its way"]
    for reason in waited:
        assert _quorum_alive(missed(reason), answering, before, 2), reason
        assert not _quorum_alive(missed(reason), paused, before, 2), reason
        assert not _quorum_alive(missed(reason), stopped, before, 2), reason
        assert not _quorum_alive(missed(reason), never, before, 2), reason
    for reason in ("no answer within 0.2 s", "skipped: failed recently"):
        assert not _quorum_alive(missed(reason), answering, before, 2), reason
