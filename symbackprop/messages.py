"""Error messages a person reads: expressions abbreviated, with their shape.

SymPy prints an expanded expression in full, and a model's expressions run
to kilobytes; a message quotes at most `LIMIT` characters of one.
"""

from __future__ import annotations

from collections.abc import Iterable

LIMIT = 300


def short(expr: object, limit: int = LIMIT) -> str:
    """`expr` printed on one line, its middle cut to "..." beyond `limit` characters."""
    try:
        text = " ".join(str(expr).split())
    except RecursionError:  # SymPy's printer recurses per level: a 1,000-layer expression
        text = f"<a {type(expr).__name__} too deep to print>"
    if len(text) <= limit:
        return text
    head = (limit * 2) // 3
    tail = limit - head - 5
    return f"{text[:head]} ... {text[-tail:]}"


def shape_text(expr: object) -> str:
    """'of shape (n, 4)' for a matrix, 'a scalar' otherwise."""
    shape = getattr(expr, "shape", None)
    if shape is None or len(shape) != 2:
        return "a scalar"
    return f"of shape {show(shape)}"


def show(shape: Iterable[object]) -> str:
    """A shape as messages print it: '(n, 4)' (dimension names as named)."""
    return "(" + ", ".join(str(d) for d in shape) + ")"


def described(expr: object) -> str:
    """The abbreviated expression and its shape: 'X*W (of shape (n, 2))'."""
    return f"{short(expr)} ({shape_text(expr)})"


def capped(message: str, limit: int = 2 * LIMIT - 40) -> str:
    """A whole message kept readable: its middle cut where it is too long
    (a safety net for messages that quote an expression unabbreviated)."""
    if len(message) <= limit:
        return message
    head = limit - 180
    return f"{message[:head]} ... {message[-170:]}"
