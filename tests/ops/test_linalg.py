"""Linear algebra ops (sbp.det, logdet, solve, cholesky, triangular_solve)
on matrices of a symbolic size n: values and gradients of the compiled C
against JAX and PyTorch in float64 (1e-10 relative) and central finite
differences, second derivatives (sbp.grad in the model, hvp) against JAX's
nested derivatives, and the documented answers for singular and indefinite
matrices. One compiled module per model, shared by the tests (module-scoped).
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.errors import ModelError

n, k = sp.symbols("n k", integer=True, positive=True)
A = sp.MatrixSymbol("A", n, n)
B = sp.MatrixSymbol("B", n, k)
S = sp.MatrixSymbol("S", n, n)
C = sp.MatrixSymbol("C", n, n)
D = sp.MatrixSymbol("D", n, k)
SIZES = (1, 2, 3, 5)


def _sum(m):
    return sbp.as_scalar(nn.sum_all(m))


def _parts():
    """The five ops in one loss, each through a different nonlinearity."""
    return {
        "det": sbp.det(A),
        "logdet": sbp.logdet(A),
        "solve": _sum(sbp.solve(A, B).applyfunc(sp.sin)),
        "cholesky": _sum(sbp.cholesky(S).applyfunc(sp.cos)),
        "lower": _sum(sbp.triangular_solve(A, B, lower=True).applyfunc(lambda v: v**2)),
        "upper_t": _sum(sbp.triangular_solve(A, B, lower=False, transpose=True).applyfunc(sp.sin)),
    }


def _loss_expr():
    p = _parts()
    return p["det"] / 3 + p["logdet"] + p["solve"] + p["cholesky"] + p["lower"] / 5 + p["upper_t"]


@pytest.fixture(scope="module")
def mod():
    outputs = {"d": sbp.det(A) * sp.OneMatrix(1, 1), "ld": sbp.logdet(A) * sp.OneMatrix(1, 1),
               "X": sbp.solve(A, B), "L": sbp.cholesky(S), "T": sbp.triangular_solve(A, B, lower=False)}
    model = sbp.Model("linalg_all", params=[A, B, S], loss=_loss_expr(), outputs=outputs)
    return sbp.compile(model)


def _draw(size, seed=0):
    rng = np.random.default_rng(seed + size)
    a = rng.standard_normal((size, size)) + 0.5 * np.eye(size)
    m = rng.standard_normal((size, size))
    s = m @ m.T + size * np.eye(size) + 0.1 * rng.standard_normal((size, size))  # not symmetric: its symmetric part is factored
    return {"A": a, "B": rng.standard_normal((size, 2)), "S": s}


def _reference_loss(xp, linalg, tri, arrays):
    """The loss in a framework (xp: its numpy; tri(t, b, lower, transpose))."""
    a, b, s = arrays["A"], arrays["B"], arrays["S"]
    lower = tri(a, b, True, False)
    upper_t = tri(a, b, False, True)
    return (linalg.det(a) / 3 + linalg.slogdet(a)[1] + xp.sum(xp.sin(linalg.solve(a, b)))
            + xp.sum(xp.cos(linalg.cholesky((s + s.T) / 2))) + xp.sum(lower**2) / 5 + xp.sum(xp.sin(upper_t)))


def _jax():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    from jax.scipy.linalg import solve_triangular

    def tri(t, b, lower, transpose):
        return solve_triangular(t, b, lower=lower, trans=1 if transpose else 0)

    return jax, jnp, tri


def _torch():
    torch = pytest.importorskip("torch")

    def tri(t, b, lower, transpose):
        t = t.tril() if lower else t.triu()
        return torch.linalg.solve_triangular(t.T if transpose else t, b, upper=(lower == transpose))

    return torch, tri


@pytest.mark.parametrize("size", SIZES)
def test_value_and_grad_match_jax(mod, size):
    jax, jnp, tri = _jax()
    arrays = _draw(size)
    loss, grads = mod.value_and_grad(**arrays)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda d: _reference_loss(jnp, jnp.linalg, tri, d)))(
        {name: jnp.asarray(v) for name, v in arrays.items()})
    assert loss == pytest.approx(float(ref_loss), rel=1e-10)
    for name in ("A", "B", "S"):
        np.testing.assert_allclose(grads[name], np.asarray(ref_grads[name]), rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("size", SIZES)
def test_value_and_grad_match_torch(mod, size):
    torch, tri = _torch()
    arrays = _draw(size, seed=10)
    tensors = {name: torch.tensor(v, dtype=torch.float64, requires_grad=True) for name, v in arrays.items()}
    ref = _reference_loss(torch, torch.linalg, tri, tensors)
    ref.backward()
    loss, grads = mod.value_and_grad(**arrays)
    assert loss == pytest.approx(ref.item(), rel=1e-10)
    for name in ("A", "B", "S"):
        np.testing.assert_allclose(grads[name], tensors[name].grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("size", (2, 5))
def test_outputs_match_numpy(mod, size):
    arrays = _draw(size, seed=20)
    out = mod.forward(**arrays)
    a, b, s = arrays["A"], arrays["B"], arrays["S"]
    np.testing.assert_allclose(out["d"], np.linalg.det(a), rtol=1e-12)
    np.testing.assert_allclose(out["ld"], np.linalg.slogdet(a)[1], rtol=1e-12)
    np.testing.assert_allclose(out["X"], np.linalg.solve(a, b), rtol=1e-10)
    np.testing.assert_allclose(out["L"], np.linalg.cholesky((s + s.T) / 2), rtol=1e-12, atol=1e-14)
    assert np.all(np.triu(out["L"], 1) == 0)
    np.testing.assert_allclose(np.triu(a) @ out["T"], b, rtol=1e-10, atol=1e-12)


def test_grad_matches_central_differences(mod):
    arrays = _draw(3, seed=30)
    _, grads = mod.value_and_grad(**arrays)
    step = 1e-6
    for name in ("A", "B", "S"):
        numeric = np.zeros_like(arrays[name])
        for index in np.ndindex(*arrays[name].shape):
            for sign in (1, -1):
                moved = {**arrays, name: arrays[name].copy()}
                moved[name][index] += sign * step
                numeric[index] += sign * mod.forward(**moved)["loss"] / (2 * step)
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-6, atol=1e-7, err_msg=name)


def test_singular_and_indefinite_give_the_documented_values(mod):
    singular = np.array([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.0, 1.0, 1.0]])  # row 2 = 2 * row 1
    indefinite = np.diag([1.0, -1.0, 2.0])
    out = mod.forward(A=singular, B=np.ones((3, 2)), S=indefinite)
    assert out["d"] == 0.0
    assert out["ld"] == -np.inf
    assert not np.all(np.isfinite(out["X"]))  # never a silent finite answer
    assert np.isfinite(out["L"][0, 0]) and np.isnan(out["L"][1:, 1:]).any()
    with_nan = singular.copy()
    with_nan[2, 0] = np.nan
    out = mod.forward(A=with_nan, B=np.ones((3, 2)), S=np.eye(3))
    assert np.isnan(out["d"]) and np.isnan(out["ld"])
    assert np.isnan(out["X"]).any()


# --- second derivatives ---------------------------------------------------------------


def _nested_loss_expr():
    """Gradients of each op inside the loss, weighted by the inputs C and D."""
    p = _parts()
    inner_a = sbp.grad(p["det"] + p["logdet"] + p["solve"] + p["lower"] + p["upper_t"], A)
    inner_b = sbp.grad(p["solve"], B)
    inner_s = sbp.grad(p["cholesky"], S)
    return _sum(sp.HadamardProduct(C, inner_a)) + _sum(sp.HadamardProduct(D, inner_b)) + _sum(sp.HadamardProduct(C, inner_s))


@pytest.fixture(scope="module")
def nested():
    return sbp.compile(sbp.Model("linalg_nested", inputs=[C, D], params=[A, B, S], loss=_nested_loss_expr()))


def _jax_parts(jnp, tri, d):
    a, b, s = d["A"], d["B"], d["S"]
    return {
        "A": jnp.linalg.det(a) + jnp.linalg.slogdet(a)[1] + jnp.sum(jnp.sin(jnp.linalg.solve(a, b)))
        + jnp.sum(tri(a, b, True, False) ** 2) + jnp.sum(jnp.sin(tri(a, b, False, True))),
        "B": jnp.sum(jnp.sin(jnp.linalg.solve(a, b))),
        "S": jnp.sum(jnp.cos(jnp.linalg.cholesky((s + s.T) / 2))),
    }


@pytest.mark.parametrize("size", (1, 5))
def test_grad_inside_the_model_matches_nested_jax(nested, size):
    jax, jnp, tri = _jax()
    arrays = _draw(size, seed=40)
    rng = np.random.default_rng(size)
    weights = {"C": rng.standard_normal((size, size)), "D": rng.standard_normal((size, 2))}

    def loss(d):
        inner = {name: jax.grad(lambda e, name=name: _jax_parts(jnp, tri, e)[name])(d)[name] for name in ("A", "B", "S")}
        return (jnp.sum(weights["C"] * inner["A"]) + jnp.sum(weights["D"] * inner["B"])
                + jnp.sum(weights["C"] * inner["S"]))

    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss))({name: jnp.asarray(v) for name, v in arrays.items()})
    value, grads = nested.value_and_grad(**arrays, **weights)
    assert value == pytest.approx(float(ref_loss), rel=1e-10)
    for name in ("A", "B", "S"):
        np.testing.assert_allclose(grads[name], np.asarray(ref_grads[name]), rtol=1e-9, atol=1e-11, err_msg=name)


@pytest.fixture(scope="module")
def small():
    """det, logdet and solve alone: a cheap Hessian-vector product."""
    p = _parts()
    return sbp.compile(sbp.Model("linalg_small", params=[A, B], loss=p["det"] + p["logdet"] + p["solve"]))


def test_hvp_matches_jax(small):
    jax, jnp, _ = _jax()
    arrays = {name: v for name, v in _draw(3, seed=50).items() if name != "S"}
    rng = np.random.default_rng(5)
    directions = {name: rng.standard_normal(v.shape) for name, v in arrays.items()}
    got = small.hvp(directions, **arrays)

    def loss(d):
        return jnp.linalg.det(d["A"]) + jnp.linalg.slogdet(d["A"])[1] + jnp.sum(jnp.sin(jnp.linalg.solve(d["A"], d["B"])))

    primals = {name: jnp.asarray(v) for name, v in arrays.items()}
    tangents = {name: jnp.asarray(v) for name, v in directions.items()}
    _, ref = jax.jit(lambda p, t: jax.jvp(jax.grad(loss), (p,), (t,)))(primals, tangents)
    for name in ("A", "B"):
        np.testing.assert_allclose(got[name], np.asarray(ref[name]), rtol=1e-9, atol=1e-11, err_msg=name)


# --- declaration errors ------------------------------------------------------------------


def test_non_square_and_mismatched_shapes_are_refused():
    with pytest.raises(ModelError, match="square"):
        sbp.det(B)
    with pytest.raises(ModelError, match="rows"):
        sbp.solve(A, sp.MatrixSymbol("E", k, 2))
    with pytest.raises(ModelError, match="matrix expression"):
        sbp.cholesky(sp.Symbol("x"))


# --- the C helpers under AddressSanitizer and UndefinedBehaviorSanitizer ----------------------


def _c_array(name, values):
    """A malloc'd array of exactly these values (an overrun by one is found)."""
    flat = ", ".join("NAN" if np.isnan(v) else repr(float(v)) for v in np.ravel(values))
    return (f"double *{name} = malloc({max(np.size(values), 1)} * sizeof(double));\n"
            f"{{ const double init[] = {{{flat}}}; memcpy({name}, init, sizeof init); }}\n")


