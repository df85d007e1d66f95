"""The docs and the lint are part of the product: CI builds and checks them here,
so `make test` (and so `.ci/run`) fails when either breaks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The sdist, the docs and the lint depend on no Python or Django version:
# `make test` checks them; CI's second pass (Python 3.13) leaves them out.
pytestmark = [pytest.mark.slow, pytest.mark.anyversion]


def test_docs_build_with_warnings_as_errors(tmp_path: Path) -> None:
    pytest.importorskip("sphinx", reason="the docs extra is not installed")
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q",
         str(ROOT / "docs"), str(tmp_path / "html")],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "html" / "index.html").exists()


def test_ruff_is_clean() -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (the lint extra)")
    targets = [p for p in ("django_redlock", "tests", "testproject", "bench") if (ROOT / p).exists()]
    proc = subprocess.run([ruff, "check", "--no-cache", *targets], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
