"""The lock manager: the nodes, the options, and the Redlock rounds.

(Why one module of 730 lines: the manager is what every lock kind and both
drivers hold, and what it owns (the nodes, the options, the renewal thread,
the late sender, the notice listener and its hand-ons) is one object's state;
the rules of the rounds live in rounds.py, the locks in their own modules.)

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

import collections
import difflib
import os
import random
import threading
import time
import weakref
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, Mapping, Sequence, TypeVar, overload

from django.core.exceptions import ImproperlyConfigured

from ..core import quorum as q
from ..core.arguments import check_max_hold, check_timeout, check_ttl
from ..core.config import DEFAULTS, NodeSpec, check_options, parse_nodes, resolve_options
from ..core.keys import fence_key, free_channels, lock_key, validate_name, waiters_key
from ..core.retry import next_wait
from ..transport import finalizers
from ..transport.nodekinds import make_node
from ..transport.notify import ReleaseNotifier
from ..transport.resp import FORCE_RELEASE, Call
from ..transport.sync import SyncTransport
from . import rounds
from .held import holds_any
from .leftovers import Leftovers, failed_requests
from .lock import Lock
from .multilock import AsyncMultiLock, MultiLock, check_names
from .reentrant import AsyncReentrantLock, HoldTable, ReentrantLock
from .rounds import AcquireResult, ExtendResult, ReleaseResult
from .segments import AsyncSegments, Segments, check_count, segment_name
from .semaphore import AsyncSemaphore, Semaphore, check_permits, line_name, permit_name
from .watchdog import Watchdog

if TYPE_CHECKING:
    from .aio import AsyncLock
    from .rwlock import AsyncReadLock, AsyncWriteLock, ReadLock, WriteLock

T = TypeVar("T")

logger = finalizers.get_logger("django_redlock.manager")

_managers: "weakref.WeakSet[LockManager]" = weakref.WeakSet()

#: How long a process that just woke other processes' waiters by a release lets
#: them go first before its own next attempt on the same lock. A release that
#: only woke a waiter (say, one queued by an older version) leaves the lock free,
#: and this keeps the releaser, already awake, from taking it first. One that
#: handed the lock over (the usual case) leaves nothing to take; there this
#: bounds how long the others pass the lock between themselves without a
#: wake-up: the last in line, finding nobody behind it, releases and re-takes
#: the lock at the cost of two round trips, until the ones that stepped back
#: queue again (each time it hands over, it steps back in turn). Longer: more
#: such cheap turns (throughput), and a process that re-acquires in a loop
#: waits that much longer for its next turn (docs/performance.rst has the A/Bs
#: of 2, 4 and 8 ms).
HANDOFF_YIELD = 0.004
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


class InvalidOption(ImproperlyConfigured, ValueError):
    """A bad ``LockManager(...)`` option or ``REDLOCK`` setting.

    Both a Django ``ImproperlyConfigured`` (it is the settings' fault when the
    manager comes from ``REDLOCK``) and a ``ValueError`` (as a bad argument to
    ``lock()`` is), so either ``except`` catches it.
    """


#: How long a hand-on of a lock handed to a waiter that is gone is sent
#: again while its node does not answer (the handed lease is at most a day;
#: a minute covers a node's brief outage, and the key expires anyway).
ORPHAN_HAND_ON_S = 60.0


class LockManager:
    """Locks on a set of independent Redis masters.

    ``nodes`` takes the same forms as ``REDLOCK_NODES``; ``options`` are the
    ``REDLOCK`` keys in lower case (``ttl=``, ``key_prefix=``, ``timeout=``,
    ``auto_renew=``, ``retry_delay=``, ``drift_factor=``, ``busy_status=``,
    ``node_timeout=``, ``max_hold=``, ``replica_acks=``). Bad values raise ``ImproperlyConfigured``
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
            raise InvalidOption("; ".join(
                f"redlock.E008: unknown LockManager option {k!r}"
                + (f" (did you mean {hints[k][0]!r}?)" if hints[k] else "") for k in unknown)
                + f". Known options: {known}.")
        upper = {k.upper(): v for k, v in options.items()}
        problems = [p for p in check_options(upper) if p.is_error]
        # Any iterable of nodes (a generator, a set...) as a list; anything
        # else as it is, for parse_nodes' E002 (a str, None, a number).
        given = nodes if isinstance(nodes, (str, bytes)) or not hasattr(nodes, "__iter__") \
            else list(nodes)
        specs, node_problems = parse_nodes(given)
        problems += [p for p in node_problems if p.is_error]
        if problems:
            raise InvalidOption("; ".join(f"redlock.{p.id}: {p.msg}" for p in problems))
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
        #: Replicas that must confirm each grant and extension (rounds.with_acks).
        self.replica_acks: int = conf["REPLICA_ACKS"]
        self.clock = clock
        self.rng = rng or random.Random()
        factory = pool_factory or _default_pool_factory
        self.nodes = [make_node(spec, node_timeout=self.node_timeout,
                                pool_factory=factory if spec.kind == "cache" else pool_factory,
                                connect_timeout=float(conf["CONNECT_TIMEOUT"]))
                      for spec in specs]
        self.quorum = q.quorum(len(self.nodes))
        self.transport = SyncTransport(self.nodes, clock=clock)
        self._watchdog: Watchdog | None = None
        #: Releases and clean-ups that failed on a node, sent again (made at the first).
        self._leftovers: Leftovers | None = None
        self._notifier: ReleaseNotifier | None = None
        self._async_transport: Any = None  # transport.aio.AsyncTransport, made by alock()
        self._lazy_lock = finalizers.Guard()  # the lazy parts' builds allocate under it
        self._closed = False
        #: retire(): close once no lock of ours is held or being released.
        self._retired = False
        self._calls: collections.deque[None] = collections.deque()
        self._retire_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._closing = False
        #: reentrant holds: thread or task -> key -> engine.reentrant.Hold (weak)
        self._reentrant = HoldTable()
        #: lock key -> until when this process lets woken waiters go first
        self._handoff: dict[bytes, float] = {}
        self._handoff_lock = finalizers.Guard()
        _managers.add(self)

    def __repr__(self) -> str:
        return f"<LockManager {len(self.nodes)} nodes, quorum {self.quorum}, prefix {self.key_prefix!r}>"

    # -- public ----------------------------------------------------------------
    @overload
    def lock(self, name: str, *, ttl: float | EllipsisType = ...,
             timeout: float | None | EllipsisType = ..., auto_renew: bool | EllipsisType = ...,
             fencing: bool = True, max_hold: float | None | EllipsisType = ...,
             label: str | None = None, reentrant: Literal[False] = False) -> Lock: ...

    @overload
    def lock(self, name: str, *, ttl: float | EllipsisType = ...,
             timeout: float | None | EllipsisType = ..., auto_renew: bool | EllipsisType = ...,
             fencing: bool = True, max_hold: float | None | EllipsisType = ...,
             label: str | None = None, reentrant: bool) -> "Lock | ReentrantLock": ...

    def lock(self, name: str, *, ttl: float | EllipsisType = ...,
             timeout: float | None | EllipsisType = ..., auto_renew: bool | EllipsisType = ...,
             fencing: bool = True, max_hold: float | None | EllipsisType = ...,
             label: str | None = None, reentrant: bool = False) -> "Lock | ReentrantLock":
        """A lock on ``name`` (not yet acquired). Options left out use the manager's.

        Every argument is checked here, before anything is sent
        (:mod:`django_redlock.core.arguments`): a bad one raises ``ValueError``
        naming it and its range. ``reentrant=True``: a
        :class:`~django_redlock.engine.reentrant.ReentrantLock`, which the same
        thread may acquire again without waiting.
        """
        if not isinstance(reentrant, bool):
            raise ValueError(f"reentrant must be True or False, not {reentrant!r}")
        if reentrant:
            proto = self.lock(name, ttl=ttl, timeout=timeout, auto_renew=auto_renew,
                              fencing=fencing, max_hold=max_hold, label=label)
            return ReentrantLock(self, lambda: self.lock(
                name, ttl=proto.ttl, timeout=proto.timeout, auto_renew=proto.auto_renew,
                fencing=fencing, max_hold=proto.max_hold, label=label), proto.timeout)
        return Lock(self, name, label=label, **self._lock_options(
            ttl, timeout, auto_renew, fencing, max_hold))

    def _lock_options(self, ttl: Any, timeout: Any, auto_renew: Any, fencing: Any,
                      max_hold: Any) -> dict[str, Any]:
        """A lock's options, checked before anything is sent (the name is
        checked by the lock itself), the manager's defaults filled in: one
        place for lock() and alock()."""
        if not isinstance(fencing, bool):
            raise ValueError(f"fencing must be True or False, not {fencing!r}")
        if auto_renew is not ... and not isinstance(auto_renew, bool):
            raise ValueError(f"auto_renew must be True or False, not {auto_renew!r}")
        return {"ttl": self.ttl if ttl is ... else check_ttl(ttl),
                "timeout": self.timeout if timeout is ... else check_timeout(timeout),
                "auto_renew": self.auto_renew if auto_renew is ... else auto_renew,
                "fencing": fencing,
                "max_hold": self.max_hold if max_hold is ... else check_max_hold(max_hold)}

    @overload
    def alock(self, name: str, *, ttl: float | EllipsisType = ...,
              timeout: float | None | EllipsisType = ..., auto_renew: bool | EllipsisType = ...,
              fencing: bool = True, max_hold: float | None | EllipsisType = ...,
              label: str | None = None, reentrant: Literal[False] = False) -> "AsyncLock": ...

    @overload
    def alock(self, name: str, *, ttl: float | EllipsisType = ...,
              timeout: float | None | EllipsisType = ..., auto_renew: bool | EllipsisType = ...,
              fencing: bool = True, max_hold: float | None | EllipsisType = ...,
              label: str | None = None,
              reentrant: bool) -> "AsyncLock | AsyncReentrantLock": ...

    def alock(self, name: str, *, ttl: float | EllipsisType = ...,
              timeout: float | None | EllipsisType = ..., auto_renew: bool | EllipsisType = ...,
              fencing: bool = True, max_hold: float | None | EllipsisType = ...,
              label: str | None = None,
              reentrant: bool = False) -> "AsyncLock | AsyncReentrantLock":
        """An :class:`~django_redlock.aio.AsyncLock` on ``name``, for asyncio code
        (``reentrant=True``: an ``AsyncReentrantLock``, per asyncio task)."""
        from .aio import AsyncLock

        if not isinstance(reentrant, bool):
            raise ValueError(f"reentrant must be True or False, not {reentrant!r}")
        if reentrant:
            opts = self.lock(name, ttl=ttl, timeout=timeout, auto_renew=auto_renew,
                             fencing=fencing, max_hold=max_hold, label=label)  # validates
            return AsyncReentrantLock(self, lambda: self.alock(
                name, ttl=opts.ttl, timeout=opts.timeout, auto_renew=opts.auto_renew,
                fencing=fencing, max_hold=opts.max_hold, label=label), opts.timeout)
        # Checked as lock() checks them, without building a sync Lock first.
        return AsyncLock(self, self._async(), name, label=label, **self._lock_options(
            ttl, timeout, auto_renew, fencing, max_hold))

    def read_lock(self, name: str, *, ttl: float | EllipsisType = ...,
                  timeout: float | None | EllipsisType = ...,
                  auto_renew: bool | EllipsisType = ..., fencing: bool = True,
                  max_hold: float | None | EllipsisType = ...,
                  label: str | None = None) -> "ReadLock":
        """A shared hold of ``name``: many readers at once, never with a writer
        (:mod:`django_redlock.engine.rwlock`). Options as :meth:`lock`'s."""
        from .rwlock import ReadLock

        held: ReadLock = self._rw(ReadLock, name, ttl, timeout, auto_renew, fencing, max_hold,
                                label)
        return held

    def write_lock(self, name: str, *, ttl: float | EllipsisType = ...,
                   timeout: float | None | EllipsisType = ...,
                   auto_renew: bool | EllipsisType = ..., fencing: bool = True,
                   max_hold: float | None | EllipsisType = ...,
                   label: str | None = None) -> "WriteLock":
        """The exclusive hold of ``name``: no reader, no other writer; a waiting
        writer stops new readers. Options as :meth:`lock`'s."""
        from .rwlock import WriteLock

        held: WriteLock = self._rw(WriteLock, name, ttl, timeout, auto_renew, fencing, max_hold,
                                label)
        return held

    def aread_lock(self, name: str, *, ttl: float | EllipsisType = ...,
                   timeout: float | None | EllipsisType = ...,
                   auto_renew: bool | EllipsisType = ..., fencing: bool = True,
                   max_hold: float | None | EllipsisType = ...,
                   label: str | None = None) -> "AsyncReadLock":
        """The asyncio twin of :meth:`read_lock`."""
        from .rwlock import AsyncReadLock

        held: AsyncReadLock = self._rw(AsyncReadLock, name, ttl, timeout, auto_renew, fencing, max_hold,
                                label)
        return held

    def awrite_lock(self, name: str, *, ttl: float | EllipsisType = ...,
                    timeout: float | None | EllipsisType = ...,
                    auto_renew: bool | EllipsisType = ..., fencing: bool = True,
                    max_hold: float | None | EllipsisType = ...,
                    label: str | None = None) -> "AsyncWriteLock":
        """The asyncio twin of :meth:`write_lock`."""
        from .rwlock import AsyncWriteLock

        held: AsyncWriteLock = self._rw(AsyncWriteLock, name, ttl, timeout, auto_renew, fencing, max_hold,
                                label)
        return held

    def _rw(self, cls: Any, name: str, ttl: float | EllipsisType,
            timeout: float | None | EllipsisType, auto_renew: bool | EllipsisType,
            fencing: bool, max_hold: float | None | EllipsisType, label: str | None) -> Any:
        """A read-write lock's holder of class ``cls``, its options checked as
        :meth:`lock` checks them (no I/O; the name by the lock itself), without
        building a plain lock first (with it, creating a read_lock() took
        7.1 µs against lock()'s 2.1 µs; without it 4.4 µs)."""
        kwargs = self._lock_options(ttl, timeout, auto_renew, fencing, max_hold)
        from .aio import AsyncLock

        if issubclass(cls, AsyncLock):
            return cls(self, self._async(), name, label=label, **kwargs)
        return cls(self, name, label=label, **kwargs)

    def _async(self) -> Any:
        """The asyncio transport, made on first use (and imported then: a
        process that never uses asyncio never loads it)."""
        transport = self._async_transport
        if transport is None:
            from ..transport.aio import AsyncTransport

            with self._lazy_lock:
                if self._async_transport is None:
                    self._async_transport = AsyncTransport(self.nodes, clock=self.clock)
                transport = self._async_transport
        return transport

    def multi_lock(self, names: Iterable[str], *, ttl: float | EllipsisType = ...,
                   timeout: float | None | EllipsisType = ...,
                   auto_renew: bool | EllipsisType = ..., fencing: bool = True,
                   max_hold: float | None | EllipsisType = ...,
                   label: str | None = None) -> MultiLock:
        """All of ``names`` or none, deadlock-free (:mod:`django_redlock.engine.multilock`)."""
        names = check_names(names)
        locks = [self.lock(n, ttl=ttl, timeout=timeout, auto_renew=auto_renew, fencing=fencing,
                           max_hold=max_hold, label=label) for n in names]
        return MultiLock(self, names, locks, locks[0].timeout)

    def amulti_lock(self, names: Iterable[str], *, ttl: float | EllipsisType = ...,
                    timeout: float | None | EllipsisType = ...,
                    auto_renew: bool | EllipsisType = ..., fencing: bool = True,
                    max_hold: float | None | EllipsisType = ...,
                    label: str | None = None) -> AsyncMultiLock:
        """The asyncio twin of :meth:`multi_lock`."""
        names = check_names(names)
        locks = [self.alock(n, ttl=ttl, timeout=timeout, auto_renew=auto_renew,
                            fencing=fencing, max_hold=max_hold, label=label) for n in names]
        return AsyncMultiLock(self, names, locks, locks[0].timeout)

    def segments(self, name: str, count: int, *, ttl: float | EllipsisType = ...,
                 timeout: float | None | EllipsisType = ...,
                 auto_renew: bool | EllipsisType = ..., fencing: bool = True,
                 max_hold: float | None | EllipsisType = ...,
                 label: str | None = None) -> Segments:
        """Any one free segment of ``count`` (:mod:`django_redlock.engine.segments`)."""
        count = check_count(count)
        validate_name(name)
        locks = [self.lock(segment_name(name, i), ttl=ttl, timeout=timeout,
                           auto_renew=auto_renew, fencing=fencing, max_hold=max_hold,
                           label=label) for i in range(count)]
        return Segments(self, name, locks, locks[0].timeout, rng=random.Random(self.rng.random()))

    def asegments(self, name: str, count: int, *, ttl: float | EllipsisType = ...,
                  timeout: float | None | EllipsisType = ...,
                  auto_renew: bool | EllipsisType = ..., fencing: bool = True,
                  max_hold: float | None | EllipsisType = ...,
                  label: str | None = None) -> AsyncSegments:
        """The asyncio twin of :meth:`segments`."""
        count = check_count(count)
        validate_name(name)
        locks = [self.alock(segment_name(name, i), ttl=ttl, timeout=timeout,
                            auto_renew=auto_renew, fencing=fencing, max_hold=max_hold,
                            label=label) for i in range(count)]
        return AsyncSegments(self, name, locks, locks[0].timeout, rng=random.Random(self.rng.random()))

    def semaphore(self, name: str, permits: int, *, ttl: float | EllipsisType = ...,
                  timeout: float | None | EllipsisType = ...,
                  auto_renew: bool | EllipsisType = ..., fencing: bool = True,
                  max_hold: float | None | EllipsisType = ...,
                  label: str | None = None) -> Semaphore:
        """At most ``permits`` holders of ``name`` at once
        (:mod:`django_redlock.engine.semaphore`)."""
        return Semaphore(self, name, *self._semaphore_locks(
            self.lock, name, permits, ttl=ttl, timeout=timeout, auto_renew=auto_renew,
            fencing=fencing, max_hold=max_hold, label=label),
            rng=random.Random(self.rng.random()))

    def asemaphore(self, name: str, permits: int, *, ttl: float | EllipsisType = ...,
                   timeout: float | None | EllipsisType = ...,
                   auto_renew: bool | EllipsisType = ..., fencing: bool = True,
                   max_hold: float | None | EllipsisType = ...,
                   label: str | None = None) -> AsyncSemaphore:
        """The asyncio twin of :meth:`semaphore`."""
        return AsyncSemaphore(self, name, *self._semaphore_locks(
            self.alock, name, permits, ttl=ttl, timeout=timeout, auto_renew=auto_renew,
            fencing=fencing, max_hold=max_hold, label=label),
            rng=random.Random(self.rng.random()))

    @staticmethod
    def _semaphore_locks(make: Callable[..., Any], name: str, permits: int, *, ttl: Any,
                         timeout: Any, auto_renew: Any, fencing: bool, max_hold: Any,
                         label: str | None) -> tuple[list[Any], float | None]:
        """The permits' locks, then the line's (renewed while its holder waits
        for a permit, whatever ``auto_renew`` says), and the timeout."""
        permits = check_permits(permits)
        validate_name(name)
        locks = [make(permit_name(name, i), ttl=ttl, timeout=timeout, auto_renew=auto_renew,
                      fencing=fencing, max_hold=max_hold, label=label) for i in range(permits)]
        locks.append(make(line_name(name), ttl=locks[0].ttl, timeout=locks[0].timeout,
                          auto_renew=True, fencing=False, max_hold=None, label=label))
        return locks, locks[0].timeout

    def close(self) -> None:
        """Stop the renewal and listener threads and close our connection pools."""
        # One close at a time: a retired manager is closed by a thread of its
        # own (conf.get_manager's look), maybe while its owner closes it too.
        with self._close_lock:
            self._closed = True
            if self._watchdog is not None:
                self._watchdog.close()
            if self._leftovers is not None:
                self._leftovers.close()
            if self._notifier is not None:
                self._notifier.close()
            self.transport.close()
            if self._async_transport is not None:
                self._async_transport.close()

    def retire(self) -> None:
        """Close this manager now if nothing of it is in use, else later.

        What replaced ``close()`` when the settings change under held locks
        (``django_redlock.conf.reset_manager``; ``override_settings`` and
        pytest-django's ``settings`` fixture send ``setting_changed``)::

            t=0    lock A (ttl 0.6, auto_renew) acquired on manager M
            t=0.1  override_settings(CACHES=...): M is closed, its renewal
                   thread stopped; nothing is logged, no lock_lost is sent
            t=0.6  A's keys expire; B acquires the same lock: two holders,
                   A's owned() and validity say nothing until its release()

        A retired manager keeps renewing, acquiring and releasing for the
        lock objects that point at it. It is closed by a later look
        (``conf.get_manager()``, every few seconds at most, in a thread of
        its own) once :meth:`_close_if_idle` finds nothing of it in use: no
        lock held with lease left (a lock lost, expired or dropped does not
        count: ``held.holds_any``), no acquire or release under way
        (:meth:`_call_begins`), no release waiting to be sent again to a
        node that missed it. Not from the release that ends the last hold:
        that thread may be an event loop, an exit hook (where Python 3.12
        refuses new threads), or a garbage collector finalizing a plan while
        its thread holds the held locks' guard. One still held at process
        exit is released by the exit hook, with the manager still open.
        """
        with self._retire_lock:
            self._retired = True
        self._close_if_idle()

    def _call_begins(self) -> None:
        """A release round is under way (``LockBase._release_plan``, the
        take-back of an interrupted acquire, the exit hook): a retired
        manager must not be closed under it. Timeline without the count::

            t=0  A and B, the last two locks of retired M, release at once
            t=0  A's round is done: B already counts as not held, M closes
            t=0  B's round meets closed connections: B's keys stay a lease

        (An acquire is not counted: a grant that lands on a manager closed
        meanwhile is refused by :meth:`closed_under_grant`.)
        """
        # On every release: a deque's append and pop are atomic (the GIL), no
        # lock taken on the uncontended path; its length is the count.
        self._calls.append(None)

    def _call_ends(self) -> None:
        """The release of :meth:`_call_begins` is over."""
        self._calls.pop()

    def closed_under_grant(self) -> bool:
        """Whether a lock just granted (and enrolled as held) must be given up
        because this retired manager was closed meanwhile: nobody would renew
        it, and its keys would expire silently while ``owned()`` said True::

            t=0  C's acquire round is on its way (an old lock object of M)
            t=0  M, retired and holding nothing, is closed
            t=0  C is granted: owned() True, renewed by nobody

        ``_close_if_idle`` sets ``_closing`` before it looks at the held
        locks: a grant enrolled before that look keeps M open; one enrolled
        after it finds ``_closing`` set and waits here for the decision."""
        if not self._closing:
            return False
        with self._retire_lock:
            return self._closed

    def _close_if_idle(self) -> bool:
        """Close a retired manager that nothing needs any more; whether it is
        closed. Held locks are looked at before the calls under way: a call
        counts itself before its lock starts or stops counting as held, so
        none falls between the two looks. Releases a node missed keep it open
        until they are sent (``engine/leftovers.py``: closing it dropped them,
        and the node kept the key a whole lease)."""
        with self._retire_lock:
            if self._closed or not self._retired:
                return self._closed
            self._closing = True  # before the looks: see _call_begins
            if holds_any(self) or len(self._calls) or (
                    self._leftovers is not None and self._leftovers.waiting()):
                self._closing = False
                return False
            self._closed = True  # this thread closes it, no other
        self.close()
        return True

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
                    self._watchdog = Watchdog(self.clock, extend_many=self._extend_many)
        return self._watchdog

    @property
    def notifier(self) -> ReleaseNotifier:
        if self._notifier is None:
            with self._lazy_lock:
                if self._notifier is None:
                    notifier = ReleaseNotifier(self.nodes)
                    notifier.on_orphan = self._hand_on_orphan
                    self._notifier = notifier
        return self._notifier

    def _hand_on_orphan(self, node: int, key: bytes, token: bytes) -> None:
        """A release handed node ``node``'s ``key`` to a waiter of ours that no
        longer waits; hand it on to the next in line (the late sender's thread
        sends it: this runs on the notice reader). Seen under load::

            W queues on the hand-over node N, whose holder H has not released
              there yet; W wins on the other nodes, holds, releases, is gone
            H's release reaches N late (a slow link, or sent again by the late
              sender) and hands N's key to W's entry: nobody takes it
            before: N kept that key for W's whole lease, and the waiters
              behind W's entry ("behind another in line") waited as long
            now: this process hears the hand-over for a token nobody waits on,
              and releases it there, which hands it to the next in line

        Compare-and-delete by W's token, and only while the key is still the
        untaken hand-over (attempt 0): a key someone else has by then, or one
        W took over (its round may count N), is left alone."""
        name = key.decode(errors="replace")
        requests = rounds.orphan_hand_on_requests(
            len(self.nodes), node, key, fence_key(name).encode(), waiters_key(name).encode(),
            token.decode(errors="replace"))
        self._send_again(requests, ORPHAN_HAND_ON_S)

    def _reset_after_fork(self) -> None:
        """In a forked child: forget the parent's threads; its locks are not ours."""
        self._watchdog = None
        self._leftovers = None  # the parent's to send, not the child's
        self._notifier = None
        self._lazy_lock = finalizers.Guard()  # the lazy parts' builds allocate under it
        # Locks a parent thread may have held at the fork, with no thread in
        # the child to let go of them: a reentrant acquire (the table's guard)
        # or a release stepping back (the hand-off table's) would wait for
        # ever. The parent's reentrant holds are not the child's either.
        self._reentrant = HoldTable()
        self._handoff_lock = finalizers.Guard()
        self._retire_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._closing = False
        self._calls = collections.deque()  # the parent's calls under way: not ours
        for node in self.nodes:
            node._after_fork()  # now: a parent thread's held locks, not at first use
            node.reset_backoff()

    def _note_release(self, key: bytes, woken: int) -> None:
        """After a release that woke a waiter or handed it the lock, step back.

        This process's next acquire of this key then sleeps what is left of
        HANDOFF_YIELD (why, and why that long: its comment) and joins the
        waiter queue at the back (``Lock.acquire``). Letting it win a few times
        in a row first (Go's mutex does) measured no faster: every such win
        costs the woken waiter a failed attempt.
        """
        if woken:
            now = self.clock()
            handoff = self._handoff
            if len(handoff) >= _HANDOFF_KEYS_MAX:
                # Keys this process never came back to: their pause is long over.
                # Other threads insert and pop meanwhile: sweep a copy, under a
                # lock so two sweeps do not race (iterating the dict itself raised
                # "dictionary changed size during iteration"). A Guard (a
                # section, transport/finalizers.py): the sweep allocates, and a
                # release a collection ran there that woke a waiter too waited
                # for this lock its own thread held, and every such release after.
                with self._handoff_lock:
                    for stale in [k for k, until in handoff.copy().items() if until <= now]:
                        handoff.pop(stale, None)
            handoff[key] = now + HANDOFF_YIELD

    def _handoff_pause(self, key: bytes) -> float:
        """Seconds to wait before a first attempt on ``key`` (see _note_release)."""
        until = self._handoff.pop(key, None)
        return 0.0 if until is None else max(0.0, until - self.clock())

    def next_wait(self, remaining: float | None, holder_ttl: float | None) -> float:
        return next_wait(remaining=remaining, max_delay=self.retry_delay, holder_ttl=holder_ttl,
                         rng=self.rng)

    # -- rounds (the rules live in rounds.py, shared with the asyncio flavour) ----
    def _run(self, steps: rounds.Steps[T]) -> T:
        """Drive a round's steps (rounds.py) with this manager's transport."""
        exchange = self.transport.round
        finalizers.enter()  # a release a collection runs meanwhile waits (finalizers.py)
        try:
            ask = next(steps)
            while True:
                replies = exchange(ask.requests, skip_backoff=ask.skip_backoff,
                                   settle=ask.settle, tag=ask.tag, final=ask.final,
                                   last=ask.last)
                if ask.redo:
                    self._send_later(ask.requests, replies, ask.redo)
                ask = steps.send(replies)
        except StopIteration as done:
            value: T = done.value
            return value
        finally:
            finalizers.leave()

    def _send_later(self, requests: Sequence[Any], replies: Sequence[Any],
                    lasts: float) -> None:
        """Hand the requests of a round that failed on their nodes to the late
        sender (engine/leftovers.py), for up to ``lasts`` seconds: a release
        or clean-up that did not arrive would keep the lock busy until the
        key's lease ends. Both flavours' drivers call this."""
        again = failed_requests(requests, replies)
        if again is not None:
            self._send_again(again, lasts)

    def _send_again(self, requests: Sequence[Any], lasts: float) -> None:
        """Give ``requests`` (per node; None: not that node) to the late sender,
        started at the first use, for up to ``lasts`` seconds."""
        if self._closed:
            return
        if self._leftovers is None:
            with self._lazy_lock:
                if self._leftovers is None:
                    self._leftovers = Leftovers(self.transport.round, len(self.nodes),
                                                    self.clock)
        self._leftovers.add(requests, lasts)

    def _acquire_round(self, key: bytes, fkey: bytes, wkey: bytes, token: str, ttl_ms: int,
                       owner: str, fencing: bool, ttl: float, *, lock_name: str,
                       waiter: bytes = b"", hand_over: bytes = b"", woken: bool = False,
                       ask_all: bool = False, again: bool = False,
                       handed: AcquireResult | None = None, attempt: int = 0,
                       guard: rounds.Guard | None = None) -> AcquireResult:
        return self._run(rounds.acquire_steps(
            self, key, fkey, wkey, token, ttl_ms, owner, fencing, ttl, lock_name=lock_name,
            waiter=waiter, hand_over=hand_over, woken=woken, ask_all=ask_all, again=again,
            handed=handed, attempt=attempt, guard=guard))

    def _release_round(self, key: bytes, fkey: bytes, wkey: bytes, token: str, fence: int, *,
                       only: list[bool] | None = None, notify: bytes = b"",
                       wait: bool = True, redo: float = 0.0,
                       every: bool = False) -> ReleaseResult:
        return self._run(rounds.release_steps(self, key, fkey, wkey, token, fence, only=only,
                                              notify=notify, wait=wait, redo=redo,
                                              every=every))

    def _leave_queue(self, wkey: bytes, entries: Sequence[bytes], token: str, *,
                     only: list[bool] | None = None, wait: bool = True) -> None:
        """A served waiter leaves the line on the nodes that answered busy and so
        queued it (``only``; ``entries``: its entry per node, see
        ``rounds.waiter_entries``); ``wait=False`` sends without waiting for
        the replies (the lock is held, its release follows)."""
        self._run(rounds.leave_queue_steps(self, wkey, entries, token=token, only=only,
                                           wait=wait))

    def _give_up(self, key: bytes, fkey: bytes, wkey: bytes, token: str,
                 entries: Sequence[bytes]) -> None:
        """A waiter that timed out or was interrupted leaves the line everywhere,
        and hands on a lock handed to it meanwhile (``rounds.give_up_steps``).
        Best effort: an entry left behind costs the next waiters one missed
        notice, then their timer; a node it cannot reach keeps a lock handed
        to it until that lease ends."""
        self._run(rounds.give_up_steps(self, key, fkey, wkey, token, entries))

    def _extend_round(self, key: bytes, fkey: bytes, token: str, fence: int,
                      ttl: float) -> ExtendResult:
        return self._run(rounds.extend_steps(self, key, fkey, token, fence, ttl))

    def _extend_many(self, items: Sequence[rounds.Extension]) -> list[ExtendResult]:
        """The renewal thread's batch (``rounds.extend_many_steps``)."""
        return self._run(rounds.extend_many_steps(self, items))

    def _holders(self, key: bytes) -> int:
        """How many nodes have ``key``; raises QuorumUnavailable when too few answer."""
        return self._run(rounds.holders_steps(self, key))

    def force_release(self, name: str, *, holder: str = "") -> list[Any]:
        """Delete lock ``name`` on every node whoever holds it; wake its waiters.

        ``holder``: the start of the holder's token as ``locks show`` and the
        admin print it; then a node deletes the key only while that holder
        still holds it there (an operator who saw a stuck holder must not
        delete the healthy one that took the lock since).

        Returns each node's deleted value (bytes), None where there was none,
        ``[0, value]`` where another holder than ``holder`` holds it (kept),
        ``[1, value]`` where ``holder`` was one holder of a read-write lock and
        only it was deleted (the others still hold the lock: nobody woken), or
        a :class:`NodeError`. For operators (``manage.py locks release
        --force``); the holder finds out at its next renewal.
        """
        if not isinstance(holder, str) or len(holder) > 64 or "|" in holder:  # type: ignore[redundant-expr]  # checked at run time too
            raise ValueError(f"holder must be the start of a lock token, not {holder!r}")
        key = self.key(name).encode()
        # A segment's or a permit's waiters listen on their family's free
        # channel: told there, they take it at once, not at their next retry.
        channels = tuple(free_channels(self.key_prefix, name))
        call = Call(FORCE_RELEASE, (key,), (holder.encode(), *channels))
        return self.transport.round([call] * len(self.nodes), skip_backoff=False)

