"""A module with many matrix products calls one function per kind of
product (emit/products.py): an unrolled GRU's C has a function for each
kind, every product is a call of one, its values and gradients are those
of the inline build and of numpy (the loss) and central differences (the
gradient), and a module with few products keeps its calls as they were."""

import re

import numpy as np
import pytest
from conftest import load_example
from test_depth import check_gru_gradient, gru_data, gru_model, gru_numpy

import symbackprop as sbp
from symbackprop.emit import products
from symbackprop.pipeline import generate
from symbackprop.toolchain.builder import BuildOptions

STEPS = 4  # 14 products a step, 56 in all: past MAX_INLINED_PRODUCTS


def _product_calls(source: str) -> list[str]:
    return re.findall(r"\bsymbackprop_f64_matmul(?:_add)?\(", source)


def test_an_unrolled_gru_has_a_function_per_kind_of_product():
    source = generate(gru_model(STEPS), derivation=False)[0].source
    kinds = re.findall(r"^void (gru_steps\d+_product\d+)\(", source, re.M)
    assert 2 <= len(set(kinds)) < 20
    calls = {kind: len(re.findall(rf"^\s+{kind}\(", source, re.M)) for kind in set(kinds)}
    assert all(count >= 1 for count in calls.values()), calls
    assert sum(calls.values()) > products.MAX_INLINED_PRODUCTS
    assert len(_product_calls(source)) == len(set(kinds))  # the helper is called only from them


def test_a_module_with_few_products_keeps_its_calls():
    source = generate(load_example("mlp").model, derivation=False)[0].source
    assert "_product0" not in source and 0 < len(_product_calls(source)) <= products.MAX_INLINED_PRODUCTS


def test_shared_products_compute_what_inline_ones_do(tmp_path, monkeypatch):
    data = gru_data(STEPS, rows=6)
    shared = sbp.compile(gru_model(STEPS), options=BuildOptions(cache_dir=tmp_path / "shared"))
    monkeypatch.setattr(products, "MAX_INLINED_PRODUCTS", 10**6)  # (another folder: its memo of the C is another)
    inline = sbp.compile(gru_model(STEPS), options=BuildOptions(cache_dir=tmp_path / "inline"))
    assert "_product0(" in shared.source and "_product0(" not in inline.source
    loss, grads = shared.value_and_grad(**data)
    loss_inline, grads_inline = inline.value_and_grad(**data)
    assert loss == pytest.approx(gru_numpy(STEPS, data), rel=1e-12)
    assert loss == pytest.approx(loss_inline, rel=1e-13)
    for name, grad in grads.items():
        np.testing.assert_allclose(grad, grads_inline[name], rtol=1e-12, atol=1e-15)
    check_gru_gradient(STEPS, data, grads, ("U_z", "W_m", "b_r", "V"), seed=1)  # central differences of numpy's loss
