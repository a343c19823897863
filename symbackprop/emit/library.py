"""Build files for a generated model, so that a C or C++ program links it
as a library: `symbackprop build --library` writes them beside the model's
.c and .h (templates/library_*.j2).

    CMakeLists.txt   static and shared library, install rules, the .pc
    Makefile         the same with only a C compiler and make
    <prefix>.pc.in   pkg-config's file, with the install prefix left to
                     CMake's configure_file or `make install PREFIX=...`

They name nothing but the model's prefix (a lower-case C identifier, so
safe in CMake, make, sed and pkg-config alike) and symbackprop's version:
the same model gives the same bytes anywhere (no date, no absolute path).
The .c includes ../symbackprop_runtime.h, which `build` writes to the top
of --out; the build files look for it there.
"""

from __future__ import annotations

import re

from symbackprop._version import __version__
from symbackprop.emit.codegen import template_environment
from symbackprop.errors import ModelError

CMAKE = "CMakeLists.txt"  # also the mark of a folder that has the build files (cli._with_library)
TEMPLATES = {CMAKE: "library_cmake.j2", "Makefile": "library_make.j2", "{p}.pc.in": "library_pc.j2"}
_PREFIX = re.compile(r"[a-z_][a-z0-9_]*")
# lib<prefix> must not shadow a library the link needs (a model named "m"
# would make a libm), nor <prefix> be a target CMake or make defines
TAKEN = frozenset("""c m dl rt pthread util crypt resolv gcc gcc_s stdc++ atomic mvec gomp omp iomp5 blas cblas
    openblas lapack all clean install test help package package_source edit_cache rebuild_cache depend""".split())


def library_files(prefix: str) -> dict[str, str]:
    """File name -> text of the build files of the model whose C prefix is
    `prefix` (as `pipeline.generate` names it: sanitized, lower case).

    Raises:
        ModelError: the library would be named as a system library or a
            build target (`TAKEN`): rename the model.
        ValueError: `prefix` is not a lower-case C identifier (a bug: the
            prefix comes from the C namer, never straight from the user).
    """
    if not _PREFIX.fullmatch(prefix):
        raise ValueError(f"the library files need the model's C prefix; got {prefix!r}")
    if prefix in TAKEN:
        raise ModelError(f"a model whose C prefix is {prefix!r} would build the library lib{prefix}, the name of a "
                         "system library or a build target: rename the model for --library")
    env = template_environment()
    return {name.format(p=prefix): env.get_template(template).render(p=prefix, version=__version__)
            for name, template in TEMPLATES.items()}


__all__ = ["CMAKE", "TEMPLATES", "library_files"]
