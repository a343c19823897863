"""The generated C of every example, built with AddressSanitizer and
UndefinedBehaviorSanitizer (any finding aborts), run through the ABI its
header documents with batch sizes 1 and 1000. Arrays are allocated to the
exact documented sizes (so an overrun by one element is found), outputs
and the workspace start as NaN (so an unwritten output or a read of
workspace never written shows as a wrong value), and the values must
match the Python call."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from c_driver import fill_values, parse_output, unwrapped, write_runtime_header
from conftest import example_names, load_example

import symbackprop as sbp
from symbackprop.pipeline import generate
from symbackprop.toolchain.builder import BuildOptions

# -O0: every access the C states is made (and it builds fast: seconds for the LSTM example, not minutes)
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g", "-O0", "-std=c99"]
REFERENCE_BUILD = BuildOptions(flags=("-O0", "-std=c99"))  # the Python module the printed values are checked against
SANITIZER_ENV = {"ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0", "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}
BATCHES = (1, 1000)
# The default run sanitizes one example per kind of kernel: dense products
# (mlp), a per-example map over gathered rows (gmm), a scan (lstm_lm). The
# rest, transformer_lm's 18 CPU s among them, run in the slow tier (--runslow).
DEFAULT_RUN = ("mlp", "gmm", "lstm_lm")


@dataclass(frozen=True)
class CArg:
    kind: str  # "dim", "input", "output", "work"
    cname: str
    shape: tuple[str, ...]  # C expressions (dimension names and integers)


@dataclass(frozen=True)
class CFunctionAbi:
    name: str
    args: tuple[CArg, ...]


PROTOTYPE = re.compile(r"^int (\w+)\((.*)\);$")
SHAPE_LINE = re.compile(r"^ \*\s+(\w+): (input|output), (.+)$")


def read_header(header: str) -> list[CFunctionAbi]:
    """The functions a generated header declares (those with a workspace:
    not the self-describing ones), with each array's shape from the comment
    above its prototype."""
    functions, shapes = [], {}
    header = unwrapped(header)
    computing = {name for name in re.findall(r"^size_t (\w+)_work_len\(", header, re.M)
                 if not name.endswith("_call")}  # F_call, the array form: its arrays are F's
    for line in header.splitlines():
        if line.startswith("/*"):
            shapes = {}
        documented = SHAPE_LINE.match(line)
        if documented:
            shapes[documented.group(1)] = tuple(d.strip() for d in documented.group(3).split(" x "))
        prototype = PROTOTYPE.match(line)
        if prototype and prototype.group(1) in computing:
            args = []
            for decl in prototype.group(2).split(", "):
                cname = decl.split()[-1].lstrip("*")
                if decl.startswith("int64_t "):
                    args.append(CArg("dim", cname, ()))
                elif decl.startswith("const int64_t *"):  # an Index: row 0 is valid whatever the sizes
                    args.append(CArg("index", cname, shapes[cname]))
                elif cname == "work":
                    args.append(CArg("work", cname, ()))
                else:
                    kind = "input" if decl.startswith("const ") else "output"
                    assert cname in shapes, f"{cname} of {prototype.group(1)} has no documented shape"
                    args.append(CArg(kind, cname, shapes[cname]))
            functions.append(CFunctionAbi(prototype.group(1), tuple(args)))
    return functions


def driver(header_name: str, functions: list[CFunctionAbi]) -> str:
    """main(): for each function and batch size, exact-size arrays, a call,
    every output printed; then a call with a zero dimension and NULL arrays,
    which must return 1 without touching them."""
    lines = ["#include <math.h>", "#include <stdio.h>", "#include <stdlib.h>", f'#include "{header_name}"', "",
             "static double *array(size_t count, int salt) {",
             "    double *a = malloc(count ? count * sizeof(double) : 1);",
             "    for (size_t k = 0; k < count; ++k) a[k] = salt < 0 ? NAN : sin((double)k + salt) * 0.5;",
             "    return a;", "}", "", "int main(void) {"]
    for fn in functions:
        dims = [a.cname for a in fn.args if a.kind == "dim"]
        for batch in BATCHES:
            lines.append("    {")
            lines += [f"        const int64_t {d} = {batch};" for d in dims]
            call = []
            for salt, arg in enumerate(fn.args):
                if arg.kind == "dim":
                    call.append(arg.cname)
                    continue
                count = " * ".join(f"(size_t)({d})" for d in arg.shape) if arg.shape else \
                    f"{fn.name}_work_len({', '.join(dims)})"
                if arg.kind == "index":
                    lines.append(f"        int64_t *a_{arg.cname} = calloc({count}, sizeof(int64_t));")
                else:
                    lines.append(f"        double *a_{arg.cname} = array({count}, {salt if arg.kind == 'input' else -1});")
                call.append(f"a_{arg.cname}")
            lines.append(f"        if ({fn.name}({', '.join(call)}) != 0) return 2;")
            for arg in fn.args:
                if arg.kind == "output":
                    count = " * ".join(f"(size_t)({d})" for d in arg.shape)
                    lines.append(f'        for (size_t k = 0; k < {count}; ++k) '
                                 f'printf("{fn.name}/{batch} {arg.cname} %.17g\\n", a_{arg.cname}[k]);')
            lines += [f"        free(a_{a.cname});" for a in fn.args if a.kind != "dim"]
            lines.append("    }")
        if dims:
            zero_call = ["0" if a.kind == "dim" else "NULL" for a in fn.args]
            lines.append(f"    if ({fn.name}({', '.join(zero_call)}) != 1) return 3;")
    lines += ["    return 0;", "}", ""]
    return "\n".join(lines)


def _sanitizer_works(folder: Path) -> bool:
    cc = shutil.which("cc")
    if cc is None:
        return False
    probe = folder / "probe.c"
    probe.write_text("#include <stdlib.h>\nint main(void) { int *p = malloc(4); *p = 0; int r = *p; free(p); return r; }\n")
    built = subprocess.run([cc, *SANITIZE, str(probe), "-o", str(folder / "probe")], capture_output=True, check=False)
    if built.returncode != 0:
        return False
    probe_run = subprocess.run([str(folder / "probe")], capture_output=True, env={**os.environ, **SANITIZER_ENV}, check=False)
    return probe_run.returncode == 0


@pytest.fixture(scope="module")
def sanitizer(tmp_path_factory):
    if not _sanitizer_works(tmp_path_factory.mktemp("probe")):
        pytest.skip("no working -fsanitize=address,undefined runtime for cc")


def test_the_header_reader_sees_the_documented_abi():
    emitted, _ = generate(load_example("mlp").model)
    functions = {fn.name: fn for fn in read_header(emitted.header)}
    assert set(functions) == {"mlp_forward", "mlp_value_and_grad"}
    args = functions["mlp_value_and_grad"].args
    assert [a.kind for a in args][:3] == ["dim", "input", "input"] and args[-1].kind == "work"
    assert next(a for a in args if a.cname == "X").shape == ("n", "3")
    assert next(a for a in args if a.cname == "grad_W1").shape == ("3", "4")


@pytest.mark.parametrize("name", [name if name in DEFAULT_RUN else pytest.param(name, marks=pytest.mark.slow)
                                  for name in example_names()])
def test_example_is_clean_under_sanitizers(name, sanitizer, tmp_path):
    _assert_clean_under_sanitizers(load_example(name).model, tmp_path)


def test_a_loop_over_whole_eights_is_clean_under_sanitizers(sanitizer, tmp_path):
    """A wide loss over copies padded to whole eights, its 64 sums in eight
    lanes each (tests/compiled/test_wide_maps.py): one example (seven lanes past
    it) and 1000."""
    from test_wide_maps import _polyfit_model

    model = _polyfit_model()
    assert "_lane_sums(lanes, 8, 64, " in generate(model)[0].source
    _assert_clean_under_sanitizers(model, tmp_path)


def test_parts_that_name_their_buffers_places_are_clean_under_sanitizers(sanitizer, tmp_path):
    """Parts that take work and name the places of the fixed-size buffers
    (macros of work: emit/cparts.py), beside buffers a dimension sizes, at
    N = 1 and 1000 (tests/compiled/test_fixed_places.py)."""
    from test_fixed_places import _rotations

    model = _rotations(4)
    source = generate(model)[0].source
    assert "_part2(" in source and "#define" in source and "N" in source
    _assert_clean_under_sanitizers(model, tmp_path)


@pytest.mark.slow  # 7 s; CI's slow tier runs it
def test_sums_added_from_a_table_are_clean_under_sanitizers(sanitizer, tmp_path):
    """Sums of a product added into a triangle's columns from a table of
    where each is (tests/compiled/test_outer_product_sums.py)."""
    from test_outer_product_sums import triangular_model

    model = triangular_model()
    assert "static const int32_t picks[" in generate(model)[0].source
    _assert_clean_under_sanitizers(model, tmp_path)


def _assert_clean_under_sanitizers(model, tmp_path) -> None:
    emitted, _ = generate(model)
    (tmp_path / f"{emitted.prefix}.c").write_text(emitted.source)
    (tmp_path / f"{emitted.prefix}.h").write_text(emitted.header)
    write_runtime_header(tmp_path)
    functions = read_header(emitted.header)
    (tmp_path / "driver.c").write_text(driver(f"{emitted.prefix}.h", functions))
    exe = tmp_path / "driver"
    subprocess.run(["cc", *SANITIZE, f"-I{tmp_path}", str(tmp_path / f"{emitted.prefix}.c"), str(tmp_path / "driver.c"),
                    "-o", str(exe), "-lm"], check=True, capture_output=True, text=True)
    env = {**os.environ, **SANITIZER_ENV}
    run = subprocess.run([str(exe)], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "runtime error" not in run.stderr and "Sanitizer" not in run.stderr, run.stderr[-4000:]
    printed = parse_output(run.stdout)
    _assert_matches_python(model, emitted, functions, printed)


def _assert_matches_python(model, emitted, functions: list[CFunctionAbi], printed: dict) -> None:
    """The sanitized build printed what the cffi module computes from the
    same inputs; a NaN left in an output would show here."""
    mod = sbp.compile(model, options=REFERENCE_BUILD)
    by_cname = {p.cname: p.name for f in emitted.module.functions for p in f.params}
    for fn in functions:
        kind = fn.name[len(emitted.prefix) + 1:]
        function = mod.function(kind)
        for batch in BATCHES:
            sizes = dict.fromkeys((a.cname for a in fn.args if a.kind == "dim"), batch)
            arrays = {}
            for salt, arg in enumerate(fn.args):
                shape = tuple(sizes.get(d) or int(d) for d in arg.shape)
                if arg.kind == "input":
                    arrays[by_cname[arg.cname]] = fill_values(int(np.prod(shape)), salt).reshape(shape)
                elif arg.kind == "index":
                    arrays[by_cname[arg.cname]] = np.zeros(shape, dtype=np.int64)
            results = dict(zip((spec.name for spec in function.outputs), function.call(arrays)))
            for arg in (a for a in fn.args if a.kind == "output"):
                got = printed[(f"{fn.name}/{batch}", arg.cname)]
                np.testing.assert_allclose(got, np.ravel(results[by_cname[arg.cname]]), rtol=1e-9, atol=1e-12,
                                           err_msg=f"{fn.name} {arg.cname} batch {batch}")
