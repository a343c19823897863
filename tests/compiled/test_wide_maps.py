"""A wide per-example body (hundreds of operations an example) that only
adds into sums (or stores one number an example into the workspace) and
reads rows it can copy runs over copies padded to whole eights with no
scalar loop, each sum in eight lanes; otherwise (here: it also returns a
number an example) over whole eights of examples, then the rest in a
scalar loop. Every count of examples gives the closed form's value and
gradient. A wide body adding into many sums marks its function
SYMBACKPROP_WIDE_SUMS (256-bit vectors). Where a loop with a scalar tail
has sums that are much of the body's work, each adds in the vector's
lanes (SYMBACKPROP_SIMD_SUMS), at the production flags too, and the C
builds under strict flags with OpenMP's simd directives and without."""

from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest
import sympy as sp
from c_driver import STRICT_FLAGS, strict_compile_errors, unwrapped, write_runtime_header

import symbackprop as sbp
from symbackprop.ops.emap_c import WIDE_SUMS_NARROW
from symbackprop.pipeline import generate
from symbackprop.toolchain import compiler
from symbackprop.toolchain.builder import DEFAULT_FLAGS, BuildOptions
from symbackprop.toolchain.compiler import SIMD_FLAGS

M = 64  # coefficients: a body far over LANES_MAX_OPS
FUNCTIONS = ("forward", "value_and_grad")


def _polyfit_model(degree: int = M - 1, free: int = M, residuals: bool = False) -> sbp.Model:
    """Least squares of a polynomial (GradBench llsq's form); with fewer
    `free` coefficients than terms, term j's coefficient is k[j % free];
    with `residuals`, forward returns each example's squared residual too
    (a number an example into an output: its loop keeps a scalar tail)."""
    N = sp.Symbol("N", integer=True, positive=True)
    points = sp.MatrixSymbol("ts", N, 2)
    coeffs = sp.MatrixSymbol("x", 1, free)
    t, s = sp.symbols("t s", real=True)
    k = sp.symbols(f"k0:{free}", real=True)
    fit = sum(k[j % free] * t**j for j in range(degree + 1))
    squared = sbp.map_examples((s - fit) ** 2, [((t, s), points), (sp.Matrix(k), coeffs)])
    name = ("wide_polyfit" if free == M else f"wide_polyfit_{free}") + ("_residuals" if residuals else "")
    return sbp.Model(name, inputs=[points], params=[coeffs], loss=sbp.reduce("sum", squared, 0) / 2,
                     outputs={"squared": squared} if residuals else None)


@pytest.fixture(scope="module")
def polyfit():
    """Least squares of a degree-63 polynomial, each example's squared
    residual returned too (a loop with a scalar tail)."""
    return sbp.compile(_polyfit_model(residuals=True), functions=FUNCTIONS)


@pytest.fixture(scope="module")
def polyfit_production(tmp_path_factory):
    """The same at the production flags (-O3 -march=native): GCC vectorizes
    the loop and its sums in lanes."""
    options = BuildOptions(flags=DEFAULT_FLAGS, cache_dir=tmp_path_factory.mktemp("production"))
    return sbp.compile(_polyfit_model(residuals=True), functions=FUNCTIONS, options=options)


@pytest.fixture(scope="module")
def polyfit_eights():
    """The loss alone: 64 sums over whole eights, in eight lanes each."""
    return sbp.compile(_polyfit_model(), functions=FUNCTIONS)


@pytest.fixture(scope="module")
def polyfit_eights_production(tmp_path_factory):
    options = BuildOptions(flags=DEFAULT_FLAGS, cache_dir=tmp_path_factory.mktemp("production_eights"))
    return sbp.compile(_polyfit_model(), functions=FUNCTIONS, options=options)


def test_the_wide_loop_has_a_scalar_tail(polyfit):
    assert "SYMBACKPROP_SCALAR_TAIL" in polyfit.emitted.source
    assert "& ~(int64_t)7" in polyfit.emitted.source


