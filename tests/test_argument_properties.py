"""One set of rules for every time argument, over generated values (issue 26).

Every public call that takes a time (``lock``/``alock(ttl=, timeout=,
max_hold=)``, ``Lock.acquire(timeout=)``, ``Lock.extend(ttl)``, their asyncio
twins, ``with_lock(...)`` and ``LockManager(...)``) is given values drawn from
numbers of every kind (ints, floats, ``nan``, ``inf``, signed zeros, tiny and
huge), booleans, strings, ``None``, ``Decimal``, ``Fraction`` and ``complex``.
The property, on real nodes:

* a refused value raises ``ValueError`` naming the argument, before anything
  is sent (the lock's key never appears on a node); never another exception
  type;
* an accepted value does what the docs say: the accepted set is exactly the
  documented range (``core.arguments``); an acquire with an accepted timeout on
  a busy lock returns ``False`` within that timeout plus one round, never later.

The lock family (reentrant locks, read and write locks, multi-locks, segments,
semaphores, sync and asyncio, and their decorators) is held to the same rules.
"""

from __future__ import annotations

import asyncio
import math
import time
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_redlock import LockManager, with_lock
from django_redlock.core.arguments import TIMEOUT_MAX, TTL_MAX, TTL_MIN
from django_redlock.exceptions import LockLost
from django_redlock.testing import RedisNodes

pytestmark = pytest.mark.slow

NODE_TIMEOUT = 0.2
RUNS = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-1.0, max_value=2.0),
    st.floats(min_value=0.0, max_value=0.05),
    st.integers(min_value=-10, max_value=10 ** 13),
    st.sampled_from([0, 0.0, -0.0, TTL_MIN, TTL_MAX, TIMEOUT_MAX, 0.001, 1e12, 1e-300,
                     float("inf"), float("-inf"), float("nan")]),
)
others = st.one_of(
    st.booleans(), st.none(), st.text(max_size=5),
    st.sampled_from(["1", "0.3", " 2 ", "nan"]),
    st.decimals(allow_nan=True, allow_infinity=True).map(Decimal),
    st.fractions(max_denominator=10).map(Fraction),
    st.complex_numbers(max_magnitude=10),
)
values = st.one_of(numbers, others)


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def ttl_ok(value: Any) -> bool:
    return _real(value) and TTL_MIN <= value <= TTL_MAX


def timeout_ok(value: Any) -> bool:
    return value is None or (_real(value) and 0 <= value <= TIMEOUT_MAX)


def max_hold_ok(value: Any) -> bool:
    return value is None or (_real(value) and 0 < value <= TIMEOUT_MAX)


RULES = {"ttl": ttl_ok, "timeout": timeout_ok, "max_hold": max_hold_ok}


def _expect(rule: str, value: Any, call: Any) -> Any:
    """Run ``call``; a refused value must raise ValueError naming ``rule``."""
    if RULES[rule](value):
        return call()
    with pytest.raises(ValueError) as info:
        call()
    assert rule in str(info.value).lower(), str(info.value)
    return None


#: An accepted lease this short may run out before the next call, on a loaded
#: machine: the lock is then lost (``LockLost``, ``owned()`` False), which is
#: the right outcome (docs/reliability.rst), not a wrong argument check.
SHORT_LEASE = 0.5


def _short(value: Any) -> bool:
    return ttl_ok(value) and float(value) < SHORT_LEASE


def _extend_checked(lock: Any, value: Any) -> None:
    """``lock.extend(value)`` judged by the ttl rule; a short accepted lease may
    end the hold (LockLost) instead."""
    try:
        _expect("ttl", value, lambda: lock.extend(value))
    except LockLost:
        assert _short(value), value


def _release_checked(lock: Any, value: Any) -> None:
    if lock.owned():
        try:
            lock.release()
        except LockLost:
            assert _short(value), value


async def _arelease_checked(lock: Any, value: Any) -> None:
    if lock.owned():
        try:
            await lock.release()
        except LockLost:
            assert _short(value), value


@pytest.fixture(scope="module")
def mgr(nodes3_module: RedisNodes) -> Any:
    manager = LockManager(nodes3_module.urls, node_timeout=NODE_TIMEOUT, auto_renew=False)
    yield manager
    manager.close()


@pytest.mark.parametrize("rule", ["ttl", "timeout", "max_hold"])
@RUNS
@given(value=values)
def test_lock_and_alock_options(mgr: Any, rule: str, value: Any) -> None:
    lock = _expect(rule, value, lambda: mgr.lock("prop", **{rule: value}))
    alock = _expect(rule, value, lambda: mgr.alock("prop", **{rule: value}))
    if lock is not None:
        expected = value if value is None else float(value)
        assert getattr(lock, rule) == expected and getattr(alock, rule) == expected


