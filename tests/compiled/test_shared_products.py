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


def _calls_a_kind(source: str) -> bool:
    """Whether the C calls a kind of product's function (<prefix>_product_<sizes>[_at][_bt][_add])."""
    return re.search(r"\w+_product_\w+\(", source) is not None


def test_a_kind_is_named_from_its_own_sizes_not_its_order():
    """A product of another shape called first renumbers no kind: each
    kind's name comes from its key (sizes, strides, add) alone."""
    keys = [(False, "n", "6", "6", "6", "1", "6", "1"), (False, "5", "6", "n", "1", "5", "6", "1"),
            (True, "n", "6", "6", "6", "1", "1", "6"), (False, "n", "3", "6", "6", "1", "3", "1")]
    names = products._names("net", keys)
    assert names == products._names("net", keys[::-1])
    assert names[keys[0]] == "net_product_n_6_6" and names[keys[1]] == "net_product_5_n_6_at"
    assert names[keys[2]] == "net_product_n_6_6_bt_add" and names[keys[3]] == "net_product_n_6_3"
    tie = (False, "n", "6", "6", "12", "1", "6", "1")  # another stride of a: the same base name
    tied = products._names("net", [keys[0], tie])
    assert len(set(tied.values())) == 2 and all(re.fullmatch(r"net_product_n_6_6_[0-9a-f]{4}", n) for n in tied.values())


def test_an_unrolled_gru_has_a_function_per_kind_of_product():
    source = generate(gru_model(STEPS), derivation=False)[0].source
    kinds = re.findall(r"^void (gru_steps\d+_product_\w+)\(", source, re.M)
    assert 2 <= len(set(kinds)) < 20
    calls = {kind: len(re.findall(rf"^\s+{kind}\(", source, re.M)) for kind in set(kinds)}
    assert all(count >= 1 for count in calls.values()), calls
    assert sum(calls.values()) > products.MAX_INLINED_PRODUCTS
    assert len(_product_calls(source)) == len(set(kinds))  # the helper is called only from them


def test_a_module_with_few_products_keeps_its_calls():
    source = generate(load_example("mlp").model, derivation=False)[0].source
    assert not _calls_a_kind(source) and 0 < len(_product_calls(source)) <= products.MAX_INLINED_PRODUCTS


def test_shared_products_compute_what_inline_ones_do(tmp_path, monkeypatch):
    data = gru_data(STEPS, rows=6)
    shared = sbp.compile(gru_model(STEPS), options=BuildOptions(cache_dir=tmp_path / "shared"))
    monkeypatch.setattr(products, "MAX_INLINED_PRODUCTS", 10**6)  # (another folder: its memo of the C is another)
    inline = sbp.compile(gru_model(STEPS), options=BuildOptions(cache_dir=tmp_path / "inline"))
    assert _calls_a_kind(shared.source) and not _calls_a_kind(inline.source)
    loss, grads = shared.value_and_grad(**data)
    loss_inline, grads_inline = inline.value_and_grad(**data)
    assert loss == pytest.approx(gru_numpy(STEPS, data), rel=1e-12)
    assert loss == pytest.approx(loss_inline, rel=1e-13)
    for name, grad in grads.items():
        np.testing.assert_allclose(grad, grads_inline[name], rtol=1e-12, atol=1e-15)
    check_gru_gradient(STEPS, data, grads, ("U_z", "W_m", "b_r", "V"), seed=1)  # central differences of numpy's loss
