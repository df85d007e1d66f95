"""The sdist can run the test suite and build the docs (issue 19): everything
git tracks under the package, the tests, the demo project and the docs is in
it, and so is every file the docs include from elsewhere."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The sdist, the docs and the lint depend on no Python or Django version:
# `make test` checks them; CI's second pass (Python 3.13) leaves them out.
pytestmark = [pytest.mark.slow, pytest.mark.anyversion]
NEEDED = ("django_redlock/", "tests/", "testproject/", "docs/")
INCLUDE = re.compile(r"^\s*\.\. (?:literal)?include:: (\S+)", re.M)


def _tracked() -> list[str]:
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an unpacked sdist, say)")
    done = subprocess.run([git, "ls-files"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=True)
    return done.stdout.splitlines()


def _included_by_docs() -> set[str]:
    found = set()
    for page in (ROOT / "docs").rglob("*.rst"):
        for target in INCLUDE.findall(page.read_text()):
            found.add((page.parent / target).resolve().relative_to(ROOT).as_posix())
    return found


def test_the_sdist_carries_the_tests_and_the_docs(tmp_path: Path) -> None:
    tracked = _tracked()
    tree = tmp_path / "tree"
    for name in tracked:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    done = subprocess.run(
        [sys.executable, "-c", "from setuptools import setup; setup()", "-q", "sdist",
         "--formats=gztar", "-d", str(tmp_path / "dist")],
        cwd=tree, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    (archive,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        carried = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    wanted = {name for name in tracked if name.startswith(NEEDED)} | _included_by_docs()
    assert _included_by_docs(), "the docs include nothing? the pattern is wrong"
    assert sorted(wanted - carried) == []
