"""mod.jacobian: one C sweep of the vjp over the output's entries, or of
the jvp over the leaves' entries where they are fewer, checked against
JAX's jacrev and jacfwd in float64 and against central differences, for a
vector and a 1 x 1 output, matrix, scalar and input leaves, and several
values of the symbolic batch size (which moves the choice of mode)."""

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.run import fastcall

n = sp.Symbol("n", integer=True, positive=True)
X = sp.MatrixSymbol("x", n, 3)
W = sp.MatrixSymbol("W", 3, 2)
s = sp.Symbol("s")
Z = s * nn.tanh(X * W)
MODEL = sbp.Model("jacobian_small", inputs=[X], params=[W, s], loss=nn.sum_all(Z),
                  outputs={"z": Z, "total": nn.sum_all(sp.HadamardProduct(Z, Z))})
WRT = ["W", "s", "x"]  # 3n + 7 entries: more than z's 2n, so z's Jacobian is reverse mode
PARAMS = ["W", "s"]  # 7 entries: z's Jacobian is forward mode from n = 6 (1.5 * 7 < 2n)


def outputs(d: dict) -> dict:
    z = d["s"] * np.tanh(d["x"] @ d["W"])
    return {"z": z, "total": np.sum(z * z).reshape(1, 1)}


def sample(batch: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, 3)), "W": rng.standard_normal((3, 2)) / 2, "s": 0.7}


@pytest.fixture(scope="module", params=[WRT, PARAMS], ids=["with-x", "params"])
def mod(request):
    return sbp.compile(MODEL, wrt=request.param)


def differences(name: str, output: str, d: dict, step: float = 1e-6) -> np.ndarray:
    """d output / d name, one central difference per entry of name."""
    base = np.asarray(d[name], dtype=np.float64)
    columns = []
    for index in np.ndindex(base.shape):
        shifted = [base.copy(), base.copy()]
        shifted[0][index] += step
        shifted[1][index] -= step
        plus, minus = (outputs({**d, name: v if v.ndim else float(v)})[output] for v in shifted)
        columns.append((plus - minus) / (2 * step))
    out_shape = columns[0].shape
    return np.moveaxis(np.array(columns), 0, -1).reshape(*out_shape, *base.shape)


@pytest.mark.parametrize("batch", [1, 5, 9])
@pytest.mark.parametrize("output", ["z", "total"])
def test_jacobian_matches_central_differences(mod, batch, output):
    d = sample(batch, seed=batch)
    jac = mod.jacobian(output, **d)
    assert set(jac) == set(mod.wrt)
    out_shape = outputs(d)[output].shape
    for name in mod.wrt:
        expected = differences(name, output, d)
        assert jac[name].shape == out_shape + np.shape(d[name]), name
        assert jac[name].dtype == np.float64 and jac[name].flags.c_contiguous
        np.testing.assert_allclose(jac[name], expected, rtol=1e-6, atol=1e-8, err_msg=name)


@pytest.mark.parametrize("batch", [2, 10])
@pytest.mark.parametrize("output", ["z", "total"])
def test_jacobian_matches_jax(mod, batch, output):
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    jax.config.update("jax_enable_x64", True)

    def f(leaves):
        z = leaves["s"] * jnp.tanh(leaves["x"] @ leaves["W"])
        return z if output == "z" else jnp.sum(z * z).reshape(1, 1)

    d = sample(batch, seed=10 + batch)
    leaves = {k: jnp.asarray(v, dtype=jnp.float64) for k, v in d.items()}
    ours = mod.jacobian(output, **d)
    for oracle in (jax.jacrev(f)(leaves), jax.jacfwd(f)(leaves)):
        for name in mod.wrt:
            theirs = np.asarray(oracle[name])
            assert ours[name].shape == theirs.shape, name
            np.testing.assert_allclose(ours[name], theirs, rtol=1e-12, atol=1e-14, err_msg=name)


@pytest.mark.parametrize("wrt, batch, output, kind", [
    (PARAMS, 6, "z", "jvp"), (PARAMS, 5, "z", "vjp"), (PARAMS, 9, "total", "vjp"), (WRT, 9, "z", "vjp")])
def test_the_mode_follows_the_entries(wrt, batch, output, kind, monkeypatch):
    """Forward mode only where the leaves have under 1/1.5 of the output's entries."""
    mod = sbp.compile(MODEL, wrt=wrt)
    swept = []
    real = fastcall.sweeper
    monkeypatch.setattr(fastcall, "sweeper", lambda lib, ffi, c_name: swept.append(c_name) or real(lib, ffi, c_name))
    mod.jacobian(output, **sample(batch))
    assert swept and all(f"_{kind}" in name for name in swept), swept


