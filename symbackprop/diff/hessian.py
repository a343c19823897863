"""Hessian-vector products: the loss's gradient and the Hessian times a
direction, by one of two compositions of the drivers in autodiff.py.

- forward over reverse: H v = jvp of the gradient graph along v, the
  tangent of each map's local derivatives from one sweep of that map's
  directional derivative (autodiff.tangent_of_local). The default: on
  an MLP (256 x 32 -> 64 -> 10, tanh, mse) its call took 0.54-0.57 ms
  against 0.60-0.63 ms reverse over forward (2-core machine).
- reverse over forward: H v = grad_w <grad f, v> = the vjp of the loss's
  tangent along v. Chosen when the loss's graph holds a loop (a scan, a fixed point): the tangent
  of a scan is a scan (over state, tangent pairs) and a scan has a VJP, so
  no rule differentiates a scan's backward pass.

`route` is the one place that chooses.
"""

from __future__ import annotations

from collections.abc import Sequence

from symbackprop.base.registry import is_loop
from symbackprop.diff.autodiff import jvp, vjp
from symbackprop.ir.construct import const
from symbackprop.ir.node import Node, topological_order


def route(loss: Node) -> str:
    """ "reverse_over_forward" when the loss's graph holds a loop, else
    "forward_over_reverse"."""
    if any(is_loop(node.op) for node in topological_order([loss])):
        return "reverse_over_forward"
    return "forward_over_reverse"


def hessian_vector(loss: Node, targets: Sequence[Node], directions: Sequence[Node],
                   how: str | None = None) -> tuple[list[Node], list[Node], dict[Node, tuple]]:
    """The gradient of the loss w.r.t. each target, H times the directions
    (one per target, of its shape) restricted to each target, and the
    origins of the backward nodes (for naming). `how` overrides `route`."""
    one = const(1, loss.shape)
    grads, origins = vjp([(loss, one)], targets)
    if (how or route(loss)) == "forward_over_reverse":
        local = {node: origin[1:] for node, origin in origins.items() if origin[0] == "local"}
        return grads, jvp(grads, dict(zip(targets, directions)), local), origins
    (tangent,) = jvp([loss], dict(zip(targets, directions)))
    products, more = vjp([(tangent, one)], targets)
    return grads, products, {**more, **origins}
