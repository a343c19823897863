"""The C compiler and its command lines: which compiler ($CC, else
Python's), what it says it is, what a module's objects and link take
(position-independent, exporting only PyInit_), and what its output depends
on beyond the command's text (toolchain: its version, the CPU -march=native
means). No BuildOptions here: builder.py turns those into flags."""

from __future__ import annotations

import importlib.machinery
import os
import shlex
import subprocess
import sysconfig
from functools import cache
from pathlib import Path

from symbackprop.errors import BuildError
from symbackprop.toolchain.key import asks_for_host_cpu, executable_stamp, target_cpu

EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or importlib.machinery.EXTENSION_SUFFIXES[0]


@cache
def libmvec_available(command: tuple[str, ...]) -> bool:
    """GCC (whose simd attribute the declarations use) and glibc's libmvec."""
    import ctypes.util
    import platform

    gcc = compiler_family(command) == "gcc"
    return gcc and platform.machine() == "x86_64" and ctypes.util.find_library("mvec") is not None


# OpenMP's simd directives without its threads or library (the runtime
# header's SYMBACKPROP_SIMD_SUMS): GCC and LLVM's Clang, whatever the flags
# (Apple's Clang turns OpenMP flags away; without them the sums keep the
# examples' order).
SIMD_FLAGS = ("-fopenmp-simd", "-DSYMBACKPROP_OPENMP_SIMD")


def simd_flags(command: tuple[str, ...]) -> tuple[str, ...]:
    return SIMD_FLAGS if compiler_family(command) in ("gcc", "clang") else ()


def compiler_command() -> list[str]:
    """The C compiler: $CC (which may carry options), else the one Python was built with."""
    command = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    if not command:
        raise BuildError("CC is set but empty; set it to a C compiler such as gcc or clang")
    return command


def link_options() -> list[str]:
    """What makes a loadable extension module: Python's LDSHARED without
    its compiler (-shared, or -bundle on macOS), and position-independent code."""
    ldshared = shlex.split(os.environ.get("LDSHARED") or sysconfig.get_config_var("LDSHARED") or "cc -shared")
    return ldshared[1:] + object_options()


def object_options() -> list[str]:
    """How each object of an extension module compiles: position-independent,
    exporting only PyInit_ (PyMODINIT_FUNC): modules of one model name loaded
    with RTLD_GLOBAL would otherwise bind to each other's functions."""
    return shlex.split(sysconfig.get_config_var("CCSHARED") or "-fPIC") + ["-fvisibility=hidden"]


def compiler_family(command: tuple[str, ...]) -> str:
    """"gcc", "clang" (LLVM's), "apple-clang" or "other", from what the
    compiler says its version is."""
    identity = compiler_identity(command)
    if "clang" in identity:
        return "apple-clang" if "Apple" in identity else "clang"
    return "gcc" if "Free Software Foundation" in identity else "other"


@cache
def compiler_identity(command: tuple[str, ...]) -> str:
    """What the compiler says its version is; BuildError when it does not run."""
    try:
        out = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(
            f"no working C compiler: running {shlex.join(command)!r} failed ({exc}); "
            "install gcc or clang, or set CC to one"
        ) from exc
    return out.stdout.strip()


def toolchain(command: list[str] | tuple[str, ...], local: bool = False) -> str:
    """What a compiler command's output depends on beyond its text: the
    compiler's version (`local`: which files its programs are, a key for
    this host only, taken without running them), and the CPU that
    -march=native (or the like) means on this host."""
    compiler = tuple(compiler_command())
    identity = executable_stamp(compiler) if local else compiler_identity(compiler)
    if not asks_for_host_cpu(command):
        return identity
    native = tuple(arg for arg in command if arg.startswith("-m") and "native" in arg)
    return f"{identity}\n{target_cpu(compiler + native)}"


# The glue's optimization level, after the flags' (the last -O wins): what it
# does per call is convert Python arguments (train_step: the same time at -O0
# as at -O1) or forward the packed entries, which the call hot path calls and
# which keep -O2 (PACKED_ATTRIBUTE). cffi's wrappers of a model with many
# arrays are long (lstm l=4: 2.5 G instructions of GCC at -O1, 1.3 G at -O0).
GLUE_LEVEL = "-O0"


def build_commands(name: str, prefix: str, flags: tuple[str, ...], folder: Path,
                   libraries: tuple[str, ...] = (), units: int = 1) -> tuple[list[list[str]], list[str]]:
    """The commands making the extension: the objects of the cffi glue and of
    the model (run at once; a model's C split into `units` translation
    units, emit.cunits, is compiled once per unit), then the link."""
    paths = sysconfig.get_paths()
    includes = [f"-I{path}" for path in dict.fromkeys([paths["include"], paths["platinclude"], str(folder)])]

    def compile_(source: str, output: str, *level: str) -> list[str]:
        return [*compiler_command(), *flags, *level, *object_options(), *includes, "-c", str(folder / f"{source}.c"),
                "-o", str(folder / output)]

    objects = [compile_(name, f"{name}.o", GLUE_LEVEL)]
    if units == 1:
        objects.append(compile_(prefix, f"{prefix}.o"))
    else:
        objects += [compile_(prefix, f"{prefix}.unit{k}.o", f"-DSYMBACKPROP_UNIT={k}") for k in range(units)]
    link = [*compiler_command(), *flags, *link_options(), *(command[-1] for command in objects),
            "-o", str(folder / f"{name}{EXT_SUFFIX}"), *libraries, "-lm"]
    return objects, link
