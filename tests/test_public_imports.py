"""Every documented name imports from its documented place (issue 19).

The API reference (``docs/api.rst``) names each public object by its import
path; the layout may move code, never those paths.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DIRECTIVE = re.compile(r"^\.\. auto(?:function|class|exception|module|data):: ([\w.]+)", re.M)


def _documented() -> list[str]:
    return sorted(set(DIRECTIVE.findall((ROOT / "docs/api.rst").read_text())))


def _resolve(path: str) -> object:
    """Import ``path`` as a module, or as an attribute of the longest module prefix."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def test_the_reference_names_enough() -> None:
    assert len(_documented()) > 20


@pytest.mark.parametrize("path", _documented())
def test_documented_name_imports(path: str) -> None:
    assert _resolve(path) is not None


@pytest.mark.parametrize("name", [
    "lock", "alock", "with_lock", "current_lock", "get_manager", "LockManager", "Lock",
    "AsyncLock", "RedlockError", "LockNotAcquired", "LockLost", "LockNotOwned",
    "QuorumUnavailable", "FencedWriteRejected", "multi_lock", "amulti_lock", "segments",
    "asegments", "semaphore", "asemaphore", "with_semaphore", "with_segments", "with_multi_lock",
    "release_held_locks"])
def test_the_package_face(name: str) -> None:
    import django_redlock

    assert getattr(django_redlock, name) is not None
    assert name in django_redlock.__all__


def test_module_paths_users_import() -> None:
    from django_redlock.aio import AsyncLock, alock  # noqa: F401
    from django_redlock.decorators import current_lock, with_lock  # noqa: F401
    from django_redlock.exceptions import RedlockError  # noqa: F401
    from django_redlock.models import FenceField, LockableModel, LockingQuerySet  # noqa: F401
    from django_redlock.signals import lock_acquired, lock_lost, lock_released  # noqa: F401
    from django_redlock.testing import FaultProxy, RedisNodes, RedisServer  # noqa: F401


@pytest.mark.parametrize("name", [
    "lock_acquired", "lock_released", "lock_lost", "lock_not_acquired", "lock_extended",
    "lock_waiter_woken", "send", "logger"])
def test_the_signals_are_the_engines_own_objects(name: str) -> None:
    """The engine sends the signals (engine/events.py); a receiver connected to the
    documented ones (django_redlock.signals) must hear it: the same objects."""
    from django_redlock import signals
    from django_redlock.engine import events

    assert getattr(signals, name) is getattr(events, name)
    assert name in signals.__all__


def test_the_signal_log_keeps_its_name() -> None:
    from django_redlock import signals

    assert signals.logger.name == "django_redlock.signals"
    assert "fenced_write_rejected" in signals.__all__


# ``from django_redlock[.x] import a, b`` in the README and the docs' examples.
EXAMPLE_IMPORT = re.compile(r"from (django_redlock[\w.]*) import \(?([\w, \n]+?)\)?\s*(?:#|$)", re.M)


def _example_imports() -> list[tuple[str, str, str]]:
    found = []
    for page in sorted([*(ROOT / "docs").rglob("*.rst"), ROOT / "README.md"]):
        for module, names in EXAMPLE_IMPORT.findall(page.read_text()):
            for name in (n.strip() for n in names.replace("\n", " ").split(",")):
                if name:
                    found.append((page.relative_to(ROOT).as_posix(), module, name))
    return found


def test_the_examples_import_enough() -> None:
    assert len(_example_imports()) > 20


@pytest.mark.parametrize("page, module, name", _example_imports())
def test_every_import_in_the_examples_works(page: str, module: str, name: str) -> None:
    assert _resolve(f"{module}.{name}") is not None, f"{page}: from {module} import {name}"
