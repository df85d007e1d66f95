"""What importing the package costs, checked in a fresh interpreter each time.

``import django_redlock`` loads the version and the exceptions only; the harness
(``django_redlock.testing``) and the pytest plugin, which pytest's entry point
loads into every test session of every project that installs the package, load
neither Django nor redis-py, and the harness works without them installed.
Every public name is still importable from the package, on first use.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import django_redlock

ROOT = Path(__file__).resolve().parent.parent

HEAVY = ("django", "redis", "django_redis", "hiredis")

_LOADED = """
import json, sys
heavy = {heavy!r}
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy)))
"""

# A finder that makes the heavy packages look uninstalled in the child.
_BLOCK = """
import sys
class _Missing:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] in {heavy!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
        return None
sys.meta_path.insert(0, _Missing)
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def _loaded_after(statement: str) -> list[str]:
    done = _run(statement + "\n" + _LOADED.format(heavy=HEAVY))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("statement", [
    "import django_redlock",
    "import django_redlock.testing",
    "import django_redlock.pytest_plugin",
    "from django_redlock import RedlockError, LockNotAcquired, QuorumUnavailable, __version__",
    "from django_redlock.testing import RedisNodes, FaultProxy, RedisServer",
])
def test_import_loads_no_django_and_no_redis(statement: str) -> None:
    assert _loaded_after(statement) == []


def test_harness_imports_and_finds_a_server_without_django_or_redis_installed() -> None:
    code = _BLOCK.format(heavy=HEAVY) + (
        "from django_redlock.testing import RedisServer, find_server_binary\n"
        "import django_redlock.pytest_plugin\n"
        "print(find_server_binary())\n"
        "try:\n"
        "    import django\n"
        "except ModuleNotFoundError:\n"
        "    print('no django')\n")
    done = _run(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "no django"  # the blocker did block


def test_every_public_name_resolves_on_first_use() -> None:
    code = (
        "import django_redlock as d\n"
        "from django_redlock import *\n"
        "from django_redlock import lock, Lock, LockManager, with_lock, alock, AsyncLock\n"
        "from django_redlock.engine.lock import Lock as L2\n"  # the engine's module ...
        "assert d.lock is lock and callable(lock) and lock.__module__ == 'django_redlock'\n"
        "assert L2 is Lock and d.Lock is Lock\n"  # ... is not the function's name
        "missing = [n for n in d.__all__ if not hasattr(d, n)]\n"
        "assert not missing, missing\n"
        "assert set(d.__all__) <= set(dir(d))\n"
        "assert callable(d.conf.reset_manager) and d.signals.lock_lost\n"  # submodules too
        "print('ok')\n")
    done = _run(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        django_redlock.nope  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute '_private'"):
        django_redlock._private  # noqa: B018
    assert not hasattr(django_redlock, "nope")
