"""A value shared by every example of a map: computed once per call, read by
every row (GradBench's hand tracking needs the bone transforms once, not per
point). Values against numpy, gradients against central differences and JAX,
and the C checked to compute the shared value before the loop over examples."""

import re

import numpy as np
import pytest
import sympy as sp
from oracles import central_differences, relative_error

import symbackprop as sbp
from symbackprop.declare import nn

N = sp.Symbol("N", integer=True, positive=True)
POSE = sp.MatrixSymbol("pose", 1, 3)  # two joint angles and a bone length
POINTS = sp.MatrixSymbol("points", N, 3)  # x, y in the rest pose and a skinning weight
TARGETS = sp.MatrixSymbol("targets", N, 2)


def rotation(angle):
    return sp.Matrix([[sp.cos(angle), -sp.sin(angle)], [sp.sin(angle), sp.cos(angle)]])


def bone_transforms():
    """Two bones of a chain as a 1 x 12 row: each a 2 x 2 rotation and an offset."""
    first = rotation(POSE[0, 0])
    second = first * rotation(POSE[0, 1])
    tip = first * sp.Matrix([POSE[0, 2], 0])
    return sp.ImmutableMatrix([[*first, 0, 0, *second, *tip]])


def skinned_model():
    bones = sp.Matrix(sp.symbols("b0:12", real=True))
    point = sp.Matrix(sp.symbols("p0:3", real=True))
    target = sp.Matrix(sp.symbols("q0:2", real=True))
    rest, weight = sp.Matrix(point[:2]), point[2]

    def place(k):
        R = sp.Matrix(2, 2, list(bones[6 * k : 6 * k + 4]))
        return R * rest + sp.Matrix(bones[6 * k + 4 : 6 * k + 6])

    moved = (1 - weight) * place(0) + weight * place(1)
    body = (moved - target).dot(moved - target)
    misfit = sbp.map_examples(body, [(bones, bone_transforms()), (point, POINTS), (target, TARGETS)])
    return sbp.Model("skinned", inputs=[POINTS, TARGETS], params=[POSE], loss=nn.sum_all(misfit), outputs={"misfit": misfit})


def skinned_numpy(pose, points, targets, xp=np):
    def rot(a):
        return xp.stack([xp.stack([xp.cos(a), -xp.sin(a)]), xp.stack([xp.sin(a), xp.cos(a)])])

    first = rot(pose[0, 0])
    second = first @ rot(pose[0, 1])
    tip = first @ xp.stack([pose[0, 2], 0.0 * pose[0, 2]])
    rest, weight = points[:, :2], points[:, 2:3]
    moved = (1 - weight) * (rest @ first.T) + weight * (rest @ second.T + tip)
    misfit = ((moved - targets) ** 2).sum(axis=1)
    return misfit.sum(), misfit


@pytest.fixture(scope="module")
def skinned():
    return sbp.compile(skinned_model(), functions=("forward", "value_and_grad"))


def data(rows, seed=0):
    rng = np.random.default_rng(seed)
    points = np.column_stack([rng.standard_normal((rows, 2)), rng.uniform(0, 1, rows)])
    return {"pose": rng.standard_normal((1, 3)), "points": points, "targets": rng.standard_normal((rows, 2))}


@pytest.mark.parametrize("rows", [1, 7, 19])
def test_a_shared_value_matches_numpy_and_finite_differences(skinned, rows):
    d = data(rows)
    out = skinned.forward(**d)
    loss, misfit = skinned_numpy(d["pose"], d["points"], d["targets"])
    np.testing.assert_allclose(out["misfit"][:, 0], misfit, rtol=1e-13)
    value, grads = skinned.value_and_grad(**d)
    assert value == pytest.approx(loss, rel=1e-13)
    expected = central_differences(lambda e: skinned_numpy(e["pose"], e["points"], e["targets"])[0], d, "pose")
    assert relative_error(grads["pose"], expected) < 1e-8


def test_a_shared_values_gradient_matches_jax(skinned):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp = jax.numpy
    d = data(23, seed=3)
    loss = jax.grad(lambda pose: skinned_numpy(pose, jnp.asarray(d["points"]), jnp.asarray(d["targets"]), xp=jnp)[0])
    expected = np.asarray(loss(jnp.asarray(d["pose"])))
    _, grads = skinned.value_and_grad(**d)
    np.testing.assert_allclose(grads["pose"], expected, rtol=1e-12, atol=1e-14)


def functions_of(source):
    """Each exported C function's body, by name (the text between its signature and the next)."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"^(?:static )?int (\w+)\(\n", source, flags=re.M)]
    ends = [start for start, _ in starts[1:]] + [len(source)]
    return {name: source[start:end] for (start, name), end in zip(starts, ends)}


def test_the_c_computes_the_shared_value_once_before_the_loop_over_examples(skinned):
    # forward and value_and_grad call one body, skinned_run (with_grads says which)
    bodies = {name: body for name, body in functions_of(skinned.source).items() if "sin(" in body}
    assert set(bodies) == {"skinned_run"}
    for name, body in bodies.items():
        code = "\n".join(line for line in body.splitlines() if not line.lstrip().startswith(("/*", "*")))
        first_loop = code.index("< N;")
        trig = [m.start() for m in re.finditer(r"\b(sin|cos)\(", code)]
        assert trig, name
        assert max(trig) < first_loop, f"{name}: a bone transform is computed inside the loop over points"
