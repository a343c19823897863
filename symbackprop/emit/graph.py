"""The backward graph as a tree in the familiar grad_fn style, as text or
Graphviz DOT.

One node per backward op, named after the forward op it differentiates
(the grad_fn field of the op's record, symbackprop.ops): common
compositions are recognised (a matrix product plus a broadcast bias is one
MatMulWithBias node; a mean of squared differences is one MseLoss),
and each differentiated leaf ends in an AccumulateGrad node. Every node
is an operation of the forward expression: how its derivative is computed
(a weight's gradient through a product takes the other operand transposed,
X^T @ grad) is not drawn, so a Transpose node means the model transposes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from symbackprop.base.registry import rule
from symbackprop.diff.autodiff import depends_on
from symbackprop.ir.node import Node, topological_order

if TYPE_CHECKING:  # only for annotations
    from symbackprop.plan import Plan


@dataclass
class GraphNode:
    """One backward op of the tree.

    Args:
        name: the grad_fn-style name, e.g. "MatMulBackward".
        detail: what it is about (a leaf's name), or "".
        children: the backward ops below it.
    """

    name: str
    detail: str = ""
    children: list[GraphNode] = field(default_factory=list)


def _reaches(plan: Plan) -> dict[Node, bool]:
    return depends_on(topological_order([plan.lowered.loss]), set(_wrt_nodes(plan)))


def _wrt_nodes(plan: Plan) -> list[Node]:
    lowered = plan.lowered
    return [lowered.leaves.get(name) or lowered.outputs[name] for name in plan.wrt]


def backward_tree(plan: Plan) -> GraphNode:
    """The tree of backward ops from the loss down to the differentiated leaves.

    Args:
        plan: a compiled module's plan (``CompiledModule.plan``).

    Returns:
        The root, the loss's backward op.
    """
    reaches = _reaches(plan)
    names = {node: name for name, node in plan.lowered.leaves.items()}
    return _tree(plan.lowered.loss, reaches, names, set(_wrt_nodes(plan)))


def _tree(root: Node, reaches: dict[Node, bool], names: dict[Node, str], wrt: set[Node]) -> GraphNode:
    """Depth first with an explicit stack (a model 1,000 layers deep is
    1,000 levels); an op reached again (a shared value: an unrolled
    recurrent state feeds several gates) is shown once, then as "shown
    above", so the tree is as large as the graph, not exponential in it."""
    top = GraphNode("")
    expanded: set[Node] = set()
    stack: list[tuple[Node | None, GraphNode]] = [(root, top)]
    while stack:
        node, parent = stack.pop()
        if node is None:  # after the operands: a retained intermediate's gradient
            parent.children.append(GraphNode("AccumulateGrad", "retained gradient"))
            continue
        if node.op == "leaf":
            out = GraphNode("AccumulateGrad", names.get(node, node.attrs[0]))
        else:
            name, operands = _classify(node)
            out = GraphNode(name + "Backward", "shown above" if node in expanded else "")
            if node not in expanded:
                expanded.add(node)
                if node in wrt:
                    stack.append((None, out))
                stack.extend((op, out) for op in reversed(operands) if reaches.get(op, False))
        parent.children.append(out)
    return top.children[0]


def _classify(node: Node) -> tuple[str, list[Node]]:
    """A grad_fn name and the operands below it, as the node's op record says."""
    return rule(node.op, "grad_fn")(node)


def graph_text(plan: Plan) -> str:
    """The backward tree as indented text, one op a line (as print_graph shows).

    Args:
        plan: a compiled module's plan (``CompiledModule.plan``).

    Returns:
        The text, without a final newline.
    """
    lines: list[str] = []
    stack = [(backward_tree(plan), "", True, True)]
    while stack:  # depth first, children in order
        node, prefix, last, top = stack.pop()
        label = node.name + (f" ({node.detail})" if node.detail else "")
        lines.append(label if top else prefix + ("└── " if last else "├── ") + label)
        child_prefix = "" if top else prefix + ("    " if last else "│   ")
        count = len(node.children)
        stack.extend((child, child_prefix, k == count - 1, False) for k, child in reversed(list(enumerate(node.children))))
    return "\n".join(lines)


def graph_dot(plan: Plan) -> str:
    """The backward tree as a Graphviz DOT digraph.

    Args:
        plan: a compiled module's plan (``CompiledModule.plan``).

    Returns:
        The DOT text, ending in a newline.
    """
    lines = ["digraph backward {", "    node [shape=box, fontname=monospace];"]
    # depth first: a node's line, its subtree, then its edge from the parent
    count = 0
    stack: list[tuple[str, GraphNode | str, str]] = [("node", backward_tree(plan), "")]
    while stack:
        step, item, parent = stack.pop()
        if step == "edge":
            lines.append(f"    {parent} -> {item};")
            continue
        assert isinstance(item, GraphNode)
        ident = f"n{count}"
        count += 1
        label = "\\n".join(_dot_escape(part) for part in (item.name, item.detail) if part)
        lines.append(f'    {ident} [label="{label}"];')
        if parent:
            stack.append(("edge", ident, parent))
        stack.extend(("node", child, ident) for child in reversed(item.children))
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_escape(text: str) -> str:
    """One line of text, safe inside a DOT double-quoted label."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ").replace("\r", " ")
