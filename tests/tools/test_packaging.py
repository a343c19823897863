"""A non-editable install, run from another directory, finds its templates
inside the wheel, beside its code (the top-level templates/ of the checkout,
mapped to symbackprop/templates by pyproject.toml's package-dir), and compiles.

The wheel is built with this interpreter's own setuptools and wheel (both in
the test extra: nothing is downloaded) and installed into a folder of its
own, which is put first on the path of a child process of this interpreter:
that process imports the installed copy, not the source tree, and takes
sympy, numpy and the rest from this environment. A nested virtual
environment would see the base interpreter's packages instead of this
environment's, which is how this test once failed in a brand-new venv.
"""

import shutil
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

SCRIPT = textwrap.dedent(
    """
    import pathlib, sys, sympy as sp, numpy as np, symbackprop as sbp
    from symbackprop import nn
    here = pathlib.Path(sbp.__file__).resolve()
    assert str(here).startswith(sys.argv[1]), here
    from symbackprop.emit import templatecache
    assert templatecache.TEMPLATES == here.parent / "templates", templatecache.TEMPLATES  # beside the code
    x = sp.MatrixSymbol("x", 1, 3)
    mod = sbp.compile(sbp.Model("packaged", params=[x], loss=nn.sum_all(x.applyfunc(sp.sin))))
    loss, grads = mod.value_and_grad(x=np.array([[0.0, 1.0, 2.0]]))
    assert np.allclose(grads["x"], np.cos([[0.0, 1.0, 2.0]])), grads
    from symbackprop.run import fastcall
    if sys.argv[2] == "1":  # the wheel built the call hot path: it is used, nothing is built into the cache
        assert fastcall.extension().__file__.startswith(sys.argv[1]), fastcall.extension()
        assert not list(pathlib.Path(sys.argv[3]).glob("fastcall-*")), list(pathlib.Path(sys.argv[3]).iterdir())
    # the wheel has the templates' compiled code (setup.py): the empty cache's first compile compiled no template
    jinja = pathlib.Path(sys.argv[3]) / "jinja"
    assert not jinja.exists() or not list(jinja.iterdir()), list(jinja.iterdir())
    print("ok", here)
    """
)


def _run(command, **kwargs):
    """Run a command; on failure the assertion shows its whole output."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{command} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result


@pytest.mark.default_flags  # what a user installs builds at the production flags (its child's env has no SYMBACKPROP_CFLAGS)
def test_wheel_install_compiles_from_another_directory(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("symbackprop", "templates"):
        ignore = shutil.ignore_patterns("__pycache__", "*.so", "templates_compiled")  # what an install builds
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)])
    (wheel,) = wheels.glob("symbackprop-*.whl")
    target = tmp_path / "installed"
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)])
    shipped = sorted(path.name for path in (target / "symbackprop" / "templates").glob("*.j2"))
    assert shipped == sorted(path.name for path in (ROOT / "templates").glob("*.j2"))  # every template, beside the code
    assert not (target / "templates").exists()  # not a top-level folder of site-packages
    assert list((target / "symbackprop" / "emit" / "templates_compiled").glob("*.cache"))  # built by setup.py
    # the call hot path's extension (setup.py): built wherever this interpreter's own copy builds or is installed
    from symbackprop.run import fastcall

    built = list((target / "symbackprop" / "run").glob("symbackprop_fastcall*"))
    assert built or fastcall.extension() is None, "the wheel has no call hot path, though it builds here"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cache = tmp_path / "cache"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(target), "SYMBACKPROP_CACHE_DIR": str(cache)}
    result = _run([sys.executable, "-c", SCRIPT, str(target), "1" if built else "0", str(cache)], cwd=elsewhere, env=env)
    assert result.stdout.startswith("ok")
