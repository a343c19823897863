"""The C grows with the number of ops, not with tensor sizes."""

import time

from conftest import load_example

import symbackprop as sbp
from symbackprop.pipeline import generate
from symbackprop.toolchain.builder import BuildOptions


def test_mnist_sized_code_is_as_small_as_the_tiny_mlp(tmp_path, capsys):
    tiny = generate(load_example("mlp").model)[0].source.count("\n")
    start = time.perf_counter()
    mnist_model = load_example("mnist_mlp").model
    mod = sbp.compile(mnist_model, options=BuildOptions(cache_dir=tmp_path))  # cold: an empty cache
    cold = time.perf_counter() - start
    mnist = mod.source.count("\n")
    with capsys.disabled():
        print(f"\nC lines: mlp (3->4->2) {tiny}, mnist_mlp (784->256->10, batch 128) {mnist}; "
              f"mnist cold compile {cold:.2f} s")
    # speed is measured in benchmarks/, not asserted here; size is deterministic
    assert mnist <= 2 * tiny
