"""The lock manager: the nodes, the options, and the Redlock rounds.

A :class:`LockManager` is cheap to share: one per process (``get_manager()``
builds it from settings) serves every thread. It owns one connection pool per
node, one renewal thread (started on first use) and one pub/sub listener
(started when someone first waits).

Each round follows the Redlock page and SAFETY.md:

* acquire: one script per node, all nodes asked in parallel; the lock counts
  only with ``N // 2 + 1`` yes answers *and* validity ``ttl - elapsed - drift`` > 0
  (node-redlock skips the second test and hands out expired locks); otherwise it
  is released on every node that may have it, including the silent ones;
* extend: compare-and-pexpire on every node, counted the same way;
* release: compare-and-delete on every node, which also wakes the waiters.
"""

from __future__ import annotations

import difflib
import logging
import os
import random
import threading
import time
import weakref
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from django.core.exceptions import ImproperlyConfigured

from . import rounds
from .core import quorum as q
from .core.config import DEFAULTS, NodeSpec, check_options, parse_nodes, resolve_options
from .core.keys import lock_key, validate_name
from .core.retry import next_wait
from .lock import Lock
from .rounds import AcquireResult, ExtendResult, ReleaseResult
from .transport.notify import ReleaseNotifier
from .transport.resp import FORCE_RELEASE, Call
from .transport.sync import NodeClient, SyncTransport
from .watchdog import Watchdog

if TYPE_CHECKING:
    from .aio import AsyncLock

logger = logging.getLogger("django_redlock.manager")

_managers: "weakref.WeakSet[LockManager]" = weakref.WeakSet()

#: How long a process that just woke other processes' waiters by a release lets
#: them go first before its own next attempt on the same lock (about one
#: wake-up: the notice, the listener thread, the waiter's round trip).
HANDOFF_YIELD = 0.002
#: Pending step-backs kept before the ones already over are swept (each entry is
#: removed when this process next acquires the key, which may be never).
_HANDOFF_KEYS_MAX = 1024


def _after_fork_in_child() -> None:
    for manager in list(_managers):
        manager._reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _default_pool_factory(spec: NodeSpec) -> Any:
    """The connection pool of a ``cache:<alias>`` node: the django-redis cache's own."""
    from django_redis import get_redis_connection

    try:
        client = get_redis_connection(spec.alias)
    except Exception as e:  # noqa: BLE001 - django-redis raises several types; all mean "unusable"
        raise ImproperlyConfigured(
            f"REDLOCK_NODES: cache {spec.alias!r} cannot lend a Redis connection pool: {e}") from e
    return client.connection_pool


