"""Depth: models hundreds of levels deep compile (no RecursionError) and
compute what numpy computes; the IR's interning table does not grow.

Deep cases run in a child process: they use a large thread stack, and a
mistake there would be a crash, not a failure. SymPy itself recurses once
per level while *building* a deep expression (a product's shape, xreplace):
up to a few hundred levels a model builds on the main thread and compiles
with a plain `sbp.compile` (its stages run on a large stack by themselves);
the 1,000-level models are built in `run_deep`.
"""

import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sympy as sp
from helpers import count_calls
from sympy.core.cache import clear_cache

import symbackprop as sbp
from symbackprop.base.exprdag import MAX_BODY_DEPTH
from symbackprop.declare import nn
from symbackprop.deep import run_deep
from symbackprop.emit.graph import graph_text
from symbackprop.errors import ModelError
from symbackprop.ir import construct as ir_construct
from symbackprop.ir import lower as ir_lower
from symbackprop.ir import node as ir_node
from symbackprop.pipeline import plan

TESTS = Path(__file__).resolve().parent


def _in_child(call: str, timeout: float = 600) -> str:
    """Run `test_depth.<call>` in a fresh interpreter; its stdout."""
    code = f"import sys; sys.path[:0] = [{str(TESTS)!r}, {str(TESTS.parent)!r}]; import test_depth; test_depth.{call}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"child failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout


def _central(f, arrays: dict, name: str, index: tuple, step: float = 1e-6) -> float:
    plus = {k: v.copy() for k, v in arrays.items()}
    minus = {k: v.copy() for k, v in arrays.items()}
    plus[name][index] += step
    minus[name][index] -= step
    return (f(plus) - f(minus)) / (2 * step)


def _check_gradients(mod, arrays: dict, numpy_loss, probes: list[tuple[str, tuple]]) -> None:
    """The loss against numpy; the gradient at each probe against central
    differences of the numpy loss (an independent oracle)."""
    loss, grads = mod.value_and_grad(**arrays)
    assert np.isclose(loss, numpy_loss(arrays), rtol=1e-10, atol=1e-12)
    for name, index in probes:
        expected = _central(numpy_loss, arrays, name, index)
        assert abs(expected) > 1e-6, f"probe {name}{index} has a vanishing gradient: the check would be empty"
        assert np.isclose(grads[name][index], expected, rtol=1e-5, atol=1e-9), (name, index, grads[name][index], expected)


# --- models --------------------------------------------------------------

N = sp.Symbol("n", integer=True, positive=True)


def mlp_model(depth: int, width: int = 3) -> sbp.Model:
    X, Y = sp.MatrixSymbol("X", N, width), sp.MatrixSymbol("Y", N, 1)
    Ws = [sp.MatrixSymbol(f"W{k}", width, width) for k in range(depth)]
    bs = [sp.MatrixSymbol(f"b{k}", 1, width) for k in range(depth)]
    V = sp.MatrixSymbol("V", width, 1)
    h = X
    for W, b in zip(Ws, bs):
        h = nn.shallow(lambda h, W, b: nn.tanh(nn.linear(h, W, b)), h, W, b)
    loss = nn.shallow(lambda h: nn.mse(h * V, Y), h)
    return sbp.Model(f"mlp_depth{depth}", inputs=[X, Y], params=[*Ws, *bs, V], loss=loss)


def mlp_numpy(depth: int, a: dict) -> float:
    h = a["X"]
    for k in range(depth):
        h = np.tanh(h @ a[f"W{k}"] + a[f"b{k}"])
    return float(np.mean((h @ a["V"] - a["Y"]) ** 2))


def mlp_data(depth: int, width: int = 3, rows: int = 4) -> dict:
    rng = np.random.default_rng(depth)
    # near-identity layers and small activations: the gradient reaches the first layer
    data = {f"W{k}": np.eye(width) + 0.1 * rng.standard_normal((width, width)) for k in range(depth)}
    data.update({f"b{k}": 0.01 * rng.standard_normal((1, width)) for k in range(depth)})
    data.update(X=0.3 * rng.standard_normal((rows, width)), Y=rng.standard_normal((rows, 1)),
                V=rng.standard_normal((width, 1)))
    return data