def test_helpers_are_memory_safe_on_singular_and_nan_input(tmp_path):
    """Each helper on exact-size arrays, read row- and column-major (a
    transposed view), at n = 1, 2, 5 and on singular, indefinite and NaN
    matrices: no sanitizer finding, and the documented values."""
    import shutil
    import subprocess

    from c_driver import write_runtime_header

    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    write_runtime_header(tmp_path)
    rng = np.random.default_rng(7)
    cases = [rng.standard_normal((size, size)) for size in (1, 2, 5)]
    cases += [np.array([[1.0, 2.0], [2.0, 4.0]]), np.diag([1.0, -1.0, 2.0]), np.array([[1.0, np.nan], [0.0, 1.0]])]
    body = []
    for number, a in enumerate(cases):
        size = a.shape[0]
        body.append(_c_array(f"a{number}", a) + _c_array(f"b{number}", np.ones((size, 2))))
        body.extend(f"double *{out}{number} = malloc({size * cols} * sizeof(double));\n"
                    for out, cols in (("x", 2), ("xt", 2), ("t", 2), ("l", size), ("lu", size + 1)))
        for rs, cs, tag in ((size, 1, "row"), (1, size, "col")):
            call = f"a{number}, {size}, {rs}, {cs}"
            body.append(
                f"symbackprop_f64_lu({call}, lu{number});\n"
                f'printf("{number} {tag} det %.17g\\n", symbackprop_f64_det({size}, lu{number}));\n'
                f'printf("{number} {tag} logdet %.17g\\n", symbackprop_f64_logdet({size}, lu{number}));\n'
                f"symbackprop_f64_solve({size}, b{number}, 2, 2, 1, lu{number}, 0, x{number});\n"
                f"symbackprop_f64_solve({size}, b{number}, 2, 2, 1, lu{number}, 1, xt{number});\n"
                f"symbackprop_f64_cholesky({call}, l{number});\n"
                f"symbackprop_f64_triangular_solve({call}, b{number}, 2, 2, 1, 0, t{number});\n"
                f'for (int i = 0; i < {2 * size}; ++i) printf("{number} {tag} solve %.17g\\n", x{number}[i]);\n'
                f'for (int i = 0; i < {2 * size}; ++i) printf("{number} {tag} solve_t %.17g\\n", xt{number}[i]);\n'
                f'for (int i = 0; i < {size * size}; ++i) printf("{number} {tag} cholesky %.17g\\n", l{number}[i]);\n'
                f'for (int i = 0; i < {2 * size}; ++i) printf("{number} {tag} upper %.17g\\n", t{number}[i]);\n')
    source = ('#include <stdio.h>\n#include <stdlib.h>\n#include <string.h>\n#include "symbackprop_runtime.h"\n'
              "int main(void) {\n" + "".join(body) + "return 0;\n}\n")
    (tmp_path / "driver.c").write_text(source)
    flags = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-g", "-O0", "-std=c99"]
    subprocess.run(["gcc", *flags, "-I", str(tmp_path), str(tmp_path / "driver.c"), "-o", str(tmp_path / "driver"), "-lm"],
                   check=True, capture_output=True, timeout=120)
    run = subprocess.run([str(tmp_path / "driver")], capture_output=True, text=True, timeout=60,
                         env={"ASAN_OPTIONS": "detect_leaks=0", "UBSAN_OPTIONS": "halt_on_error=1"})
    assert run.returncode == 0, run.stderr
    values: dict[tuple, list] = {}
    for line in run.stdout.split("\n"):
        if line:
            number, tag, what, value = line.split()
            values.setdefault((int(number), tag, what), []).append(float(value))
    for number, a in enumerate(cases):
        for tag, m in (("row", a), ("col", a.T)):
            got = {what: np.array(values[number, tag, what])
                   for what in ("det", "logdet", "solve", "solve_t", "cholesky", "upper")}
            size = m.shape[0]
            if number < 3:  # regular: numpy's values
                np.testing.assert_allclose(got["det"], np.linalg.det(m), rtol=1e-12)
                np.testing.assert_allclose(got["logdet"], np.linalg.slogdet(m)[1], rtol=1e-12, atol=1e-14)
                np.testing.assert_allclose(got["solve"].reshape(size, 2), np.linalg.solve(m, np.ones((size, 2))), rtol=1e-10)
                np.testing.assert_allclose(got["solve_t"].reshape(size, 2), np.linalg.solve(m.T, np.ones((size, 2))),
                                           rtol=1e-10)
                np.testing.assert_allclose(got["upper"].reshape(size, 2), np.linalg.solve(np.triu(m), np.ones((size, 2))),
                                           rtol=1e-10)
            elif number == 3:  # singular
                assert got["det"] == 0 and got["logdet"] == -np.inf and not np.isfinite(got["solve"]).all()
            elif number == 4:  # indefinite: NaN from the second pivot on
                assert got["cholesky"][0] == 1 and np.isnan(got["cholesky"][4])
            else:  # a NaN entry
                assert np.isnan(got["det"]) and np.isnan(got["logdet"]) and np.isnan(got["solve"]).any()


