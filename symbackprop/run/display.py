"""How a compiled module shows itself in Jupyter (IPython's _repr_*_ methods):
its backward graph (an SVG drawn by Graphviz's `dot` when installed, the
grad_fn-style tree as text otherwise), its derivation as math, and its
memory report as a table; in a terminal (`repr`), its name, dtype,
functions and arguments with their shapes.

Everything a user names (model, inputs, parameters) reaches the HTML escaped.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Protocol

import numpy as np

from symbackprop.emit.derivation import plan_derivation, render_derivation, render_derivation_html
from symbackprop.emit.graph import graph_dot, graph_text
from symbackprop.emit.picture import dot_program, render_dot

if TYPE_CHECKING:  # only for annotations
    from symbackprop.base.abi import ModuleSpec
    from symbackprop.declare.model import Model
    from symbackprop.emit.derivation import MemoryPlan
    from symbackprop.emit.emitted import Emitted
    from symbackprop.plan import Plan


class Shown(Protocol):
    """What this module reads of a CompiledModule (named here, not imported: module.py imports this)."""

    model: Model
    dtype: np.dtype
    spec: ModuleSpec
    emitted: Emitted

    @property
    def plan(self) -> Plan: ...

    def memory_plan(self) -> MemoryPlan: ...

# the memory report's rows: key -> what it is
MEMORY_ROWS = {
    "kept_for_backward": "forward values value_and_grad keeps for its backward pass",
    "prediction": "workspace of a prediction-only forward pass",
    "value_and_grad": "workspace of value_and_grad",
}


class BackwardGraph:
    """The backward graph of a module (``mod.graph``): the grad_fn-style tree
    when printed, a picture in Jupyter.

    Args:
        plan: the module's plan.
    """

    def __init__(self, plan: Plan) -> None:
        self.text = graph_text(plan)
        self.dot = graph_dot(plan)

    def __str__(self) -> str:
        return self.text

    def svg(self) -> str:
        """The graph drawn by Graphviz.

        Returns:
            The SVG text.

        Raises:
            ToolMissing: Graphviz's `dot` is not installed.
        """
        return render_dot(self.dot, "svg").decode("utf-8")

    def _repr_svg_(self) -> str | None:
        return self.svg() if dot_program() else None  # None: IPython shows another form

    def _repr_html_(self) -> str:
        if dot_program():
            svg = self.svg()
            # Inline in HTML: no XML prolog or DOCTYPE. The labels hold user names, which
            # may hold "$$": the classes keep MathJax 2 and 3 from typesetting them.
            return f'<div class="tex2jax_ignore mathjax_ignore">{svg[svg.find("<svg"):]}</div>'
        return ("<p>(Graphviz's <code>dot</code> is not installed: the graph as a tree; install Graphviz "
                "for a picture.)</p>\n"
                f"<pre>{html.escape(self.text)}</pre>")


class MemoryReport(dict[str, int]):
    """``mod.memory(...)``: bytes by name, a dict; a table in Jupyter.

    Args:
        sizes: bytes by name (the keys of MEMORY_ROWS).
        dims: the dimensions they are for.
    """

    def __init__(self, sizes: dict[str, int], dims: dict[str, int]) -> None:
        super().__init__(sizes)
        self.dims = dict(dims)

    def _caption(self) -> str:
        return ", ".join(f"{name} = {value}" for name, value in sorted(self.dims.items())) or "fixed shapes"

    def _repr_html_(self) -> str:
        return memory_html(dict(self), f"Memory for {self._caption()}")

    def _repr_markdown_(self) -> str:
        return memory_markdown(dict(self), f"Memory for {self._caption()}")


def readable_bytes(size: object) -> str:
    """A whole number of bytes in KiB/MiB/GiB, or "" for an expression."""
    if not isinstance(size, int):
        return ""
    value, unit = float(size), "B"
    for bigger in ("KiB", "MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{size} B" if unit == "B" else f"{value:.3g} {unit}"


def memory_html(sizes: dict[str, object], caption: str) -> str:
    """The memory report as an HTML table.

    Args:
        sizes: bytes (whole numbers, or expressions in the dimensions) by name.
        caption: what the sizes are for.

    Returns:
        The table.
    """
    rows = "\n".join(
        f"<tr><td><code>{html.escape(name)}</code></td><td>{html.escape(MEMORY_ROWS.get(name, ''))}</td>"
        f"<td>{html.escape(str(size))}</td><td>{html.escape(readable_bytes(size))}</td></tr>"
        for name, size in sizes.items())
    return (f"<table>\n<caption>{html.escape(caption)}</caption>\n"
            "<thead><tr><th>memory</th><th>what</th><th>bytes</th><th></th></tr></thead>\n"
            f"<tbody>\n{rows}\n</tbody>\n</table>")


def memory_markdown(sizes: dict[str, object], caption: str) -> str:
    """The memory report as a Markdown table (see memory_html)."""
    rows = "\n".join(f"| `{name}` | {MEMORY_ROWS.get(name, '')} | {size} | {readable_bytes(size)} |"
                     for name, size in sizes.items())
    return f"{caption}:\n\n| memory | what | bytes | |\n|---|---|---|---|\n{rows}\n"


def _symbolic_sizes(mod: Shown) -> dict[str, object] | None:
    """The memory report in the dimensions; None for a model without a loss."""
    if not mod.spec.has_loss:
        return None
    return {name: (int(size) if size.is_Integer else size) for name, size in mod.memory_plan().sizes().items()}


def _arguments_html(mod: Shown) -> str:
    rows = "\n".join(
        f"<tr><td><code>{html.escape(str(leaf.name))}</code></td><td>{role}</td>"
        f"<td>{html.escape(_shape_text(getattr(leaf, 'shape', ())))}</td></tr>"
        for role, leaves in (("input", mod.model.inputs), ("parameter", mod.model.params)) for leaf in leaves)
    return f"<table>\n<thead><tr><th>argument</th><th>role</th><th>shape</th></tr></thead>\n<tbody>\n{rows}\n</tbody>\n</table>"


def _shape_text(shape: tuple) -> str:
    """A shape as "n x 3"; a scalar (a Symbol leaf, no shape) as "scalar"."""
    return " x ".join(str(d) for d in shape) or "scalar"


def module_text(mod: Shown, built: list[str]) -> str:
    """A compiled module in a terminal (its repr): name, dtype, functions
    (those built, and those compiled on first use), arguments and outputs
    with their shapes.

    Args:
        mod: the module.
        built: the kinds of the functions built so far.

    Returns:
        The text, several lines.
    """
    kinds = ("forward", "value_and_grad", "vjp", "jvp", "hvp") + (("train_step",) if getattr(mod, "optimizer", None)
                                                                   else ())
    usable = [k for k in kinds if mod.spec.has_loss or k in ("forward", "vjp", "jvp")]
    built = [k for k in built if k in usable]
    later = [k for k in usable if k not in built]
    lines = [f"<CompiledModule {mod.model.name!r} ({mod.dtype.name})",
             f"  functions: {', '.join(built)}" + (f"; on first use: {', '.join(later)}" if later else "")]
    for role, leaves in (("inputs", mod.model.inputs), ("params", mod.model.params)):
        if leaves:
            shown = (f"{leaf.name} ({_shape_text(getattr(leaf, 'shape', ()))})" for leaf in leaves)
            lines.append(f"  {role}: " + ", ".join(shown))
    outputs = ([("loss", mod.spec.loss_shape)] if mod.spec.has_loss else []) + [
        (name, shape) for name, shape, _ in mod.spec.outputs]
    lines.append("  outputs: " + ", ".join(f"{name} ({_shape_text(tuple(shape))})" for name, shape in outputs))
    if mod.spec.dims:
        lines.append(f"  dimensions bound at call time: {', '.join(mod.spec.dims)}")
    return "\n".join(lines) + ">"


def module_html(mod: Shown) -> str:
    """A compiled module in Jupyter: arguments, backward graph, memory, derivation.

    Args:
        mod: the module.

    Returns:
        An HTML fragment.
    """
    parts = [f"<h3>Compiled model <code>{html.escape(mod.model.name)}</code> ({mod.dtype.name})</h3>",
             _arguments_html(mod)]
    sizes = _symbolic_sizes(mod)
    if sizes is not None:
        parts += ["<h4>Backward graph</h4>", BackwardGraph(mod.plan)._repr_html_(),
                  "<h4>Memory</h4>", memory_html(sizes, "Bytes, in the dimensions")]
    derivation = plan_derivation(mod.plan, mod.model.name, mod.dtype.name)
    if derivation is not None:
        parts += ["<h4>Derivation</h4>", render_derivation_html(derivation)]
    return "\n".join(parts) + "\n"


def module_markdown(mod: Shown) -> str:
    """A compiled module as Markdown: the derivation (its math in $$...$$),
    the memory report and the backward graph as text.

    Args:
        mod: the module.

    Returns:
        The Markdown text.
    """
    sizes = _symbolic_sizes(mod)
    if sizes is None:
        return f"Compiled model `{mod.model.name}` ({mod.dtype.name}), without a loss: outputs {list(mod.model.outputs)}.\n"
    return "\n".join([
        mod.emitted.derivation or _derivation_markdown(mod),
        "## Memory\n", memory_markdown(sizes, "Bytes, in the dimensions"),
        "## Backward graph\n", f"```text\n{graph_text(mod.plan)}\n```\n",
    ])


def _derivation_markdown(mod: Shown) -> str:
    """The derivation file's text, for a module compiled without it (some functions only)."""
    derivation = plan_derivation(mod.plan, mod.model.name, mod.dtype.name)
    return "" if derivation is None else render_derivation(derivation)
