"""The packed entries: one more C entry point per generated function,
the dimensions as one int64 array and the arrays as one pointer array,
written into the cffi glue (symbackprop.run.fastcall calls them)."""

from __future__ import annotations

import re

# Before each packed entry: GCC optimizes it as at -O2 in the -O0 glue.
PACKED_ATTRIBUTE = ("#if defined(__GNUC__) && !defined(__clang__)\n"
                    "#define SYMBACKPROP_PACKED __attribute__((optimize(\"O2\")))\n"
                    "#else\n#define SYMBACKPROP_PACKED\n#endif\n")


_PROTOTYPE = re.compile(r"^(int|size_t) (\w+)\((.*)\);$")


def packed_entries(cdef: str) -> tuple[str, str]:
    """Declarations and definitions of one more entry point per generated
    function, for symbackprop.run.fastcall: the dimensions as one int64 array
    and the arrays as one pointer array, whatever the function's arity."""
    declarations, definitions = [], []
    for line in cdef.splitlines():
        match = _PROTOTYPE.match(line.strip())
        if not match:
            continue
        returns, name, params = match.groups()
        kinds = [p.split()[0] if p != "void" else "" for p in params.split(", ")] if params != "void" else []
        if any(kind not in ("int64_t", "void") for kind in kinds):
            continue  # e.g. an epoch's hyperparameters: no packed entry
        dims = [f"d[{k}]" for k, kind in enumerate(kinds) if kind == "int64_t"]
        arrays = [f"a[{k}]" for k in range(len(kinds) - len(dims))]
        if returns == "size_t":
            signature = f"size_t {name}__packed(const int64_t *d)"
            body = f"return {name}({', '.join(dims)});"
        else:
            signature = f"int {name}__packed(const int64_t *d, void *const *a)"
            body = f"return {name}({', '.join(dims + arrays)});"
        declarations.append(signature + ";")
        definitions.append(f"SYMBACKPROP_PACKED {signature}\n{{\n    (void)d;\n    {body}\n}}")
    return "\n".join(declarations) + "\n", PACKED_ATTRIBUTE + "\n".join(definitions) + "\n"
