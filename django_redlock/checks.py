"""System checks: bad settings reported by ``manage.py check``, never a traceback.

The rules live in :mod:`django_redlock.core.config` (shared with the runtime);
this module only turns their problems into ``redlock.E0xx`` / ``redlock.W0xx``
check messages. Registered in :meth:`RedlockConfig.ready`.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks

from .core.config import Problem, check_cache_aliases, check_node_timeouts, check_options, parse_nodes


def _message(problem: Problem) -> checks.CheckMessage:
    cls = checks.Error if problem.is_error else checks.Warning
    return cls(problem.msg, hint=problem.hint, id=f"redlock.{problem.id}")


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    options = getattr(settings, "REDLOCK", None)
    caches = getattr(settings, "CACHES", {}) or {}
    problems = check_options(options)
    specs, node_problems = parse_nodes(getattr(settings, "REDLOCK_NODES", None))
    problems += node_problems
    problems += check_cache_aliases(specs, caches)
    problems += check_node_timeouts(specs, options, caches)
    return [_message(p) for p in problems]


#: Seconds the node-settings check may take for all nodes together (they are
#: asked in parallel; each request is also bounded by the node timeout).
NODE_CHECK_DEADLINE = 2.0


def check_node_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """The node settings that silently drop held locks, read from the nodes.

    Registered with ``deploy=True``: it runs with ``manage.py check --deploy``
    (and ``locks health`` reads the same settings), not with every management
    command's automatic checks, because it opens connections to the nodes, which
    ``runserver`` or ``migrate`` on a laptop without Redis should not need. Each
    node is read in parallel within :data:`NODE_CHECK_DEADLINE`; a node that does
    not answer is a warning, never a hang or an error.

    * ``redlock.E020``: ``maxmemory`` set with an ``allkeys-*`` or ``volatile-*``
      policy. Redis deletes keys under memory pressure, held locks included (a
      lock key has an expiry, so ``volatile-*`` takes it too); a second holder
      gets in while the first still sees ``owned()`` true.
    * ``redlock.W020``: such a policy without ``maxmemory``: harmless until a
      ``maxmemory`` is set.
    * ``redlock.W021``: the settings could not be read (``CONFIG`` refused and
      ``INFO memory`` silent): unknown is not healthy.
    * ``redlock.W022``: the node did not answer.
    * ``redlock.W023``: the node reports itself a replica (Redlock needs
      independent masters).
    * ``redlock.W024``: fewer replicas are connected to the node than
      ``REPLICA_ACKS`` asks to confirm: none of its grants can count.
    """
    from django.core.exceptions import ImproperlyConfigured

    from .conf import get_manager
    from .engine.inspection import eviction_verdict, read_node_settings

    try:
        manager = get_manager()
    except ImproperlyConfigured:
        return []  # check_settings reports the bad settings
    found: list[checks.CheckMessage] = []
    for node in read_node_settings(manager, deadline=NODE_CHECK_DEADLINE):
        if node.error is not None:
            found.append(checks.Warning(
                f"Redis node {node.node} could not be read to check its eviction settings: "
                f"{node.error}.",
                hint="Run 'manage.py locks health' when the node is up.", id="redlock.W022"))
            continue
        verdict = eviction_verdict(node.maxmemory, node.maxmemory_policy)
        if verdict is not None:
            kind, text = verdict
            if kind == "unsafe":
                found.append(checks.Error(
                    f"Redis node {node.node} {text}.",
                    hint="CONFIG SET maxmemory-policy noeviction (and in redis.conf), or use "
                         "Redis servers that are not shared with a cache; fence the writes "
                         "that must never overlap.", id="redlock.E020"))
            elif kind == "inert":
                found.append(checks.Warning(
                    f"Redis node {node.node}: {text}.",
                    hint="CONFIG SET maxmemory-policy noeviction (and in redis.conf).",
                    id="redlock.W020"))
            else:
                found.append(checks.Warning(
                    f"Redis node {node.node}: {text}.",
                    hint="Allow CONFIG GET (or INFO memory) to the lock's Redis user, or "
                         "check the settings by hand and silence redlock.W021.",
                    id="redlock.W021"))
        if node.role == "replica":
            found.append(checks.Warning(
                f"Redis node {node.node} reports itself a replica: Redlock needs independent "
                f"masters (a replica refuses writes, and a failover can hand a held lock to a "
                f"second holder).", hint="List masters only in REDLOCK_NODES.",
                id="redlock.W023"))
        acks = getattr(manager, "replica_acks", 0)
        if acks and node.role != "replica" and node.replicas is not None \
                and node.replicas < acks:
            found.append(checks.Warning(
                f"Redis node {node.node} has {node.replicas} connected replica(s), and "
                f"REPLICA_ACKS is {acks}: none of its grants can count toward the quorum.",
                hint="Connect its replicas, or lower REPLICA_ACKS to what every node has.",
                id="redlock.W024"))
    return found
