"""A hold's end reported once, whatever the schedule: a release and the
renewal's loss report (``_mark_lost_plan``) that run into each other.

A release a garbage collection runs does not wait for the lock's ``_io``
(transport/finalizers.py: the renewal's receivers may wait for the
collecting thread); in the renewal's own thread, a collection runs it
between any two lines of the loss report, ``_io`` (reentrant) or not. The
schedules that broke it::

    renewal: the lease ran out; the state is "held": go on
    release:   the state is "held" and no loss reported: report lock_lost,
               state "unlocked", keys deleted
    renewal: state "lost", lock_lost again

``lock_lost`` was sent twice for one hold, and the released object was
left "lost". Each test below runs one side whole at each line of the other,
on real servers.
"""

from __future__ import annotations

import dis
import sys
import time
from typing import Any, Callable, Iterator

import pytest

from django_redlock import signals
from django_redlock.engine import protocol
from django_redlock.exceptions import LockLost, LockNotOwned
from django_redlock.testing import RedisNodes

MakeManager = Callable[..., Any]

_TTL = 0.2  # auto_renew off: the lease is out after this, and nothing reports it


def _body_lines(function: Any) -> list[int]:
    """The lines where a statement of ``function`` starts (each may be
    where the other side runs); some are in branches these schedules never
    take, and there the two sides simply run one after the other."""
    code = function.__code__
    return sorted({line for _, line in dis.findlinestarts(code)
                   if line is not None and line > code.co_firstlineno})


def _run_at_line(function: Any, lineno: int, action: Callable[[], None],
                 call: Callable[[], Any]) -> bool:
    """Run ``call()`` with ``action()`` placed where line ``lineno`` of
    ``function`` is about to run (once); True when that line was reached."""
    code = function.__code__
    fired: list[bool] = []

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not code or fired:
            return None

        def line(frame: Any, event: str, arg: Any) -> Any:
            if event == "line" and frame.f_lineno == lineno and not fired:
                fired.append(True)
                sys.settrace(None)
                action()
            return line
        return line

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return bool(fired)


@pytest.fixture
def lost_reports() -> Iterator[list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        seen.append(kwargs)

    signals.lock_lost.connect(receiver, weak=False, dispatch_uid="loss-report-race")
    try:
        yield seen
    finally:
        signals.lock_lost.disconnect(dispatch_uid="loss-report-race")


def _expired_hold(nodes: RedisNodes, make_manager: MakeManager, name: str) -> Any:
    lock = make_manager(nodes).lock(name, ttl=_TTL, auto_renew=False)
    assert lock.acquire()
    time.sleep(_TTL + 0.05)  # the lease is out by the lock's clock; the keys go with it
    return lock


def _outcome(lock: Any, raised: list[str], reports: list[dict[str, Any]]) -> dict[str, Any]:
    state = lock._state
    again = lock.acquire(timeout=2)  # the object is free for a new hold
    if again:
        lock.release()
    return {"lost reports": len(reports), "state": state, "raised": sorted(raised),
            "acquired again": again}


def _calls(lock: Any, raised: list[str]) -> tuple[Callable[[], None], Callable[[], None]]:
    def release() -> None:
        try:
            lock.release()
        except (LockLost, LockNotOwned) as exc:
            raised.append(f"release: {type(exc).__name__}")

    def extend() -> None:  # the lease is out: the loss report (_mark_lost_plan)
        try:
            lock.extend()
        except (LockLost, LockNotOwned) as exc:
            raised.append(f"extend: {type(exc).__name__}")

    return release, extend


@pytest.mark.parametrize("at", range(len(_body_lines(protocol.LockBase._mark_lost_plan))))
def test_a_release_between_any_two_lines_of_the_loss_report_reports_once(
        nodes3: RedisNodes, make_manager: MakeManager, lost_reports: list[dict[str, Any]],
        at: int) -> None:
    """A release run whole where line ``at`` of the loss report is about to
    run (what a collection there runs): one ``lock_lost``, the object
    unlocked and free for a new hold."""
    lock = _expired_hold(nodes3, make_manager, f"race-mark-{at}")
    raised: list[str] = []
    release, extend = _calls(lock, raised)
    lineno = _body_lines(protocol.LockBase._mark_lost_plan)[at]
    reached = _run_at_line(protocol.LockBase._mark_lost_plan, lineno, release, extend)
    if not reached:  # past a return: the schedule does not exist
        release()
    outcome = _outcome(lock, raised, lost_reports)
    assert outcome["lost reports"] == 1, (lineno, lost_reports)
    assert outcome["state"] == "unlocked", lineno
    assert outcome["acquired again"] is True
    assert outcome["raised"] == ["extend: LockLost", "release: LockLost"], (lineno, outcome)


@pytest.mark.parametrize("at", range(len(_body_lines(protocol.LockBase._release_plan))))
def test_the_loss_report_between_any_two_lines_of_a_release_reports_once(
        nodes3: RedisNodes, make_manager: MakeManager, lost_reports: list[dict[str, Any]],
        at: int) -> None:
    """The loss report run whole (an ``extend()`` of the expired hold, as
    the renewal thread runs it) where line ``at`` of a release is about to
    run: one ``lock_lost``, the object unlocked and free for a new hold,
    and the release raises ``LockLost``."""
    lock = _expired_hold(nodes3, make_manager, f"race-release-{at}")
    raised: list[str] = []
    release, extend = _calls(lock, raised)
    lineno = _body_lines(protocol.LockBase._release_plan)[at]
    _run_at_line(protocol.LockBase._release_plan, lineno, extend, release)
    outcome = _outcome(lock, raised, lost_reports)
    assert outcome["lost reports"] == 1, (lineno, lost_reports)
    assert outcome["state"] == "unlocked", lineno
    assert outcome["acquired again"] is True
    assert "release: LockLost" in outcome["raised"], (lineno, outcome)
