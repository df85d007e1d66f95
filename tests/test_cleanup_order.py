"""A clean-up handed to a connection set-up never deletes the next attempt's grant.

The clean-up after a lost attempt (``DEL key if it holds token T``) must reach
a node that may have granted the attempt, also when that node has no free
connection: then the node's connection set-up sends it first
(``NodeClient.deliver_later``). The next attempt of the same token could reach
that node sooner, on a connection another round gives back, and the late
clean-up would delete its grant: the holder believes it holds the lock, and a
second client takes it. The timeline, driven exactly on a real Redis (the
set-up is held at its start by an event; everything else is real I/O):

    clean-up   DEL k if T   no connection free -> handed to the set-up (held)
    attempt 2  SET k T      on the connection given back meanwhile
    set-up     DEL k if T   runs now

Seen once in a cold burst under load (issue 25's guard, ``LockLost`` 5 ms
after a grant). Now a round for T gets no connection to a node where a
clean-up of T is on its way: the node sits that round out.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import redis

from django_redlock.engine import rounds
from django_redlock.testing import RedisNodes
from django_redlock.transport.resp import Command
from django_redlock.transport.sync import NodeError

from .polling import wait_until

TOKEN = "attempt-token"


def _holder(client: redis.Redis, key: bytes) -> str | None:
    """The token the key holds on that node (its value is ``token|fence|owner``)."""
    value = client.get(key)
    return None if value is None else value.decode().split("|")[0]


def _hold_setups(node: Any, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold every connection set-up of ``node`` at its start until the event is set."""
    go = threading.Event()
    connect = node.connect

    def held(conn: Any) -> None:
        assert go.wait(timeout=10), "set-up held too long"
        connect(conn)

    monkeypatch.setattr(node, "connect", held)
    return go


def test_a_late_clean_up_never_deletes_the_next_attempts_grant(
        nodes3: RedisNodes, make_manager: Callable[..., Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = make_manager(nodes3.urls[:1], node_timeout=0.2)
    lock = mgr.lock("cleanup-order")
    key, fkey, wkey = lock._key_b, lock._fence_key_b, lock._waiters_key_b
    node = mgr.nodes[0]
    direct = redis.Redis.from_url(nodes3.urls[0])
    transport = mgr.transport

    assert transport.round([Command(b"PING")], skip_backoff=False) == [b"PONG"]
    busy = node.get()  # the node's only connection, in use by "another round"
    assert busy is not None
    go = _hold_setups(node, monkeypatch)

    # The clean-up of attempt 1: no connection free, so it goes to the set-up.
    cleanup = rounds.release_requests(1, key, fkey, wkey, TOKEN, 0, only=[True])
    result = transport.round(cleanup, settle=rounds.NO_WAIT, tag=TOKEN, until=0.0)
    assert isinstance(result[0], NodeError), result  # it did not go out now...
    assert node._later, "the clean-up was not handed to the set-up"  # ...but will

    node.put(busy)  # the other round is done: a connection is free again
    attempt = rounds.acquire_call(key, fkey, wkey, TOKEN, 30_000, "owner", True)
    reply = transport.round([attempt], tag=TOKEN)[0]
    granted_now = rounds.granted_by(reply)

    go.set()  # the set-up runs the clean-up now
    assert wait_until(lambda: not node._setting_up and not node._later_tags, timeout=10)

    if granted_now:
        # The bug: granted, then deleted by our own late clean-up.
        assert _holder(direct, key) == TOKEN, "the late clean-up deleted the grant"
    else:
        assert isinstance(reply, NodeError) and "clean-up" in reply.reason, reply
    # Once the clean-up ran, the next attempt is granted and keeps its key.
    reply = transport.round([attempt], tag=TOKEN)[0]
    assert rounds.granted_by(reply), reply
    assert _holder(direct, key) == TOKEN