@pytest.mark.parametrize("rule", ["ttl", "timeout", "max_hold"])
@RUNS
@given(value=values)
def test_with_lock_checks_when_decorating(rule: str, value: Any) -> None:
    """Checked at decoration (module import), not at the first call."""
    _expect(rule, value, lambda: with_lock("prop:<x>", **{rule: value})(lambda x: x))


#: The manager's other time options, with the ranges docs/settings.rst gives
#: them (they have no per-call twin): seconds, bounds included.
MANAGER_ONLY = {"retry_delay": (0.001, 60.0), "node_timeout": (0.001, 30.0),
                "connect_timeout": (0.001, 60.0)}
manager_values = st.one_of(values, st.sampled_from(
    [0.001, 0.0009999, 0.00100001, 30, 30.000001, 60, 60.0, 60.000001, 59.99]))


def _accepted_per_call(mgr: Any, rule: str, value: Any) -> bool:
    """Whether ``lock()`` (the per-call check) takes ``value`` for ``rule``."""
    try:
        mgr.lock("prop", **{rule: value})
    except ValueError:
        return False
    return True


def _manager_takes(urls: list[str], option: str, value: Any) -> bool:
    """Whether ``LockManager(**{option: value})`` and ``REDLOCK[OPTION]`` take
    ``value``; a refusal must be ``InvalidOption`` with the setting's
    ``redlock.E009``/``E010`` code and name, and ``check_options`` (what
    ``manage.py check`` reports) must agree with the manager."""
    from django_redlock.core.config import check_options
    from django_redlock.engine.manager import InvalidOption

    errors = [p for p in check_options({option.upper(): value}) if p.is_error]
    try:
        manager = LockManager(urls, **{option: value})
    except InvalidOption as e:
        assert errors, (option, value, str(e))
        assert option.upper() in str(e), str(e)
        assert all(p.id in ("E009", "E010") for p in errors), errors
        assert any(f"redlock.{p.id}" in str(e) for p in errors), str(e)
        return False
    manager.close()
    assert not errors, (option, value, errors)
    taken = manager.options[option.upper()]
    assert taken == value, (option, value, taken)
    return True


@pytest.mark.parametrize("rule", ["ttl", "timeout", "max_hold"])
@RUNS
@given(value=manager_values)
def test_lock_manager_options(mgr: Any, nodes3_module: RedisNodes, rule: str,
                              value: Any) -> None:
    """``LockManager(...)`` and ``REDLOCK`` take exactly what ``lock()`` takes
    (one set of rules): ``LockManager(timeout=1e10)`` was accepted while
    ``lock(timeout=1e10)`` was refused."""
    per_call = _accepted_per_call(mgr, rule, value)
    assert per_call == RULES[rule](value), (rule, value)
    assert _manager_takes(nodes3_module.urls, rule, value) == per_call, (rule, value)


@pytest.mark.parametrize("option", sorted(MANAGER_ONLY))
@RUNS
@given(value=manager_values)
def test_lock_manager_time_options_without_a_per_call_twin(
        nodes3_module: RedisNodes, option: str, value: Any) -> None:
    low, high = MANAGER_ONLY[option]
    documented = _real(value) and low <= value <= high
    assert _manager_takes(nodes3_module.urls, option, value) == documented, (option, value)


@RUNS
@given(value=values)
def test_acquire_timeout_on_a_busy_lock(mgr: Any, nodes3_module: RedisNodes,
                                        value: Any) -> None:
    nodes3_module.flushall()
    holder = mgr.lock("busy-prop", ttl=30)
    assert holder.acquire(timeout=0)
    try:
        waiter = mgr.lock("busy-prop")
        if timeout_ok(value) and (value is None or value > 0.3):
            # Accepted, but a long wait: checked on a free lock instead.
            free = mgr.lock("free-prop")
            assert free.acquire(timeout=value) is True
            free.release()
            return
        started = time.monotonic()
        got = _expect("timeout", value, lambda: waiter.acquire(timeout=value))
        took = time.monotonic() - started
        if timeout_ok(value):
            assert got is False
            assert took < float(value) + 2 * NODE_TIMEOUT + 0.5, (value, took)
        else:
            assert took < 0.1  # refused before anything was sent
            assert not any(server.client().exists(mgr.key("free-prop"))
                           for server in nodes3_module)
    finally:
        holder.release()


@RUNS
@given(value=values)
def test_extend(mgr: Any, value: Any) -> None:
    lock = mgr.lock("extend-prop", ttl=5)
    assert lock.acquire(timeout=1)
    try:
        _extend_checked(lock, value)
        assert lock.owned() or _short(value)
        if ttl_ok(value):
            assert lock.validity <= float(value) + 0.01
    finally:
        _release_checked(lock, value)


