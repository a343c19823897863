"""Write and build small C programs that call generated modules without
Python, for tests (plain-C use, sanitizers, linking several modules)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np

STRICT_FLAGS = ["-std=c99", "-Wall", "-Wextra", "-Wpedantic", "-Werror"]


def unwrapped(c_text: str) -> str:
    """Generated C with each statement or prototype the emitter wrapped at
    100 columns (emit/wrap.py: continued 8 columns deeper, cut at spaces)
    back on one line, its parts joined by a single space."""
    lines: list[str] = []
    first_indent, depth, code = -1, 0, False
    for line in c_text.split("\n"):
        text = line.lstrip(" ")
        indent = len(line) - len(text)
        if code and text and (depth > 0 or (indent == first_indent + 8 and not lines[-1].endswith("{"))):
            lines[-1] += " " + text
        else:
            lines.append(line)
            first_indent, depth = indent, 0
            code = not text.startswith(("/*", "*", "#", "//"))
        if code:
            depth = max(depth + text.count("(") - text.count(")"), 0)
    return "\n".join(lines)


def write_runtime_header(folder: Path) -> Path:
    """symbackprop_runtime.h, which every generated .c includes, into `folder`."""
    from symbackprop.emit.codegen import RUNTIME_HEADER, runtime_header

    path = Path(folder) / RUNTIME_HEADER
    path.write_text(runtime_header())
    return path



def strict_compile_errors(emitted, folder: Path, dtype: str) -> str:
    """Compile a generated module's C (an Emitted: source, header, prefix)
    into an object file at STRICT_FLAGS (-Wdouble-promotion for float32):
    the compiler's errors and warnings, "" when it compiles clean."""
    folder = Path(folder)
    source = folder / f"{emitted.prefix}.c"
    source.write_text(emitted.source)
    (folder / f"{emitted.prefix}.h").write_text(emitted.header)
    write_runtime_header(folder)
    flags = [*STRICT_FLAGS] + (["-Wdouble-promotion"] if dtype == "float32" else [])
    result = subprocess.run(["cc", *flags, "-c", str(source), "-o", str(folder / "m.o")], capture_output=True, text=True)
    return result.stderr if result.returncode == 0 else result.stderr or f"cc exited with {result.returncode}"


def fill_values(size: int, salt: int) -> np.ndarray:
    """The deterministic values a driver puts in an array: sin(k + salt)."""
    return np.sin(np.arange(size, dtype=np.float64) + salt) * 0.5


def driver_source(modules, function: str, dims: dict[str, int]) -> str:
    """A main() that calls `function` of each CModule on fill_values data
    and prints every output value with %.17g, one per line."""
    lines = ["#include <stdio.h>", "#include <stdlib.h>", "#include <math.h>"]
    lines += [f'#include "{m.prefix}.h"' for m in modules]
    lines += ["", "int main(void)", "{"]
    for m in modules:
        fn = next(f for f in m.functions if f.name == f"{m.prefix}_{function}")
        dim_args = [str(dims[p.name]) for p in fn.params if p.role == "dim"]
        call_args = list(dim_args)
        for salt, p in enumerate(fn.params):
            if p.role not in ("input", "output"):
                continue
            size = _size(p.shape, fn, dims)
            var = f"{m.prefix}_{p.cname}"
            lines.append(f"    double *{var} = malloc(sizeof(double) * {size});")
            if p.role == "input":
                lines.append(f"    for (int k = 0; k < {size}; ++k) {var}[k] = sin(k + {salt}) * 0.5;")
            call_args.append(var)
        work = f"{m.prefix}_work"
        lines.append(f"    double *{work} = malloc(sizeof(double) * ({fn.name}_work_len({', '.join(dim_args)}) + 1));")
        call_args.append(work)
        lines.append(f"    if ({fn.name}({', '.join(call_args)}) != 0) return 1;")
        for p in fn.params:
            if p.role == "output":
                size = _size(p.shape, fn, dims)
                value = f"{m.prefix}_{p.cname}[k]"
                lines.append(f'    for (int k = 0; k < {size}; ++k) printf("{m.prefix} {p.name} %.17g\\n", {value});')
        for p in fn.params:
            if p.role in ("input", "output"):
                lines.append(f"    free({m.prefix}_{p.cname});")
        lines.append(f"    free({work});")
    lines += ["    return 0;", "}", ""]
    return "\n".join(lines)


def _size(shape, fn, dims: dict[str, int]) -> int:
    by_c = {p.cname: dims[p.name] for p in fn.params if p.role == "dim"}
    total = 1
    for d in shape:
        total *= int(by_c.get(d, d))
    return total


def input_arrays(module, function: str, dims: dict[str, int], shapes: dict[str, tuple]) -> dict[str, np.ndarray]:
    """The arrays the driver builds, for the same call from Python."""
    fn = next(f for f in module.functions if f.name == f"{module.prefix}_{function}")
    arrays = {}
    for salt, p in enumerate(fn.params):
        if p.role == "input":
            shape = shapes[p.name]
            arrays[p.name] = fill_values(int(np.prod(shape)), salt).reshape(shape)
    return arrays


def build_program(folder: Path, sources: list[Path], driver: str, extra_flags: list[str] = ()) -> Path:
    main = folder / "driver.c"
    main.write_text(driver)
    exe = folder / "driver"
    cmd = ["cc", *STRICT_FLAGS, *extra_flags, f"-I{folder}", *map(str, sources), str(main), "-o", str(exe), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return exe


def parse_output(text: str) -> dict[tuple[str, str], list[float]]:
    values: dict[tuple[str, str], list[float]] = {}
    for line in text.splitlines():
        prefix, name, value = line.split()
        values.setdefault((prefix, name), []).append(float(value))
    return values
