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
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_active = 0  # paused blocks in progress, in any thread
_was_enabled = False  # the collector's state when the first of them began


@contextmanager
def gc_paused() -> Iterator[None]:
    """The block runs with the cyclic collector disabled; it is enabled
    again when the last paused block ends (nested, or in another thread:
    compile writes a derivation while the next model's C is generated),
    if it was when the first began. The collector is per process: other
    threads see it paused meanwhile, which only delays their collections."""
    global _active, _was_enabled
    with _lock:
        if _active == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0 and _was_enabled:
                gc.enable()
