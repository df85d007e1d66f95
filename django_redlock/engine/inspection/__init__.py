"""Read-only inspection of the nodes: who holds which lock, and are the nodes fit.

This is what ``manage.py locks`` shows. It never writes (``release --force`` goes
through :meth:`LockManager.force_release`), and it never uses ``KEYS``:

* locks are found with ``SCAN MATCH "<prefix>:<glob>" COUNT 500`` on every node,
  then read with one pipeline of ``GET`` + ``PTTL`` + ``LLEN <waiter queue>``
  per batch of keys. A lock key's value is ``token|fence|owner-json``
  (:mod:`django_redlock.core.owner`), so the owner costs nothing extra. Fencing
  counters and waiter queues start with ``{`` (:mod:`django_redlock.core.keys`)
  and never match. A matching key whose value is not a lock value (a raw
  ``SET``, a key of another type, the counter or queue of the layout before
  0.1.0) still blocks the lock, so it is reported (:class:`ForeignKey`), never
  listed as a lock nor skipped in silence.
* the waiters of a lock are the length of its waiter queue. A waiter joins the
  queue of each node that refuses it: usually the lock's gate node alone (a
  waiter's retry asks that node first and stops there when it is busy), every
  busy node when the gate node is out. So the count shown is the longest queue
  among the nodes read, not a sum (which would count a waiter once per node).
* the per-node views are merged by lock name. Nodes that agree on the same
  holder token are counted together: ``k/N`` with ``k`` the size of the largest
  group. ``k`` below the quorum means a *minority* lock: a leftover of a failed
  attempt, or the survivor of nodes that restarted empty. Such a lock blocks
  nobody for long (acquirers need a quorum), but it is shown, not hidden.
* the time left is what the holder can count on: with ``k >= quorum`` it is the
  quorum-th largest ``PTTL`` among the agreeing nodes (when that node's key
  expires, fewer than a quorum hold it); below a quorum it is the largest.

Every node is asked from its own daemon thread and the caller waits for them
against one deadline, so a dead, paused or slow node costs at most that
deadline, never a hang; each socket operation is also bounded by the node
timeout of the manager's connection pools. A node's failure is reported with a
short reason, never with its password (:attr:`NodeSpec.display`, and the
password is scrubbed from error texts).

The package is in three parts: :mod:`.common` (patterns, secrets, asking every
node against one deadline), :mod:`.locks` (who holds what) and :mod:`.health`
(are the nodes fit); this module is their public face.
"""

from __future__ import annotations

from .common import (
    CLOCK_OFFSET_WARN_MS,
    MAX_KEYS_PER_NODE,
    PINGS,
    SCAN_COUNT,
    SCAN_DEADLINE,
    PatternError,
    glob_escape,
    short_reason,
    validate_pattern,
    what_answered,
)
from .health import (
    EVICTING_POLICY_PREFIXES,
    HealthReport,
    NodeHealth,
    NodeSettings,
    check_health,
    eviction_verdict,
    read_node_settings,
)
from .locks import (
    ForeignKey,
    Inventory,
    LockDetail,
    NodeFailure,
    ReleaseReport,
    force_release,
    inspect_lock,
    inspect_semaphore,
    merge,
    scan_locks,
)
from .records import PREVIEW_CHARS, ForeignValue, LockInfo, NodeLockValue
from .semaphores import SemaphoreInfo, group_semaphores

__all__ = [
    "CLOCK_OFFSET_WARN_MS",
    "MAX_KEYS_PER_NODE",
    "PINGS",
    "SCAN_COUNT",
    "SCAN_DEADLINE",
    "PatternError",
    "glob_escape",
    "short_reason",
    "validate_pattern",
    "what_answered",
    "EVICTING_POLICY_PREFIXES",
    "HealthReport",
    "NodeHealth",
    "NodeSettings",
    "check_health",
    "eviction_verdict",
    "read_node_settings",
    "PREVIEW_CHARS",
    "ForeignKey",
    "ForeignValue",
    "Inventory",
    "LockDetail",
    "LockInfo",
    "NodeFailure",
    "NodeLockValue",
    "ReleaseReport",
    "force_release",
    "inspect_lock",
    "inspect_semaphore",
    "merge",
    "scan_locks",
    "SemaphoreInfo",
    "group_semaphores",
]
