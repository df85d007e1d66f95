"""``manage.py locked NAME [options] -- COMMAND ARGS...``: a management command run
under a lock, in-process (``call_command``) and in a subprocess, against the
suite's real Redis nodes. The inner command is ``sleepy`` (tests/testapp), which
writes ``start``/``end`` lines to a file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_redlock import LockManager
from django_redlock.management.commands.locked import SKIPPED
from tests.polling import wait_until

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def manager(session_nodes: Any, make_manager: Callable[..., LockManager]) -> LockManager:
    return make_manager(session_nodes, auto_renew=False)


def _keys(session_nodes: Any, name: str) -> list[bool]:
    return [bool(server.execute("EXISTS", f"redlock:{name}")) for server in session_nodes]


@pytest.fixture
def manage(tmp_path: Path, session_nodes: Any) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start ``python -m django locked ...`` with settings pointing at the suite's nodes."""
    (tmp_path / "locked_settings.py").write_text(
        f"from tests.settings import *  # noqa\nREDLOCK_NODES = {list(session_nodes.urls)!r}\n")
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "locked_settings",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-m", "django", "locked", *args], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def test_runs_the_command_under_the_lock_and_releases(tmp_path: Path, manager: LockManager,
                                                      session_nodes: Any) -> None:
    out = tmp_path / "out.txt"
    seen: list[bool] = []

    # While the inner command runs, a second acquirer is refused.
    from django.core.management import get_commands, load_command_class

    sleepy = load_command_class(get_commands()["sleepy"], "sleepy")
    original = sleepy.__class__.handle

    def spy(self: Any, *args: Any, **options: Any) -> None:
        seen.append(manager.lock("job:nightly", timeout=0).acquire())
        original(self, *args, **options)

    sleepy.__class__.handle = spy
    try:
        call_command("locked", "job:nightly", "--", "sleepy", str(out))
    finally:
        sleepy.__class__.handle = original
    assert seen == [False]
    assert out.read_text() == "start\nend\n"
    assert _keys(session_nodes, "job:nightly") == [False, False, False]


def test_skip_if_busy_runs_nothing_and_says_3(tmp_path: Path, manager: LockManager) -> None:
    out = tmp_path / "out.txt"
    with manager.lock("job:busy"):
        with pytest.raises(CommandError) as caught:
            call_command("locked", "job:busy", "--skip-if-busy", "--", "sleepy", str(out))
    assert caught.value.returncode == SKIPPED == 3
    assert "busy" in str(caught.value)
    assert not out.exists()


def test_busy_past_timeout_without_skip_is_an_error(tmp_path: Path, manager: LockManager) -> None:
    out = tmp_path / "out.txt"
    started = time.monotonic()
    with manager.lock("job:busy"):
        with pytest.raises(CommandError) as caught:
            call_command("locked", "job:busy", "--timeout", "0.3", "--", "sleepy", str(out))
    assert caught.value.returncode == 1
    assert 0.25 < time.monotonic() - started < 10
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["job:x"], "no command to run"),
    (["job:x", "--", "no-such-command"], "unknown command"),
    (["bad name\n", "--", "sleepy", "f"], "bad lock name"),
    (["job:x", "--", "locked", "job:y", "--", "sleepy", "f"], "cannot run itself"),
])
def test_bad_invocations(argv: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        call_command("locked", *argv)


@pytest.mark.slow
def test_subprocess_exit_statuses(tmp_path: Path, manager: LockManager, session_nodes: Any,
                                  manage: Callable[..., subprocess.Popen[str]]) -> None:
    out = tmp_path / "out.txt"
    # The inner command's own options come after "--" and are not ours.
    proc = manage("job:sub", "--ttl", "5", "--", "sleepy", str(out), "--seconds", "0")
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert out.read_text() == "start\nend\n"
    # The inner command's failure status is passed through; the lock is released.
    proc = manage("job:sub", "--", "sleepy", str(out), "--fail")
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 5, stderr
    assert "failed on purpose" in stderr
    assert _keys(session_nodes, "job:sub") == [False, False, False]
    # Busy and --skip-if-busy: exit status 3, nothing run.
    out.unlink()
    with manager.lock("job:sub"):
        proc = manage("job:sub", "--skip-if-busy", "--", "sleepy", str(out))
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == SKIPPED, stderr
    assert "busy" in stderr
    assert not out.exists()


@pytest.mark.slow
def test_sigterm_releases_the_lock(tmp_path: Path, manager: LockManager, session_nodes: Any,
                                   manage: Callable[..., subprocess.Popen[str]]) -> None:
    """SIGTERM while the inner command runs: the lock is deleted at once, not left
    on the nodes for its 60 s lease."""
    out = tmp_path / "out.txt"
    proc = manage("job:term", "--ttl", "60", "--", "sleepy", str(out), "--seconds", "30")
    assert wait_until(lambda: out.exists() and "start" in out.read_text(), timeout=30), \
        proc.stderr.read() if proc.poll() is not None else "inner command did not start"
    assert _keys(session_nodes, "job:term") == [True, True, True]
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=20)
    assert _keys(session_nodes, "job:term") == [False, False, False], stderr
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "released" in stderr
    assert out.read_text() == "start\n"  # stopped in the middle
    assert manager.lock("job:term", timeout=0).acquire()