def check_mlp(depth: int) -> None:
    mod = sbp.compile(mlp_model(depth))  # as a user would: no run_deep
    probes = [("W0", (0, 1)), (f"b{depth // 2}", (0, 2)), (f"W{depth - 1}", (2, 0)), ("V", (1, 0))]
    _check_gradients(mod, mlp_data(depth), lambda a: mlp_numpy(depth, a), probes)
    print("ok")


GATES = "rzm"


def gru_model(steps: int, hidden: int = 3) -> sbp.Model:
    xs = [sp.MatrixSymbol(f"x{t}", N, 1) for t in range(steps)]
    y = sp.MatrixSymbol("y", N, 1)
    W = [sp.MatrixSymbol(f"W_{g}", 1, hidden) for g in GATES]
    U = [sp.MatrixSymbol(f"U_{g}", hidden, hidden) for g in GATES]
    b = [sp.MatrixSymbol(f"b_{g}", 1, hidden) for g in GATES]
    V = sp.MatrixSymbol("V", hidden, 1)
    h = None
    for x in xs:
        h = nn.gru_cell(x, h, W, U, b)
    loss = nn.shallow(lambda h: nn.mse(h * V, y), h)
    return sbp.Model(f"gru_steps{steps}", inputs=[*xs, y], params=[*W, *U, *b, V], loss=loss)


def gru_numpy(steps: int, a: dict) -> float:
    def sigmoid(v):
        return 1 / (1 + np.exp(-v))

    h = np.zeros((a["y"].shape[0], a["V"].shape[0]))
    for t in range(steps):
        x = a[f"x{t}"]
        r = sigmoid(x @ a["W_r"] + h @ a["U_r"] + a["b_r"])
        z = sigmoid(x @ a["W_z"] + h @ a["U_z"] + a["b_z"])
        m = np.tanh(x @ a["W_m"] + a["b_m"] + r * (h @ a["U_m"]))
        h = (1 - z) * m + z * h
    return float(np.mean((h @ a["V"] - a["y"]) ** 2))


def check_gru_gradient(steps: int, data: dict, grads: dict, names: tuple[str, ...], seed: int) -> None:
    """Each named gradient against central differences of numpy's loss
    (gru_numpy), along one random direction each."""
    rng = np.random.default_rng(seed)
    for name in names:
        direction = rng.standard_normal(data[name].shape)
        eps = 1e-6
        plus = gru_numpy(steps, {**data, name: data[name] + eps * direction})
        minus = gru_numpy(steps, {**data, name: data[name] - eps * direction})
        assert np.sum(grads[name] * direction) == pytest.approx((plus - minus) / (2 * eps), rel=1e-6, abs=1e-9), name


def gru_data(steps: int, hidden: int = 3, rows: int = 4) -> dict:
    rng = np.random.default_rng(steps)
    data = {f"x{t}": rng.standard_normal((rows, 1)) for t in range(steps)}
    for g in GATES:
        data[f"W_{g}"] = 0.5 * rng.standard_normal((1, hidden))
        data[f"U_{g}"] = 0.5 * rng.standard_normal((hidden, hidden))
        data[f"b_{g}"] = 0.1 * rng.standard_normal((1, hidden))
    data.update(y=rng.standard_normal((rows, 1)), V=rng.standard_normal((hidden, 1)))
    return data


def check_gru(steps: int) -> None:
    mod = sbp.compile(gru_model(steps))  # as a user would: no run_deep
    # weights that every step uses
    probes = [("U_m", (0, 1)), ("W_z", (0, 2)), ("b_r", (0, 0)), ("V", (2, 0))]
    _check_gradients(mod, gru_data(steps), lambda a: gru_numpy(steps, a), probes)
    print("ok")


def horner_model(degree: int) -> sbp.Model:
    """The mean squared error of a polynomial written in Horner form (each
    coefficient one level deeper) inside a per-example map."""
    points = sp.MatrixSymbol("points", N, 2)
    coeffs = sp.MatrixSymbol("coeffs", 1, degree + 1)
    x, y = sp.symbols("x y", real=True)
    k = sp.symbols(f"k0:{degree + 1}", real=True)
    p = k[degree]
    for j in range(degree - 1, -1, -1):
        p = p * x + k[j]
    error = sbp.map_examples((p - y) ** 2, [((x, y), points), (sp.Matrix(k), coeffs)])
    return sbp.Model(f"horner{degree}", inputs=[points], params=[coeffs], loss=sbp.reduce("mean", error, 0))


