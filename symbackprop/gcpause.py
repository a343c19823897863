"""Python's cyclic garbage collector paused while a model compiles.

Compiling builds hundreds of thousands of SymPy objects that live until it
ends, and next to none of them form reference cycles (reference counting
frees the rest at once). Each automatic collection still walks every live
object: at a determinant by minors of ell = 9 they were a fifth of the
compile's Python time and found about a hundred objects. So the collector
waits until the compile ends; its state before is restored (a program that
keeps it disabled keeps it so).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """The block runs with the cyclic collector disabled; it is enabled
    again after, if it was before (a nested block leaves that to the
    outermost one). The collector is per process: other threads see it
    paused meanwhile, which only delays their collections."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
