"""The public `symbackprop.optim`: the names of `symbackprop.run.optim`
(the public module path stays; the code lives in its stage package)."""

from symbackprop.run.optim import *  # noqa: F403
