"""`symbackprop build --library`: the CMake project, the Makefile and the
pkg-config file it writes build static and shared libraries that a C
program links, and that program computes what the Python module computes;
examples/c/train_digits.c trains the digits MLP through the generated
train_epoch. Needs a C compiler, make, cmake and pkg-config (each test
skips when one it runs is absent; scikit-learn for the digits)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from c_driver import STRICT_FLAGS, driver_source, input_arrays, parse_output
from conftest import ROOT, load_example

import symbackprop as sbp
from symbackprop.cli import main
from symbackprop.pipeline import generate

MODEL_FILE = '''
import sympy as sp
import symbackprop as sbp
from symbackprop import nn

n = sp.Symbol("n", integer=True, positive=True)
X, T = sp.MatrixSymbol("X", n, 3), sp.MatrixSymbol("T", n, 2)
W, b = sp.MatrixSymbol("W", 3, 2), sp.MatrixSymbol("b", 1, 2)
Z = nn.linear(X, W, b)
net = sbp.Model("net-1", inputs=[X, T], params=[W, b], loss=nn.softmax_cross_entropy(nn.tanh(Z), T), outputs={"Z": Z})
'''
PREFIX = "net_1"  # the C prefix of "net-1", and the library's name
DIMS = {"n": 5}


def needs(*tools: str) -> None:
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} on PATH")


def run(command: list[str], **kwargs) -> str:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> dict:
    """The model file, `build --library` run on it, the C driver of
    value_and_grad, and what the Python module returns for its arrays."""
    folder = tmp_path_factory.mktemp("library")
    (folder / "net.py").write_text(MODEL_FILE)
    out = folder / "gen"
    assert main(["build", str(folder / "net.py"), "--out", str(out), "--library"]) == 0
    spec = {}
    exec(compile(MODEL_FILE, "net.py", "exec"), spec)
    emitted, _ = generate(spec["net"])
    arrays = input_arrays(emitted.module, "value_and_grad", DIMS, {"X": (5, 3), "T": (5, 2), "W": (3, 2), "b": (1, 2)})
    loss, grads = sbp.compile(spec["net"]).value_and_grad(**arrays)
    driver = folder / "driver.c"
    driver.write_text(driver_source([emitted.module], "value_and_grad", DIMS))
    return {"folder": folder, "out": out, "driver": driver, "loss": loss, "grads": grads}


def check_program(library: dict, exe: Path) -> None:
    """The program prints the loss and gradients the Python module computes."""
    printed = parse_output(run([str(exe)]))
    assert printed[(PREFIX, "loss")] == pytest.approx([library["loss"]], rel=1e-12)
    for name, grad in library["grads"].items():
        np.testing.assert_allclose(printed[(PREFIX, f"grad_{name}")], grad.ravel(), rtol=1e-12, atol=1e-15)


def link(library: dict, name: str, flags: list[str]) -> Path:
    exe = library["folder"] / name
    run(["cc", *STRICT_FLAGS, str(library["driver"]), "-o", str(exe), *flags])
    return exe


def build_with(tool: str, library: dict) -> tuple[Path, Path]:
    """Build the libraries with CMake or make, and install them: (the
    folder holding lib<prefix>.a and .so, the install prefix)."""
    model = library["out"] / PREFIX
    build, prefix = library["folder"] / f"build-{tool}", library["folder"] / f"install-{tool}"
    if tool == "cmake":
        run(["cmake", "-S", str(model), "-B", str(build), f"-DCMAKE_INSTALL_PREFIX={prefix}",
             "-DCMAKE_INSTALL_LIBDIR=lib"])
        run(["cmake", "--build", str(build)])
        run(["cmake", "--install", str(build)])
    else:
        run(["make", "-C", str(model), f"BUILD={build}"])
        run(["make", "-C", str(model), f"BUILD={build}", "install", f"PREFIX={prefix}"])
    return build, prefix


@pytest.mark.parametrize("tool", ["cmake", "make"])
def test_static_and_shared_libraries_compute_what_python_does(library, tool):
    needs("cc", tool)
    build, _ = build_with(tool, library)
    static, shared = build / f"lib{PREFIX}.a", build / f"lib{PREFIX}.so"
    include = f"-I{library['out'] / PREFIX}"
    check_program(library, link(library, f"static-{tool}", [include, str(static), "-lm"]))
    with_shared = link(library, f"shared-{tool}", [include, str(shared), f"-Wl,-rpath,{build}", "-lm"])
    check_program(library, with_shared)
    if shutil.which("readelf"):  # it calls the shared library, not a copy of the code
        assert f"lib{PREFIX}.so" in run(["readelf", "-d", str(with_shared)])


@pytest.mark.parametrize("tool", ["cmake", "make"])
def test_pkg_config_gives_flags_that_build_a_program(library, tool):
    needs("cc", tool, "pkg-config")
    _, prefix = build_with(tool, library)
    env = {**os.environ, "PKG_CONFIG_PATH": str(prefix / "lib" / "pkgconfig")}
    flags = run(["pkg-config", "--cflags", "--libs", PREFIX], env=env).split()
    assert f"-I{prefix}/include/{PREFIX}" in flags and f"-l{PREFIX}" in flags
    check_program(library, link(library, f"pkg-config-{tool}", [*flags, f"-Wl,-rpath,{prefix / 'lib'}"]))


def test_library_files_are_deterministic_and_checked(library, tmp_path, capsys):
    model = library["out"] / PREFIX
    names = sorted(p.name for p in model.iterdir())
    assert names == sorted(["CMakeLists.txt", "Makefile", f"{PREFIX}.pc.in", f"{PREFIX}.c", f"{PREFIX}.h",
                            "derivation.md"])
    again = tmp_path / "elsewhere"
    assert main(["build", str(library["folder"] / "net.py"), "--out", str(again), "--library"]) == 0
    for name in ("CMakeLists.txt", "Makefile", f"{PREFIX}.pc.in"):
        text = (model / name).read_text()
        assert text == (again / PREFIX / name).read_text()  # no path, date or host in it
        assert str(library["folder"]) not in text and "net-1" not in text  # the prefix, never the raw name
    spec = [str(library["folder"] / "net.py"), "--out", str(again)]
    assert main(["build", *spec, "--check", "--library"]) == 0
    (again / PREFIX / "Makefile").write_text("stale\n")
    assert main(["build", *spec, "--check"]) == 1  # a folder that has the build files: checked without --library too
    capsys.readouterr()
    assert main(["build", *spec, "--check", "--library"]) == 1
    captured = capsys.readouterr()
    assert "-stale" in captured.out and "--library" in captured.err


def test_checked_in_digits_library_is_up_to_date(capsys):
    """generated/digits_mlp/ holds the build files examples/c/ uses."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        status = main(["build", "examples/digits_mlp.py", "--check", "--library"])
    finally:
        os.chdir(cwd)
    assert status == 0, capsys.readouterr().out


