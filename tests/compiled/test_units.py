"""A large module's C is compiled as several translation units at once
(emit/cunits.py): the split module computes the same bits as the module in
one unit, its file still compiles alone as one unit (and each unit under
strict flags), a compile error in any unit is a BuildError naming the
log, and the split depends on the model only."""

import os
import re
import subprocess

import numpy as np
import pytest
from c_driver import STRICT_FLAGS, write_runtime_header
from conftest import load_example

import symbackprop as sbp
from symbackprop.emit import cunits
from symbackprop.emit.cunits import unit_count
from symbackprop.errors import BuildError
from symbackprop.pipeline import generate
from symbackprop.toolchain import builder
from symbackprop.toolchain.builder import DEFAULT_FLAGS, BuildOptions

FUNCTIONS = ("forward", "value_and_grad", "vjp")


@pytest.fixture
def split_everything(monkeypatch):
    """Every module split as far as it goes: each kernel a part, up to MAX_UNITS units."""
    monkeypatch.setattr(cunits, "UNIT_CHARS", 1)
    monkeypatch.setattr(cunits, "ALONE_CHARS", 1)


def _bits(value) -> object:
    """Results as exact bytes (NaN-safe), nested as returned."""
    if isinstance(value, dict):
        return {k: _bits(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_bits(v) for v in value]
    array = np.asarray(value)
    return (array.dtype.str, array.shape, array.tobytes())


def _results(mod, data: dict) -> list:
    """forward, value_and_grad, and vjp of a named output (else of the loss)."""
    values = mod.forward(**data)
    output = next((name for name in values if name != "loss"), "loss")
    seed = np.random.default_rng(7).standard_normal(np.shape(values[output]))
    return [_bits(values), _bits(mod.value_and_grad(**data)), _bits(mod.vjp(output, seed, **data))]


@pytest.mark.parametrize("name", ["gmm", "lstm_lm", pytest.param("pinn_poisson", marks=pytest.mark.slow)])
def test_a_split_module_computes_the_same_bits_as_one_unit(name, tmp_path, monkeypatch):
    """At the default flags (-O3, FMA contraction): in units, functions
    cannot be inlined across them, which must change no result."""
    example = load_example(name)
    data = example.sample_data(np.random.default_rng(3))
    most = cunits.MAX_UNITS
    monkeypatch.setattr(cunits, "MAX_UNITS", 1)
    whole = sbp.compile(example.model, functions=FUNCTIONS,
                        options=BuildOptions(flags=DEFAULT_FLAGS, cache_dir=tmp_path / "whole"))
    monkeypatch.setattr(cunits, "MAX_UNITS", most)
    monkeypatch.setattr(cunits, "UNIT_CHARS", 1)
    monkeypatch.setattr(cunits, "ALONE_CHARS", 1)
    split = sbp.compile(example.model, functions=FUNCTIONS,
                        options=BuildOptions(flags=DEFAULT_FLAGS, cache_dir=tmp_path / "split"))
    assert unit_count(whole.source) == 1 and unit_count(split.source) > 2
    log = (split.folder / "build.log").read_text()
    assert all(f"-DSYMBACKPROP_UNIT={k}" in log for k in range(unit_count(split.source)))
    assert _results(split, data) == _results(whole, data)


def _cc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["cc", *STRICT_FLAGS, *args], capture_output=True, text=True)


@pytest.mark.parametrize("name", ["gmm", "lstm_sequence", pytest.param("transformer_lm", marks=pytest.mark.slow)])
def test_a_split_file_compiles_as_one_unit_and_as_its_units(name, tmp_path, split_everything):
    """Without SYMBACKPROP_UNIT the file is one plain C99 unit (what a C
    user compiles); with it, each unit compiles under strict flags and the
    units link with no symbol missing or defined twice."""
    emitted, _ = generate(load_example(name).model, functions=FUNCTIONS)
    units = unit_count(emitted.source)
    assert units > 1
    source = tmp_path / f"{emitted.prefix}.c"
    source.write_text(emitted.source)
    (tmp_path / f"{emitted.prefix}.h").write_text(emitted.header)
    write_runtime_header(tmp_path)
    whole = _cc("-c", str(source), "-o", str(tmp_path / "whole.o"))
    assert whole.returncode == 0 and whole.stderr == "", whole.stderr
    objects = []
    for k in range(units):
        objects.append(str(tmp_path / f"unit{k}.o"))
        unit = _cc(f"-DSYMBACKPROP_UNIT={k}", "-fPIC", "-c", str(source), "-o", objects[-1])
        assert unit.returncode == 0 and unit.stderr == "", unit.stderr
    linked = subprocess.run(["cc", "-shared", "-Wl,--no-undefined", *objects, "-o", str(tmp_path / "m.so"), "-lm"],
                            capture_output=True, text=True)
    assert linked.returncode == 0, linked.stderr
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(tmp_path / "m.so")], capture_output=True, text=True).stdout
    assert f"{emitted.prefix}_value_and_grad" in symbols
    assert "_part1" not in symbols  # what units share is hidden (static in one unit)