def test_many_sums_of_a_wide_loss_run_over_whole_eights_in_lanes(polyfit_eights):
    """Each of the 64 sums in eight lanes of the workspace (from a 64-byte
    line), the last eight examples' apart, added up after the loop."""
    source = polyfit_eights.emitted.source
    assert "SYMBACKPROP_SCALAR_TAIL" not in source and "SYMBACKPROP_SIMD_SUMS" not in source
    assert "+ 63) & ~(uintptr_t)63); /* its sums' lanes" in unwrapped(source)
    assert "*const into = i0 + 8 <= N ? lanes : lanes + 512;" in source
    assert re.search(r"into\[504 \+ lane\] \+= ", source)
    assert "_lane_sums(lanes, 8, 64, N - (rows8 - 8), term_sums);" in source
    # the 64 sums then add into x's gradient in one loop, not 64 lines
    assert "for (int64_t k = 0; k < 64; ++k) {\n" in source and "grad_x[k] += term_sums[k];" in source
    assert "grad_x[1] +=" not in source


@pytest.mark.parametrize("build", ["polyfit", "polyfit_production", "polyfit_eights", "polyfit_eights_production"])
@pytest.mark.parametrize("n", [1, 5, 7, 8, 13, 16, 21])
def test_every_count_of_examples_gives_the_closed_form(build, n, request):
    polyfit = request.getfixturevalue(build)
    rng = np.random.default_rng(n)
    t = rng.uniform(-1, 1, n)
    s = rng.normal(size=n)
    x = rng.normal(size=M) / np.arange(1, M + 1)
    V = t[:, None] ** np.arange(M)[None, :]
    r = s - V @ x
    ts, row = np.stack([t, s], axis=1), x.reshape(1, -1)
    loss, grads = polyfit.value_and_grad(ts=ts, x=row)
    np.testing.assert_allclose(float(np.asarray(loss).ravel()[0]), 0.5 * r @ r, rtol=1e-10)
    np.testing.assert_allclose(grads["x"].ravel(), -(V.T @ r), rtol=1e-9, atol=1e-12)
    forward = polyfit.forward(ts=ts, x=row)
    np.testing.assert_allclose(float(np.asarray(forward["loss"]).ravel()[0]), 0.5 * r @ r, rtol=1e-10)
    if "squared" in forward:
        np.testing.assert_allclose(np.ravel(forward["squared"]), r * r, rtol=1e-10)


@pytest.fixture(scope="module")
def many_sums():
    """A wide body whose gradient adds into WIDE_SUMS_NARROW sums: squared
    residuals of one line per coefficient, k_j t - s."""
    count = WIDE_SUMS_NARROW
    N = sp.Symbol("N", integer=True, positive=True)
    points = sp.MatrixSymbol("ts", N, 2)
    coeffs = sp.MatrixSymbol("k", 1, count)
    t, s = sp.symbols("t s", real=True)
    k = sp.symbols(f"k0:{count}", real=True)
    body = sum((k[j] * t - s) ** 2 for j in range(count)) / 2
    squared = sbp.map_examples(body, [((t, s), points), (sp.Matrix(k), coeffs)])
    model = sbp.Model("wide_many_sums", inputs=[points], params=[coeffs], loss=sbp.reduce("sum", squared, 0))
    return sbp.compile(model, functions=("forward", "value_and_grad"))


def test_many_sums_mark_their_function_and_few_do_not(polyfit, many_sums):
    # the shared function, or (a module split into units: emit/cunits.py) its parts
    assert re.search(r"^SYMBACKPROP_WIDE_SUMS (static|WIDE_MANY_SUMS_SHARED) ", many_sums.emitted.source, re.M)
    assert "SYMBACKPROP_WIDE_SUMS" not in polyfit.emitted.source  # 64 sums
    assert re.search(r"^SYMBACKPROP_WIDE (static|WIDE_POLYFIT_RESIDUALS_SHARED) ", polyfit.emitted.source, re.M)


@pytest.mark.parametrize("n", [1, 7, 8, 13])
def test_many_sums_give_the_closed_form(many_sums, n):
    rng = np.random.default_rng(100 + n)
    t, s = rng.normal(size=n), rng.normal(size=n)
    k = rng.normal(size=WIDE_SUMS_NARROW)
    r = k[None, :] * t[:, None] - s[:, None]  # examples x coefficients
    ts = np.stack([t, s], axis=1)
    loss, grads = many_sums.value_and_grad(ts=ts, k=k.reshape(1, -1))
    np.testing.assert_allclose(float(np.asarray(loss).ravel()[0]), 0.5 * np.sum(r * r), rtol=1e-12)
    np.testing.assert_allclose(grads["k"].ravel(), (r * t[:, None]).sum(0), rtol=1e-12, atol=1e-12)