def check_horner(degree: int) -> None:
    mod = sbp.compile(horner_model(degree))  # as a user would: no run_deep
    rng = np.random.default_rng(degree)
    xs = rng.uniform(-1, 1, 50)
    points = np.stack([xs, np.cos(3 * xs)], axis=1)
    coeffs = rng.standard_normal((1, degree + 1)) / np.arange(1, degree + 2)
    powers = xs[:, None] ** np.arange(degree + 1)  # closed form: d mean((p - y)^2) / dk_j = mean(2 (p - y) x^j)
    residual = powers @ coeffs[0] - points[:, 1]
    loss, grads = mod.value_and_grad(points=points, coeffs=coeffs)
    assert np.isclose(loss, np.mean(residual ** 2), rtol=1e-10)
    np.testing.assert_allclose(grads["coeffs"][0], 2 * residual @ powers / len(xs), rtol=1e-9, atol=1e-12)
    print("ok")


def det_model(ell: int) -> sbp.Model:
    """The determinant by expansion in minors along the first row, each minor
    built once (a shared graph of 2^ell minors, not a tree of ell! terms)."""
    A = sp.MatrixSymbol("A", ell, ell)
    minors: dict[tuple, sp.Expr] = {}

    def minor(row: int, cols: tuple) -> sp.Expr:
        if row == ell:
            return sp.Integer(1)
        if cols not in minors:
            minors[cols] = sp.Add(*[(-1) ** k * A[row, c] * minor(row + 1, cols[:k] + cols[k + 1:])
                                    for k, c in enumerate(cols)])
        return minors[cols]

    return sbp.Model(f"det_minors{ell}", inputs=[], params=[A], loss=minor(0, tuple(range(ell))))


def check_det(ell: int) -> None:
    mod = run_deep("test", lambda: sbp.compile(det_model(ell)))
    A = np.random.default_rng(ell).standard_normal((ell, ell))
    loss, grads = mod.value_and_grad(A=A)
    det = np.linalg.det(A)
    assert np.isclose(loss, det, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grads["A"], det * np.linalg.inv(A).T, rtol=1e-8, atol=1e-10)  # Jacobi's formula
    print("ok")


# --- tests ---------------------------------------------------------------


def test_determinant_by_minors():
    """A shared scalar graph (448 distinct subexpressions at ell=7) is
    differentiated as a graph: it compiled in over 125 s before."""
    assert _in_child("check_det(7)") == "ok\n"


def plan_deep(mlp_depth: int, gru_steps: int) -> None:
    """Lower, differentiate and schedule without the C compile (GCC's time
    on one long straight-line function, not ours, dominates deep builds).
    The GRU as it is written, unrolled (loops/unrolled.py, which would make
    it a scan, turned off), then as the scan it becomes."""
    gru = run_deep("test", gru_model, gru_steps)
    assert any(n.op == "scan" for n in ir_node.topological_order([plan(gru, ("forward",)).lowered.loss]))
    os.environ["SYMBACKPROP_UNROLLED_SCANS"] = "0"  # (a child process of its own)
    for model in (run_deep("test", mlp_model, mlp_depth), gru):
        the_plan = plan(model)
        assert len(the_plan.function("value_and_grad").schedule.kernels) > mlp_depth
        text = graph_text(the_plan)  # the backward graph, as deep, printed without recursion
        assert text.count("MatMul") >= mlp_depth
        assert ("shown above" in text) == model.name.startswith("gru")  # the shared state, expanded once
    print("ok")


def test_deep_mlp_and_gru_plan():
    """Depths at which lowering used to raise RecursionError (100 layers);
    1,000 layers and steps are the slow tests below."""
    assert _in_child("plan_deep(150, 40)") == "ok\n"


def test_deep_mlp():
    assert _in_child("check_mlp(25)") == "ok\n"


def test_unrolled_gru():
    assert _in_child("check_gru(10)") == "ok\n"