def test_model_file_optimizer_adds_train_step_and_epoch():
    header = (ROOT / "generated" / "digits_mlp" / "digits_mlp.h").read_text()
    for function in ("train_step", "train_epoch", "forward", "value_and_grad"):
        assert f"int digits_mlp_{function}(" in header
    assert isinstance(load_example("digits_mlp").optimizer, sbp.Adam)
    plain = (ROOT / "generated" / "relu_net" / "relu_net.h").read_text()  # no optimizer in its file
    assert "train_step" not in plain


@pytest.mark.parametrize("line, expected", [
    ('optimizer = "adam"', r"`optimizer` .* must be a symbackprop\.SGD or symbackprop\.Adam; it is a str"),
    ("optimizer = sbp.Adam", r"it is the class Adam \(call it: Adam\(lr=\.\.\.\)\)"),
    ("optimizer = sbp.SGD(lr=0.1)\nnet = sbp.Model('nolossnet', inputs=[X, T], params=[W, b], outputs={'Z': Z})",
     r"the model 'nolossnet' .* has no loss to train"),
])
def test_bad_optimizer_in_a_model_file_is_a_clear_error(tmp_path, capsys, line, expected):
    path = tmp_path / "bad.py"
    path.write_text(MODEL_FILE + line + "\n")
    assert main(["build", str(path), "--out", str(tmp_path / "gen")]) == 2
    err = capsys.readouterr().err
    assert re.search(expected, err) and str(path) in err, err
    assert not (tmp_path / "gen").exists()  # checked before anything is written


def test_library_named_like_a_system_library_is_refused(tmp_path, capsys):
    path = tmp_path / "m.py"
    path.write_text(MODEL_FILE.replace('"net-1"', '"M"'))  # its library would be libm
    assert main(["build", str(path), "--out", str(tmp_path / "gen")]) == 0  # without --library: fine
    assert main(["build", str(path), "--out", str(tmp_path / "lib"), "--library"]) == 2
    assert "would build the library libm" in capsys.readouterr().err
    assert not (tmp_path / "lib").exists()


def test_train_digits_c_program_learns(tmp_path):
    """examples/c: write the data, build train_digits with its CMake project
    (which adds generated/digits_mlp/), run it: no Python in the loop."""
    needs("cc", "cmake")
    pytest.importorskip("sklearn")
    data = tmp_path / "digits.bin"
    run([sys.executable, str(ROOT / "examples" / "c" / "write_digits.py"), str(data)])
    build = tmp_path / "build"
    run(["cmake", "-S", str(ROOT / "examples" / "c"), "-B", str(build)])
    run(["cmake", "--build", str(build)])
    printed = run([str(build / "train_digits"), str(data), "20"])
    losses = [float(x) for x in re.findall(r"mean loss (\S+)", printed)]
    accuracy = float(re.search(r"test accuracy: (\S+)", printed).group(1))
    assert len(losses) == 20 and losses[-1] < losses[0] / 10
    assert accuracy >= 0.95, printed


def test_a_folder_with_build_files_keeps_them_checked_without_the_flag(tmp_path, monkeypatch):
    """Once written, the build files are part of the model's output: plain
    `build --check` (the pre-commit hook) finds them stale, plain `build`
    rewrites them, and a folder without them does not get them."""
    from symbackprop.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.py").write_text(
        "import sympy as sp\nimport symbackprop as sbp\n"
        "n = sp.Symbol('n', integer=True, positive=True)\n"
        "X = sp.MatrixSymbol('X', n, 2)\nW = sp.MatrixSymbol('W', 2, 1)\n"
        "model = sbp.Model('net', inputs=[X], params=[W], loss=sbp.as_scalar((X * W).T * (X * W)))\n")
    assert main(["build", "net.py", "--out", "gen"]) == 0
    assert not (tmp_path / "gen" / "net" / "CMakeLists.txt").exists()
    assert main(["build", "net.py", "--out", "gen", "--library"]) == 0
    makefile = tmp_path / "gen" / "net" / "Makefile"
    fresh = makefile.read_text()
    makefile.write_text(fresh + "# edited by hand\n")
    assert main(["build", "net.py", "--out", "gen", "--check"]) == 1
    assert main(["build", "net.py", "--out", "gen"]) == 0
    assert makefile.read_text() == fresh
    assert main(["build", "net.py", "--out", "gen", "--check"]) == 0
