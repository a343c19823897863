"""Declare a model: named inputs and parameters, a scalar loss, named outputs.

A Model holds the user's SymPy expressions as given and checks only what can
be checked without lowering them (names, roles, the loss's shape). The other
checks happen where the expressions are lowered (see ir.py), which names the
offending subexpression.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, TypeAlias

import sympy as sp

from .errors import ModelError

Leaf: TypeAlias = sp.Symbol | sp.MatrixSymbol


def _as_leaves(kind: str, items: Iterable[object]) -> tuple[Leaf, ...]:
    leaves = tuple(items)
    for leaf in leaves:
        if not isinstance(leaf, (sp.Symbol, sp.MatrixSymbol)):
            raise ModelError(
                f"{kind} must be sympy Symbols or MatrixSymbols; got {leaf!r} "
                f"of type {type(leaf).__name__}"
            )
    return leaves


def leaf_name(leaf: Leaf) -> str:
    return str(leaf.name)


def _is_scalar(expr: object) -> bool:
    if isinstance(expr, (sp.MatrixBase, sp.MatrixExpr)):
        return tuple(expr.shape) == (1, 1)
    return isinstance(expr, sp.Expr)


@dataclass(frozen=True)
class Model:
    """A model to compile.

    Args:
        name: the module's name; it prefixes every C symbol (sanitized).
        inputs: data Symbols/MatrixSymbols; not differentiated unless listed
            in ``grad_inputs``.
        params: Symbols/MatrixSymbols the loss is differentiated against.
        loss: a scalar expression, or a 1x1 matrix expression.
        outputs: named expressions that ``forward`` returns besides the loss.
        grad_inputs: inputs to differentiate as well (e.g. for adversarial
            examples); their gradients are returned beside the parameters'.

    Raises:
        ModelError: a leaf is not a Symbol/MatrixSymbol, a name is declared
            twice (as leaves, or as a leaf and an output), a leaf or output
            is named "loss", the loss is not scalar, or a grad input is not
            an input.
    """

    name: str
    inputs: tuple[Leaf, ...] = ()
    params: tuple[Leaf, ...] = ()
    loss: sp.Basic = sp.Integer(0)
    outputs: Mapping[str, sp.Basic] = field(default_factory=dict)
    grad_inputs: tuple[Leaf, ...] = ()

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if not isinstance(self.name, str) or not self.name:
            raise ModelError(f"a model needs a non-empty string name; got {self.name!r}")
        set_(self, "inputs", _as_leaves("inputs", self.inputs))
        set_(self, "params", _as_leaves("params", self.params))
        set_(self, "grad_inputs", _as_leaves("grad_inputs", self.grad_inputs))
        set_(self, "outputs", dict(self.outputs))
        self._check_names()
        if not _is_scalar(self.loss):
            shape = getattr(self.loss, "shape", None)
            raise ModelError(
                f"the loss must be a scalar (or a 1x1 matrix); got shape {shape}: {self.loss}"
            )
        for leaf in self.params:
            if getattr(leaf, "is_index", False):
                raise ModelError(f"the Index {leaf_name(leaf)!r} holds integers: declare it an input, not a param")
        for leaf in self.grad_inputs:
            if getattr(leaf, "is_index", False):
                raise ModelError(f"grad_inputs names the Index {leaf_name(leaf)!r}: row numbers have no gradient")
            if leaf not in self.inputs:
                raise ModelError(f"grad_inputs names {leaf_name(leaf)!r}, which is not an input")

    def _check_names(self) -> None:
        seen: dict[str, str] = {}
        for role, leaves in (("input", self.inputs), ("param", self.params)):
            for leaf in leaves:
                name = leaf_name(leaf)
                if name in seen:
                    raise ModelError(
                        f"{name!r} is declared twice (as {seen[name]} and as {role})"
                    )
                if name == "loss":
                    raise ModelError(f"'loss' is reserved for the loss; rename that {role}")
                seen[name] = role
        for out_name in self.outputs:
            if not isinstance(out_name, str) or not out_name:
                raise ModelError(f"output names must be non-empty strings; got {out_name!r}")
            if out_name == "loss":
                raise ModelError("'loss' is reserved for the loss; rename that output")
            if out_name in seen:
                # the C functions take the leaves and return the outputs by name
                raise ModelError(f"the output {out_name!r} clashes with the {seen[out_name]} of that name; rename one")

    @property
    def differentiated(self) -> tuple[Leaf, ...]:
        """The leaves gradients are taken against: params, then grad inputs."""
        return self.params + self.grad_inputs
