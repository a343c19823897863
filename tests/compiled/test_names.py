"""User names never reach the C text except as sanitized, unique
identifiers (and as neutralized comment text): models with hostile names
compile, compute the right gradients, and carry no injected code."""

from __future__ import annotations

import functools
import itertools
import re
import shutil
import subprocess
import sysconfig

import numpy as np
import pytest
import sympy as sp
from helpers import assert_gradients_match, random_data

import symbackprop as sbp
from symbackprop.base.cnames import C_KEYWORDS, C_LIBRARY, CNamer, sanitize
from symbackprop.declare import nn
from symbackprop.pipeline import generate

MARK = "INJECTED"  # every payload that tries to escape carries it after a non-word character

HOSTILE = [
    # C keywords
    "int", "for", "return", "double", "restrict", "_Bool", "inline", "sizeof",
    # spaces, quotes, semicolons, comment and preprocessor syntax
    "my var", " lead", "trail ", 'a"b', "a'b", '"', "x;y", ";",
    "a*/b", "/*", f"a */ {MARK}_1(); /* b", f"c\n#define {MARK}_2 1\nd", "e\\\nf", "tab\there",
    f"q\"; {MARK}_3; \"r", f"s // {MARK}_4", "#include <stdio.h>", "??/", "a??=b",
    # non-ASCII letters
    "α", "λ_1", "\u2126", "\u03a9", "ﬁ", "ǅ", "١", "x\u0301", "日本", "🙂",
    # very long, and long names equal in their first 48 characters
    "x" * 300, "x" * 299 + "y", "w" * 48 + "z",
    # math.h, libc and macro names
    "y0", "j1", "gamma", "exp", "index", "sqrt", "fmax", "expf", "isinf", "errno", "stdin",
    "NAN", "INFINITY", "M_PI", "EDOM", "INT_MAX", "st_mtime", "static_assert", "main", "malloc", "Py_None",
    # names the generated code uses itself
    "i", "j", "k", "work", "acc", "total", "maxval", "x0", "x1", "_load0", "t1", "grad_p", "dt1_dp",
    "NASTY_H", "nasty", "nasty_forward", "nasty_value_and_grad",
    # names that collide once sanitized
    "a b", "a-b", "a_b", "a__b", "a.b", "v", "", " ", "1abc", "v1abc", "u03b1", "int_", "p",
]

C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def test_sanitized_names_are_valid_unreserved_and_unique():
    namer = CNamer()
    idents = [namer.name(name) for name in HOSTILE]
    assert len(set(HOSTILE)) == len(HOSTILE)
    assert len(set(idents)) == len(idents)
    for name, ident in zip(HOSTILE, idents):
        assert C_IDENTIFIER.match(ident), (name, ident)
        assert ident not in C_KEYWORDS and ident not in C_LIBRARY, (name, ident)
        assert not ident.startswith("_"), (name, ident)  # _X and __x are the implementation's
    again = CNamer()
    assert [again.name(name) for name in HOSTILE] == idents  # deterministic


