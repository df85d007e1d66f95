"""A lock handed to a waiter that is gone is handed on at once.

``tests/test_burst.py`` (200 threads on 20 names, two CPU hogs) saw waiters
time out after 30 s on a lock nobody held. The timeline, on the hand-over
node N of three::

    W queues on N, whose holder P has not released there yet
    W wins on the two other nodes, holds, releases, and is gone; its entry
      stays in N's line (its leave request and P's release cross)
    P's release reaches N late and hands N's key to W's entry: the notice
      goes to W's process, where nobody waits for that token any more
    before: N kept the key for W's whole lease, and every waiter behind W's
      entry was refused there as "behind another in line" for as long
    now: the process hands the key on (engine/manager.py, _hand_on_orphan)

Here the stale entry is put in line by hand, in front of a real waiter, on
one real node: the release hands the lock to it, and the waiter behind it is
served within a second instead of after the stale entry's 10 s lease.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from django_redlock.core.keys import waiters_key
from django_redlock.core.owner import new_token
from django_redlock.testing import RedisServer
from tests.polling import wait_until

LEASE_MS = 10_000


def test_a_lock_handed_to_a_waiter_that_is_gone_goes_to_the_next_in_line(
        redis_server: RedisServer, make_manager: Callable[..., Any]) -> None:
    mgr = make_manager([redis_server.url], retry_delay=5.0)  # served by notice only
    holder = mgr.lock("orphan", ttl=LEASE_MS / 1000, auto_renew=False)
    assert holder.acquire()
    queue = waiters_key(holder.key)
    served: list[float] = []
    waiter = mgr.lock("orphan", ttl=LEASE_MS / 1000, timeout=8, auto_renew=False)

    def wait() -> None:
        if waiter.acquire():
            served.append(time.monotonic())

    thread = threading.Thread(target=wait)
    thread.start()
    try:
        assert wait_until(lambda: redis_server.execute("LLEN", queue) == 1, timeout=5.0)
        # A copy of the waiter's own entry (same process inbox, hand-over form)
        # for a token nobody in this process waits on: W's, above.
        entry = redis_server.execute("LINDEX", queue, 0)
        inbox, token, rest = entry.split(b"|", 2)
        gone = new_token().encode()
        redis_server.execute("LPUSH", queue, inbox + b"|" + gone + b"|" + rest)
        released = time.monotonic()
        holder.release()
        # The release handed the key to the entry that is gone ...
        thread.join(timeout=8)
        assert served, "the waiter behind the entry that is gone was not served"
        assert served[0] - released < 2.0, served[0] - released  # not the 10 s lease
        assert waiter.owned()
        value = redis_server.execute("GET", waiter.key)
        assert value.startswith(waiter._token.encode())
    finally:
        thread.join(timeout=10)
        if waiter.owned():
            waiter.release()
    assert token != gone


def test_a_late_hand_over_notice_never_takes_a_lock_its_holder_counts(
        redis_server: RedisServer, make_manager: Callable[..., Any]) -> None:
    """The hand-on deletes only the untaken hand-over (attempt number 0). A
    key its token took over or won by its own attempt (which its round may
    count) stays, even when a hand-over notice for that token comes after its
    acquire returned (a release and the holder's own round crossing)."""
    mgr = make_manager([redis_server.url], retry_delay=5.0)
    first = mgr.lock("kept", ttl=10, auto_renew=False)
    assert first.acquire()
    waiter = mgr.lock("kept", ttl=10, timeout=0.3, auto_renew=False)
    assert not waiter.acquire()  # the notifier now listens on the inbox
    first.release()
    kept = mgr.lock("kept", ttl=10, auto_renew=False)
    assert kept.acquire()  # its own attempt: number 1 in the value
    notice = b"|".join([kept._token.encode(), str(kept.fence).encode(), b"1",
                        kept.key.encode()])
    assert redis_server.execute("PUBLISH", mgr.notifier.inbox, notice) == 1
    time.sleep(0.5)  # the hand-on is sent 0.1 s after the notice
    assert redis_server.execute("GET", kept.key).startswith(kept._token.encode())
    kept.release()  # no LockLost: nothing was taken
