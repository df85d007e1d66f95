"""The key layout: no lock name can reach another name's fencing counter or waiter
queue, and each internal key stays in its lock key's Cluster hash slot.

The layout used to append ``:fence`` / ``:waiters`` to the lock key of a name with
a hash tag, so lock ``{x}:fence`` *was* the counter of lock ``{x}``. The property
tests below generate names rich in braces, colons and role words; the two tests
on real servers replay the two failures the old layout produced.
"""

from __future__ import annotations

import string
import time
from typing import Any, Callable

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from django_redlock.core.keys import (
    InvalidLockName,
    fence_key,
    hash_tag,
    legacy_internal_role,
    lock_key,
    name_from_key,
    parse_internal_key,
    validate_name,
    waiters_key,
)
from django_redlock.testing import RedisNodes

MakeManager = Callable[..., Any]

# ------------------------------------------------------------ Cluster slots

def _crc16(data: bytes) -> int:
    """CRC16-CCITT (XModem), the checksum Redis Cluster uses for key slots."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def slot(key: str) -> int:
    """The Cluster slot of ``key`` (Redis' ``keyHashSlot``)."""
    raw = key.encode()
    start = raw.find(b"{")
    if start >= 0:
        end = raw.find(b"}", start + 1)
        if end > start + 1:
            raw = raw[start + 1:end]
    return _crc16(raw) % 16384


def test_slot_function_matches_redis() -> None:
    # Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
    assert _crc16(b"123456789") == 0x31C3
    assert slot("foo") == 12182
    assert slot("{user1000}.following") == slot("{user1000}.followers")
    assert slot("foo{}{bar}") == _crc16(b"foo{}{bar}") % 16384  # empty tag: whole key
    assert slot("foo{{bar}}zap") == slot("{bar")


# --------------------------------------------------------------- strategies

#: Pieces that build the names most likely to collide: braces, colons, the
#: role words and the old suffixes.
PIECES = ["{", "}", ":", "fence", "waiters", ":fence", ":waiters", "{x}", "{}", "x", "y",
          "redlock", "é", " ", "*"]
names = st.one_of(
    st.lists(st.sampled_from(PIECES), min_size=1, max_size=8).map("".join),
    st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs")), min_size=1,
            max_size=30),
).filter(lambda n: _valid(n))
prefixes = st.one_of(st.just("redlock"),
                     st.text(alphabet=string.ascii_letters + string.digits + "_.:-",
                             min_size=1, max_size=8))
ROLES = ("lock", "fence", "waiters")


def _valid(name: str) -> bool:
    try:
        validate_name(name)
    except InvalidLockName:
        return False
    return True


def key_of(prefix: str, name: str, role: str) -> str:
    k = lock_key(prefix, name)
    return {"lock": k, "fence": fence_key(k), "waiters": waiters_key(k)}[role]


# ------------------------------------------------------------------ properties

@settings(max_examples=1500, deadline=None)
@given(prefix=prefixes, a=names, b=names, role_a=st.sampled_from(ROLES),
       role_b=st.sampled_from(ROLES))
@example(prefix="redlock", a="{x}", b="{x}:fence", role_a="fence", role_b="lock")
@example(prefix="redlock", a="{y}", b="{y}:waiters", role_a="waiters", role_b="lock")
@example(prefix="redlock", a="a}b", b="a", role_a="fence", role_b="fence")
@example(prefix="redlock", a="}:fence:redlock:{q}", b="{q}", role_a="lock", role_b="fence")
def test_no_two_name_role_pairs_share_a_key(prefix: str, a: str, b: str, role_a: str,
                                             role_b: str) -> None:
    if (a, role_a) != (b, role_b):
        assert key_of(prefix, a, role_a) != key_of(prefix, b, role_b)


@settings(max_examples=1500, deadline=None)
@given(prefix=prefixes, name=names)
@example(prefix="redlock", name="{x}")
@example(prefix="redlock", name="a}b")
@example(prefix="redlock", name="{}x}")
@example(prefix="redlock", name="x{")
def test_internal_keys_read_back_and_stay_in_the_lock_slot(prefix: str, name: str) -> None:
    k = lock_key(prefix, name)
    assert name_from_key(prefix, k) == name
    for role, internal in (("fence", fence_key(k)), ("waiters", waiters_key(k))):
        # No internal key is a lock key of any name, under any prefix: lock keys
        # start with the prefix, which has no brace; internal keys start with one.
        assert internal.startswith("{")
        assert name_from_key(prefix, internal) is None
        assert parse_internal_key(internal) == (k, role)
        if hash_tag(k) is not None or "}" not in k:
            assert slot(internal) == slot(k), (k, internal)
    assert parse_internal_key(k) is None


