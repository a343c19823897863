"""Run a compile stage on a large stack, so depth is never a RecursionError.

SymPy recurses once per level of an expression in many places we do not
control (building and hashing nested expressions, `shape` of a product
chain, `diff`, `xreplace`, `cse`, printing), and so do some of our own
rules. Our graph walks are iterative; for SymPy's, a model 1,000 layers or
1,000 unrolled steps deep needs tens of thousands of frames, beyond Python's
default limit of 1,000 and the main thread's 8 MiB C stack. So the pipeline
runs in a worker thread with a STACK_BYTES stack, with the recursion limit
raised to RECURSION_LIMIT for as long as any such run lasts (the limit is
process-wide: it is restored when the last concurrent run ends). The limit
is set so that the stack cannot overflow before the limit is reached (at
most STACK_BYTES / RECURSION_LIMIT = 5 KiB of C stack per frame), so the
worst case is a ModelError, never a crash.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from symbackprop.errors import ModelError

STACK_BYTES = 512 * 1024 * 1024  # address space only: pages are used as the stack grows
RECURSION_LIMIT = 100_000

T = TypeVar("T")

_lock = threading.Lock()
_active = 0  # deep runs in progress
_saved_limit = 0
_local = threading.local()  # marks the worker threads: a nested call runs in place


def _enter() -> None:
    global _active, _saved_limit
    with _lock:
        if _active == 0:
            _saved_limit = sys.getrecursionlimit()
            sys.setrecursionlimit(max(_saved_limit, RECURSION_LIMIT))
        _active += 1


def _leave() -> None:
    global _active
    with _lock:
        _active -= 1
        if _active == 0:
            sys.setrecursionlimit(_saved_limit)


def run_deep(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on a large stack; its result, or its exception.

    Raises:
        ModelError: the model is nested deeper than even that stack allows
            (names `what` and what to do), besides whatever fn raises.
    """
    if getattr(_local, "deep", False):
        return fn(*args, **kwargs)
    outcome: dict[str, Any] = {}

    def work() -> None:
        _local.deep = True
        try:
            outcome["value"] = fn(*args, **kwargs)
        except RecursionError:
            outcome["error"] = ModelError(
                f"{what} is nested too deeply to compile (over {RECURSION_LIMIT} levels of recursion in SymPy): "
                "build it from fewer, wider layers, or a scan (symbackprop.scan) instead of unrolling a loop")
        except BaseException as exc:  # re-raised in the caller's thread
            outcome["error"] = exc

    _enter()
    try:
        with _lock:  # stack_size applies to threads started after it: set it only around this start
            previous = threading.stack_size(STACK_BYTES)
            try:
                worker = threading.Thread(target=work, name="symbackprop-compile", daemon=True)
                worker.start()
            finally:
                threading.stack_size(previous)
        worker.join()
    finally:
        _leave()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def build_deep(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on a large stack: for building an expression
    hundreds of levels deep with SymPy's own operators, which recurse once
    per level (nn's layers do not: a 1,000-layer MLP of nn.linear and
    nn.tanh builds on Python's default stack); `compile` needs no such
    help, its stages run on a large stack by themselves.

    Example: ``model = symbackprop.build_deep(make_mlp, 1000)``.

    Args:
        fn: the function that builds the model (or any expression).
        *args: its positional arguments.
        **kwargs: its keyword arguments.

    Returns:
        What fn returns.

    Raises:
        ModelError: the expression is nested deeper than even that stack
            allows; besides whatever fn raises.
    """
    return run_deep("the model being built", fn, *args, **kwargs)


__all__ = ["RECURSION_LIMIT", "STACK_BYTES", "build_deep", "run_deep"]
