"""Pipeline logging: each stage with its duration, cache hits and misses."""

import logging
import re
import shlex

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
import symbackprop.log as log
import symbackprop.toolchain.builder as build_module
from symbackprop.cli import main
from symbackprop.declare import nn
from symbackprop.toolchain.builder import BuildOptions


def small_model():
    x, w = sp.MatrixSymbol("x", 2, 1), sp.MatrixSymbol("w", 1, 2)
    return sbp.Model("logged", inputs=[x], params=[w], loss=nn.sum_all(nn.tanh(w * x)))


def test_stages_of_a_fresh_compile_then_a_cache_hit(tmp_path, caplog):
    options = BuildOptions(cache_dir=tmp_path)
    caplog.set_level(logging.INFO, logger="symbackprop")
    sbp.compile(small_model(), options=options)
    lines = [r.getMessage() for r in caplog.records if r.name == "symbackprop"]
    for name in ("lower logged", "differentiate logged", "emit logged", "C compile logged"):
        assert any(re.match(rf"{name}: \d+\.\d{{3}} s", line) for line in lines), (name, lines)
    ops = next(line for line in lines if line.startswith("differentiate"))
    before, after = map(int, re.search(r"value_and_grad: (\d+) -> (\d+) scalar ops", ops).groups())
    assert 0 < after <= before
    assert any(line.startswith(f"cache miss: {tmp_path}/") for line in lines), lines
    assert not any(line.startswith("cache hit") for line in lines)
    caplog.clear()
    sbp.compile(small_model(), options=options)
    lines = [r.getMessage() for r in caplog.records if r.name == "symbackprop"]
    assert any(line.startswith(f"cache hit: {tmp_path}") for line in lines), lines
    assert not any(line.startswith(("lower", "C compile", "cache miss")) for line in lines)


def test_build_verbose_logs_to_stderr(tmp_path, capsys):
    logger = logging.getLogger("symbackprop")
    handlers, level = list(logger.handlers), logger.level
    try:
        model_file = tmp_path / "m.py"
        model_file.write_text(
            "import sympy as sp\nimport symbackprop as sbp\n"
            "a = sp.Symbol('a')\nmodel = sbp.Model('cli_logged', params=[a], loss=a**2)\n"
        )
        assert main(["build", str(model_file), "--out", str(tmp_path / "out"), "-v"]) == 0
        err = capsys.readouterr().err
        for name in ("lower", "differentiate", "emit"):
            assert re.search(rf"^symbackprop: {name} cli_logged: \d+\.\d+ s", err, re.MULTILINE), err
    finally:
        for handler in logger.handlers[len(handlers):]:
            logger.removeHandler(handler)
        logger.setLevel(level)


def test_a_slow_compile_logs_what_it_compiles_and_its_progress(tmp_path, caplog, monkeypatch):
    """A compiler that takes 0.4 s, progress every 0.1 s: the lines before,
    during and after the compiler runs, in that order."""
    slow = tmp_path / "slow-cc"
    real = shlex.join(build_module.compiler_command())
    slow.write_text(f'#!/bin/sh\nif [ "$1" != --version ]; then sleep 0.4; fi\nexec {real} "$@"\n')
    slow.chmod(0o755)
    monkeypatch.setenv("CC", str(slow))
    monkeypatch.setattr(build_module, "PROGRESS_SECONDS", 0.1)
    caplog.set_level(logging.INFO, logger="symbackprop")
    x, w = sp.MatrixSymbol("x", 2, 1), sp.MatrixSymbol("w", 1, 2)
    sbp.compile(sbp.Model("slow_logged", inputs=[x], params=[w], loss=nn.sum_all(nn.tanh(w * x))),
                options=BuildOptions(cache_dir=tmp_path / "cache"))
    lines = [r.getMessage() for r in caplog.records if r.name == "symbackprop"]
    starts = [i for i, line in enumerate(lines)
              if re.fullmatch(r"compiling slow_logged: [1-9]\d* lines of C, cache key [0-9a-f]{12}", line)]
    progress = [i for i, line in enumerate(lines) if line.startswith("still compiling")]
    done = [i for i, line in enumerate(lines) if re.fullmatch(r"C compile slow_logged: \d+\.\d{3} s", line)]
    assert len(starts) == 1 and progress and len(done) == 1, lines
    assert starts[0] < min(progress) and max(progress) < done[0], lines
    assert all(re.fullmatch(r"still compiling slow_logged: \d+\.\d s elapsed", lines[i]) for i in progress), lines
    key = next(line for line in lines if line.startswith("cache miss: ")).rsplit("/", 1)[1]
    assert lines[starts[0]].endswith(f"cache key {key[:12]}")