def test_horner_degree_127_in_a_map():
    assert _in_child("check_horner(127)") == "ok\n"


@pytest.mark.slow
def test_mlp_120_layers():
    assert _in_child("check_mlp(120)", timeout=1800) == "ok\n"


@pytest.mark.slow
def test_gru_40_steps():
    assert _in_child("check_gru(40)", timeout=1800) == "ok\n"


@pytest.mark.slow
def test_mlp_1000_layers_and_gru_1000_steps_plan():
    assert _in_child("plan_deep(1000, 1000)", timeout=3600) == "ok\n"


def test_horner_body_is_cut_into_shallow_lets():
    """The map's program holds no expression deeper than MAX_BODY_DEPTH,
    so its derivatives are linear in its size."""
    lowered = run_deep("test", lambda: ir_lower.lower(horner_model(127)))
    (emap,) = [n for n in ir_node.topological_order([lowered.loss]) if n.op == "emap"]
    bodies, lets = emap.attrs[0], emap.attrs[4]

    def depth(expr):
        return 0 if not expr.args else 1 + max(depth(a) for a in expr.args)

    assert len(lets) > 127 // MAX_BODY_DEPTH
    assert max(depth(e) for e in [*bodies, *(e for _, e in lets)]) <= MAX_BODY_DEPTH


def test_interning_table_does_not_grow():
    """Compiling (and planning every kind of function for) one model 4
    times leaves the table as it was after the first time (a leak grows
    it every time)."""
    model = mlp_model(2)
    kinds = ("forward", "value_and_grad", "vjp", "jvp", "hvp")
    sizes = []
    for _ in range(4):
        sbp.compile(model)
        plan(model, functions=kinds)
        gc.collect()
        sizes.append(len(ir_node._INTERNED))
    assert sizes[-1] <= sizes[0], sizes
    assert max(sizes) == sizes[0], sizes


def test_hash_consing_holds_while_a_node_lives():
    a = ir_construct.leaf("a_depth_test", (3, 1), "param")
    first = ir_construct.map_(sp.tanh(ir_node.placeholder(0)), [a])
    assert ir_construct.map_(sp.tanh(ir_node.placeholder(0)), [a]) is first
    key = ("map", (a,), (3, 1), (sp.tanh(ir_node.placeholder(0)),))
    assert ir_node._INTERNED.get(key) is first
    del first
    gc.collect()
    assert ir_node._INTERNED.get(key) is None


_DROP_AT_EXIT = """
import gc, weakref
import sympy as sp
from symbackprop.ir import construct, node
a = construct.leaf("a", (3, 1), "param")
first = construct.map_(sp.Float(0.5) * node.placeholder(0), [a])
old = weakref.ref(node._INTERNED)
node._drop_interned()
gc.collect()
assert old() is None  # nothing else holds the old table: its callbacks went with it
del first
gc.collect()
again = construct.map_(sp.Float(0.5) * node.placeholder(0), [a])
assert construct.map_(sp.Float(0.5) * node.placeholder(0), [a]) is again
print("ok")
"""