def test_no_macro_of_the_compiled_headers_survives_sanitizing(tmp_path):
    """Every object-like macro a generated module may see (Python.h, math.h,
    stdint.h, stddef.h, the compiler's own) is renamed when a user picks it."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    probe = tmp_path / "probe.c"
    probe.write_text("#include <Python.h>\n#include <math.h>\n#include <stdint.h>\n#include <stddef.h>\n")
    include = sysconfig.get_paths()["include"]
    out = subprocess.run([cc, "-std=c99", "-dM", "-E", f"-I{include}", str(probe)], capture_output=True, text=True, check=True)
    macros = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("#define ")]
    object_like = [m for m in macros if "(" not in m and not m.startswith("_")]
    assert len(object_like) > 500
    assert [m for m in object_like if sanitize(m) == m] == []


def _scalar_model(model_name: str, names: list[str]) -> tuple[sbp.Model, list[sp.Symbol]]:
    """loss = sum_k (k+1) s_k^2 + sum_k s_k s_(k+1): each gradient depends
    on its own coefficient and its neighbours, so swapped names show."""
    syms = [sp.Symbol(name) for name in names]
    loss = sum((k + 1) * s**2 for k, s in enumerate(syms)) + sum(s * t for s, t in itertools.pairwise(syms))
    return sbp.Model(model_name, inputs=[], params=syms, loss=loss), syms


def _check_scalar_model(model_name: str, names: list[str]) -> None:
    model, syms = _scalar_model(model_name, names)
    mod = sbp.compile(model)
    values = [0.01 * (k - 40) for k in range(len(syms))]
    _, grads = mod.value_and_grad(**{s.name: v for s, v in zip(syms, values)})
    assert sorted(grads) == sorted(names)
    for k, s in enumerate(syms):
        neighbours = (values[k - 1] if k > 0 else 0.0) + (values[k + 1] if k + 1 < len(values) else 0.0)
        want = 2 * (k + 1) * values[k] + neighbours
        assert grads[s.name] == pytest.approx(want, rel=1e-12, abs=1e-15), repr(s.name)
    _assert_nothing_injected(mod.source)
    _assert_nothing_injected(mod.header)


def test_every_hostile_name_in_one_model():
    _check_scalar_model("nasty", HOSTILE)


MODEL_NAMES = ["int", f"a */ {MARK}_M(); /* b", "α β", "exp", "x" * 300, "NASTY_H", "\n#define", "Py_None"]


@pytest.mark.parametrize("model_name", MODEL_NAMES, ids=range(len(MODEL_NAMES)))
def test_hostile_model_names(model_name):
    guards = ["INT_H", "A_INJECTED_M_B_H", "U03B1_U03B2_H", "EXP_H", "NASTY_H", "V_DEFINE_H", "PY_NONE_H"]
    _check_scalar_model(model_name, list(dict.fromkeys([*guards, "main", model_name])))


def test_hostile_matrix_names_dimension_and_outputs():
    n = sp.Symbol(f"n */ {MARK}_D(); /*", integer=True, positive=True)
    names = ["int", f"a */ {MARK}_1(); /* b", "α", "exp", "x" * 300, "x" * 299 + "y", "NASTY_H", "a b", "a-b", "work"]
    leaves = [sp.MatrixSymbol(name, n if k % 3 == 0 else 1, 2) for k, name in enumerate(names)]
    data_in = sp.MatrixSymbol("gamma", n, 2)
    total = data_in
    for leaf in leaves:
        total = total + (sp.OneMatrix(n, 1) * leaf if leaf.shape[0] != n else leaf)
    hidden = total.applyfunc(sp.tanh)
    outputs = {f"o */ {MARK}_O(); /*": hidden, "expf": sp.HadamardProduct(hidden, hidden), "y0": leaves[0]}
    model = sbp.Model(f"m */ {MARK}", inputs=[data_in], params=leaves, loss=nn.mean_all(sp.HadamardPower(hidden, 2)),
                      outputs=outputs)
    mod = sbp.compile(model)
    dims = {n: 3}
    data = random_data(model, np.random.default_rng(3), dims)
    assert_gradients_match(mod, model, data, dims)
    forward = mod.forward(**data)
    assert sorted(forward) == sorted(["loss", *outputs])
    expected_hidden = np.tanh(data["gamma"] + sum(data[name] for name in names))  # rows broadcast
    np.testing.assert_allclose(forward[f"o */ {MARK}_O(); /*"], expected_hidden, rtol=1e-12)
    np.testing.assert_allclose(forward["expf"], expected_hidden**2, rtol=1e-12)
    _assert_nothing_injected(mod.source)
    _assert_nothing_injected(mod.header)


def test_generation_is_deterministic_with_hostile_names():
    first, _ = generate(_scalar_model("nasty", HOSTILE)[0])
    second, _ = generate(_scalar_model("nasty", HOSTILE)[0])
    assert first.source == second.source and first.header == second.header and first.cdef == second.cdef


COMMENT = re.compile(r"/\*.*?\*/", re.DOTALL)
DIRECTIVE = re.compile(r"^\s*#\s*(include|ifndef|ifdef|if|define|endif|else|elif|undef|error)\b")


def _assert_nothing_injected(text: str) -> None:
    """Outside comments the marker appears only inside identifiers (never
    after a non-word character, as in every payload: a comment closed early
    would leave it there), the only string literals are the templates' own,
    and every preprocessor line is a plain directive."""
    code = COMMENT.sub(" ", text)
    assert "/*" not in code and "*/" not in code
    # the marker, then its line for the message: a leading ".*" would make
    # the search quadratic in a line's length (the hostile model's C: 15 CPU s)
    found = re.search(rf"\b{MARK}", code)
    assert found is None, code[code.rfind("\n", 0, found.start()) + 1:].partition("\n")[0]
    assert _literals(code) <= _template_literals()
    for line in code.splitlines():
        if line.lstrip().startswith("#"):
            assert DIRECTIVE.match(line), line


STRING_LITERAL = re.compile(r'"(?:\\.|[^"\\])*"')


def _literals(code: str) -> set[str]:
    """String literals of C code, the header's own #include excepted; a
    module's real-type macro (in an #error) read as P_REAL, and quoted C
    identifiers (the names the self-description returns, made by the namer)
    as one: neither can carry a user's text other than as an identifier."""
    found = STRING_LITERAL.findall(re.sub(r'#include "\w+\.h"', "", code))
    return {'"identifier"' if re.fullmatch(r'"[A-Za-z_]\w*"', s) else re.sub(r"\b\w+_REAL\b", "P_REAL", s)
            for s in found}


