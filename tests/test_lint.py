"""The package is ruff-clean and mypy-clean (settings in pyproject.toml)."""

import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import ROOT


def test_ruff_is_clean():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it is in the test extra)")
    result = subprocess.run([ruff, "check", "symbackprop"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean():
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (it is in the test extra)")
    # the cache lives outside the checkout; warm, a run takes about a second
    cache = Path(tempfile.gettempdir()) / "symbackprop-mypy-cache"
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache), "symbackprop"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
