"""The package is ruff-clean and mypy-clean (settings in pyproject.toml).

Both tools are in the test extra: where one is missing the test fails (a
lint check that skips itself checks nothing)."""

import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from conftest import ROOT


def test_ruff_is_clean():
    # the ruff beside this interpreter (its venv's, also when not activated), else PATH's
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is not installed: pip install -e '.[test]'"
    result = subprocess.run([ruff, "check", "symbackprop"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean():
    assert importlib.util.find_spec("mypy") is not None, "mypy is not installed: pip install -e '.[test]'"
    # the cache lives outside the checkout; warm, a run takes about a second
    cache = Path(tempfile.gettempdir()) / "symbackprop-mypy-cache"
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache), "symbackprop"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
