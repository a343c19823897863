"""The DAG CSE (schedule.dagcse) and the printer's term order (base.cprint):
checked against evaluation of the original expressions and against
SymPy's own as_ordered_terms."""

import random
import re
import shutil
import subprocess

import pytest
import sympy as sp
from conftest import load_example

import symbackprop as sbp
from symbackprop.base.cprint import ordered_terms
from symbackprop.schedule.dagcse import dag_cse
from symbackprop.toolchain.builder import DEFAULT_FLAGS, BuildOptions

x, y, z, w = sp.symbols("x y z w", real=True)


def _evaluate(temps, reduced, point):
    """The reduced outputs' values, each temporary computed in order."""
    values = dict(point)
    for symbol, value in temps:
        values[symbol] = float(value.xreplace(values))
    return [float(e.xreplace(values)) for e in reduced]


def _uses(symbol, temps, reduced):
    return sum(1 for e in [v for _, v in temps] + reduced if symbol in e.free_symbols)


def test_values_are_unchanged_and_shared_terms_computed_once():
    shared = sp.sin(x * y) + z
    exprs = [shared * w + sp.exp(shared), -x * y * z + sp.cos(x * y), x * y * z + 1 / (1 + shared ** 2)]
    temps, reduced = dag_cse(exprs)
    rng = random.Random(0)
    for _ in range(5):
        point = {s: rng.uniform(0.5, 2.0) for s in (x, y, z, w)}
        want = [float(e.xreplace(point)) for e in exprs]
        assert all(abs(a - b) <= 1e-12 * max(1.0, abs(b)) for a, b in zip(_evaluate(temps, reduced, point), want))
    expanded: dict = {}
    for symbol, value in temps:
        expanded[symbol] = value.xreplace(expanded)
    values = list(expanded.values())
    assert shared in values and x * y in values  # each shared once
    assert x * y * z in values  # shared with its negation, which reads it
    assert not any(v == -x * y * z for v in values)
    assert [s.name for s, _ in temps] == [f"x{k}" for k in range(len(temps))]
    for symbol, _ in temps:  # a temporary is read more than once
        assert _uses(symbol, temps, reduced) >= 2


def test_products_and_sums_share_their_common_parts():
    exprs = [2 * x * y * w, 3 * x * y * z, x * y * z * w, 1 + sp.sin(x) + sp.cos(y), sp.sin(x) + sp.cos(y) + z]
    temps, reduced = dag_cse(exprs)
    expanded: dict = {}
    for symbol, value in temps:
        expanded[symbol] = value.xreplace(expanded)
    assert any(v.is_Mul and {x, y} <= v.free_symbols for v in expanded.values())  # x*y (or w*x*y) once
    assert sp.sin(x) + sp.cos(y) in expanded.values()
    point = {x: 0.3, y: -1.2, z: 0.7, w: 2.5}
    got = _evaluate(temps, reduced, point)
    want = [float(e.xreplace(point)) for e in exprs]
    assert all(abs(a - b) <= 1e-12 for a, b in zip(got, want))


def test_a_sum_and_its_negation_share_a_temporary():
    a = sp.MatrixSymbol("A", 3, 3)
    shared = a[0, 0] * (x * y - z) - a[0, 1] * (z * w - x) + 2 * w
    exprs = [shared * sp.sin(x), -shared * sp.cos(x)]
    temps, reduced = dag_cse(exprs)
    assert [v for _, v in temps] in ([shared], [-shared])  # the other reads it
    point = {x: 0.3, y: -1.2, z: 0.7, w: 2.5, a[0, 0]: 1.5, a[0, 1]: -0.4}
    got = _evaluate(temps, reduced, point)
    assert all(abs(a - float(e.xreplace(point))) <= 1e-12 for a, e in zip(got, exprs))


def test_temporaries_come_after_what_they_read():
    temps, _ = dag_cse([sp.sin(x + y) * sp.cos(x + y), sp.sin(x + y) + sp.cos(x + y)])
    defined = set()
    for symbol, value in temps:
        assert value.free_symbols - {x, y} <= defined
        defined.add(symbol)


