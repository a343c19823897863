"""Every ```python block of README.md runs as pasted: the first alone (a
reader's first example), and all of them in order in one interpreter (a
reader pasting them into one session). Each in a fresh process, with a
module cache of its own, in an empty working folder."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, re.DOTALL | re.MULTILINE)


def _run(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, SYMBACKPROP_CACHE_DIR=str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    work = tmp_path / "work"
    work.mkdir()
    return subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_readme_has_a_first_example_and_the_quick_start_commands():
    assert len(BLOCKS) >= 2
    assert "python -m pip install -e . && symbackprop demo" in README
    assert "python -m pip install -e '.[test]' && python -m pytest" in README
    assert len(README.splitlines()) <= 250


def test_the_first_example_runs_as_pasted(tmp_path):
    run = _run(BLOCKS[0], tmp_path)
    assert run.returncode == 0, run.stderr
    assert "relative error" in run.stdout   # the gradient check's report


def test_every_python_block_runs_in_order(tmp_path):
    code = "\n".join(f"exec(compile({block!r}, 'README.md python block {number}', 'exec'))"
                     for number, block in enumerate(BLOCKS, 1))
    run = _run(code, tmp_path)
    assert run.returncode == 0, run.stderr
