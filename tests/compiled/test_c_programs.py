"""C and C++ programs that use a generated module through its
self-description alone (emit/describe.py): the two programs of
docs/c_programs.md, built with gcc and g++ against examples/mlp.py (its
batch n symbolic) for float64, for float32, and for float64 compiled with
-DMLP_REAL=float; every name, shape and value they print is checked
against the Python module (the oracle: its own tests check it against
finite differences and torch). Then the description of models with Index
inputs and a train step, against the Python ABI spec; and the real types
a module refuses."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from c_driver import STRICT_FLAGS, fill_values, write_runtime_header
from test_c_preconditions import trained_model, two_gathers_model

import symbackprop as sbp
from symbackprop.base.abi import ARG_INDEX, ARG_REAL, ARG_UPDATED, concrete
from symbackprop.pipeline import generate
from symbackprop.run.optim import SGD

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "c_programs.md"
BATCH = 5  # what the programs bind every dimension to
CXX_FLAGS = ["-std=c++17", "-Wall", "-Wextra", "-Wpedantic", "-Werror"]

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None or shutil.which("gcc") is None,
                               reason="g++ is not installed")


def _blocks(language: str) -> str:
    return "".join(re.findall(rf"^```{language}\n(.*?)^```", PAGE.read_text(), re.S | re.M))


def _mlp_model():
    spec = importlib.util.spec_from_file_location("example_mlp", ROOT / "examples" / "mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.model


@pytest.fixture(scope="module")
def mlp():
    model = _mlp_model()
    return {dtype: sbp.compile(model, dtype=dtype) for dtype in ("float64", "float32")}


def _write_module(folder: Path, emitted) -> Path:
    """The module's files (an Emitted, or a compiled module's) in `folder`."""
    write_runtime_header(folder)
    prefix = emitted.spec.prefix if hasattr(emitted, "spec") else emitted.prefix
    (folder / f"{prefix}.h").write_text(emitted.header)
    source = folder / f"{prefix}.c"
    source.write_text(emitted.source)
    return source


def _compile_module(folder: Path, emitted, defines=()) -> subprocess.CompletedProcess:
    source = _write_module(folder, emitted)
    return subprocess.run(["gcc", *STRICT_FLAGS, "-O1", *defines, f"-I{folder}", "-c", str(source),
                           "-o", str(folder / "module.o")], capture_output=True, text=True)


def _run(folder: Path, mod, language: str, defines=()) -> str:
    """Build the page's program in `language` against the module and run it."""
    built = _compile_module(folder, mod, defines)
    assert built.returncode == 0, built.stderr
    if language == "c":
        program, command = folder / "demo.c", ["gcc", *STRICT_FLAGS, "-O1"]
    else:
        program, command = folder / "demo.cpp", ["g++", *CXX_FLAGS, "-O1"]
    program.write_text(_blocks(language))
    exe = folder / "demo"
    built = subprocess.run([*command, *defines, f"-I{folder}", str(program), str(folder / "module.o"), "-o", str(exe),
                            "-lm"], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    return ran.stdout


def _parse(text: str):
    dims, arrays = {}, {}
    for line in text.splitlines():
        words = line.split()
        if words[0] == "dim":
            dims[words[1]] = int(words[2])
            continue
        function, what, name, rows, cols = words[:5]
        values = np.array([float(v) for v in words[5:]])
        assert values.size == int(rows) * int(cols), line[:80]
        arrays.setdefault((function, what), []).append((name, (int(rows), int(cols)), values.reshape(int(rows), int(cols))))
    return dims, arrays


def _expected(mod, kind: str):
    """What the Python module returns for the program's inputs: (inputs,
    outputs), each [(name, shape, values)] in the C order."""
    fn = mod.spec.function(kind)
    bound = dict.fromkeys(mod.spec.dims, BATCH)
    inputs = []
    for salt, arg in enumerate(fn.inputs):
        shape = concrete(arg.shape, bound)
        inputs.append((arg.name, shape, fill_values(int(np.prod(shape)), salt).reshape(shape)))
    data = {name: values.astype(mod.spec.dtype) for name, _, values in inputs}
    if kind == "forward":
        results = mod.forward(**data)
    else:
        loss, grads = mod.value_and_grad(**data)
        results = {"loss": loss, **grads}
    outputs = [(out.name, concrete(out.shape, bound), np.reshape(results[out.key], concrete(out.shape, bound)))
               for out in fn.outputs]
    return inputs, outputs


def _check(text: str, mod, rtol: float, atol: float):
    dims, arrays = _parse(text)
    assert dims == {"n": BATCH}
    for kind in ("forward", "value_and_grad"):
        inputs, outputs = _expected(mod, kind)
        for what, expected in (("in", inputs), ("out", outputs)):
            got = arrays[(f"mlp_{kind}", what)]
            assert [(name, shape) for name, shape, _ in got] == [(name, shape) for name, shape, _ in expected]
            for (name, _, value), (_, _, want) in zip(got, expected):
                np.testing.assert_allclose(value, want, rtol=rtol, atol=atol, err_msg=f"{kind} {name}")
    return arrays


@needs_gcc
@pytest.mark.parametrize("language", ["c", pytest.param("cpp", marks=needs_gxx)])
def test_the_page_programs_match_python(mlp, tmp_path, language):
    """float64: the values the Python module returns (the same C code, to
    rounding); float32: those of the float32 module."""
    (tmp_path / "f64").mkdir()
    (tmp_path / "f32").mkdir()
    _check(_run(tmp_path / "f64", mlp["float64"], language), mlp["float64"], rtol=1e-12, atol=1e-14)
    _check(_run(tmp_path / "f32", mlp["float32"], language), mlp["float32"], rtol=1e-5, atol=1e-6)


@needs_gcc
def test_a_float64_module_compiled_as_float(mlp, tmp_path):
    """-DMLP_REAL=float: every value a float (the single-precision path
    ran), within float accuracy of the float64 module."""
    text = _run(tmp_path, mlp["float64"], "c", ["-DMLP_REAL=float"])
    arrays = _check(text, mlp["float64"], rtol=2e-5, atol=1e-6)
    values = np.concatenate([v.ravel() for group in arrays.values() for _, _, v in group])
    np.testing.assert_array_equal(values.astype(np.float32).astype(np.float64), values)
    doubles = _parse(_run(tmp_path, mlp["float64"], "c"))[1]
    assert not np.array_equal(doubles[("mlp_forward", "out")][0][2], arrays[("mlp_forward", "out")][0][2])


@needs_gcc
@pytest.mark.parametrize(("dtype", "real", "message"), [
    ("float32", "double", "was generated for float32"),
    ("float64", "int", "MLP_REAL must be double or float"),
    ("float64", "my_real", "MLP_REAL must be double or float"),
])
def test_a_real_type_the_module_cannot_take_is_refused(mlp, tmp_path, dtype, real, message):
    built = _compile_module(tmp_path, mlp[dtype], [f"-DMLP_REAL={real}"])
    assert built.returncode != 0 and message in built.stderr


@needs_gcc
def test_float_is_refused_where_train_epoch_keeps_index_rows_in_doubles(tmp_path):
    emitted, _ = generate(trained_model(), functions=("forward", "train_step"), optimizer=SGD(lr=0.1))
    assert _compile_module(tmp_path, emitted).returncode == 0
    built = _compile_module(tmp_path, emitted, ["-DTRAINED_REAL=float"])
    assert built.returncode != 0 and "keeps Index rows" in built.stderr


# --- the description of any module, against the Python ABI spec ------------------


def _describe_program(emitted, functions, dims=(3,) * 8) -> str:
    """A main() that prints what the module says of each function, for
    these dimensions (a `dims` array)."""
    p = emitted.prefix
    lines = ["#include <stdio.h>", f'#include "{p}.h"', "",
             "static void show(const char *f, int n_in, int n_out, const char *(*name_in)(int64_t),",
             "                 const char *(*name_out)(int64_t), int (*kind_in)(int64_t),",
             "                 int (*shape_in)(int64_t, const int64_t *, int64_t *),",
             "                 int (*shape_out)(int64_t, const int64_t *, int64_t *), const int64_t *dims)",
             "{",
             "    int64_t s[2] = {-1, -1};",
             "    for (int i = 0; i <= n_in; ++i) {",  # one past the last: NULL, -1 and 3
             "        int status = shape_in(i, dims, s);",
             '        printf("%s in %s %d %d %lld %lld\\n", f, name_in(i) ? name_in(i) : "NULL", kind_in(i), status,',
             "               (long long)s[0], (long long)s[1]);",
             "    }",
             "    for (int i = 0; i <= n_out; ++i) {",
             "        int status = shape_out(i, dims, s);",
             '        printf("%s out %s 0 %d %lld %lld\\n", f, name_out(i) ? name_out(i) : "NULL", status,',
             "               (long long)s[0], (long long)s[1]);",
             "    }",
             "}", "", "int main(void)", "{", f"    int64_t dims[8] = {{{', '.join(map(str, dims))}}};",
             f'    for (int d = 0; d <= {p}_n_dims(); ++d) printf("dim %s\\n", {p}_name_dim(d) ? {p}_name_dim(d) : "NULL");']
    for kind in functions:
        f = f"{p}_{kind}"
        lines.append(f'    printf("{kind} dims"); for (int d = 0; d <= {f}_n_dims(); ++d) printf(" %s", '
                     f'{f}_name_dim(d) ? {f}_name_dim(d) : "NULL"); printf("\\n");')
        lines.append(f'    show("{kind}", {f}_n_in(), {f}_n_out(), {f}_name_in, {f}_name_out, {f}_kind_in, '
                     f"{f}_shape_in, {f}_shape_out, dims);")
    lines += ["    return 0;", "}", ""]
    return "\n".join(lines)


def _described(emitted, functions, folder: Path, dims=(3,) * 8) -> list[str]:
    assert _compile_module(folder, emitted).returncode == 0
    program = folder / "describe.c"
    program.write_text(_describe_program(emitted, functions, dims))
    subprocess.run(["gcc", *STRICT_FLAGS, f"-I{folder}", str(program), str(folder / "module.o"), "-o",
                    str(folder / "describe"), "-lm"], check=True, capture_output=True, text=True)
    return subprocess.run([str(folder / "describe")], check=True, capture_output=True, text=True).stdout.splitlines()


@needs_gcc
@pytest.mark.parametrize("model", [two_gathers_model, trained_model])
def test_the_description_is_the_python_spec(model, tmp_path):
    """Names, kinds (an Index 1, an array a train step updates 2), shapes
    and dimension names, against mod.spec; past the last argument: NULL,
    -1 and status 3."""
    functions = ("forward", "value_and_grad", "train_step")
    emitted, _ = generate(model(), functions=functions, optimizer=SGD(lr=0.1))
    spec = sbp.compile(model(), functions=functions, optimizer=SGD(lr=0.1)).spec
    lines = _described(emitted, functions, tmp_path)
    assert lines[:len(spec.dims) + 1] == [f"dim {d}" for d in spec.dims] + ["dim NULL"]
    bound = dict.fromkeys(spec.dims, 3)
    expected = []
    for kind in functions:
        fn = spec.function(kind)
        expected.append(f"{kind} dims {' '.join(spec.dims)} NULL")
        for arg in fn.inputs:
            code = ARG_INDEX if arg.index else ARG_UPDATED if arg.name in fn.inplace else ARG_REAL
            expected.append(f"{kind} in {arg.name} {code} 0 {' '.join(map(str, concrete(arg.shape, bound)))}")
        last = expected[-1].rsplit(" ", 2)[1:]
        expected.append(f"{kind} in NULL -1 3 {' '.join(last)}")  # shape left as it was
        expected += [f"{kind} out {out.name} 0 0 {' '.join(map(str, concrete(out.shape, bound)))}"
                     for out in fn.outputs if out.name not in fn.inplace]
        last = expected[-1].rsplit(" ", 2)[1:]
        expected.append(f"{kind} out NULL 0 3 {' '.join(last)}")
    assert lines[len(spec.dims) + 1:] == expected
    assert any(" in " in line and f" {ARG_INDEX} 0 " in line for line in lines)
    assert any(f" {ARG_UPDATED} 0 " in line for line in lines if line.startswith("train_step in"))


@needs_gcc
def test_train_epoch_describes_itself_from_the_step(tmp_path):
    """trained (an Index sliced with the examples, one passed whole, SGD):
    train_epoch's dims are rows and batch; its inputs the order (an Index
    of rows), then train_step's, the data with all the rows; its output a
    loss a minibatch (7 rows in 3s: 3)."""
    emitted, _ = generate(trained_model(), functions=("forward", "train_step"), optimizer=SGD(lr=0.1))
    step = sbp.compile(trained_model(), functions=("forward", "train_step"), optimizer=SGD(lr=0.1)).spec.function("train_step")
    lines = _described(emitted, ("train_epoch",), tmp_path, dims=(7, 3))
    data_rows = {step.epoch_batch: 7}
    expected = ["train_epoch dims rows batch NULL", "train_epoch in order 1 0 7 1"]
    for arg in step.inputs:
        code = ARG_INDEX if arg.index else ARG_UPDATED if arg.name in step.inplace else ARG_REAL
        expected.append(f"train_epoch in {arg.name} {code} 0 {' '.join(map(str, concrete(arg.shape, data_rows)))}")
    last = expected[-1].rsplit(" ", 2)[1:]
    expected += [f"train_epoch in NULL -1 3 {' '.join(last)}", "train_epoch out losses 0 0 3 1",
                 "train_epoch out NULL 0 3 3 1"]
    assert [line for line in lines if line.startswith("train_epoch")] == expected
    assert "idx" in step.epoch_data and f"train_epoch in idx {ARG_INDEX} 0 7 1" in expected


# --- the array-form call, through the page's C++ wrapper ---------------------------

RUNNER = """
#include <cstdio>
#include <iostream>
#include "{prefix}.h"

// argv: a function, then its dimensions as name=value; stdin: lines
// "name value..." filling inputs; prints every array after the call.
int main(int argc, char **argv) {{
    symbackprop::Module<{real}> module;
{adds}
    std::map<std::string, int64_t> dims;
    for (int k = 2; k < argc; ++k) {{
        std::string word = argv[k];
        dims[word.substr(0, word.find('='))] = std::stoll(word.substr(word.find('=') + 1));
    }}
    try {{
        auto arrays = module.arrays(argv[1], dims);
        std::string name;
        while (std::cin >> name) {{
            auto &a = arrays[name];
            for (auto &v : a.reals) std::cin >> v;
            for (auto &v : a.index) std::cin >> v;
        }}
        module.call(argv[1], arrays);
        for (auto *group : {{&arrays.in, &arrays.out}}) {{
            for (auto &a : *group) {{
                std::printf("%s %d %lld %lld", a.name.c_str(), a.kind, (long long)a.rows, (long long)a.cols);
                for (auto v : a.reals) std::printf(" %.17g", (double)v);
                for (auto v : a.index) std::printf(" %lld", (long long)v);
                std::printf("\\n");
            }}
        }}
    }} catch (const std::exception &e) {{
        std::fprintf(stderr, "%s\\n", e.what());
        return 1;
    }}
    return 0;
}}
"""


def _wrapper() -> str:
    return re.findall(r"^```cpp\n(.*?)^```", PAGE.read_text(), re.S | re.M)[0]


def _runner(folder: Path, header: str, source: str, prefix: str, functions) -> Path:
    """The page's wrapper and RUNNER, built against a module's C."""
    folder.mkdir(exist_ok=True)
    write_runtime_header(folder)
    (folder / f"{prefix}.h").write_text(header)
    (folder / f"{prefix}.c").write_text(source)
    subprocess.run(["gcc", *STRICT_FLAGS, "-O1", f"-I{folder}", "-c", str(folder / f"{prefix}.c"), "-o",
                    str(folder / "module.o")], check=True, capture_output=True, text=True)
    adds = "\n".join(f"    SYMBACKPROP_ADD(module, {prefix}_{kind});" for kind in functions)
    program = folder / "runner.cpp"
    program.write_text(_wrapper() + RUNNER.format(prefix=prefix, real=f"{prefix.upper()}_REAL", adds=adds))
    built = subprocess.run(["g++", *CXX_FLAGS, "-O1", f"-I{folder}", str(program), str(folder / "module.o"), "-o",
                            str(folder / "runner"), "-lm"], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    return folder / "runner"


def _call(runner: Path, function: str, dims: dict[str, int], inputs: dict[str, np.ndarray]):
    """Runs `function` through the wrapper: {name: (kind, values)} of every array after the call."""
    stdin = "".join(f"{name} {' '.join(repr(v) for v in np.ravel(values).tolist())}\n" for name, values in inputs.items())
    ran = subprocess.run([str(runner), function, *(f"{d}={v}" for d, v in dims.items())], input=stdin,
                         capture_output=True, text=True, timeout=120, check=True)
    arrays = {}
    for line in ran.stdout.splitlines():
        name, kind, rows, cols, *values = line.split()
        arrays[name] = (int(kind), np.array([float(v) for v in values]).reshape(int(rows), int(cols)))
    return arrays


@needs_gxx
def test_the_wrapper_calls_functions_with_an_index_by_name(tmp_path):
    """two_gathers (an Index into two arrays, three dimensions): forward and
    value_and_grad through F_call, against the Python module."""
    functions = ("forward", "value_and_grad")
    emitted, _ = generate(two_gathers_model(), functions=functions)
    mod = sbp.compile(two_gathers_model(), functions=functions)
    runner = _runner(tmp_path, emitted.header, emitted.source, emitted.prefix, functions)
    dims = dict(zip(mod.spec.dims, (5, 4, 3)))
    rng = np.random.default_rng(1)
    inputs = {}
    for arg in mod.spec.function("forward").inputs:
        shape = concrete(arg.shape, dims)
        inputs[arg.name] = rng.integers(0, 3, size=shape) if arg.index else rng.standard_normal(shape)
    forward = _call(runner, "two_gathers_forward", dims, inputs)
    for name, value in mod.forward(**inputs).items():
        np.testing.assert_allclose(forward[name][1], np.reshape(value, forward[name][1].shape), rtol=1e-12, atol=1e-14)
    assert forward["idx"][0] == ARG_INDEX and np.array_equal(forward["idx"][1].ravel(), inputs["idx"].ravel())
    gradient = _call(runner, "two_gathers_value_and_grad", dims, inputs)
    loss, grads = mod.value_and_grad(**inputs)
    np.testing.assert_allclose(gradient["loss"][1][0, 0], loss, rtol=1e-12)
    for out in mod.spec.function("value_and_grad").outputs[1:]:
        np.testing.assert_allclose(gradient[out.name][1], np.reshape(grads[out.key], gradient[out.name][1].shape),
                                   rtol=1e-12, atol=1e-14, err_msg=out.name)


def _digits():
    spec = importlib.util.spec_from_file_location("example_digits", ROOT / "examples" / "digits_mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_gxx
def test_one_train_epoch_of_digits_through_the_wrapper_is_pythons(tmp_path):
    """The checked-in generated/digits_mlp (Adam): one epoch of 37 rows in
    minibatches of 8 (the last 5) in a shuffled order, through
    digits_mlp_train_epoch_call; the parameters, the optimizer state and
    the losses are those of the Python module's train_epoch."""
    digits = _digits()
    folder = ROOT / "generated" / "digits_mlp"
    runner = _runner(tmp_path, (folder / "digits_mlp.h").read_text(), (folder / "digits_mlp.c").read_text(),
                     "digits_mlp", ("train_epoch",))
    mod = sbp.compile(digits.model, functions=("forward", "value_and_grad", "train_step"), optimizer=digits.optimizer)
    rng = np.random.default_rng(7)
    data = digits.sample_data(rng, batch=37)
    order = rng.permutation(37)
    step = mod.spec.function("train_step")
    inputs = {"order": order, **data}
    for arg, role, key in step.extra_roles:  # what the runtime passes: the hyperparameters, the state zeros
        shape = concrete(next(a.shape for a in step.inputs if a.name == arg), {})
        inputs[arg] = np.full(shape, mod.trainer.hyperparameters[key] if role == "hyper" else 0.0)
    got = _call(runner, "digits_mlp_train_epoch", {"rows": 37, "batch": 8}, inputs)
    python = {name: np.array(value, dtype=np.float64) for name, value in data.items()}
    losses = mod.train_epoch(8, order, **python)
    assert got["losses"][1].shape == (5, 1)
    np.testing.assert_allclose(got["losses"][1].ravel(), losses, rtol=1e-12, atol=1e-12)
    updated = {**python, **mod.trainer.state}
    kinds = {name: kind for name, (kind, _) in got.items()}
    assert {name for name, kind in kinds.items() if kind == ARG_UPDATED} == set(step.inplace)
    for name in step.inplace:
        np.testing.assert_allclose(got[name][1], np.reshape(updated[name], got[name][1].shape), rtol=1e-12, atol=1e-12,
                                   err_msg=name)
    assert not np.allclose(got["W1"][1], data["W1"])  # it trained


STATUSES = """
#include <stdio.h>
#include "mlp.h"

int main(void)
{
    double arrays[6][64] = {{0}}, outputs[2][64], work[1024];
    const void *in[6] = {arrays[0], arrays[1], arrays[2], arrays[3], arrays[4], arrays[5]};
    void *out[2] = {outputs[0], outputs[1]};
    const int64_t five[1] = {5}, zero[1] = {0};
    const void *missing[6] = {arrays[0], NULL, arrays[2], arrays[3], arrays[4], arrays[5]};
    void *no_out[2] = {outputs[0], NULL};
    if (mlp_forward_call_work_len(five) > 1024) return 1;
    printf("%d %d %d %d %d %d %d %d\\n", mlp_forward_call(five, in, out, work), mlp_forward_call(NULL, in, out, work),
           mlp_forward_call(five, NULL, out, work), mlp_forward_call(five, in, NULL, work),
           mlp_forward_call(five, missing, out, work), mlp_forward_call(five, in, no_out, work),
           mlp_forward_call(five, in, out, NULL), mlp_forward_call(zero, in, out, work));
    return 0;
}
"""


@needs_gcc
def test_the_array_form_call_checks_its_pointers(mlp, tmp_path):
    """Each NULL pointer it needs: 4; a dimension 0: the function's own 1."""
    assert _compile_module(tmp_path, mlp["float64"]).returncode == 0
    (tmp_path / "statuses.c").write_text(STATUSES)
    subprocess.run(["gcc", *STRICT_FLAGS, f"-I{tmp_path}", str(tmp_path / "statuses.c"), str(tmp_path / "module.o"),
                    "-o", str(tmp_path / "statuses"), "-lm"], check=True, capture_output=True, text=True)
    ran = subprocess.run([str(tmp_path / "statuses")], check=True, capture_output=True, text=True)
    assert ran.stdout.split() == ["0", "4", "4", "4", "4", "4", "4", "1"]
