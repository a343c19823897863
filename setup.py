"""The call hot path's C extension, built with the package.

Everything else about the package is in pyproject.toml. `pip install`,
`pip install -e .` and a wheel build compile symbackprop/run/_fastcall.c
into `symbackprop.run.symbackprop_fastcall`, so that the first model
compiled into an empty cache does not pay for it (0.15-0.25 s of CPU).
The extension is optional: where it does not build (no compiler, no
Python headers, no numpy at build time) the install goes on, and
symbackprop.run.fastcall builds it into the module cache on first use, as
it also does where the installed one does not import or was built from
another version of _fastcall.c (the SHA-256 of the source, compiled in).
"""

import hashlib
from pathlib import Path

from setuptools import Extension, setup

SOURCE = "symbackprop/run/_fastcall.c"
NAME = "symbackprop.run.symbackprop_fastcall"  # the last part is its PyInit_ name
FLAGS = ["-O2", "-std=c11", "-pthread"]  # symbackprop.run.fastcall.FLAGS (tests/test_fastcall.py checks they agree)


def source_digest(path: Path) -> str:
    """What symbackprop.run.fastcall.source_digest computes of the installed _fastcall.c."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def extensions() -> list[Extension]:
    try:
        import numpy
    except ImportError:  # no headers to build against: built on first use instead
        return []
    digest = source_digest(Path(__file__).resolve().parent / SOURCE)
    return [Extension(NAME, [SOURCE], include_dirs=[numpy.get_include()], extra_compile_args=FLAGS,
                      extra_link_args=["-pthread"], define_macros=[("SYMBACKPROP_FASTCALL_SOURCE", f'"{digest}"')],
                      optional=True)]


if __name__ == "__main__":
    setup(ext_modules=extensions())
