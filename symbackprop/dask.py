"""The public `symbackprop.dask`: the names of `symbackprop.interop.dask`
(the public module path stays; the code lives in its stage package)."""

from symbackprop.interop.dask import *  # noqa: F403
from symbackprop.interop.dask import __all__  # noqa: F401