@RUNS
@given(value=values)
def test_async_acquire_and_extend(mgr: Any, value: Any) -> None:
    async def scenario() -> None:
        lock = mgr.alock("aprop", ttl=5)
        if timeout_ok(value):  # the lock is free: any accepted wait ends at once
            assert await lock.acquire(timeout=value) is True
        else:
            with pytest.raises(ValueError, match="timeout"):
                await lock.acquire(timeout=value)
            assert await lock.acquire(timeout=1) is True
        try:
            if ttl_ok(value):
                try:
                    await lock.extend(value)
                except LockLost:
                    assert _short(value), value
                assert lock.owned() or _short(value)
            else:
                with pytest.raises(ValueError, match="ttl"):
                    await lock.extend(value)
                assert lock.owned()
        finally:
            await _arelease_checked(lock, value)

    asyncio.run(scenario())


# -- the lock family: the same rules, checked by the same code ---------------------------
FAMILY_RUNS = settings(max_examples=25, deadline=None, database=None,
                       suppress_health_check=[HealthCheck.function_scoped_fixture,
                                              HealthCheck.too_slow])

#: Each family call, made with options: (sync, asyncio) twins.
FAMILY: dict[str, Any] = {
    "reentrant": (lambda m, **o: m.lock("fam-re", reentrant=True, **o),
                  lambda m, **o: m.alock("fam-re", reentrant=True, **o)),
    "read_lock": (lambda m, **o: m.read_lock("fam-rw", **o),
                  lambda m, **o: m.aread_lock("fam-rw", **o)),
    "write_lock": (lambda m, **o: m.write_lock("fam-rw", **o),
                   lambda m, **o: m.awrite_lock("fam-rw", **o)),
    "multi_lock": (lambda m, **o: m.multi_lock(["fam-m1", "fam-m2"], **o),
                   lambda m, **o: m.amulti_lock(["fam-m1", "fam-m2"], **o)),
    "segments": (lambda m, **o: m.segments("fam-seg", 2, **o),
                 lambda m, **o: m.asegments("fam-seg", 2, **o)),
    "semaphore": (lambda m, **o: m.semaphore("fam-sem", 2, **o),
                  lambda m, **o: m.asemaphore("fam-sem", 2, **o)),
}


@pytest.mark.parametrize("kind", sorted(FAMILY))
@pytest.mark.parametrize("rule", ["ttl", "timeout", "max_hold"])
@FAMILY_RUNS
@given(value=values)
def test_family_options(mgr: Any, kind: str, rule: str, value: Any) -> None:
    for make in FAMILY[kind]:
        _expect(rule, value, lambda make=make: make(mgr, **{rule: value}))


@pytest.mark.parametrize("kind", sorted(FAMILY))
@FAMILY_RUNS
@given(value=values)
def test_family_acquire_and_extend(mgr: Any, kind: str, value: Any) -> None:
    """On a free name (any accepted wait ends at once), sync and asyncio: a
    refused ``timeout`` or ``ttl`` is a ValueError naming it, and the
    object is left as it was (not held, or still held)."""
    make, amake = FAMILY[kind]
    lock = make(mgr, ttl=5)
    if timeout_ok(value):
        assert lock.acquire(timeout=value) is True
    else:
        with pytest.raises(ValueError, match="timeout"):
            lock.acquire(timeout=value)
        assert lock.acquire(timeout=1) is True
    try:
        _extend_checked(lock, value)
    finally:
        _release_checked(lock, value)

    async def scenario() -> None:
        alock = amake(mgr, ttl=5)
        if timeout_ok(value):
            assert await alock.acquire(timeout=value) is True
        else:
            with pytest.raises(ValueError, match="timeout"):
                await alock.acquire(timeout=value)
            assert await alock.acquire(timeout=1) is True
        try:
            if ttl_ok(value):
                try:
                    await alock.extend(value)
                except LockLost:
                    assert _short(value), value
            else:
                with pytest.raises(ValueError, match="ttl"):
                    await alock.extend(value)
        finally:
            await _arelease_checked(alock, value)

    asyncio.run(scenario())


@pytest.mark.parametrize("decorator", ["read", "write", "reentrant", "semaphore", "segments",
                                       "multi"])
@pytest.mark.parametrize("rule", ["ttl", "timeout", "max_hold"])
@FAMILY_RUNS
@given(value=values)
def test_family_decorators_check_when_decorating(decorator: str, rule: str,
                                                 value: Any) -> None:
    from django_redlock import with_multi_lock, with_segments, with_semaphore

    def decorate() -> Any:
        if decorator == "semaphore":
            return with_semaphore("prop:<x>", 2, **{rule: value})(lambda x: x)
        if decorator == "segments":
            return with_segments("prop:<x>", 2, **{rule: value})(lambda x: x)
        if decorator == "multi":
            return with_multi_lock(["prop:<x>", "prop2:<x>"], **{rule: value})(lambda x: x)
        if decorator == "reentrant":
            return with_lock("prop:<x>", reentrant=True, **{rule: value})(lambda x: x)
        return with_lock("prop:<x>", mode=decorator, **{rule: value})(lambda x: x)

    _expect(rule, value, decorate)
