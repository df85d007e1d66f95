"""A late request of an earlier attempt never undoes a later attempt's grant.

Every attempt of one ``acquire()`` call uses the same holder token. When a
node answers too late, the round drops that connection, but the node still
runs what it had received, and it may read that socket after a newer one.
So on one node the requests of one token may run out of the order they were
sent in. The worst order, seen once in CI (a burst of 200 threads on a
loaded machine: ``LockLost`` at release, "2 of 3 nodes no longer had this
holder's key", with a 10 s lease held for a millisecond)::

    attempt 1   SET k T          node slow: no reply in time, connection dropped
    clean-up    DEL k if T       (attempt 1 lost) sent on another connection
    attempt 2   SET k T          a third connection: granted, the lock is held
    node        runs the clean-up last: the grant is gone, a second client
                can take the lock while the first still holds it

Each attempt now writes its number into the lock value (``"n"``, the owner's
last field), and the scripts compare it (``lua/attempt.lua``): a clean-up
deletes only what its attempt (or an earlier one) wrote; a late acquire of an
earlier attempt changes nothing; a lock a release handed to the waiter is
deleted only by the clean-up of the attempt that took it over.

The tests below run those orders on a real Redis: the late request is either
really late (a proxy delays its connection) or sent after the other one.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest
import redis

from django_redlock.engine import rounds
from django_redlock.testing import FaultProxy, RedisNodes

from .polling import wait_until

TOKEN = "attempt-order-token"
RW_TOKEN = "w." + TOKEN
OWNER = '{"host":"h","pid":1,"thread":"t","since":1.000}'


def _script_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


def _value(client: redis.Redis, key: bytes, token: str) -> str | None:
    """The lock value this token holds at the key (plain or read-write), or None."""
    if client.type(key) == b"hash":
        field = client.hget(key, token)
        return None if field is None else field.decode()
    value = client.get(key)
    if value is None or not value.decode().startswith(token + "|"):
        return None
    return value.decode()


def _acquire(lock: Any, token: str, attempt: int, owner: str = OWNER) -> Any:
    return rounds.acquire_call(lock._key_b, lock._fence_key_b, lock._waiters_key_b, token,
                               30_000, rounds.attempt_owner(owner, attempt), True)


def _cleanup(lock: Any, token: str, attempt: int, *, handed: bool = False) -> Any:
    return rounds.release_requests(1, lock._key_b, lock._fence_key_b, lock._waiters_key_b,
                                   token, 0, only=[True], attempt=attempt,
                                   handed=[handed])[0]


def _run(mgr: Any, request: Any, token: str) -> Any:
    return mgr.transport.round([request], tag=token)[0]


@pytest.mark.parametrize("token", [TOKEN, RW_TOKEN], ids=["lock", "write_lock"])
def test_a_clean_up_delayed_on_the_wire_never_deletes_the_next_attempts_grant(
        token: str, nodes3: RedisNodes, make_manager: Callable[..., Any]) -> None:
    """The timeline above, with the clean-up really late: it travels through a
    proxy that holds it 0.4 s, while the next attempt goes straight to the
    same server and is granted first."""
    server = nodes3.servers[0]
    direct = redis.Redis.from_url(server.url)
    with FaultProxy.for_server(server) as proxy:
        slow = make_manager([proxy.url], node_timeout=2.0)
        fast = make_manager([server.url])
        lock = fast.lock("attempt-order")
        # Attempt 1 was granted; its reply was lost (the round gave up).
        assert rounds.granted_by(_run(fast, _acquire(lock, token, 1), token))
        # Attempt 1 lost overall: its clean-up leaves, slowly.
        assert _run(slow, rounds.Command(b"PING"), "") == b"PONG"  # connected already
        proxy.set_latency(0.4)
        calls = _script_calls(direct)
        sent_at = time.monotonic()
        slow.transport.round([_cleanup(lock, token, 1)], settle=rounds.NO_WAIT, tag=token)
        # Attempt 2 reaches the node first and takes the key over.
        assert rounds.granted_by(_run(fast, _acquire(lock, token, 2), token))
        assert time.monotonic() - sent_at < 0.3, "attempt 2 was not ahead of the clean-up"
        assert _value(direct, lock._key_b, token) is not None
        # The clean-up runs now; the key must stay attempt 2's.
        proxy.set_latency(0.0)
        # The clean-up has run once the node counted both script calls (a PING
        # on the slow manager may take another connection and come back first).
        assert wait_until(lambda: _script_calls(direct) >= calls + 2, timeout=10)
        value = _value(direct, lock._key_b, token)
        assert value is not None, "the late clean-up of attempt 1 deleted attempt 2's grant"
        assert value.endswith(',"n":2}'), value


@pytest.mark.parametrize("token", [TOKEN, RW_TOKEN], ids=["lock", "write_lock"])
def test_late_requests_of_an_earlier_attempt_change_nothing(
        token: str, nodes3: RedisNodes, make_manager: Callable[..., Any]) -> None:
    """Attempt 2 holds the key; attempt 1's acquire runs late (it must not
    write its number back), then attempt 1's clean-up (it must not delete)."""
    mgr = make_manager(nodes3.urls[:1])
    direct = redis.Redis.from_url(nodes3.urls[0])
    lock = mgr.lock("attempt-order")
    assert rounds.granted_by(_run(mgr, _acquire(lock, token, 2), token))
    before = _value(direct, lock._key_b, token)
    assert before is not None and before.endswith(',"n":2}')
    assert rounds.granted_by(_run(mgr, _acquire(lock, token, 1), token))  # late, harmless
    assert _value(direct, lock._key_b, token) == before
    assert _run(mgr, _cleanup(lock, token, 1), token) == 0  # not its to delete
    assert _value(direct, lock._key_b, token) == before
    # Attempt 2's own clean-up (had it lost) does delete it.
    assert _run(mgr, _cleanup(lock, token, 2), token) == 1
    assert _value(direct, lock._key_b, token) is None


