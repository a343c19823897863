"""Graphviz DOT text as a picture (SVG or PNG), drawn by Graphviz's `dot`.

`dot` is a program, not a Python package (pip cannot install it), so it is
run directly: found on PATH, given an argument list (no shell) and the DOT
text on stdin. Where it is missing, ToolMissing says how to install it.
"""

from __future__ import annotations

import shutil
import subprocess

from symbackprop.errors import ToolMissing

FORMATS = ("svg", "png")  # what render_dot draws
INSTALL_HINT = ("install Graphviz (apt install graphviz, brew install graphviz, conda install graphviz, "
                "or https://graphviz.org/download/), or use --format dot and draw it elsewhere")


def dot_program() -> str | None:
    """The path of Graphviz's `dot`, or None when it is not on PATH."""
    return shutil.which("dot")


def render_dot(dot: str, fmt: str) -> bytes:
    """Draw DOT text with Graphviz.

    Args:
        dot: a DOT digraph (emit.graph.graph_dot).
        fmt: "svg" or "png".

    Returns:
        The picture's bytes (SVG is UTF-8 XML).

    Raises:
        ToolMissing: `dot` is not on PATH.
        ValueError: fmt is not one of FORMATS.
        subprocess.CalledProcessError: `dot` rejected the text (a bug: graph_dot escapes every label).
    """
    if fmt not in FORMATS:
        raise ValueError(f"picture format {fmt!r}: expected one of {FORMATS}")
    program = dot_program()
    if program is None:
        raise ToolMissing(f"drawing the graph as {fmt.upper()} needs Graphviz's `dot` program, "
                          f"which is not on PATH: {INSTALL_HINT}")
    done = subprocess.run([program, f"-T{fmt}"], input=dot.encode("utf-8"), capture_output=True, check=True, timeout=120)
    return done.stdout
