"""The C of a model does not get slower with the order SymPy happens to
list a product's factors in (it sorts them by a key, e.g. which of sigmoid
and tanh sorts first): with tanh first, the loop left to compute tanh(g)
alone in an LSTM's step was unrolled by GCC into 16 scalar tanhf calls
(W9 8% slower); and an LSTM's h = o * tanh(c), read as the next state and
(rebuilt sorted) inside h @ V, was two nodes (stored twice, sigmoid(o) in a
loop of its own, W9 3-6% slower)."""

import shutil
import subprocess

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.ir.lower import lower
from symbackprop.pipeline import generate
from symbackprop.toolchain.builder import DEFAULT_FLAGS, BuildOptions

n = sp.Symbol("n", integer=True, positive=True)
X, Y = sp.MatrixSymbol("X", n, 4), sp.MatrixSymbol("Y", n, 4)
V, Z = sp.MatrixSymbol("V", 4, 2), sp.MatrixSymbol("Z", n, 2)


def product_model(first: str) -> sbp.Model:
    """A product of a sigmoid and a tanh written with `first` first, an
    output as written and, read inside a matrix product, as SymPy rebuilds it."""
    gates = {"sigmoid": nn.sigmoid(X), "tanh": nn.tanh(Y)}
    written = sp.HadamardProduct(gates[first], *[g for name, g in gates.items() if name != first])
    within = (written * V).args[0]  # rebuilt inside a product: sorted
    return sbp.Model("prod", inputs=[X, Y, Z], params=[V], loss=nn.mse(written * V, Z),
                     outputs={"written": written, "within": within})


@pytest.mark.parametrize("first", ["sigmoid", "tanh"])
def test_a_product_lowers_to_one_node_whatever_order_its_factors_were_written_in(first):
    model = product_model(first)
    assert model.outputs["written"].args[0] == (nn.sigmoid(X) if first == "sigmoid" else nn.tanh(Y))
    if first == "sigmoid":  # SymPy sorts tanh first: the two orders differ, the test can tell
        assert model.outputs["within"].args != model.outputs["written"].args
    lowered = lower(model)
    assert lowered.outputs["written"] is lowered.outputs["within"]


@pytest.mark.parametrize("first", ["sigmoid", "tanh"])
def test_the_one_product_computes_both_orders_values_and_the_gradient(first):
    rng = np.random.default_rng(3)
    arrays = {"X": rng.standard_normal((6, 4)), "Y": rng.standard_normal((6, 4)),
              "Z": rng.standard_normal((6, 2)), "V": rng.standard_normal((4, 2))}
    mod = sbp.compile(product_model(first))
    h = np.tanh(arrays["Y"]) / (1 + np.exp(-arrays["X"]))  # numpy by hand
    out = mod.forward(**arrays)
    assert np.allclose(out["written"], h, rtol=1e-13) and np.allclose(out["within"], h, rtol=1e-13)
    loss, grads = mod.value_and_grad(**arrays)
    residual = h @ arrays["V"] - arrays["Z"]
    assert np.isclose(loss, np.mean(residual ** 2), rtol=1e-12)
    assert np.allclose(grads["V"], 2 * h.T @ residual / residual.size, rtol=1e-11)


def lstm_model(hidden=16, vocab=5):
    T = sp.Symbol("T", integer=True, positive=True)
    gates = "ifgo"
    W = [sp.MatrixSymbol(f"W_{g}", vocab, hidden) for g in gates]
    U = [sp.MatrixSymbol(f"U_{g}", hidden, hidden) for g in gates]
    b = [sp.MatrixSymbol(f"b_{g}", 1, hidden) for g in gates]
    Vo, c = sp.MatrixSymbol("Vo", hidden, vocab), sp.MatrixSymbol("c", 1, vocab)
    Xs, Ys = sp.MatrixSymbol("Xs", T, vocab), sp.MatrixSymbol("Ys", T, vocab)
    h, cell, x = (sp.MatrixSymbol("h", 1, hidden), sp.MatrixSymbol("cell", 1, hidden),
                  sp.MatrixSymbol("x", 1, vocab))
    h_next, cell_next = nn.lstm_cell(x, h, cell, W, U, b)
    zero = sp.ZeroMatrix(1, hidden)
    logits = sbp.scan((h_next, cell_next), h_next * Vo + c, (h, cell), x, (zero, zero), Xs)
    return sbp.Model("lstm_order", inputs=[Xs, Ys], params=[*W, *U, *b, Vo, c],
                     loss=nn.softmax_cross_entropy(logits, Ys))


def loops_calling(source: str, function: str) -> list[tuple[str, str]]:
    """(the pragma lines before it, its body) of each loop over j whose body calls `function`."""
    lines = source.splitlines()
    found = []
    for index, line in enumerate(lines):
        if line.strip().startswith("for (int64_t j = 0;"):
            body = "\n".join(lines[index + 1:index + 8])
            pragmas = "\n".join(lines[max(0, index - 4):index])
            if f"{function}(" in body.split("}")[0]:
                found.append((pragmas, body))
    return found


@pytest.fixture(scope="module")
def lstm_c():
    return generate(lstm_model(), dtype="float32", derivation=False)[0].source


def test_a_step_loop_calling_tanh_is_kept_a_loop(lstm_c):
    loops = loops_calling(lstm_c, "tanhf")
    assert loops
    for pragmas, body in loops:
        if "ivdep" in pragmas:  # a scan step's loop (see loops/emit.py)
            assert "#pragma GCC unroll 1" in pragmas, body


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump reads the compiled module")
def test_the_compiled_step_calls_no_scalar_tanh(tmp_path):
    """GCC with libmvec: a loop of 16 tanh's is one call of the 16-wide
    variant, never 16 calls of tanhf (where the module links libmvec)."""
    sbp.compile(lstm_model(), dtype="float32", options=BuildOptions(flags=DEFAULT_FLAGS, cache_dir=tmp_path))
    built = [*tmp_path.rglob("_sbp_*.so")]
    assert built
    text = "".join(subprocess.run(["objdump", "-d", str(p)], capture_output=True, text=True).stdout for p in built)
    if "_ZGV" not in text:
        pytest.skip("this build does not use libmvec")
    assert "<tanhf@plt>" not in text
