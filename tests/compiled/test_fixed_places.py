"""The workspace buffers of a fixed size lie first in work, each at a fixed
place, and a function cut into parts names those places (an enum, and a
macro per buffer) instead of passing its parts a pointer per buffer
(symbackprop/emit/cparts.py, schedule/workspace.py)."""

import re

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.emit.cparts import FixedBuffer, enumerators
from symbackprop.pipeline import generate
from symbackprop.schedule.workspace import plan_workspace


class _Kernel:
    def __init__(self, writes: tuple[str, ...], reads: tuple[str, ...] = ()):
        self._writes, self._reads = writes, reads

    def writes(self):
        return self._writes

    def reads(self):
        return self._reads


def test_fixed_size_buffers_lie_first_then_those_a_dimension_sizes():
    n = sp.Symbol("n", integer=True, positive=True)
    shapes = {"a": (n, 3), "s": (1, 1), "b": (n, 1), "t": (4, 4), "u": (1, 1)}
    kernels = [_Kernel((name,)) for name in ("a", "s", "b", "t", "u")] + [_Kernel((), tuple(shapes))]  # none reused
    slots, size = plan_workspace(kernels, shapes)
    place = {slot.name: slot.offset for slot in slots}
    # the fixed ones take 18 entries; those a dimension sizes start at the next 64-byte line (16 entries)
    assert place == {"s": 0, "t": 1, "u": 17, "a": 32, "b": 32 + 3 * n}
    assert sp.expand(size - (32 + 4 * n)) == 0
    after = {slot.name: slot.after for slot in slots}
    assert after == {"s": None, "t": "s", "u": "t", "a": None, "b": "a"}  # a: the first at work + 32
    fixed_only = {"s": (1, 1), "t": (4, 4), "u": (1, 1)}  # no dimension: nothing to align, no room spent
    assert plan_workspace([_Kernel(("s", "t", "u")), _Kernel((), tuple(fixed_only))], fixed_only)[1] == 18


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("count", [0, 1, 7, 1000, 3_000_001])
def test_the_python_side_workspace_starts_on_a_cache_line(count, dtype):
    from symbackprop.run.function import WORK_ALIGN, empty_workspace

    work = empty_workspace(count, dtype)
    assert work.ctypes.data % WORK_ALIGN == 0 and work.size == max(count, 1) and work.dtype == np.dtype(dtype)
    assert work.flags.c_contiguous and work.flags.writeable


def test_a_dead_fixed_buffer_is_reused_at_its_place():
    shapes = {"s": (1, 1), "t": (2, 2), "u": (1, 1)}
    kernels = [_Kernel(("s",)), _Kernel(("t",), ("s",)), _Kernel(("u",), ("t",))]
    slots, size = plan_workspace(kernels, shapes)
    by_name = {slot.name: slot for slot in slots}
    assert by_name["u"].reuses == "s" and by_name["u"].offset == 0 and size == 5


def test_each_place_is_named_relative_to_its_base():
    buffers = [FixedBuffer("s", None, 0, "1 x 1"), FixedBuffer("t", "s", 1, "1 x 1"),
               FixedBuffer("m", "t", 1, "4 x 4"), FixedBuffer("v", "m", 16, "1 x 1"),
               FixedBuffer("r", "s", 0, "1 x 1"), FixedBuffer("late", None, 40, "1 x 1")]
    assert [value for value, _ in enumerators("f", buffers)] == [
        "f__s", "f__t", "f__m", "f__v = f__m + 16", "f__r = f__s", "f__late = 40"]
    assert enumerators("f", [FixedBuffer("x", None, 3, "2 x 1")])[0][0] == "f__x = 3"  # the first, not at 0


def _chain(links: int) -> sbp.Model:
    x, w = sp.symbols("x w")
    e = x
    for _ in range(links):
        e = sp.tanh(w * e + x)
    return sbp.Model(f"chain{links}", inputs=[x], params=[w], loss=e)


def _parts(source: str) -> list[list[str]]:
    """Each part's parameter declarations, from its definition (and its
    prototype, where the module is split into units)."""
    found = re.findall(r"(?:static|\w+_SHARED) void \w+_part\d+\(\n(.*?)\n\)", source, re.S)
    return [[line.strip().rstrip(",") for line in params.splitlines()] for params in found]


