"""What is built with the package: the call hot path's C extension and the
templates' compiled code.

Everything else about the package is in pyproject.toml. `pip install`,
`pip install -e .` and a wheel build compile symbackprop/run/_fastcall.c
into `symbackprop.run.symbackprop_fastcall`, so that the first model
compiled into an empty cache does not pay for it (0.15-0.25 s of CPU).
The extension is optional: where it does not build (no compiler, no
Python headers, no numpy at build time) the install goes on, and
symbackprop.run.fastcall builds it into the module cache on first use, as
it also does where the installed one does not import or was built from
another version of _fastcall.c (the SHA-256 of the source, compiled in).

The templates' compiled code (symbackprop/emit/templatecache.py, loaded from
its file: the package is not importable yet) is written into the package's
folder templates_compiled, so that the first model compiled into an empty
cache compiles no template (0.2-0.3 s of CPU). It is optional too: without
jinja2 at build time, or where it fails, templates compile on first use as
before, as they do where a copy was compiled from another source, Python or
Jinja (templatecache checks each).
"""

import hashlib
import importlib.util
from pathlib import Path

from setuptools import Extension, find_namespace_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent

SOURCE = "symbackprop/run/_fastcall.c"
NAME = "symbackprop.run.symbackprop_fastcall"  # the last part is its PyInit_ name
FLAGS = ["-O2", "-std=c11", "-pthread"]  # symbackprop.run.fastcall.FLAGS (tests/compiled/test_fastcall.py checks they agree)


def source_digest(path: Path) -> str:
    """What symbackprop.run.fastcall.source_digest computes of the installed _fastcall.c."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def extensions() -> list[Extension]:
    try:
        import numpy
    except ImportError:  # no headers to build against: built on first use instead
        return []
    digest = source_digest(HERE / SOURCE)
    return [Extension(NAME, [SOURCE], include_dirs=[numpy.get_include()], extra_compile_args=FLAGS,
                      extra_link_args=["-pthread"], define_macros=[("SYMBACKPROP_FASTCALL_SOURCE", f'"{digest}"')],
                      optional=True)]


TEMPLATE_CACHE = "symbackprop/emit/templatecache.py"  # write_compiled, COMPILED (the folder, in the package)


class BuildPyWithTemplates(build_py):
    """build_py, then the templates' compiled code: into the build folder, or
    into the source tree for an editable install (where build_py copies nothing)."""

    def run(self) -> None:
        super().run()
        try:
            spec = importlib.util.spec_from_file_location("_symbackprop_templatecache", HERE / TEMPLATE_CACHE)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            relative = module.COMPILED.relative_to(HERE)
            folder = HERE / relative if self.editable_mode else Path(self.build_lib) / relative
            names = module.write_compiled(folder)
        except Exception as error:  # optional: the templates compile on first use instead
            print(f"symbackprop: templates not precompiled ({type(error).__name__}: {error}); they compile on first use")
            return
        print(f"symbackprop: {len(names)} templates compiled into {folder}")


if __name__ == "__main__":
    # the package and its stages (declare, ir, ops, diff, schedule, emit, build, run, loops, interop), and the
    # top-level templates/ as symbackprop.templates (pyproject.toml's package-dir: the templates beside the code)
    packages = find_namespace_packages(include=["symbackprop", "symbackprop.*"]) + ["symbackprop.templates"]
    setup(packages=packages, ext_modules=extensions(), cmdclass={"build_py": BuildPyWithTemplates})
