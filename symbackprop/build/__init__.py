"""The build stage: generated C compiled with cffi into a verified cache.

    builder.py   BuildOptions and build: compile, cache, load
    blas.py      which BLAS large products call, how to link it, its threads
    threads.py   sbp.set_num_threads / get_num_threads (the BLAS's and OpenMP's)
    cachedir.py  where the caches are kept
    key.py       cache keys, and what -march=native means here
    trust.py     which folders, files and entries the cache trusts
"""
