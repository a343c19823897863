"""The public `symbackprop.nn`: the names of `symbackprop.declare.nn`
(the public module path stays; the code lives in its stage package)."""

from symbackprop.declare.nn import *  # noqa: F403
