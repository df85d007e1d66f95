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