def _hand_over_to(mgr: Any, lock: Any, direct: redis.Redis, token: str) -> Any:
    """Another holder's release hands the lock to ``token``, queued in the
    hand-over form; returns the waiter's inbox subscription."""
    inbox = b"test-inbox:" + token.encode()
    pubsub = direct.pubsub()
    pubsub.subscribe(inbox)
    assert wait_until(lambda: pubsub.get_message(timeout=0.1) is not None, timeout=5)
    entry = b"%s|%s|%s" % (inbox, token.encode(), rounds.hand_over_entry(30_000, True, OWNER))
    direct.rpush(lock._waiters_key_b, entry)
    other = "other-holder-token"
    assert rounds.granted_by(_run(mgr, _acquire(lock, other, 1), other))
    release = rounds.release_requests(1, lock._key_b, lock._fence_key_b,
                                      lock._waiters_key_b, other, 0, only=None)[0]
    assert _run(mgr, release, other) == 3  # handed over
    return pubsub


def test_a_lock_handed_to_a_waiter_is_not_deleted_by_its_late_requests(
        nodes3: RedisNodes, make_manager: Callable[..., Any]) -> None:
    """A release hands the lock to the waiter, which holds it once it reads
    the notice. Late requests of the waiter's earlier attempts then run: an
    acquire (which must not make the lock that attempt's) and that attempt's
    clean-up (which must not delete it)."""
    mgr = make_manager(nodes3.urls[:1])
    direct = redis.Redis.from_url(nodes3.urls[0])
    lock = mgr.lock("attempt-order-handed")
    pubsub = _hand_over_to(mgr, lock, direct, TOKEN)
    try:
        handed = _value(direct, lock._key_b, TOKEN)
        assert handed is not None and ',"n":' not in handed
        assert _run(mgr, _cleanup(lock, TOKEN, 3), TOKEN) == 0
        assert _value(direct, lock._key_b, TOKEN) == handed
        # Attempt 4 (the waiter did not read the notice first) takes it over,
        # and says that it was a hand-over.
        reply = _run(mgr, _acquire(lock, TOKEN, 4), TOKEN)
        assert rounds.granted_by(reply) and reply[2:] == [1], reply
        taken = _value(direct, lock._key_b, TOKEN)
        assert taken is not None and taken.endswith(',"n":-4}'), taken
        # Late requests of attempt 3: neither takes it back nor deletes it.
        assert rounds.granted_by(_run(mgr, _acquire(lock, TOKEN, 3), TOKEN))
        assert _run(mgr, _cleanup(lock, TOKEN, 3), TOKEN) == 0
        assert _run(mgr, _cleanup(lock, TOKEN, 3, handed=True), TOKEN) == 0
        assert _run(mgr, _cleanup(lock, TOKEN, 4), TOKEN) == 0  # a plain one: not a hand-over's
        assert _value(direct, lock._key_b, TOKEN) == taken
        # Attempt 4's own clean-up of the hand-over (had it lost) deletes it.
        assert _run(mgr, _cleanup(lock, TOKEN, 4, handed=True), TOKEN) == 1
        assert _value(direct, lock._key_b, TOKEN) is None
    finally:
        pubsub.close()


def test_the_holders_release_and_extend_ignore_attempt_numbers(
        nodes3: RedisNodes, make_manager: Callable[..., Any]) -> None:
    """Through the public API: a lock held after several attempts renews and
    releases as before, and a waiter served by a hand-over releases it."""
    mgr = make_manager(nodes3.urls)
    direct = [redis.Redis.from_url(url) for url in nodes3.urls]
    holder = mgr.lock("attempt-order-api", ttl=5)
    assert holder.acquire(timeout=0)
    waiter = mgr.lock("attempt-order-api", ttl=5)
    assert not waiter.acquire(timeout=0.3)  # a few attempts, refused
    holder.release()
    assert waiter.acquire(timeout=5)
    values = [c.get(waiter._key_b) for c in direct]
    assert sum(v is not None and v.decode().startswith(waiter._token + "|") for v in values) >= 2
    waiter.extend(5)
    assert waiter.owned() and waiter.validity > 4
    waiter.release()
    assert all(c.get(waiter._key_b) is None for c in direct)