def test_sums_that_are_much_of_the_body_add_in_the_vectors_lanes(polyfit, polyfit_production):
    """64 sums in a body of some 400 operations: OpenMP's simd reduction,
    which the builder's flags turn on."""
    for module in (polyfit, polyfit_production):
        loop = r"SYMBACKPROP_SIMD_SUMS\(acc0, acc1, .*, acc63\)\n *for \(int64_t i = 0; i < \(N & ~"
        assert re.search(loop, unwrapped(module.emitted.source))
        assert " ".join(SIMD_FLAGS) in (module.folder / "build.log").read_text()


@pytest.fixture(scope="module")
def few_sums():
    """4 sums in a body of hundreds of operations (GradBench gmm's kind)."""
    return sbp.compile(_polyfit_model(free=4), functions=FUNCTIONS)


@pytest.fixture(scope="module")
def few_sums_production(tmp_path_factory):
    options = BuildOptions(flags=DEFAULT_FLAGS, cache_dir=tmp_path_factory.mktemp("production_few"))
    return sbp.compile(_polyfit_model(free=4), functions=FUNCTIONS, options=options)


def test_few_sums_in_a_wide_body_run_over_whole_eights(few_sums):
    """No scalar tail: the rows it reads are copied to whole eights (the last
    again past it), each sum adds in eight lanes, and the lanes add up after
    the loop."""
    source = few_sums.emitted.source
    assert "const int64_t rows8 = (N + 7) & ~(int64_t)7;" in source
    assert "ts_by_column[i + rows8] = ts[2*row + 1];" in source
    assert "SYMBACKPROP_SCALAR_TAIL" not in source
    assert "SYMBACKPROP_SIMD_SUMS" not in source
    assert "for (int64_t lane = 0; lane < 8; ++lane) {" in source
    assert "_lane_sums(lanes, 8, 4, N - (rows8 - 8), term_sums);" in source


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_value_only_variant_of_a_loop_over_whole_eights_adds_no_sums(dtype, tmp_path):
    """forward's variant of that loop (its sums are the gradient's) keeps
    no lanes: it zeroed them, added them up and into the gradient (its
    `into` unused, which -Wall -Werror refused), as it ran the product
    after the loop of OuterProductSums (the template read the sums of the
    loop with gradients)."""
    emitted, _ = generate(_polyfit_model(free=4), dtype=dtype, functions=FUNCTIONS)
    with_grads, rest = emitted.source.split("/* the forward values only */")
    value_only = rest.split("/* colsum_x = ")[0]  # to the loop's end
    assert "_lane_sums(lanes, " in with_grads and "grad_x[0] += term_sums[0];" in with_grads
    assert "lanes" not in value_only and "term_sums" not in value_only and "grad_x" not in value_only
    assert strict_compile_errors(emitted, tmp_path, dtype) == ""


@pytest.mark.parametrize(("dim", "points_name", "coeffs_name"), [("rows8", "row", "x"), ("N", "lanes", "into")])
def test_whole_eights_keep_clear_of_user_names(dim, points_name, coeffs_name):
    """A dimension named rows8, points named row or lanes, coefficients
    named into (the names of the loop's own locals) are renamed in the C,
    and the sums stay right."""
    N = sp.Symbol(dim, integer=True, positive=True)
    points = sp.MatrixSymbol(points_name, N, 2)
    coeffs = sp.MatrixSymbol(coeffs_name, 1, 4)
    t, s = sp.symbols("t s", real=True)
    k = sp.symbols("k0:4", real=True)
    fit = sum(k[j % 4] * t**j for j in range(M))
    squared = sbp.map_examples((s - fit) ** 2, [((t, s), points), (sp.Matrix(k), coeffs)])
    model = sbp.Model(f"wide_names_{points_name}", inputs=[points], params=[coeffs],
                      loss=sbp.reduce("sum", squared, 0) / 2)
    module = sbp.compile(model, functions=FUNCTIONS)
    source = module.emitted.source
    assert "const int64_t rows8 = " in source and "*const lanes = " in source and "*const into = " in source
    for name in {dim, points_name, coeffs_name} & {"rows8", "row", "lanes", "into"}:
        assert re.search(rf"\b{name}_\w*\b", source), name  # the user's, renamed
    rng = np.random.default_rng(3)
    t_, s_, k_ = rng.uniform(-1, 1, 11), rng.normal(size=11), rng.normal(size=4)
    fold = np.zeros((M, 4))
    fold[np.arange(M), np.arange(M) % 4] = 1
    V = t_[:, None] ** np.arange(M)[None, :]
    r = s_ - V @ fold @ k_
    loss, grads = module.value_and_grad(**{points_name: np.stack([t_, s_], axis=1), coeffs_name: k_.reshape(1, -1)})
    np.testing.assert_allclose(float(np.asarray(loss).ravel()[0]), 0.5 * r @ r, rtol=1e-10)
    np.testing.assert_allclose(grads[coeffs_name].ravel(), -(fold.T @ V.T @ r), rtol=1e-9,
                               atol=1e-9 * np.abs(V.T @ r).max())