@pytest.mark.parametrize("batch", [3, 9])
def test_the_python_loop_gives_the_same_rows(mod, batch, monkeypatch):
    """Where the call extension is missing, the same sweep runs from Python."""
    d = sample(batch, seed=3)
    in_c = mod.jacobian("z", **d)
    monkeypatch.setattr(fastcall, "sweeper", lambda *_: None)
    in_python = mod.jacobian("z", **d)
    for name in mod.wrt:
        np.testing.assert_array_equal(in_c[name], in_python[name])


def test_float32_jacobian_keeps_its_dtype():
    mod32 = sbp.compile(MODEL, dtype="float32")
    d = sample(9, seed=4)  # 18 entries of z, 7 of W and s: forward mode
    jac = mod32.jacobian("z", **{k: np.asarray(v, dtype=np.float32) if k != "s" else v for k, v in d.items()})
    for name in ("W", "s"):
        assert jac[name].dtype == np.float32
        np.testing.assert_allclose(jac[name], differences(name, "z", d), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("output", ["nope", "loss", "Z"])
def test_a_bad_output_name_is_refused_by_name(mod, output):
    with pytest.raises(sbp.ArgumentError, match=rf"no output named '{output}'.*'z', 'total'"):
        mod.jacobian(output, **sample(2))


def test_an_intermediate_among_the_leaves_gives_the_identity():
    """d z / d z with z differentiated as an intermediate (reverse mode)."""
    mod = sbp.compile(MODEL, wrt=["s", "z"])
    d = sample(3, seed=5)
    jac = mod.jacobian("z", **d)
    np.testing.assert_array_equal(jac["z"], np.eye(6).reshape(3, 2, 3, 2))
    np.testing.assert_allclose(jac["s"], np.tanh(d["x"] @ d["W"]), rtol=1e-13)


@pytest.mark.parametrize("batch", [1, 3, 6, 12])
@pytest.mark.parametrize("output", ["z", "total"])
def test_jacobian_matches_torch(mod, batch, output):
    """Against torch.autograd.functional.jacobian in float64: wide (reverse)
    and tall (forward, every tangent in one sweep) Jacobians."""
    torch = pytest.importorskip("torch")
    d = sample(batch, seed=20 + batch)
    names = list(mod.wrt)

    def f(*leaves):
        given = {**{k: torch.as_tensor(v, dtype=torch.float64) for k, v in d.items()}, **dict(zip(names, leaves))}
        z = given["s"] * torch.tanh(given["x"] @ given["W"])
        return z if output == "z" else torch.sum(z * z).reshape(1, 1)

    leaves = tuple(torch.tensor(np.asarray(d[k], dtype=np.float64)) for k in names)
    theirs = torch.autograd.functional.jacobian(f, leaves)
    ours = mod.jacobian(output, **d)
    for name, block in zip(names, theirs):
        np.testing.assert_allclose(ours[name], block.numpy(), rtol=1e-12, atol=1e-14, err_msg=name)


def test_a_forward_sweep_covers_several_leaves_in_one_call(monkeypatch):
    """Forward mode sweeps every tangent (W's 6 entries, then s) in one C
    call; each leaf's columns land in its own block (W's against s's)."""
    mod = sbp.compile(MODEL, wrt=PARAMS)
    calls = []
    real = fastcall.sweeper

    def counted(lib, ffi, c_name):
        sweep = real(lib, ffi, c_name)
        return lambda *args: calls.append(args[2]) or sweep(*args)

    monkeypatch.setattr(fastcall, "sweeper", counted)
    d = sample(12, seed=6)
    jac = mod.jacobian("z", **d)
    assert len(calls) == 1 and len(calls[0]) == 2  # one call, two seed slots
    np.testing.assert_allclose(jac["s"], np.tanh(d["x"] @ d["W"]), rtol=1e-13)
    np.testing.assert_allclose(jac["W"], differences("W", "z", d), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("x"), r"missing.*'x'"),
    (lambda d: d.update(x=np.ones((4, 5))), r"x"),
    (lambda d: d.update(W=np.ones((2, 2))), r"W"),
    (lambda d: d.update(extra=np.ones(2)), r"extra"),
])
@pytest.mark.parametrize("batch", [2, 12])  # reverse and forward mode
def test_bad_arguments_are_named(mod, batch, change, message):
    d = sample(batch)
    change(d)
    with pytest.raises(sbp.ArgumentError, match=message):
        mod.jacobian("z", **d)
