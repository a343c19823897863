"""A cold compile runs the C compiler as soon as the model's C is written
(symbackprop.toolchain.builder): the model's objects start before cffi writes
the glue, and the derivation is written while they compile; the module's
derivation is generate's, in compile() and compile_all() alike."""

import subprocess

import numpy as np
import sympy as sp

import symbackprop as sbp
from symbackprop import nn, pipeline
from symbackprop.pipeline import generate
from symbackprop.toolchain.builder import BuildOptions


def _model(name: str):
    x = sp.MatrixSymbol("x", 1, 6)
    return sbp.Model(name, inputs=[], params=[x], loss=nn.sum_all(nn.tanh(x)))


def test_the_derivation_is_written_while_the_model_compiles(tmp_path, monkeypatch):
    events: list[str] = []
    popen, derive = subprocess.Popen.__init__, pipeline.derivation_text

    def started(self, args, *rest, **kwargs):
        if isinstance(args, list) and "-c" in args:
            events.append("glue" if any(a.endswith(".c") and "_sbp_" in a for a in args) else "model")
        popen(self, args, *rest, **kwargs)

    def derivation(*args, **kwargs):
        events.append("derivation")
        return derive(*args, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", started)
    monkeypatch.setattr(pipeline, "derivation_text", derivation)
    for name, build in (("overlap_one", lambda m, o: sbp.compile(m, options=o)),
                        ("overlap_all", lambda m, o: sbp.compile_all({0: m}, options=o)[0])):
        events.clear()
        model = _model(name)
        mod = build(model, BuildOptions(cache_dir=tmp_path))
        assert events == ["model", "glue", "derivation"]
        assert mod.emitted.derivation == generate(model)[0].derivation != ""
        v = np.linspace(-1, 1, 6).reshape(1, 6)
        loss, grads = mod.value_and_grad(x=v)
        assert np.isclose(loss, np.sum(np.tanh(v)), rtol=1e-13)
        assert np.allclose(grads["x"], 1 - np.tanh(v) ** 2, rtol=1e-13, atol=0)
    # compiled again: the memo's derivation, no compiler run
    events.clear()
    again = sbp.compile(_model("overlap_one"), options=BuildOptions(cache_dir=tmp_path))
    assert "model" not in events and again.emitted.derivation != ""
