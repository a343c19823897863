"""The keys a cached compile computes without running anything: the
model's fingerprint (one walk of its expressions' DAG) and the call hot
path's key (the compiler's files, not its `--version`)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import sympy as sp

import symbackprop as sbp
from symbackprop.declare.nn import relu, sum_all
from symbackprop.run import fastcall
from symbackprop.run.runtime import model_fingerprint
from symbackprop.toolchain.key import executable_stamp

x, a = sp.symbols("x a", real=True)


def _fingerprint(model: sbp.Model) -> str:
    return model_fingerprint(model, "float64", ("forward",), None, None, None)


def _relu_model(name: str = "keys") -> sbp.Model:
    X = sp.MatrixSymbol("X", 3, 2)
    W = sp.MatrixSymbol("W", 2, 2)
    return sbp.Model(name, inputs=[X], params=[W], loss=sum_all(relu(X * W)))


def test_equal_models_have_one_fingerprint_and_any_change_another():
    base = _fingerprint(sbp.Model("keys", inputs=[x], params=[a], loss=sp.sin(a * x) + 3 * a**2))
    assert _fingerprint(sbp.Model("keys", inputs=[x], params=[a], loss=sp.sin(a * x) + 3 * a**2)) == base
    others = [
        sp.sin(a * x) + 4 * a**2,  # a constant
        sp.cos(a * x) + 3 * a**2,  # a function
        sp.sin(a * x) + 3 * a**3,  # an exponent
    ]
    prints = {_fingerprint(sbp.Model("keys", inputs=[x], params=[a], loss=loss)) for loss in others}
    assert len(prints) == 3 and base not in prints
    positive = sp.Symbol("x", positive=True)  # the same name, other assumptions
    assert _fingerprint(sbp.Model("keys", inputs=[positive], params=[a], loss=sp.sin(a * positive) + 3 * a**2)) != base


def test_entries_of_matrices_are_told_apart():
    """A matrix's entry at constant indices is one line of the walk (its
    matrix's line and the indices): every index, matrix and shape still
    counts, and equal entries read as new objects give one fingerprint."""
    A, B = sp.MatrixSymbol("A", 3, 3), sp.MatrixSymbol("B", 3, 3)

    def loss(M, i=0, j=1):
        return M[i, j] * M[1, 1] + M[2, 0] ** 2

    base = _fingerprint(sbp.Model("entries", params=[A], loss=loss(A)))
    assert _fingerprint(sbp.Model("entries", params=[A], loss=loss(A))) == base
    others = [sbp.Model("entries", params=[A], loss=loss(A, 1, 0)),  # indices swapped
              sbp.Model("entries", params=[A], loss=loss(A, 0, 2)),  # another column
              sbp.Model("entries", params=[B], loss=loss(B)),  # another matrix
              sbp.Model("entries", params=[sp.MatrixSymbol("A", 3, 4)], loss=loss(sp.MatrixSymbol("A", 3, 4)))]
    prints = {_fingerprint(model) for model in others}
    assert len(prints) == len(others) and base not in prints


def test_lambdas_dummies_do_not_change_the_fingerprint():
    """Each relu builds a Lambda over a fresh Dummy: numbered, not named."""
    assert _fingerprint(_relu_model()) == _fingerprint(_relu_model())
    assert _fingerprint(_relu_model()) != _fingerprint(_relu_model("other"))


def test_a_deep_shared_graph_is_fingerprinted_once_per_node():
    """y <- y * y + y, 300 times: 2^300 paths, 900 distinct nodes."""
    y = x
    for _ in range(300):
        y = y * y + y
    began = time.process_time()
    first = _fingerprint(sbp.Model("deep", inputs=[x], params=[a], loss=a * y))
    assert time.process_time() - began < 30  # a walk of the tree would never end
    z = x
    for _ in range(299):
        z = z * z + z
    assert _fingerprint(sbp.Model("deep", inputs=[x], params=[a], loss=a * z)) != first


def _program(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_the_stamp_names_each_program_and_changes_with_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    cc = _program(tmp_path, "fakecc", "#!/bin/sh\necho 1\n")
    wrapper = _program(tmp_path, "fakewrap", "#!/bin/sh\nexec \"$@\"\n")
    alone = executable_stamp(["fakecc", "-O2"])
    assert str(cc.resolve()) in alone and len(alone.splitlines()) == 1
    both = executable_stamp(["fakewrap", "fakecc"])
    assert str(wrapper.resolve()) in both and str(cc.resolve()) in both
    cc.write_text("#!/bin/sh\necho 2 a newer compiler\n")  # reinstalled: another size and time
    assert executable_stamp(["fakecc", "-O2"]) != alone
    link = tmp_path / "cc-link"
    link.symlink_to(cc)
    assert executable_stamp([str(link)]) == executable_stamp(["fakecc"])  # the file, by its real path


def test_the_hot_paths_entry_follows_the_compiler(tmp_path, monkeypatch):
    """Another compiler (CC), or the same one reinstalled, is another entry."""
    cc = _program(tmp_path, "cc-one", "#!/bin/sh\nexec gcc \"$@\"\n")
    monkeypatch.setenv("CC", str(cc))
    first = fastcall._entry()[1]
    assert fastcall._entry()[1] == first
    cc.write_text("#!/bin/sh\n# reinstalled\nexec gcc \"$@\"\n")
    second = fastcall._entry()[1]
    assert second != first
    monkeypatch.setenv("CC", str(_program(tmp_path, "cc-two", "#!/bin/sh\nexec gcc \"$@\"\n")))
    assert fastcall._entry()[1] not in (first, second)


def test_the_package_digest_reads_every_template(monkeypatch):
    """The memo's key hashes the templates, though a checkout keeps them in
    the top-level templates/, outside the package it walks: a template
    edited in a checkout is a new digest."""
    from symbackprop.emit import templatecache
    from symbackprop.toolchain import memo

    read: list[str] = []

    def recording(path, *args, **kwargs):
        read.append(os.path.realpath(path))
        return open(path, *args, **kwargs)

    monkeypatch.setattr(memo, "open", recording, raising=False)
    memo.package_digest.cache_clear()  # (kept for the process)
    memo.package_digest()
    templates = sorted(os.path.realpath(path) for path in templatecache.TEMPLATES.glob("*.j2"))
    assert len(templates) > 20
    assert [path for path in templates if path not in read] == []