def test_the_parts_of_a_1000_scalar_chain_take_no_pointer_per_scalar(monkeypatch):
    monkeypatch.setenv("SYMBACKPROP_UNROLLED_SCANS", "0")  # a chain of one link repeated is otherwise a scan
    source = generate(_chain(333), "float64")[0].source  # 1,000 distinct subexpressions
    parts = _parts(source)
    assert len(parts) >= 4, "the chain is no longer cut into parts: this test checks nothing"
    scalars = re.findall(r"^    (chain333_\w+__\w+)(?: = [^,]*)?, /\* 1 x 1 \*/$", source, re.M)
    assert len(scalars) >= 300  # the chain's values and adjoints, each named once
    # a part takes the function's parameters it uses and work, whatever the chain's length
    assert max(map(len, parts)) <= 5, parts
    assert all(any(p.endswith("*work") for p in params) for params in parts)
    assert not re.search(r"\w+_REAL \*\w+ = [^;]*; /\* 1 x 1 \*/", source)  # nor does a function declare one
    for enumerator in scalars:  # each buffer's name is its place, until its function's end
        buffer = enumerator.split("__", 1)[1]
        assert source.count(f"#define {buffer} (work + {enumerator})\n") == 1
        assert source.index(f"#undef {buffer}\n") > source.index(f"#define {buffer} ")


def _chain_numpy(links: int, x: float, w: float) -> tuple[float, float]:
    """The chain's value and d/dw by forward mode in numpy: the oracle."""
    e, de = x, 0.0
    for _ in range(links):
        e_next = np.tanh(w * e + x)
        de = (1 - e_next**2) * (e + w * de)
        e = e_next
    return e, de


def test_a_chain_cut_into_parts_computes_its_value_and_gradient():
    links = 100  # (60 are one function)
    mod = sbp.compile(_chain(links))
    assert "_part2(" in mod.source and "#define" in mod.source
    for x, w in ((0.3, 0.7), (-1.1, 1.4)):
        loss, grads = mod.value_and_grad(x=x, w=w)
        value, slope = _chain_numpy(links, x, w)
        assert float(loss) == pytest.approx(value, rel=1e-12)
        assert float(np.ravel(grads["w"])[0]) == pytest.approx(slope, rel=1e-9, abs=1e-13)


def _rotations(count: int) -> sbp.Model:
    """An explicit chain of 2-D rotations and shifts applied to points: a
    long straight-line part of its own in each derivative."""
    n = sp.Symbol("N", integer=True, positive=True)
    pose = sp.MatrixSymbol("pose", 1, 2 * count)
    points = sp.MatrixSymbol("points", n, 2)
    chain = sp.eye(3)
    for k in range(count):
        a, c = pose[0, 2 * k], pose[0, 2 * k + 1]
        chain = chain * sp.Matrix([[sp.cos(a), -sp.sin(a), c], [sp.sin(a), sp.cos(a), 0], [0, 0, 1]])
    shared = sp.Matrix(sp.symbols("m0:6", real=True))
    p = sp.Matrix(sp.symbols("p0:2", real=True))
    moved = sp.Matrix(2, 3, list(shared)) * sp.Matrix([p[0], p[1], 1])
    per_point = sbp.map_examples(moved.dot(moved), [(shared, sp.ImmutableMatrix([list(chain[:2, :])])), (p, points)])
    from symbackprop.declare import nn
    return sbp.Model(f"rotations{count}", inputs=[points], params=[pose], loss=nn.sum_all(per_point))


def _rotations_torch(count: int, pose: np.ndarray, points: np.ndarray, direction: np.ndarray) -> np.ndarray:
    torch = pytest.importorskip("torch")
    t = torch.tensor(pose, dtype=torch.float64, requires_grad=True)
    chain = torch.eye(3, dtype=torch.float64)
    for k in range(count):
        a, c = t[0, 2 * k], t[0, 2 * k + 1]
        zero, one = torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64)
        step = torch.stack([torch.stack([torch.cos(a), -torch.sin(a), c]),
                            torch.stack([torch.sin(a), torch.cos(a), zero]), torch.stack([zero, zero, one])])
        chain = chain @ step
    ones = torch.ones((points.shape[0], 1), dtype=torch.float64)
    moved = torch.cat([torch.tensor(points), ones], 1) @ chain[:2, :].T
    loss = (moved**2).sum()
    (grad,) = torch.autograd.grad(loss, t, create_graph=True)
    (hvp,) = torch.autograd.grad((grad * torch.tensor(direction)).sum(), t)
    return hvp.numpy()


@pytest.mark.slow
def test_the_hvp_of_an_explicit_chain_matches_double_backward():
    count = 6
    rng = np.random.default_rng(5)
    pose, points = 0.4 * rng.standard_normal((1, 2 * count)), rng.standard_normal((7, 2))
    direction = rng.standard_normal((1, 2 * count))
    mod = sbp.compile(_rotations(count))
    got = mod.hvp({"pose": direction}, pose=pose, points=points)["pose"]
    np.testing.assert_allclose(np.reshape(got, pose.shape), _rotations_torch(count, pose, points, direction),
                               rtol=1e-9, atol=1e-11)
