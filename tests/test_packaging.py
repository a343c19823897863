"""A non-editable install into a fresh virtual environment, run from
another directory, finds its templates inside the wheel and compiles."""

import shutil
import subprocess
import sys
import textwrap

from conftest import ROOT

SCRIPT = textwrap.dedent(
    """
    import pathlib, sympy as sp, numpy as np, symbackprop as sbp
    from symbackprop import nn
    here = pathlib.Path(sbp.__file__).resolve()
    assert "site-packages" in str(here), here
    x = sp.MatrixSymbol("x", 1, 3)
    mod = sbp.compile(sbp.Model("packaged", params=[x], loss=nn.sum_all(x.applyfunc(sp.sin))))
    loss, grads = mod.value_and_grad(x=np.array([[0.0, 1.0, 2.0]]))
    assert np.allclose(grads["x"], np.cos([[0.0, 1.0, 2.0]])), grads
    print("ok", here)
    """
)


def test_wheel_install_compiles_from_another_directory(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("symbackprop", "templates"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    # system site packages supply sympy, numpy, jinja2 and cffi without a download
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(source)],
                   check=True, capture_output=True, timeout=600)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run([str(python), "-c", SCRIPT], cwd=elsewhere, capture_output=True, text=True,
                            timeout=600, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                              "SYMBACKPROP_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok")
    assert str(venv) in result.stdout