def test_the_layout_by_example() -> None:
    # Ordinary names keep the keys they always had (no upgrade for them).
    assert fence_key("redlock:stock:1") == "{redlock:stock:1}:fence"
    assert waiters_key("redlock:stock:1") == "{redlock:stock:1}:waiters"
    # A name with its own hash tag: same tag, and the whole lock key after the role.
    assert fence_key("redlock:{x}") == "{x}:fence:redlock:{x}"
    assert waiters_key("redlock:{u1}:cart") == "{u1}:waiters:redlock:{u1}:cart"
    assert fence_key("redlock:{x}") != lock_key("redlock", "{x}:fence")
    # A '}' without a tag: no key can share its slot; still unambiguous.
    assert fence_key("redlock:a}b") == "{}:fence:redlock:a}b"
    assert legacy_internal_role("{x}:fence") == ("{x}", "fence")
    assert legacy_internal_role("{x}:waiters") == ("{x}", "waiters")
    assert legacy_internal_role("x:fence") is None
    assert legacy_internal_role("{}:fence") is None


# -------------------------------------------------- the failures, on servers

def test_a_name_ending_in_fence_is_not_another_lock_s_counter(nodes3: RedisNodes,
                                                               make_manager: MakeManager) -> None:
    """Old layout: acquiring ``{x}`` overwrote the value of lock ``{x}:fence`` with
    a fence number, so its holder lost it (and the key stayed busy for an hour)."""
    mgr = make_manager(nodes3, auto_renew=False)
    suffix_lock = mgr.lock("{x}:fence", ttl=10)
    assert suffix_lock.acquire(timeout=0)
    fence = suffix_lock.fence
    base = mgr.lock("{x}", ttl=10)
    assert base.acquire(timeout=0)
    base.release()
    for node in nodes3:
        value = node.client().get(mgr.key("{x}:fence"))
        assert value is not None and value.split(b"|")[0] == suffix_lock._token.encode()
    suffix_lock.extend()   # raises LockLost when the value was overwritten
    assert suffix_lock.owned()
    suffix_lock.release()
    again = mgr.lock("{x}:fence", ttl=10)
    assert again.acquire(timeout=0)
    assert again.fence > fence
    again.release()


def test_holding_a_name_ending_in_waiters_does_not_break_blocking_acquires(
        nodes3: RedisNodes, make_manager: MakeManager) -> None:
    """Old layout: lock ``{y}:waiters`` was the waiter queue of ``{y}`` (a string
    where a list belongs), and every blocking acquire of ``{y}`` got WRONGTYPE on
    every node: QuorumUnavailable with all nodes up."""
    mgr = make_manager(nodes3, auto_renew=False)
    other = make_manager(nodes3, auto_renew=False)
    squatter = mgr.lock("{y}:waiters", ttl=10)
    assert squatter.acquire(timeout=0)
    holder = mgr.lock("{y}", ttl=10)
    assert holder.acquire(timeout=0)
    waiter = other.lock("{y}", ttl=10)
    started = time.monotonic()
    assert waiter.acquire(timeout=0.3) is False   # waits, times out: no error
    assert time.monotonic() - started < 5.0
    holder.release()
    assert waiter.acquire(timeout=2.0)
    waiter.release()
    assert squatter.owned()
    squatter.release()


@pytest.mark.parametrize("name", ["a}b", "{}x}", "x{"])
def test_names_with_stray_braces_lock_and_fence(nodes3: RedisNodes, make_manager: MakeManager,
                                                name: str) -> None:
    mgr = make_manager(nodes3, auto_renew=False)
    first = mgr.lock(name, ttl=10)
    assert first.acquire(timeout=0)
    first.release()
    second = mgr.lock(name, ttl=10)
    assert second.acquire(timeout=0)
    assert second.fence > first.fence
    assert nodes3[0].client().get(fence_key(mgr.key(name))) is not None
    second.release()


def test_free_channels_of_a_forced_release() -> None:
    """A forced release publishes where a segment's or a permit's family listens."""
    from django_redlock.core.keys import free_channels, lock_key

    assert free_channels("p", "stock:4[2]") == [lock_key("p", "stock:4[free]").encode()]
    assert free_channels("p", "exports#1") == [lock_key("p", "exports#free").encode()]
    for plain in ("stock:4", "x[a]", "[1]", "#1", "y#line", "z#"):
        assert free_channels("p", plain) == [], plain
