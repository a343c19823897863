"""A map's tangent is one map over its local derivatives and its
arguments' tangents, not a product map per argument and a sum of them:
forward over reverse on the many-argument scalar maps an explicit bone
chain lowers to (GradBench's hand tracking) had built five times the
gradient's nodes, nearly all of them those products. The structure is
checked on the graph; the values of jvp and hvp against JAX float64 and
central differences, and the tangent of a local derivative (hvp's second
derivatives, one sweep a map) against sympy.diff twice."""

import numpy as np
import pytest
import sympy as sp
from oracles import relative_error

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.diff.autodiff import jvp, local_derivative, vjp
from symbackprop.diff.hessian import hessian_vector
from symbackprop.ir.construct import const, leaf, map_
from symbackprop.ir.node import placeholder, topological_order

A0, A1, A2 = placeholder(0), placeholder(1), placeholder(2)


def test_a_maps_tangent_is_one_map_over_its_local_derivatives_and_tangents():
    x, y, z = (leaf(name, (4, 3), "input") for name in "xyz")
    tx, ty, tz = (leaf(f"t{name}", (4, 3), "tangent") for name in "xyz")
    node = map_(sp.sin(A0) * A1 + sp.exp(A2) * A0, [x, y, z])
    (tangent,) = jvp([node], {x: tx, y: ty, z: tz})
    assert tangent.op == "map"
    locals_ = {local_derivative(node, index) for index in range(3)}
    assert set(tangent.args) == locals_ | {tx, ty, tz}
    added = set(topological_order([tangent])) - set(topological_order([node])) - locals_
    assert added == {tangent, tx, ty, tz}  # no node per argument


def test_a_tangent_of_some_arguments_reads_only_theirs():
    x, y = leaf("x", (2, 2), "input"), leaf("y", (2, 2), "input")
    ty = leaf("ty", (2, 2), "tangent")
    node = map_(sp.cos(A0 * A1), [x, y])
    (tangent,) = jvp([node], {y: ty})
    assert set(tangent.args) == {local_derivative(node, 1), ty}