def test_the_table_is_dropped_at_exit():
    """At exit the table goes, so that its entries' callbacks do nothing
    (a node freed while the interpreter shuts down had its key, a SymPy
    Float among it, hashed after imports were gone: "Exception ignored");
    nodes built after it are hash-consed in a new table. (In a process
    of its own: this one's nodes stay in this one's table.)"""
    out = subprocess.run([sys.executable, "-c", _DROP_AT_EXIT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout == "ok\n" and out.stderr == "", out.stderr


def _nest(levels: int) -> sp.Expr:
    """sin(sin(...(x))), built without SymPy's evaluation (which recurses)."""
    expr = sp.Symbol("x")
    for _ in range(levels):
        expr = sp.Basic.__new__(sp.sin, expr)
    return expr


def recursion_becomes_model_error() -> None:
    """Deeper than even the large stack allows: a ModelError (no crash), and
    the recursion limit is restored afterwards."""
    limit = sys.getrecursionlimit()
    expr = _nest(300_000)
    try:
        run_deep("the test expression", str, expr)
    except ModelError as exc:
        assert "nested too deeply" in str(exc) and "the test expression" in str(exc), exc
    else:
        raise AssertionError("no ModelError")
    assert sys.getrecursionlimit() == limit
    print("ok")


def test_recursion_beyond_the_stack_is_a_model_error():
    assert _in_child("recursion_becomes_model_error()") == "ok\n"


def test_run_deep_passes_results_and_errors_through():
    limit = sys.getrecursionlimit()
    assert run_deep("x", str, _nest(5000)).startswith("sin(sin(")  # beyond the default limit
    with pytest.raises(ModelError, match="wrong"):
        run_deep("x", lambda: (_ for _ in ()).throw(ModelError("wrong")))
    assert sys.getrecursionlimit() == limit


def check_scalar_horner(degree: int) -> None:
    """A deep scalar loss (no map): lowered as a chain of maps, each at most
    MAX_BODY_DEPTH deep."""
    x = sp.Symbol("x", real=True)
    k = sp.symbols(f"c0:{degree + 1}", real=True)
    p = k[degree]
    for j in range(degree - 1, -1, -1):
        p = p * x + k[j]
    model = sbp.Model(f"scalar_horner{degree}", inputs=[x], params=list(k), loss=p, grad_inputs=[x])
    mod = run_deep("test", sbp.compile, model)
    coeffs = np.random.default_rng(degree).standard_normal(degree + 1) / np.arange(1, degree + 2)
    at = 0.7
    loss, grads = mod.value_and_grad(x=at, **{f"c{j}": c for j, c in enumerate(coeffs)})
    assert np.isclose(loss, np.polynomial.polynomial.polyval(at, coeffs), rtol=1e-12)
    slope = np.polynomial.polynomial.polyval(at, np.polynomial.polynomial.polyder(coeffs))
    assert np.isclose(grads["x"], slope, rtol=1e-10)
    assert np.isclose(grads[f"c{degree}"], at ** degree, rtol=1e-10)
    print("ok")


def test_deep_scalar_loss():
    assert _in_child("check_scalar_horner(150)") == "ok\n"


def build_deep_builds_what_the_default_stack_cannot() -> None:
    """SymPy's printer recurses per level: a nested expression 3,000 deep
    is a RecursionError on the default stack, and prints in build_deep."""
    expr = _nest(3000)
    try:
        str(expr)
    except RecursionError:
        pass
    else:
        raise AssertionError("SymPy printed 3,000 levels on the default stack: the test shows nothing")
    assert sbp.build_deep(str, expr).startswith("sin(sin(")
    print("ok")


def test_build_deep_builds_what_the_default_stack_cannot():
    assert _in_child("build_deep_builds_what_the_default_stack_cannot()") == "ok\n"


# --- stacks declared as the README declares layers (issue 41) --------------


def readme_mlp(depth: int, width: int = 8) -> sbp.Model:
    """H = nn.tanh(nn.linear(H, W, b)) in a loop, the loss nn.mse: no
    nn.shallow, no build_deep."""
    X, T = sp.MatrixSymbol("X", N, width), sp.MatrixSymbol("T", N, width)
    params, H = [], X
    for k in range(depth):
        W, b = sp.MatrixSymbol(f"W{k}", width, width), sp.MatrixSymbol(f"b{k}", 1, width)
        params += [W, b]
        H = nn.tanh(nn.linear(H, W, b))
    return sbp.Model(f"readme_mlp{depth}", inputs=[X, T], params=params, loss=nn.mse(H, T))


def readme_numpy(depth: int, a: dict) -> float:
    h = a["X"]
    for k in range(depth):
        h = np.tanh(h @ a[f"W{k}"] + a[f"b{k}"])
    return float(np.mean((h - a["T"]) ** 2))


def readme_data(depth: int, width: int = 8, rows: int = 5) -> dict:
    rng = np.random.default_rng(depth)
    data = {f"W{k}": np.eye(width) + 0.1 * rng.standard_normal((width, width)) for k in range(depth)}
    data.update({f"b{k}": 0.05 * rng.standard_normal((1, width)) for k in range(depth)})
    data.update(X=0.5 * rng.standard_normal((rows, width)), T=rng.standard_normal((rows, width)))
    return data


def declare_without_recursion(depth: int) -> None:
    """Declaring (and Model's checks) under Python's default recursion
    limit, on the main thread's stack: 250 layers were a RecursionError."""
    assert sys.getrecursionlimit() <= 1000
    model = readme_mlp(depth)
    assert len(model.params) == 2 * depth
    print("ok")


def test_400_layers_declare_under_the_default_recursion_limit():
    assert _in_child("declare_without_recursion(400)") == "ok\n"


def test_each_layer_costs_the_same_to_declare():
    """The work of declaring a layer does not grow with the layers below it:
    SymPy's doit, shapes and sort keys walked the whole stack at every
    layer (quadratic: 17.6 s for 100 layers). Each 20 more layers cost
    about what the 20 before them did."""
    readme_mlp(2)  # the activation's Lambda, once
    calls = {}
    for k in (20, 40, 60):
        clear_cache()  # each from SymPy's empty cache (else a hit or a miss depends on what ran before)
        calls[k] = count_calls(lambda k=k: readme_mlp(k))
    first, second = calls[40] - calls[20], calls[60] - calls[40]
    assert second < 1.25 * first, calls
    assert second / 20 < 3000, calls  # calls per layer (1,800 now)


def test_a_100_layer_readme_stack_compiles_and_matches_numpy():
    """As the README writes layers: the loss against numpy, the gradient of
    the first layer's weights (through 99 layers) against central
    differences of numpy's loss."""
    depth = 100
    mod = sbp.compile(readme_mlp(depth))
    probes = [("W0", (0, 1)), (f"b{depth // 2}", (0, 3)), (f"W{depth - 1}", (2, 5))]
    _check_gradients(mod, readme_data(depth), lambda a: readme_numpy(depth, a), probes)


def test_a_5_layer_readme_stack_matches_torch():
    torch = pytest.importorskip("torch")
    depth = 5
    mod = sbp.compile(readme_mlp(depth))
    data = readme_data(depth)
    loss, grads = mod.value_and_grad(**data)
    tensors = {k: torch.tensor(v, dtype=torch.float64, requires_grad=k not in ("X", "T")) for k, v in data.items()}
    h = tensors["X"]
    for k in range(depth):
        h = torch.tanh(h @ tensors[f"W{k}"] + tensors[f"b{k}"])
    expected = torch.mean((h - tensors["T"]) ** 2)
    expected.backward()
    assert np.isclose(loss, expected.item(), rtol=1e-12)
    for k in range(depth):
        for name in (f"W{k}", f"b{k}"):
            np.testing.assert_allclose(grads[name], tensors[name].grad.numpy(), rtol=1e-10, atol=1e-13)


def readme_1000() -> None:
    """1,000 layers declared on the default stack, compiled by plain
    sbp.compile; the loss against numpy."""
    depth = 1000
    mod = sbp.compile(readme_mlp(depth))
    data = readme_data(depth)
    assert np.isclose(mod.forward(**data)["loss"], readme_numpy(depth, data), rtol=1e-9)
    print("ok")


@pytest.mark.slow
def test_a_1000_layer_readme_stack_declares_and_compiles():
    assert _in_child("readme_1000()", timeout=3600) == "ok\n"


def test_nested_derivatives_build_no_message_unless_they_raise(monkeypatch):
    """sbp.grad and sbp.jvp name the expression in their errors, printed by
    SymPy as a tree (a nested jvp's text doubled per level): printed only
    when one is raised."""
    from symbackprop.declare import derivatives
    from symbackprop.diff import nested

    def refuse(*args, **kwargs):
        raise AssertionError("an error message was built with nothing to report")

    monkeypatch.setattr(nested, "short", refuse)
    monkeypatch.setattr(derivatives, "short", refuse)
    w, v = sp.MatrixSymbol("w", 3, 1), sp.MatrixSymbol("v", 3, 1)
    x = sp.MatrixSymbol("x", N, 3)
    f = nn.sum_all(nn.tanh(x * w).applyfunc(lambda e: e**2))
    hvp = sbp.jvp(sbp.grad(f, w), w, v)  # grad's and jvp's checks at declaration
    model = sbp.Model("lazy_messages", inputs=[x, v], params=[w], loss=nn.sum_all(hvp.applyfunc(sp.sin)))
    plan(model)  # and their lowering