# --- small explicit matrices inside a map: closed forms ----------------------------------------


def test_small_matrices_inside_a_map_match_jax_vmap():
    """A 2x2 matrix per example (an explicit sp.Matrix of the body's
    symbols): its closed forms, differentiated by the map's scalar rules."""
    jax, jnp, tri = _jax()
    x = sp.symbols("x0:4", real=True)
    m = sp.Matrix([[x[0], x[1]], [x[2], x[3]]])
    rhs = sp.Matrix([1, x[0]])
    body = (sbp.det(m) + sbp.logdet(m) + sbp.solve(m, rhs)[1, 0] + sbp.cholesky(m * m.T + sp.eye(2))[1, 0]
            + sbp.triangular_solve(m, rhs, lower=False, transpose=True)[1, 0])
    rows = sp.MatrixSymbol("R", n, 4)
    mod = sbp.compile(sbp.Model("linalg_in_map", params=[rows], loss=nn.sum_all(sbp.map_examples(body, [(sp.Matrix(x), rows)]))))

    def one(r):
        a, b = r.reshape(2, 2), jnp.stack([1.0, r[0]])
        return (jnp.linalg.det(a) + jnp.linalg.slogdet(a)[1] + jnp.linalg.solve(a, b)[1]
                + jnp.linalg.cholesky(a @ a.T + jnp.eye(2))[1, 0] + tri(a, b, False, True)[1])

    values = np.random.default_rng(3).standard_normal((6, 4))
    ref, ref_grad = jax.jit(jax.value_and_grad(lambda r: jnp.sum(jax.vmap(one)(r))))(jnp.asarray(values))
    loss, grads = mod.value_and_grad(R=values)
    assert loss == pytest.approx(float(ref), rel=1e-10)
    np.testing.assert_allclose(grads["R"], np.asarray(ref_grad), rtol=1e-10, atol=1e-12)