def _slow_compiler(tmp_path, monkeypatch, seconds=0.4):
    slow = tmp_path / "slow-cc"
    real = shlex.join(build_module.compiler_command())
    slow.write_text(f'#!/bin/sh\nif [ "$1" != --version ]; then sleep {seconds}; fi\nexec {real} "$@"\n')
    slow.chmod(0o755)
    monkeypatch.setenv("CC", str(slow))


SO_FAR = r"more than 0\.1 s so far \(now: (lower|differentiate|emit|C compile) {}\)"


def test_every_slow_compile_says_so_once_with_model_and_stage(tmp_path, caplog, monkeypatch):
    """compile and the C functions built on first use (vjp, jvp, hvp, and
    train_step inside fit): one line each, naming the model and the stage."""
    _slow_compiler(tmp_path, monkeypatch)
    monkeypatch.setattr(log, "SLOW_SECONDS", 0.1)
    caplog.set_level(logging.INFO, logger="symbackprop")
    n = sp.Symbol("n", integer=True, positive=True)
    x, w, t = sp.MatrixSymbol("x", n, 2), sp.MatrixSymbol("w", 2, 1), sp.MatrixSymbol("t", n, 1)
    model = sbp.Model("slow_lazy", inputs=[x, t], params=[w], loss=nn.mse(nn.tanh(x * w), t), outputs={"y": x * w})
    mod = sbp.compile(model, options=BuildOptions(cache_dir=tmp_path / "cache"), optimizer=sbp.SGD(lr=0.1))
    arrays = {"x": np.ones((3, 2)), "t": np.zeros((3, 1)), "w": np.full((2, 1), 0.5)}
    mod.vjp("y", np.ones((3, 1)), **arrays)
    mod.jvp({"w": np.ones((2, 1))}, **arrays)
    mod.hvp({"w": np.ones((2, 1))}, **arrays)
    mod.fit(1, 2, **arrays)
    lines = [r.getMessage() for r in caplog.records if r.name == "symbackprop" and "so far" in r.getMessage()]
    expected = [r"compiling 'slow_lazy' \(forward, value_and_grad, float64\): "] + [
        rf"compiling {kind} of 'slow_lazy' \(built on first use\): " for kind in ("vjp", "jvp", "hvp", "train_step")]
    assert len(lines) == len(expected), lines
    for line, start in zip(lines, expected):
        assert re.fullmatch(start + SO_FAR.format("slow_lazy"), line), line


def test_a_fast_compile_says_nothing_and_a_terminal_hears_without_logging(tmp_path, caplog, capsys, monkeypatch):
    caplog.set_level(logging.INFO, logger="symbackprop")
    options = BuildOptions(cache_dir=tmp_path / "cache")
    sbp.compile(small_model(), options=options)
    caplog.clear()
    sbp.compile(small_model(), options=options)  # a cache hit: well under a second
    assert not [r for r in caplog.records if "so far" in r.getMessage()]
    # no logging configured (pytest's handlers hidden), stderr a terminal: the line goes to stderr
    _slow_compiler(tmp_path, monkeypatch)
    monkeypatch.setattr(log, "SLOW_SECONDS", 0.1)
    monkeypatch.setattr(log.logger, "hasHandlers", lambda: False)
    monkeypatch.setattr(log, "is_terminal", lambda stream: True)
    sbp.compile(small_model(), options=BuildOptions(cache_dir=tmp_path / "other"))
    err = capsys.readouterr().err
    assert re.fullmatch(r"symbackprop: compiling 'logged' \(forward, value_and_grad, float64\): "
                        + SO_FAR.format("logged") + "\n", err), err
    monkeypatch.setattr(log, "is_terminal", lambda stream: False)  # not a terminal: silent, as progress bars
    sbp.compile(small_model(), options=BuildOptions(cache_dir=tmp_path / "third"))
    assert capsys.readouterr().err == ""


def test_build_progress_shows_the_stages_of_one_model(tmp_path, capsys):
    pytest.importorskip("tqdm")
    model_file = tmp_path / "m.py"
    model_file.write_text("import sympy as sp\nimport symbackprop as sbp\n"
                          "a = sp.Symbol('a')\nmodel = sbp.Model('staged', params=[a], loss=a**2)\n")
    assert main(["build", str(model_file), "--out", str(tmp_path / "out"), "--progress"]) == 0
    err = capsys.readouterr().err
    for name in ("lower", "differentiate", "emit"):
        assert f"stage={name} staged" in err, err
    assert "1/1" in err