@pytest.mark.parametrize("build", ["few_sums", "few_sums_production"])
@pytest.mark.parametrize("n", [1, 5, 7, 8, 13, 21, 8200])
def test_whole_eights_give_the_closed_form(build, n, request):
    """Sums over 1 to 8200 examples (a count of whole eights or not, less
    than eight) against numpy's closed form."""
    module = request.getfixturevalue(build)
    free = 4
    rng = np.random.default_rng(n)
    t = rng.uniform(-1, 1, n)
    s = rng.normal(size=n)
    k = rng.normal(size=free)
    V = t[:, None] ** np.arange(M)[None, :]
    fold = np.zeros((M, free))
    fold[np.arange(M), np.arange(M) % free] = 1  # term j's coefficient is k[j % free]
    r = s - V @ fold @ k
    ts, row = np.stack([t, s], axis=1), k.reshape(1, -1)
    loss, grads = module.value_and_grad(ts=ts, x=row)
    np.testing.assert_allclose(float(np.asarray(loss).ravel()[0]), 0.5 * r @ r, rtol=1e-10)
    np.testing.assert_allclose(grads["x"].ravel(), -(fold.T @ V.T @ r), rtol=1e-9, atol=1e-9 * np.abs(V.T @ r).max())
    np.testing.assert_allclose(float(np.asarray(module.forward(ts=ts, x=row)["loss"]).ravel()[0]), 0.5 * r @ r,
                               rtol=1e-10)


@pytest.mark.parametrize("build", ["polyfit_production", "polyfit_eights_production"])
def test_repeated_calls_give_the_same_bits(build, request):
    module = request.getfixturevalue(build)
    rng = np.random.default_rng(5)
    ts = np.stack([rng.uniform(-1, 1, 21), rng.normal(size=21)], axis=1)
    row = rng.normal(size=(1, M))
    first = module.value_and_grad(ts=ts, x=row)[1]["x"].copy()
    assert np.array_equal(module.value_and_grad(ts=ts, x=row)[1]["x"], first)


@pytest.mark.parametrize("build", ["polyfit", "polyfit_eights"])
@pytest.mark.parametrize("simd", [True, False], ids=["simd", "plain"])
def test_simd_sums_build_under_strict_flags_with_the_directives_and_without(build, tmp_path, simd, request):
    """What a C user compiles: no warning about an unknown pragma where the
    directives are off, none about the reduction where they are on (nor
    about the lanes of a loop over whole eights)."""
    polyfit = request.getfixturevalue(build)
    source = tmp_path / "polyfit.c"
    source.write_text(polyfit.emitted.source)
    (tmp_path / f"{polyfit.emitted.prefix}.h").write_text(polyfit.emitted.header)
    write_runtime_header(tmp_path)
    flags = [*STRICT_FLAGS, "-O2", *(SIMD_FLAGS if simd else ())]
    built = subprocess.run(["cc", *flags, "-I", str(tmp_path), "-c", str(source), "-o", str(tmp_path / "p.o")],
                           capture_output=True, text=True)
    assert built.returncode == 0 and built.stderr == "", built.stderr


@pytest.mark.parametrize(("identity", "flags"), [
    ("gcc (Debian 12.2.0-14) 12.2.0\nCopyright (C) 2022 Free Software Foundation, Inc.", SIMD_FLAGS),
    ("Ubuntu clang version 18.1.3\nTarget: x86_64-pc-linux-gnu", SIMD_FLAGS),
    ("Apple clang version 16.0.0 (clang-1600.0.26.6)\nTarget: arm64-apple-darwin24.3.0", ()),
    ("tcc version 0.9.27 (x86_64 Linux)", ()),
])
def test_the_simd_flags_go_to_compilers_that_take_them(identity, flags, monkeypatch):
    """Apple's Clang turns OpenMP flags away, and other compilers may not
    know them: those build without (the sums then keep the examples' order)."""
    monkeypatch.setattr(compiler, "compiler_identity", lambda command: identity)
    assert compiler.simd_flags(("cc-for", identity)) == flags