@functools.lru_cache(maxsize=1)
def _template_literals() -> frozenset[str]:
    """The string literals the templates write for a model with plain names
    (scalar and matrix parameters, a batch dimension, elementwise loops)."""
    a, batch = sp.Symbol("a"), sp.Symbol("n", integer=True, positive=True)
    X, W = sp.MatrixSymbol("X", batch, 3), sp.MatrixSymbol("W", 3, 2)
    model = sbp.Model("plain", inputs=[X], params=[W, a], loss=a * nn.mean_all(nn.tanh(X * W)), outputs={"Y": X * W})
    emitted, _ = generate(model)
    return frozenset(_literals(COMMENT.sub(" ", emitted.source + emitted.header)))


@pytest.mark.parametrize("name", ["i", "j", "k", "row", "rows8"])
def test_a_dimension_named_as_a_loop_index(name):
    """A dimension declared Symbol("i", integer=True), as the kernels' own
    loop index symbols are, is still the dimension in the C: it printed as
    the loop's i, which the C did not declare (or, inside the loop, read as
    the wrong number)."""
    N = sp.Symbol(name, integer=True)
    X = sp.MatrixSymbol("X", N, 3)
    w = sp.MatrixSymbol("w", 1, 3)
    a, b = sp.symbols("a0:3", real=True), sp.symbols("b0:3", real=True)
    body = sp.tanh(sum(a[k] * b[k] for k in range(3))) ** 2
    terms = sbp.map_examples(body, [(sp.Matrix(a), X), (sp.Matrix(b), w)])
    module = sbp.compile(sbp.Model(f"dim_{name}", inputs=[X], params=[w], loss=sbp.reduce("sum", terms, 0)),
                         functions=("value_and_grad",))
    x, weights = np.random.default_rng(0).normal(size=(5, 3)), np.full((1, 3), 0.3)
    loss, grads = module.value_and_grad(X=x, w=weights)
    z = np.tanh(x @ weights.T)
    np.testing.assert_allclose(float(np.ravel(loss)[0]), np.sum(z**2), rtol=1e-12)
    np.testing.assert_allclose(grads["w"], (2 * z * (1 - z**2)).T @ x, rtol=1e-10)