def _chain():
    """Two bones of an explicit chain (a rotation about z, one about x, a
    translation), applied to points: many-argument scalar maps."""
    n = sp.Symbol("n", integer=True, positive=True)
    pose, points, targets = sp.MatrixSymbol("pose", 1, 6), sp.MatrixSymbol("P", n, 3), sp.MatrixSymbol("T", n, 3)
    chain = sp.eye(4)
    for k in range(2):
        a, b, c = pose[0, 3 * k], pose[0, 3 * k + 1], pose[0, 3 * k + 2]
        rz = sp.Matrix([[sp.cos(a), -sp.sin(a), 0, 0], [sp.sin(a), sp.cos(a), 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
        rx = sp.Matrix([[1, 0, 0, 0], [0, sp.cos(b), -sp.sin(b), 0], [0, sp.sin(b), sp.cos(b), 0], [0, 0, 0, 1]])
        chain = chain * rz * rx * sp.Matrix([[1, 0, 0, c], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
    moved = points * sp.ImmutableMatrix(chain[:3, :3].T) + sp.OneMatrix(n, 1) * sp.ImmutableMatrix(chain[:3, 3].T)
    residual = moved - targets
    loss = nn.sum_all(residual.applyfunc(lambda r: r**2))
    return sbp.Model("jvp_one_map_chain", inputs=[points, targets], params=[pose], loss=loss,
                     outputs={"residual": residual})


def _chain_numpy(pose, points, targets, xp=np):
    chain = xp.eye(4)
    for k in range(2):
        a, b, c = pose[0, 3 * k], pose[0, 3 * k + 1], pose[0, 3 * k + 2]
        zero, one = 0.0 * a, 1.0 + 0.0 * a
        rz = xp.stack([xp.stack([xp.cos(a), -xp.sin(a), zero, zero]), xp.stack([xp.sin(a), xp.cos(a), zero, zero]),
                       xp.stack([zero, zero, one, zero]), xp.stack([zero, zero, zero, one])])
        rx = xp.stack([xp.stack([one, zero, zero, zero]), xp.stack([zero, xp.cos(b), -xp.sin(b), zero]),
                       xp.stack([zero, xp.sin(b), xp.cos(b), zero]), xp.stack([zero, zero, zero, one])])
        shift = xp.stack([xp.stack([one, zero, zero, c]), xp.stack([zero, one, zero, zero]),
                          xp.stack([zero, zero, one, zero]), xp.stack([zero, zero, zero, one])])
        chain = chain @ rz @ rx @ shift
    residual = points @ chain[:3, :3].T + chain[:3, 3] - targets
    return (residual**2).sum(), residual


def _data():
    rng = np.random.default_rng(5)
    return {"pose": rng.standard_normal((1, 6)), "P": rng.standard_normal((7, 3)), "T": rng.standard_normal((7, 3))}


def hvp_growth() -> float:
    """Nodes the Hessian-vector product adds to the gradient's graph, per node of it."""
    from symbackprop.ir.lower import lower

    lowered = lower(_chain())
    pose = lowered.leaves["pose"]
    grads, _ = vjp([(lowered.loss, const(1, lowered.loss.shape))], [pose])
    gradient = set(topological_order(grads))
    direction = leaf("direction_pose", pose.shape, "direction")
    _, products, _ = hessian_vector(lowered.loss, [pose], [direction], how="forward_over_reverse")
    return sum(node not in gradient for node in topological_order(products)) / len(gradient)


def test_the_hvp_of_a_chain_adds_fewer_nodes_than_its_gradient_has():
    """Forward over reverse adds a tangent per node of the gradient: 0.97
    per node here. A product map per argument and their sum added 3.3; the
    map rule on each local derivative (a second-derivative map per pair of
    arguments) 1.45."""
    assert hvp_growth() < 1.2


@pytest.fixture(scope="module")
def chain_module():
    return sbp.compile(_chain(), functions=("forward",))


def test_the_chains_jvp_matches_central_differences(chain_module):
    d = _data()
    direction = np.random.default_rng(6).standard_normal((1, 6))
    got = chain_module.jvp({"pose": direction}, **d)
    step = 1e-6
    up, down = ({**d, "pose": d["pose"] + s * direction} for s in (step, -step))
    for out, index in (("loss", 0), ("residual", 1)):
        want = (_chain_numpy(up["pose"], d["P"], d["T"])[index] - _chain_numpy(down["pose"], d["P"], d["T"])[index])
        want = np.asarray(want) / (2 * step)
        assert relative_error(np.reshape(got[out], np.shape(want)), want) < 1e-7, out


def test_the_chains_jvp_and_hvp_match_jax(chain_module):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp = jax.numpy
    d = _data()
    direction = jnp.asarray(np.random.default_rng(7).standard_normal((1, 6)))
    P, T, pose = jnp.asarray(d["P"]), jnp.asarray(d["T"]), jnp.asarray(d["pose"])
    _, (want_dloss, want_dresidual) = jax.jvp(lambda p: _chain_numpy(p, P, T, jnp), (pose,), (direction,))
    got = chain_module.jvp({"pose": np.asarray(direction)}, **d)
    assert got["loss"] == pytest.approx(float(want_dloss), rel=1e-11)
    np.testing.assert_allclose(got["residual"], np.asarray(want_dresidual), rtol=1e-10, atol=1e-12)
    want_hvp = jax.jvp(jax.grad(lambda p: _chain_numpy(p, P, T, jnp)[0]), (pose,), (direction,))[1]
    got_hvp = chain_module.hvp({"pose": np.asarray(direction)}, **d)["pose"]
    np.testing.assert_allclose(np.reshape(got_hvp, (1, 6)), np.asarray(want_hvp), rtol=1e-10, atol=1e-11)


BODIES = [
    sp.sin(A0) * A1 + sp.exp(A2) * A0,  # three arguments
    sp.cos(A0 * A1) * (A0 + A1) ** 3,  # two, a product inside a function
    sp.tanh(A0 - A2) * sp.log(1 + A1**2) + A0 * A1 * A2,
]


@pytest.mark.parametrize("body", BODIES, ids=["three", "two", "tanh_log"])
@pytest.mark.parametrize("with_tangent", [(0, 1, 2), (1,), (0, 2)], ids=["all", "one", "two"])
def test_a_local_derivatives_tangent_is_its_second_derivatives_along_the_tangents(body, with_tangent):
    """hvp's tangent of d y / d arg_k (one sweep over y's directional
    derivative, shared by every k) against sympy.diff twice, evaluated at
    random points; arguments without a tangent held constant, a row
    argument broadcast along the map's rows."""
    from symbackprop.diff.autodiff import tangent_of_local
    from symbackprop.ir.interpret import evaluate

    count = len(body.free_symbols)
    shapes = [(4, 3), (1, 3), (4, 3)][:count]
    args = [leaf(f"x{i}", shape, "input") for i, shape in enumerate(shapes)]
    tangents = [leaf(f"t{i}", shape, "tangent") if i in with_tangent else None for i, shape in enumerate(shapes)]
    y = map_(body, args)
    rng = np.random.default_rng(len(with_tangent))
    arrays = {f"{kind}{i}": rng.uniform(0.2, 0.9, shape) for i, shape in enumerate(shapes) for kind in "xt"}
    symbols = [placeholder(i) for i in range(count)]
    for k in range(count):
        got = tangent_of_local(y, k, tangents)
        want = sum(sp.diff(body, symbols[k], symbols[j]) * sp.Symbol(f"t{j}") for j in with_tangent if j < count)
        if want == 0:
            assert got is None
            continue
        numeric = sp.lambdify([*symbols, *sp.symbols(f"t0:{count}")], want, "numpy")
        expected = np.broadcast_to(numeric(*(arrays[f"x{i}"] for i in range(count)),
                                           *(arrays[f"t{i}"] for i in range(count))), (4, 3))
        (value,) = evaluate([got], arrays, {})
        np.testing.assert_allclose(value, expected, rtol=1e-12, atol=1e-13)