def test_lets_are_named_where_read_and_copies_substituted():
    a, b, c = sp.symbols("_p0 _p1 _p2", real=True)
    lets = {a: sp.exp(x) + y, b: -z, c: a * a}
    temps, reduced = dag_cse([c + b, a * w], lets)
    assert sp.exp(x) + y in [v for _, v in temps]
    assert not any(v == -z for _, v in temps)  # a negated atom is a copy
    point = {x: 0.3, y: 1.1, z: 0.7, w: 2.0}
    pv = float(sp.exp(0.3)) + 1.1
    got = _evaluate(temps, reduced, point)
    assert abs(got[0] - (pv * pv - 0.7)) < 1e-12 and abs(got[1] - pv * 2.0) < 1e-12


def test_a_deeply_shared_dag_is_walked_once_per_node():
    # as a tree this has 2**300 paths: a walk per path would not finish
    e = x
    for _ in range(300):
        e = sp.sin(e) * e + y
    temps, reduced = dag_cse([e, e * z])
    assert 300 <= len(temps) <= 1200
    point = {x: 0.1, y: 0.2, z: 0.5}
    got = _evaluate(temps, reduced, point)
    assert abs(got[1] - 0.5 * got[0]) < 1e-12


def test_ordered_terms_is_sympys_print_order():
    a = sp.MatrixSymbol("A", 3, 3)
    cases = [1 - 2 * x, x ** 2 + 2 * x + 1, sp.sqrt(2) * x + x + 3, x * y + sp.Rational(1, 3) * z - x ** -2 + sp.exp(x),
             a[0, 1] * x - a[1, 0] * y + a[2, 2] * x * y + 2.5, sp.I * x + x + 2, -x * y - z ** 3 * w + sp.sin(x) ** 2]
    for expr in cases:
        assert ordered_terms(expr) == expr.as_ordered_terms(), expr


def test_lets_of_one_value_keep_their_values():
    """Two named values equal once their reads are temporaries (the same
    forward value in a residual and in its Jacobian, grouped in one loop)
    and what is built on them: each as the original expressions give it."""
    a, b, c, d = sp.symbols("a b c d", real=True)
    lets = {a: sp.sin(x) + y, b: sp.sin(x) + y, c: sp.sqrt(a) * z, d: sp.sqrt(b) * z}
    exprs = [c * w + a, d * x + b, c + d]
    temps, reduced = dag_cse(exprs, lets)
    rng = random.Random(1)
    for _ in range(5):
        point = {s: rng.uniform(0.5, 2.0) for s in (x, y, z, w)}
        want = [float(e.xreplace(lets).xreplace(lets).xreplace(point)) for e in exprs]  # (lets read lets)
        got = _evaluate(temps, reduced, point)
        assert all(abs(g - v) <= 1e-12 * max(1.0, abs(v)) for g, v in zip(got, want))


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump reads the compiled module")
def test_gcc_computes_a_value_two_lets_hold_once(tmp_path):
    """Why dag_cse leaves two lets of one value two temporaries: GCC's value
    numbering merges them. bundle_adjustment's forward loop holds |r|^2,
    its sqrt, sin and cos in the residual's lets and again in the
    Jacobian's; the compiled loop takes one sqrt and one sin and cos."""
    model = load_example("bundle_adjustment").model
    sbp.compile(model, options=BuildOptions(flags=DEFAULT_FLAGS, cache_dir=tmp_path))
    built = [*tmp_path.rglob("_sbp_*.so")]
    assert built
    dump = "".join(subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(p)], capture_output=True,
                                  text=True).stdout for p in built)
    functions = re.split(r"\n(?=[0-9a-f]+ <)", dump)
    forward = "".join(f for f in functions if re.match(r"[0-9a-f]+ <bundle_adjustment_forward", f))
    if "bundle_adjustment_forward" not in forward:
        pytest.skip("the forward is inlined under another name in this build")
    calls = re.findall(r"call.*<(sincos|sin|cos)@plt>", forward)
    roots = re.findall(r"\bv?sqrtsd\b|call.*<sqrt@plt>", forward)
    assert calls and roots  # the test sees them
    assert len(roots) == 1 and (calls == ["sincos"] or sorted(calls) == ["cos", "sin"]), (calls, roots)
