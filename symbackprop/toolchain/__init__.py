"""The build stage (toolchain): generated C compiled with cffi into a
verified cache.

    builder.py   BuildOptions and build: compile, cache, load
    compiler.py  the C compiler, its command lines and what its output depends on
    packed.py    the packed entry points written into the cffi glue
    memo.py      the front cache: a model's generated code and plan, as JSON
    blas.py      which BLAS large products call, how to link it, its threads
    threads.py   sbp.set_num_threads / get_num_threads (the BLAS's and OpenMP's)
    key.py       cache keys, and what -march=native means here

Where the caches live and what they trust: symbackprop.base (cachedir.py,
trust.py), shared with the template cache.
"""