@pytest.mark.parametrize("unit", [0, -1])
def test_a_compile_error_in_any_unit_is_a_build_error_naming_the_log(unit, tmp_path, split_everything):
    emitted, _ = generate(load_example("gmm").model)
    units = unit_count(emitted.source)
    guard = f"#if !defined(SYMBACKPROP_UNIT) || SYMBACKPROP_UNIT == {unit % units}\n"
    assert guard in emitted.source
    broken = emitted.source.replace(guard, guard + "#error this unit is broken\n", 1)
    assert unit_count(broken) == units
    with pytest.raises(BuildError, match="this unit is broken") as caught:
        builder.build(emitted.prefix, broken, emitted.header, emitted.cdef, BuildOptions(cache_dir=tmp_path))
    kept = re.search(r"are in (\S+\.log)", str(caught.value))
    assert kept and os.path.isfile(kept.group(1)), caught.value
    with open(kept.group(1)) as log:
        assert f"-DSYMBACKPROP_UNIT={unit % units}" in log.read()


def test_the_split_depends_on_the_model_only(monkeypatch):
    """The same C on any machine (not on its cores): a file's units are
    read from its guards, and generating again gives the same text."""
    model = load_example("transformer_lm").model
    first, _ = generate(model)
    assert unit_count(first.source) > 1  # large enough at the default thresholds
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    again, _ = generate(model)
    assert again.source == first.source


def test_a_small_module_stays_one_unit():
    emitted, _ = generate(load_example("mlp").model)
    assert unit_count(emitted.source) == 1 and "SYMBACKPROP_UNIT" not in emitted.source


def test_largest_pieces_go_to_the_lightest_unit(monkeypatch):
    """The units share the model's long bodies about equally: no unit holds
    more than the largest piece plus an even share of the rest."""
    emitted, _ = generate(load_example("transformer_lm").model)
    module = emitted.module
    sizes = cunits.kernel_sizes(module)
    loads = [0] * module.units
    largest = 0
    for fn in module.internal + module.functions:
        if fn.parts:
            for (start, end), unit in zip(fn.parts, fn.part_units):
                loads[unit] += sum(sizes[fn.name][start:end])
                largest = max(largest, sum(sizes[fn.name][start:end]))
        else:
            loads[fn.unit] += sum(sizes[fn.name])
            largest = max(largest, sum(sizes[fn.name]))
    assert 1 < module.units <= cunits.MAX_UNITS
    assert max(loads) <= largest + sum(loads) / module.units, loads


M_WIDE = 96  # coefficients: a body over ops.emap_kernel.LANES_MAX_OPS, run over whole eights and then the rest


def _polynomial_fit(m: int):
    """GradBench's llsq at m coefficients: a map over points whose body reads
    a shared row; its loop adds into the row's gradient (a value-only variant
    for forward)."""
    import sympy as sp

    N = sp.Symbol("N", integer=True, positive=True)
    points, coeffs = sp.MatrixSymbol("ts", N, 2), sp.MatrixSymbol("x", 1, m)
    t, s = sp.symbols("t s", real=True)
    k = sp.symbols(f"k0:{m}", real=True)
    body = (s - sum(k[j] * t**j for j in range(m))) ** 2
    sq = sbp.map_examples(body, [((t, s), points), (sp.Matrix(k), coeffs)])
    return sbp.Model(f"units_fit_m{m}", inputs=[points], params=[coeffs], loss=sbp.reduce("sum", sq, 0) / 2)


def test_a_loop_with_a_value_only_variant_is_two_parts_in_two_units(tmp_path, monkeypatch):
    """The per-example loop that adds into the shared row's gradient and its
    value-only variant are parts in different units (llsq's compile waited
    for both in one); they agree with numpy and, bit for bit, with the
    module in one unit, at a count of points that is not a whole number of
    vectors (the scalar rest runs too)."""
    model, functions = _polynomial_fit(M_WIDE), ("forward", "value_and_grad")
    rng = np.random.default_rng(5)
    t = np.linspace(-1, 1, 13)
    data = {"ts": np.stack([t, np.sign(t)], axis=1), "x": rng.standard_normal((1, M_WIDE))}
    most = cunits.MAX_UNITS
    monkeypatch.setattr(cunits, "MAX_UNITS", 1)
    whole = sbp.compile(model, functions=functions, options=BuildOptions(flags=DEFAULT_FLAGS, cache_dir=tmp_path / "w"))
    monkeypatch.setattr(cunits, "MAX_UNITS", most)
    monkeypatch.setattr(cunits, "UNIT_CHARS", 1)
    monkeypatch.setattr(cunits, "ALONE_CHARS", 1)
    mod = sbp.compile(model, functions=functions, options=BuildOptions(flags=DEFAULT_FLAGS, cache_dir=tmp_path / "s"))
    run = next(fn for fn in generate(model, functions=functions)[0].module.internal if fn.split is not None)
    unit_of = {k.fields["branch"]: unit for (start, end), unit in zip(run.parts, run.part_units)
               for k in run.kernels[start:end] if "branch" in k.fields}
    assert set(unit_of) == {"with_grads", "!with_grads"}
    assert unit_of["with_grads"] != unit_of["!with_grads"]
    powers = t[:, None] ** np.arange(M_WIDE)[None, :]
    residual = data["ts"][:, 1] - powers @ data["x"][0]
    loss, grads = mod.value_and_grad(**data)
    np.testing.assert_allclose(mod.forward(**data)["loss"], 0.5 * residual @ residual, rtol=1e-12)
    np.testing.assert_allclose(loss, 0.5 * residual @ residual, rtol=1e-12)
    np.testing.assert_allclose(grads["x"], -(powers.T @ residual)[None, :], rtol=1e-11, atol=1e-12)
    assert unit_count(whole.source) == 1
    assert [_bits(mod.forward(**data)), _bits(mod.value_and_grad(**data))] == \
        [_bits(whole.forward(**data)), _bits(whole.value_and_grad(**data))]
