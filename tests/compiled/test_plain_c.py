"""The generated .c/.h are plain C99: they compile without warnings under
strict flags, run without Python with the same numbers as the Python call,
and two modules link into one program."""

import subprocess

import numpy as np
import pytest
import sympy as sp
from c_driver import STRICT_FLAGS, build_program, driver_source, input_arrays, parse_output, write_runtime_header
from conftest import example_names, load_example

import symbackprop as sbp
from symbackprop.pipeline import generate


def _write(emitted, folder):
    source = folder / f"{emitted.prefix}.c"
    source.write_text(emitted.source)
    (folder / f"{emitted.prefix}.h").write_text(emitted.header)
    write_runtime_header(folder)
    return source


@pytest.mark.parametrize("name", example_names())
def test_compiles_without_warnings(name, tmp_path):
    emitted, _ = generate(load_example(name).model)
    source = _write(emitted, tmp_path)
    result = subprocess.run(["cc", *STRICT_FLAGS, "-c", str(source), "-o", str(tmp_path / "m.o")],
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "", result.stderr


@pytest.mark.parametrize("name", ["mlp", "gmm"])
def test_every_kind_of_function_compiles_without_warnings(name, tmp_path):
    """vjp of an output that ignores some inputs (the MLP's Y ignores T)
    casts those to void; jvp and hvp take tangent and direction arrays."""
    emitted, _ = generate(load_example(name).model, functions=("forward", "value_and_grad", "vjp", "jvp", "hvp"))
    source = _write(emitted, tmp_path)
    result = subprocess.run(["cc", *STRICT_FLAGS, "-c", str(source), "-o", str(tmp_path / "m.o")],
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "", result.stderr


def _shapes(example, dims):
    shapes = {}
    for leaf in example.model.inputs + example.model.params:
        shape = leaf.shape if isinstance(leaf, sp.MatrixSymbol) else (1, 1)
        shapes[leaf.name] = tuple(dims[str(d)] if isinstance(d, sp.Symbol) else int(d) for d in shape)
    return shapes


def test_c_driver_matches_python_call(tmp_path):
    example = load_example("mlp")
    emitted, _ = generate(example.model)
    source = _write(emitted, tmp_path)
    dims = {"n": 5}
    exe = build_program(tmp_path, [source], driver_source([emitted.module], "value_and_grad", dims))
    printed = parse_output(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout)
    arrays = input_arrays(emitted.module, "value_and_grad", dims, _shapes(example, dims))
    loss, grads = sbp.compile(example.model).value_and_grad(**arrays)
    assert printed[("mlp", "loss")] == pytest.approx([loss], rel=1e-12)
    for name, grad in grads.items():
        np.testing.assert_allclose(printed[("mlp", f"grad_{name}")], grad.ravel(), rtol=1e-12, atol=1e-15)


def test_two_modules_link_into_one_program(tmp_path):
    first, _ = generate(load_example("mlp").model)
    second, _ = generate(load_example("relu_net").model)
    sources = [_write(first, tmp_path), _write(second, tmp_path)]
    driver = driver_source([first.module, second.module], "forward", {"n": 3})
    exe = build_program(tmp_path, sources, driver)
    printed = parse_output(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout)
    assert len(printed[("mlp", "Y")]) == 6 and len(printed[("relu_net", "y")]) == 1
    for source in sources:  # every symbol a module defines carries its prefix
        obj = source.with_suffix(".o")
        subprocess.run(["cc", "-std=c99", "-c", str(source), "-o", str(obj)], check=True)
        defined = subprocess.run(["nm", "-g", "--defined-only", str(obj)], capture_output=True, text=True,
                                 check=True).stdout.split()[2::3]
        assert defined and all(s.startswith(source.stem + "_") for s in defined), defined
