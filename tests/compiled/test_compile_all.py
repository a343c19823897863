"""compile_all: several models compiled as compile() compiles each (the same
C, the same cache entries, the same results against numpy), each one's C
compiler running in a thread beside the next model's generation, and
every build it started ended before it returns or raises."""

import threading

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.errors import BuildError, ModelError
from symbackprop.run import runtime
from symbackprop.toolchain.builder import BuildOptions

N = 3


def _models():
    x, w = sp.MatrixSymbol("x", 1, N), sp.MatrixSymbol("w", 1, N)
    square = sbp.Model("all_square", inputs=[x], params=[w], loss=sum((w[0, i] * x[0, i]) ** 2 for i in range(N)))
    soft = sbp.Model("all_soft", inputs=[x], params=[w],
                     loss=sp.log(sum(sp.exp(w[0, i] - x[0, i]) for i in range(N))))
    return {"square": square, "soft": soft}


def _builds() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("symbackprop build")]


@pytest.fixture
def data():
    rng = np.random.default_rng(5)
    return {"x": rng.normal(size=(1, N)), "w": rng.normal(size=(1, N))}


def test_the_modules_are_compile_s_and_their_builds_ran_beside(tmp_path, data, monkeypatch):
    options = BuildOptions(cache_dir=tmp_path)
    models = _models()
    where: list[tuple[str, bool]] = []  # (prefix, in the main thread)
    build_entry = runtime.build_entry

    def recorded(prefix, *args):
        where.append((prefix, threading.current_thread() is threading.main_thread()))
        return build_entry(prefix, *args)

    monkeypatch.setattr(runtime, "build_entry", recorded)
    mods = sbp.compile_all(models, functions={"square": ("forward",), "soft": ("value_and_grad",)}, options=options)
    assert list(mods) == ["square", "soft"]
    assert sorted(where) == [("all_soft", False), ("all_square", False)]
    assert not _builds()
    x, w = data["x"], data["w"]
    assert np.isclose(mods["square"].forward(x=x, w=w)["loss"], np.sum((w * x) ** 2), rtol=1e-13)
    loss, grads = mods["soft"].value_and_grad(x=x, w=w)
    e = np.exp(w - x)
    assert np.isclose(loss, np.log(e.sum()), rtol=1e-13)
    assert np.allclose(grads["w"], e / e.sum(), rtol=1e-13, atol=0)
    # compile() of each model gives the same C and the same cache entry (a memo hit now)
    monkeypatch.setattr(runtime, "build_entry", build_entry)
    for key, functions in (("square", ("forward",)), ("soft", ("value_and_grad",))):
        alone = sbp.compile(models[key], functions=functions, options=BuildOptions(cache_dir=tmp_path / "alone"))
        assert alone.emitted.source == mods[key].emitted.source
        assert alone.folder.name == mods[key].folder.name


def test_a_model_error_waits_for_the_builds_already_started(tmp_path, monkeypatch):
    models = _models()
    z = sp.MatrixSymbol("z", 1, N)
    models["bad"] = sbp.Model("all_bad", inputs=[], params=[z], loss=sp.Symbol("undeclared") * z[0, 0])
    with pytest.raises(ModelError, match="undeclared"):
        sbp.compile_all(models, functions=("forward",), options=BuildOptions(cache_dir=tmp_path))
    assert not _builds()
    # the models before it were built and are in the cache: compile() finds them
    hit = sbp.compile(models["square"], functions=("forward",), options=BuildOptions(cache_dir=tmp_path))
    assert hit.forward(x=np.ones((1, N)), w=np.ones((1, N)))["loss"] == N


def test_a_build_error_is_raised_after_every_build_ended(tmp_path, monkeypatch):
    build_entry = runtime.build_entry

    def failing(prefix, *args):
        if prefix == "all_square":
            raise BuildError("the C compiler failed on all_square")
        return build_entry(prefix, *args)

    monkeypatch.setattr(runtime, "build_entry", failing)
    with pytest.raises(BuildError, match="all_square"):
        sbp.compile_all(_models(), functions=("forward",), options=BuildOptions(cache_dir=tmp_path))
    assert not _builds()
