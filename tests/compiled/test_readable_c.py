"""The C a reviewer reads: names made from the model (an op's word and the
param or input it is nearest to), the user's names of intermediates carried into the C (made
valid identifiers), comment lines at most 100 columns, every kernel's
operations counted in derivation.md, and the model-independent helpers in
one shared header."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import sympy as sp
from conftest import example_names

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.emit.codegen import RUNTIME_HEADER
from symbackprop.emit.wrap import WIDTH, wrap, wrap_c_code, wrap_c_comments, wrap_markdown_equations
from symbackprop.errors import ModelError
from symbackprop.pipeline import generate

GENERATED = Path(__file__).resolve().parents[2] / "generated"


def _mlp(names=None):
    n = sp.Symbol("n", integer=True, positive=True)
    X, T = sp.MatrixSymbol("X", n, 3), sp.MatrixSymbol("T", n, 2)
    W1, b1 = sp.MatrixSymbol("W1", 3, 4), sp.MatrixSymbol("b1", 1, 4)
    W2, b2 = sp.MatrixSymbol("W2", 4, 2), sp.MatrixSymbol("b2", 1, 2)
    Z = nn.linear(X, W1, b1)
    H = nn.sigmoid(Z)
    Y = nn.linear(H, W2, b2)
    chosen = {key: {"Z": Z, "H": H, "R": Y - T}[value] for key, value in (names or {}).items()}
    return sbp.Model("mlp", inputs=[X, T], params=[W1, b1, W2, b2], loss=nn.mse(Y, T), outputs={"Y": Y},
                     names=chosen)


@pytest.mark.parametrize("name", example_names())
def test_no_name_is_a_number_in_store_order(name):
    """No t<k> or g<k>: a value is named after its op and the model's
    names near it, so one more stored value renames no other."""
    source = (GENERATED / name / f"{name}.c").read_text()
    declared = set(re.findall(r"\*(\w+) = ", source))
    assert not [d for d in declared if re.fullmatch(r"[tg]\d+", d)]


def test_an_adjoint_is_named_after_its_value_stored_or_not():
    source = generate(_mlp())[0].source
    declared = set(re.findall(r"\*(\w+) = ", source))
    assert {"mm_W1", "sigmoid_W1", "grad_sigmoid_W1", "mm_W2", "Y"} <= declared | {"Y"}
    # grad_add_Y: the adjoint of b2 + mm_W2 - T (the residual), a value that lives only inside a loop
    assert "grad_add_Y" in declared and "add_Y" not in declared
    # the adjoint of b1 + mm_W1 (the sigmoid's argument) is written over grad_sigmoid_W1, which nothing
    # reads after it (schedule/inplace.py): one name for one memory, the comment says so
    assert "grad_add_W1" not in declared
    assert "/* grad_sigmoid_W1 = grad_sigmoid_W1*sigmoid_W1*(1 - sigmoid_W1) */" in source


def test_the_users_names_of_intermediates_reach_the_c_as_identifiers():
    emitted, _ = generate(_mlp({"hidden layer": "H", "int": "Z", "residual": "R"}))
    source, derivation = emitted.source, emitted.derivation
    declared = set(re.findall(r"\*(\w+) = ", source))
    assert {"hidden_layer", "grad_hidden_layer", "grad_residual", "grad_int"} <= declared
    assert "hidden layer" not in source and "int int" not in source
    assert r"\frac{\partial L}{\partial residual}" in derivation
    assert "/* hidden_layer = sigmoid(b1 + mm_W1) */" in source


def test_naming_changes_no_result():
    rng = np.random.default_rng(0)
    data = {"X": rng.standard_normal((5, 3)), "T": rng.standard_normal((5, 2)), "W1": rng.standard_normal((3, 4)),
            "b1": rng.standard_normal((1, 4)), "W2": rng.standard_normal((4, 2)), "b2": rng.standard_normal((1, 2))}
    plain = sbp.compile(_mlp()).value_and_grad(**data)
    named = sbp.compile(_mlp({"hidden": "H", "for": "Z"})).value_and_grad(**data)
    assert plain[0] == named[0]
    for key in plain[1]:
        assert np.array_equal(plain[1][key], named[1][key])


@pytest.mark.parametrize("names, fragment", [
    ({"X": "H"}, "clashes with the input"),
    ({"Y": "H"}, "clashes with the output"),
    ({"loss": "H"}, "clashes with the loss"),
    ({"": "H"}, "non-empty strings"),
])
def test_a_name_that_clashes_is_refused(names, fragment):
    with pytest.raises(ModelError, match=fragment):
        _mlp(names)


def test_comment_lines_fit_in_100_columns():
    files = [*GENERATED.glob("*/*.c"), *GENERATED.glob("*/*.h"), GENERATED / RUNTIME_HEADER]
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith(("/*", "* ")):
                assert len(line) <= WIDTH, f"{path}:{number}"
    for path in GENERATED.glob("*/derivation.md"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "$$" in line or line.startswith("   "):
                assert len(line) <= WIDTH or " " not in line.strip(), f"{path}:{number}"


def test_code_lines_fit_in_100_columns():
    """Long calls and expressions continue on further lines; only
    preprocessor lines and tables of strings may be longer."""
    for path in [*GENERATED.glob("*/*.c"), *GENERATED.glob("*/*.h")]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if len(line) > WIDTH:
                assert line.startswith("#") or '"' in line, f"{path}:{number}"


def test_no_trailing_blanks_and_a_function_body_opens_on_its_own_line():
    """What a reviewer's diff shows as noise: blanks at line ends, and code
    glued to the brace that opens a function."""
    files = [*GENERATED.glob("*/*.c"), *GENERATED.glob("*/*.h"), GENERATED / RUNTIME_HEADER]
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert line == line.rstrip(), f"{path}:{number}: trailing blanks"
            assert not re.match(r"\{\s*\S", line), f"{path}:{number}: code after an opening brace"


def test_wrapping_keeps_every_word_in_order():
    text = " ".join(f"w{k}[i, {k}]*(a + b{k})" for k in range(40))
    lines = wrap(text, 60, 60)
    assert all(len(line) <= 60 for line in lines)
    assert " ".join(lines) == text
    comment = "    /* " + text + " */"
    wrapped = wrap_c_comments(comment).split("\n")
    assert wrapped[0].startswith("    /* ") and all(line.startswith("     * ") for line in wrapped[1:])
    assert wrapped[-1].endswith(" */") and all(len(line) <= WIDTH for line in wrapped)
    assert wrap_c_comments(comment) == wrap_c_comments(comment)
    equation = "1. $$" + r" + \frac{a}{b}" * 30 + "$$"
    lines = wrap_markdown_equations(equation).split("\n")
    assert len(lines) > 1 and all(line.startswith("   ") for line in lines[1:])
    assert re.sub(r"\s+", " ", " ".join(lines)) == re.sub(r"\s+", " ", equation)


def test_a_long_call_is_one_argument_a_line():
    """A call too long for a line lists one argument a line (an argument
    added in the middle is one line of a diff, not the lines after it
    moved along); a long expression that is not one call flows on."""
    args = [f"grad_tanh_W{k}" for k in range(12)] + ["work + 8*n", "(const double *)in[3]", "f(a, b)"]
    for head in ("net_run_part1", "return net_run", "const int status = net_value_and_grad"):
        lines = wrap_c_code(f"    {head}(n, {', '.join(args)});").split("\n")
        assert lines[0] == f"    {head}(" and lines[-1] == "    );", lines
        assert [line.strip().rstrip(",") for line in lines[1:-1]] == ["n", *args]
    expression = "    x = " + " + ".join(f"f(a{k}, b{k})" for k in range(20)) + ";"
    flowed = wrap_c_code(expression).split("\n")
    assert len(flowed) > 1 and all(line.startswith("            ") for line in flowed[1:])
    assert re.sub(r"\s+", " ", " ".join(flowed)).strip() == expression.strip()


def test_every_kernel_has_its_operations_counted():
    """A product X (n x 3) @ W1 (3 x 4) is n*3*4 multiply-adds; the sum of
    a (n x 2) matrix down its columns n*2 additions."""
    derivation = generate(_mlp())[0].derivation
    table = derivation.split("## Operations per kernel", 1)[1]
    assert "| `mm_W1` | matrix product | 12*n multiply-adds |" in table
    assert "| `colsum_Y` | sum | 2*n operations |" in table
    assert "| `grad_W1` | matrix product | 12*n multiply-adds |" in table
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    steps = list(re.findall(r"^1\. \$\$(.*?) =", derivation, flags=re.M))
    assert len(rows) == len(list(generate(_mlp())[1].function("value_and_grad").schedule.kernels))
    assert len(steps) >= len(rows)


def test_the_shared_helpers_are_in_the_runtime_header_only():
    emitted, _ = generate(_mlp())
    assert '#include "symbackprop_runtime.h"' in emitted.source
    assert "simd" not in emitted.source and "cblas" not in emitted.source.lower()
    assert "symbackprop_f64_matmul(" in emitted.source
    header = (GENERATED / RUNTIME_HEADER).read_text()
    for helper in ("matmul", "sum", "max", "min", "logsumexp"):
        assert f"symbackprop_f64_{helper}(" in header and f"symbackprop_f32_{helper}(" in header


def test_the_cffi_build_carries_the_runtime_header_and_keys_on_it(tmp_path, monkeypatch):
    from symbackprop.emit import codegen
    from symbackprop.toolchain.builder import BuildOptions, cache_key

    x, w = sp.symbols("x w")
    mod = sbp.compile(sbp.Model("rt_header", params=[w], inputs=[x], loss=sp.tanh(w * x)),
                      options=BuildOptions(cache_dir=tmp_path))
    assert (mod.folder / RUNTIME_HEADER).read_text() == (GENERATED / RUNTIME_HEADER).read_text()
    assert RUNTIME_HEADER in (mod.folder / "manifest.json").read_text()
    emitted = mod.emitted
    key = cache_key(emitted.prefix, emitted.source, emitted.header, emitted.cdef, ())
    monkeypatch.setattr(codegen, "runtime_header", lambda: "/* another runtime */\n")  # the builder reads it there
    assert cache_key(emitted.prefix, emitted.source, emitted.header, emitted.cdef, ()) != key
