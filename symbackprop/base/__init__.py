"""The bottom stage: leaves that every later stage may share. Each module
here imports only the top-level leaves (errors, messages, log) and the
modules of this package, never a stage.

    registry.py   OpRecord and the op table (register, record, rule); it loads
                  the op families (symbackprop.ops, loops) by name on first look-up
    functions.py  one ScalarFunction record per scalar function beyond libm
    stable.py     sigmoid and softplus, and the exact rewrites into them
    scalar.py     a scalar SymPy body's derivatives by all its symbols in one sweep
    exprdag.py    iterative walks over SymPy DAGs
    cprint.py     the scalar C printer (IEEEPrinter) and the sum-term order
    cnames.py     C names: sanitized, unique, the ABI's reserved names
    abi.py        the JSON-able ABI spec: argument kinds, status texts, limits
    cachedir.py   where the caches are kept
    trust.py      which folders, files and entries a cache trusts
"""