class LockManager:
    """Locks on a set of independent Redis masters.

    ``nodes`` takes the same forms as ``REDLOCK_NODES``; ``options`` are the
    ``REDLOCK`` keys in lower case (``ttl=``, ``key_prefix=``, ``timeout=``,
    ``auto_renew=``, ``retry_delay=``, ``drift_factor=``, ``busy_status=``,
    ``node_timeout=``, ``max_hold=``). Bad values raise ``ImproperlyConfigured``
    with the same wording as ``manage.py check``.
    """

    def __init__(self, nodes: Iterable[Any], *, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None,
                 pool_factory: Callable[[NodeSpec], Any] | None = None,
                 **options: Any) -> None:
        unknown = [k for k in options if k != k.lower() or k.upper() not in DEFAULTS]
        if unknown:
            known = ", ".join(sorted(k.lower() for k in DEFAULTS))
            hints = {k: difflib.get_close_matches(k.lower(), [d.lower() for d in DEFAULTS], n=1)
                     for k in unknown}
            raise ImproperlyConfigured("; ".join(
                f"redlock.E008: unknown LockManager option {k!r}"
                + (f" (did you mean {hints[k][0]!r}?)" if hints[k] else "") for k in unknown)
                + f". Known options: {known}.")
        upper = {k.upper(): v for k, v in options.items()}
        problems = [p for p in check_options(upper) if p.is_error]
        specs, node_problems = parse_nodes(list(nodes) if not isinstance(nodes, (str, bytes)) else nodes)
        problems += [p for p in node_problems if p.is_error]
        if problems:
            raise ImproperlyConfigured("; ".join(f"redlock.{p.id}: {p.msg}" for p in problems))
        conf = resolve_options(upper)
        self.options: Mapping[str, Any] = conf
        self.key_prefix: str = conf["KEY_PREFIX"]
        self.ttl: float = float(conf["TTL"])
        self.timeout: float | None = conf["TIMEOUT"]
        self.auto_renew: bool = conf["AUTO_RENEW"]
        self.retry_delay: float = float(conf["RETRY_DELAY"])
        self.drift_factor: float = float(conf["DRIFT_FACTOR"])
        self.busy_status: int = conf["BUSY_STATUS"]
        self.node_timeout: float = float(conf["NODE_TIMEOUT"])
        self.max_hold: float | None = conf["MAX_HOLD"]
        self.clock = clock
        self.rng = rng or random.Random()
        factory = pool_factory or _default_pool_factory
        self.nodes = [NodeClient(spec, node_timeout=self.node_timeout,
                                 pool_factory=factory if spec.kind == "cache" else pool_factory)
                      for spec in specs]
        self.quorum = q.quorum(len(self.nodes))
        self.transport = SyncTransport(self.nodes, clock=clock)
        self._watchdog: Watchdog | None = None
        self._notifier: ReleaseNotifier | None = None
        self._async_transport: Any = None  # transport.aio.AsyncTransport, made by alock()
        self._lazy_lock = threading.Lock()
        self._closed = False
        #: lock key -> until when this process lets woken waiters go first
        self._handoff: dict[bytes, float] = {}
        _managers.add(self)

    def __repr__(self) -> str:
        return f"<LockManager {len(self.nodes)} nodes, quorum {self.quorum}, prefix {self.key_prefix!r}>"

    # -- public ----------------------------------------------------------------
    def lock(self, name: str, *, ttl: float | EllipsisType = ...,
             timeout: float | None | EllipsisType = ..., auto_renew: bool | EllipsisType = ...,
             fencing: bool = True, max_hold: float | None | EllipsisType = ...,
             label: str | None = None) -> Lock:
        """A lock on ``name`` (not yet acquired). Options left out use the manager's."""
        if ttl is not ... and not (isinstance(ttl, (int, float)) and ttl > 0):
            raise ValueError(f"ttl must be a positive number of seconds, not {ttl!r}")
        if timeout is not ... and timeout is not None and not (
                isinstance(timeout, (int, float)) and timeout >= 0):
            raise ValueError(f"timeout must be None, 0 or a positive number, not {timeout!r}")
        return Lock(self, name,
                    ttl=self.ttl if ttl is ... else float(ttl),
                    timeout=self.timeout if timeout is ... else timeout,
                    auto_renew=self.auto_renew if auto_renew is ... else bool(auto_renew),
                    fencing=fencing,
                    max_hold=self.max_hold if max_hold is ... else max_hold,
                    label=label)

    def alock(self, name: str, *, ttl: float | EllipsisType = ...,
              timeout: float | None | EllipsisType = ..., auto_renew: bool | EllipsisType = ...,
              fencing: bool = True, max_hold: float | None | EllipsisType = ...,
              label: str | None = None) -> AsyncLock:
        """An :class:`~django_redlock.aio.AsyncLock` on ``name``, for asyncio code."""
        from .aio import AsyncLock
        from .transport.aio import AsyncTransport

        opts = self.lock(name, ttl=ttl, timeout=timeout, auto_renew=auto_renew, fencing=fencing,
                         max_hold=max_hold, label=label)  # validates like lock(); no I/O
        if self._async_transport is None:
            with self._lazy_lock:
                if self._async_transport is None:
                    self._async_transport = AsyncTransport(self.nodes, clock=self.clock)
        return AsyncLock(self, self._async_transport, opts.name, ttl=opts.ttl,
                         timeout=opts.timeout, auto_renew=opts.auto_renew, fencing=fencing,
                         max_hold=opts.max_hold, label=label)

    def close(self) -> None:
        """Stop the renewal and listener threads and close our connection pools."""
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.close()
        if self._notifier is not None:
            self._notifier.close()
        self.transport.close()
        if self._async_transport is not None:
            self._async_transport.close()

    async def aclose(self) -> None:
        """:meth:`close`, closing the running event loop's connections before returning."""
        if self._async_transport is not None:
            await self._async_transport.aclose()
        self.close()

    def __enter__(self) -> "LockManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def key(self, name: str) -> str:
        return lock_key(self.key_prefix, validate_name(name))

    # -- lazily started helpers ------------------------------------------------
    @property
    def watchdog(self) -> Watchdog:
        if self._watchdog is None:
            with self._lazy_lock:
                if self._watchdog is None:
                    self._watchdog = Watchdog(self.clock)
        return self._watchdog

    @property
    def notifier(self) -> ReleaseNotifier:
        if self._notifier is None:
            with self._lazy_lock:
                if self._notifier is None:
                    self._notifier = ReleaseNotifier(self.nodes)
        return self._notifier

    def _reset_after_fork(self) -> None:
        """In a forked child: forget the parent's threads; its locks are not ours."""
        self._watchdog = None
        self._notifier = None
        self._lazy_lock = threading.Lock()
        for node in self.nodes:
            node.reset_backoff()

    def _note_release(self, key: bytes, woken: int) -> None:
        """After a release that woke a waiter, step back briefly.

        Without it, a process that releases and re-acquires in a loop wins almost
        every time (it is awake; the woken waiter is still waking up), and the
        others starve. Its next acquire of this key then sleeps HANDOFF_YIELD and
        joins the waiter queue at the back (``Lock.acquire``). Letting it win a
        few times in a row first (Go's mutex does) measured no faster: every
        such win costs the woken waiter a failed attempt.
        """
        if woken:
            now = self.clock()
            handoff = self._handoff
            if len(handoff) >= _HANDOFF_KEYS_MAX:
                # Keys this process never came back to: their pause is long over.
                for stale in [k for k, until in handoff.items() if until <= now]:
                    del handoff[stale]
            handoff[key] = now + HANDOFF_YIELD

    def _handoff_pause(self, key: bytes) -> float:
        """Seconds to wait before a first attempt on ``key`` (see _note_release)."""
        until = self._handoff.pop(key, None)
        return 0.0 if until is None else max(0.0, until - self.clock())

    def next_wait(self, remaining: float | None, holder_ttl: float | None) -> float:
        return next_wait(remaining=remaining, max_delay=self.retry_delay, holder_ttl=holder_ttl,
                         rng=self.rng)

    # -- rounds (the rules live in rounds.py, shared with the asyncio flavour) ----
    def _acquire_round(self, key: bytes, fkey: bytes, wkey: bytes, token: str, ttl_ms: int,
                       owner: str, fencing: bool, ttl: float, *, lock_name: str,
                       waiter: bytes = b"", woken: bool = False,
                       ask_all: bool = False) -> AcquireResult:
        call = rounds.acquire_call(key, fkey, wkey, token, ttl_ms, owner, fencing, waiter, woken)
        n = len(self.nodes)
        start = self.clock()
        # A waiter (it queues) asks the gate node first; see rounds.gate_node.
        gate = rounds.gate_node(key, self.nodes, start) if waiter and not ask_all else None
        if gate is not None:
            first = self.transport.round([call if i == gate else None for i in range(n)],
                                         tag=token)[gate]
            busy = rounds.busy_at_gate(first)
            if busy is not None:
                return busy
            need = self.quorum - (1 if rounds.granted_by(first) else 0)
            replies = self.transport.round([None if i == gate else call for i in range(n)],
                                           settle=rounds.acquire_settle(need), tag=token)
            replies[gate] = first
        else:
            replies = self.transport.round([call] * n, settle=rounds.acquire_settle(self.quorum),
                                           tag=token)
        elapsed = self.clock() - start
        tally = rounds.tally_acquire(replies, [node.name for node in self.nodes])
        won = rounds.granted(tally, n_nodes=n, start=start, elapsed=elapsed, ttl=ttl,
                             drift_factor=self.drift_factor)
        if won is not None:
            if not rounds.fences_disagree(tally, ttl):
                return won
            synced = self._extend_round(key, fkey, token, won.fence, ttl, lock_name=lock_name)
            if synced.extended:
                return won
            logger.info("lock %r: the fence could not be written back to a quorum; retrying",
                        lock_name)
        if any(tally.maybe_ours):
            # Release wherever the key may be ours, including nodes that went
            # silent after the request left: a leftover would block others.
            self._release_round(key, fkey, wkey, token, 0, only=tally.maybe_ours)
        return rounds.refused(tally, n_nodes=n, elapsed=elapsed, ttl=ttl, lock_name=lock_name)

    def _release_round(self, key: bytes, fkey: bytes, wkey: bytes, token: str, fence: int, *,
                       only: list[bool] | None = None) -> ReleaseResult:
        requests = rounds.release_requests(len(self.nodes), key, fkey, wkey, token, fence, only)
        # A clean-up after a lost attempt (``only``) waits for no reply: it is
        # sent behind the attempt on the same connection (``tag``), so it runs
        # after it and before the next attempt, and what it finds changes
        # nothing for the caller. A release is the token's last round.
        settle = rounds.NO_WAIT if only is not None else rounds.release_settle(
            len(self.nodes), rounds.gate_node(key, self.nodes, self.clock()))
        return rounds.tally_release(
            self.transport.round(requests, skip_backoff=only is None, settle=settle, tag=token,
                                 final=only is None), key)

    def _leave_queue(self, wkey: bytes, waiter: bytes, token: str, *,
                     only: list[bool] | None = None, wait: bool = True) -> None:
        """A waiter gives up: out of the line on every node (best effort: an entry
        left behind costs the next waiters one missed notice, then their timer).

        ``only``: just those nodes (after a won round, the ones that answered busy
        and so queued us; the lock is held, its release follows); ``wait=False``
        sends without waiting for the replies.
        """
        command = rounds.leave_queue_command(wkey, waiter)
        self.transport.round([command if only is None or only[i] else None
                              for i in range(len(self.nodes))],
                             settle=None if wait else rounds.NO_WAIT, tag=token,
                             final=only is None)

    def _extend_round(self, key: bytes, fkey: bytes, token: str, fence: int, ttl: float, *,
                      lock_name: str) -> ExtendResult:
        call = rounds.extend_call(key, fkey, token, fence, ttl)
        start = self.clock()
        # Every reply is read: an extension is off the hot path (the renewal
        # thread's), and its caller may rely on every node having the new lease.
        replies = self.transport.round([call] * len(self.nodes), tag=token)
        return rounds.tally_extend(replies, start=start, elapsed=self.clock() - start, ttl=ttl,
                                   drift_factor=self.drift_factor)

    def _holders(self, key: bytes) -> int:
        """How many nodes have ``key``; raises QuorumUnavailable when too few answer."""
        return rounds.tally_holders(
            self.transport.round([rounds.exists_command(key)] * len(self.nodes)), key)

    def force_release(self, name: str) -> list[Any]:
        """Delete lock ``name`` on every node whoever holds it; wake its waiters.

        Returns each node's deleted value (bytes), None where there was none, or a
        :class:`NodeError`. For operators (``manage.py locks release --force``);
        the holder finds out at its next renewal.
        """
        key = self.key(name).encode()
        return self.transport.round([Call(FORCE_RELEASE, (key,), ())] * len(self.nodes),
                                    skip_backoff=False)