def test_pairs_with_a_per_pair_weight_read_by_column_match_differences():
    """Of two loops over (point, centre) pairs, a wide body whose sums add
    into rows of the outer loop (which may then run on threads, so it keeps
    its scalar loop for the last examples) reads its copies, the softmax
    weights of the pairs by column too, to whole eights: the gradient
    against central differences at counts of points under eight and not a
    whole eight."""
    d, p = 8, 60
    N, K = sp.symbols("N K", integer=True, positive=True)
    X, MU = sp.MatrixSymbol("X", N, d), sp.MatrixSymbol("mu", K, d)
    x, m = sp.symbols(f"x0:{d}", real=True), sp.symbols(f"m0:{d}", real=True)
    s = sum((x[k] - m[k]) ** 2 for k in range(d)) / d
    body = sum(s**j / sp.factorial(j) * (-1) ** j for j in range(1, p))  # exp(-s) - 1, as a polynomial
    terms = sbp.map_examples(body, [(sp.Matrix(x), X), (sp.Matrix(m), MU)])
    loss = sbp.reduce("sum", sbp.reduce("logsumexp", terms, 1), 0)
    module = sbp.compile(sbp.Model("wide_pairs", inputs=[X], params=[MU], loss=loss), functions=FUNCTIONS)
    # the pairs' weights (the softmax's adjoint, N x K) copied by column, the last row again past the last
    assert re.search(r"\w+_by_column\[i \+ rows8\*j\] = \w+\[K\*row \+ j\];", module.emitted.source)

    def value(points, centres):
        S = ((points[:, None, :] - centres[None, :, :]) ** 2).sum(-1) / d
        F = sum(S**j / np.prod(np.arange(1.0, j + 1)) * (-1) ** j for j in range(1, p))
        top = F.max(1, keepdims=True)
        return float(np.sum(top[:, 0] + np.log(np.exp(F - top).sum(1))))

    rng = np.random.default_rng(11)
    for n in (3, 13):
        points, centres = rng.normal(size=(n, d)) * 0.5, rng.normal(size=(4, d)) * 0.5
        loss_value, grads = module.value_and_grad(X=points, mu=centres)
        np.testing.assert_allclose(float(np.ravel(loss_value)[0]), value(points, centres), rtol=1e-12)
        step, fd = 1e-6, np.zeros_like(centres)
        for a, b in np.ndindex(*centres.shape):
            up, down = centres.copy(), centres.copy()
            up[a, b] += step
            down[a, b] -= step
            fd[a, b] = (value(points, up) - value(points, down)) / (2 * step)
        np.testing.assert_allclose(grads["mu"], fd, rtol=1e-6, atol=1e-7 * np.abs(fd).max())


@pytest.fixture(scope="module")
def polyfit_eights_float32():
    return sbp.compile(_polyfit_model(), functions=FUNCTIONS, dtype="float32")


@pytest.mark.parametrize("n", [1, 7, 8, 13, 1003])
def test_lanes_in_float32_give_the_closed_form(polyfit_eights_float32, n):
    """The same loop in float: sixteen lanes of floats a sum (a 64-byte
    line, one vector register), the runtime's f32 lane_sums; against
    numpy's float64 closed form (tests/compiled/test_emap_lanes.py: more
    counts, and the other loops)."""
    source = polyfit_eights_float32.emitted.source
    assert "symbackprop_f32_lane_sums(lanes, 16, 64, N - (rows16 - 16), term_sums);" in source
    rng = np.random.default_rng(40 + n)
    t, s = rng.uniform(-1, 1, n), rng.normal(size=n)
    x = rng.normal(size=M) / np.arange(1, M + 1)
    V = t[:, None] ** np.arange(M)[None, :]
    r = s - V @ x
    ts = np.stack([t, s], axis=1).astype(np.float32)
    loss, grads = polyfit_eights_float32.value_and_grad(ts=ts, x=x.reshape(1, -1).astype(np.float32))
    scale = np.abs(V).T @ np.abs(r) + 1
    np.testing.assert_allclose(float(np.ravel(loss)[0]), 0.5 * r @ r, rtol=1e-4)
    assert np.all(np.abs(grads["x"].ravel() + V.T @ r) <= 1e-4 * scale)
