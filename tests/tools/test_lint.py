"""The package, its tests and examples are ruff-clean, and the package is
mypy-clean (settings in pyproject.toml): what the pre-commit hooks
(.pre-commit-config.yaml) check, so that a commit the hooks accept passes
here and the other way round.

Both tools are in the test extra: where one is missing the test fails (a
lint check that skips itself checks nothing)."""

import hashlib
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from conftest import ROOT

LINTED = ("symbackprop", "tests", "examples")  # the pre-commit hook's `files`


def test_ruff_is_clean():
    # the ruff beside this interpreter (its venv's, also when not activated), else PATH's
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is not installed: pip install -e '.[test]'"
    result = subprocess.run([ruff, "check", *LINTED], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean():
    assert importlib.util.find_spec("mypy") is not None, "mypy is not installed: pip install -e '.[test]'"
    # the cache lives outside the checkout, one per checkout (a cache shared by
    # two worktrees reported one's moved class as the other's); warm, a run
    # takes about a second
    checkout = hashlib.sha256(str(Path(ROOT).resolve()).encode()).hexdigest()[:12]
    cache = Path(tempfile.gettempdir()) / f"symbackprop-mypy-cache-{checkout}"
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache), "symbackprop"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_hooks_check_what_this_test_checks():
    config = (Path(ROOT) / ".pre-commit-config.yaml").read_text(encoding="utf-8")
    assert "entry: ruff check" in config and "entry: mypy" in config
    assert f"files: ^({'|'.join(LINTED)})/" in config
