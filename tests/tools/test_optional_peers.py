"""The README's test command runs in a venv that has only the test extra:
the peers that some tests compare against (PyTorch, JAX, SciPy,
scikit-learn, CasADi) are optional. Here the whole suite is collected in a
child interpreter that cannot import any of them: a test module that
imports a peer at module level, or a helper module (oracles, helpers) that
imports one, fails collection there, as it would in a bare venv. Tests
that need a peer use pytest.importorskip (at module level or inside the
test), which skips with the reason."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Top-level names of the optional peers (what `import` names, not what pip names).
OPTIONAL_PEERS = ("torch", "jax", "jaxlib", "scipy", "sklearn", "casadi", "threadpoolctl", "mkl")

BLOCKER = textwrap.dedent(f"""
    import importlib.util
    import sys

    class _Absent:
        '''Refuses the optional peers, as a venv without them would.'''
        names = {OPTIONAL_PEERS!r}

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.names:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: an optional peer)", name=name)
            return None

    sys.meta_path.insert(0, _Absent())
    _find_spec = importlib.util.find_spec

    def _find_spec_absent(name, package=None):
        '''find_spec answers None for a peer, as where it is not installed.'''
        if name.split(".")[0] in _Absent.names:
            return None
        return _find_spec(name, package)

    importlib.util.find_spec = _find_spec_absent
""")


def test_blocker_refuses_a_peer(tmp_path):
    """The check below can fail: with the blocker, importing torch fails."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    code = "import importlib.util; assert importlib.util.find_spec('jax') is None; import scipy"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode != 0 and "blocked: an optional peer" in result.stderr, result.stderr


def test_suite_collects_without_the_optional_peers(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    env.pop("PYTEST_XDIST_WORKER", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider", str(ROOT / "tests")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    assert "error" not in result.stdout.splitlines()[-1].lower(), tail
