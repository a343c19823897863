"""Declare a model: named inputs and parameters, a scalar loss, named outputs.

A Model holds the user's SymPy expressions as given and checks only what can
be checked without lowering them (names, roles, the loss's shape). The other
checks happen where the expressions are lowered (see ir.py), which names the
offending subexpression.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

import sympy as sp
from sympy.matrices.expressions.matexpr import MatrixElement

from symbackprop.declare.conv import Images
from symbackprop.errors import ModelError
from symbackprop.messages import described, short

Leaf: TypeAlias = sp.Symbol | sp.MatrixSymbol


def _as_leaves(kind: str, items: Iterable[object]) -> tuple[Leaf, ...]:
    leaves = tuple(item.matrix if isinstance(item, Images) else item for item in items)  # sbp.images: its matrix
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


class Entry(MatrixElement):
    """The entry of a 1x1 matrix expression that as_scalar gives: it stays
    an entry through doit, which SymPy calls on every scalar * matrix
    (MatrixElement's doit writes the entry of a product out, a term per
    entry: an LSTM's log-sum-exp times a row of ones became its whole step
    written out per bit, its derivative hundreds of scalar values)."""

    def doit(self, **hints: object) -> sp.Expr:
        parent = self.parent.doit(**hints) if hints.get("deep", True) else self.parent
        if isinstance(parent, sp.MatrixExpr):
            return Entry(parent, self.i, self.j)
        return parent[self.i, self.j]


def as_scalar(m: object) -> sp.Expr:
    """The entry of a 1x1 matrix expression as a scalar, which mixes with
    scalars: ``as_scalar(nn.mse(Y, T)) + lam * w**2``.

    SymPy refuses ``m + s`` for a matrix m and a scalar s, and ``m[0, 0]``
    of a product over a symbolic dimension is expanded into a ``Sum`` that
    cannot be compiled; this entry stays ``m``'s and lowers as ``m``.

    Args:
        m: a 1x1 matrix expression (nn's losses, sum_all, mean_all), an
            explicit 1x1 sympy Matrix, or already a scalar (returned as is).

    Returns:
        A scalar SymPy expression.

    Raises:
        ModelError: m is a matrix of another shape, or not an expression.
    """
    if isinstance(m, sp.MatrixBase) and m.shape == (1, 1):
        return m[0, 0]
    if isinstance(m, sp.MatrixExpr) and tuple(m.shape) == (1, 1):
        return Entry(m, 0, 0)  # not m[0, 0], which SymPy expands
    if isinstance(m, (sp.MatrixBase, sp.MatrixExpr)):
        raise ModelError(f"as_scalar needs a 1x1 matrix; got {described(m)}: reduce it first "
                         "(nn.sum_all, nn.mean_all or reduce(op, m))")
    if isinstance(m, numbers.Real) and not isinstance(m, bool):
        return sp.sympify(m)
    if isinstance(m, sp.Expr):
        return m
    raise ModelError(f"as_scalar takes a 1x1 matrix expression or a scalar; got {short(repr(m))} "
                     f"of type {type(m).__name__}")


def _find_sum(expr: sp.Basic) -> sp.Basic | None:
    """A Sum in expr (walked without recursion, each shared subtree once)."""
    seen: set[int] = set()
    stack = [expr]
    while stack:
        sub = stack.pop()
        if id(sub) in seen or not isinstance(sub, sp.Basic):
            continue
        seen.add(id(sub))
        if isinstance(sub, sp.Sum):
            return sub
        stack.extend(sub.args)
    return None


def _check_no_sum(expr: sp.Basic, what: str) -> None:
    found = _find_sum(expr)
    if found is not None:
        raise ModelError(
            f"{what} holds {short(found, 150)}: SymPy's expansion of m[0, 0] for a product m over a symbolic "
            "dimension (as nn's losses), which cannot be compiled. For the entry of a 1x1 matrix m write "
            "sbp.as_scalar(m) (as_scalar(m) + s mixes with a scalar s), or keep a matrix: m + s * OneMatrix(1, 1)"
        )


def _immutable(expr: object) -> object:
    """A sympy.Matrix (mutable: not a SymPy expression, not hashable) as the
    ImmutableMatrix of its entries, as sbp.grad takes it; the rest as given."""
    return sp.ImmutableMatrix(expr) if isinstance(expr, sp.MatrixBase) else expr


def _normalised_loss(loss: object) -> sp.Basic:
    """The loss as a SymPy scalar or 1x1 matrix expression."""
    if isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        loss = sp.sympify(loss)
    loss = _immutable(loss)
    if not isinstance(loss, sp.Basic):
        raise ModelError(f"the loss must be a SymPy expression; got {short(repr(loss))} of type {type(loss).__name__}")
    if not isinstance(loss, (sp.Expr, sp.MatrixBase, sp.MatrixExpr)):  # e.g. a relation a > x
        raise ModelError(f"the loss must be a scalar or a 1x1 matrix; got {short(loss)}, a {type(loss).__name__}")
    if not _is_scalar(loss):
        raise ModelError(
            f"the loss must be a scalar or a 1x1 matrix; got {described(loss)}: reduce it "
            "(nn.sum_all, nn.mean_all, or a loss of nn)"
        )
    _check_no_sum(loss, "the loss")
    return loss


@dataclass(frozen=True)
class Model:
    """A model to compile.

    Args:
        name: the module's name; it prefixes every C symbol (sanitized).
        inputs: data Symbols/MatrixSymbols; not differentiated unless listed
            in ``grad_inputs``.
        params: Symbols/MatrixSymbols the loss is differentiated against.
        loss: a scalar expression (numbers too), or a 1x1 matrix expression;
            ``as_scalar(m)`` turns a 1x1 matrix into a scalar that mixes
            with other scalars. None (the default): the model has no loss,
            only named outputs (``has_loss`` is False; ``vjp`` with a seed
            differentiates them).
        outputs: named expressions that ``forward`` returns besides the loss.
        grad_inputs: inputs to differentiate as well (e.g. for adversarial
            examples); their gradients are returned beside the parameters'.
        names: names of intermediates, ``{"hidden": H}``: where the
            generated C stores H it is called ``hidden`` (sanitized into a C
            identifier, made unique) and its adjoint ``grad_hidden``, in the
            C, its comments and derivation.md. Naming changes no result and
            no schedule: a value computed inside a loop stays unstored.

    Raises:
        ModelError: a leaf is not a Symbol/MatrixSymbol, a name is declared
            twice (as leaves, or as a leaf and an output), a leaf or output
            is named "loss", an intermediate's name is one of those, the
            loss is not scalar, the loss or an output holds a SymPy Sum (what ``m[0, 0]`` of a product over a symbolic
            dimension becomes: write ``as_scalar(m)``), or a grad input is
            not an input.
    """

    name: str
    inputs: tuple[Leaf, ...] = ()
    params: tuple[Leaf, ...] = ()
    loss: sp.Basic = None  # None: no loss; a SymPy expression after __post_init__
    outputs: Mapping[str, sp.Basic] = field(default_factory=dict)
    grad_inputs: tuple[Leaf, ...] = ()
    names: Mapping[str, sp.Basic] = field(default_factory=dict)
    has_loss: bool = field(init=False, default=True)  # whether a loss was declared (a loss of 0 is one)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if not isinstance(self.name, str) or not self.name:
            raise ModelError(f"a model needs a non-empty string name; got {self.name!r}")
        set_(self, "inputs", _as_leaves("inputs", self.inputs))
        set_(self, "params", _as_leaves("params", self.params))
        set_(self, "grad_inputs", _as_leaves("grad_inputs", self.grad_inputs))
        if self.outputs is not None and not isinstance(self.outputs, Mapping):
            raise ModelError("outputs must map names to expressions (a dict); "
                             f"got a {type(self.outputs).__name__}: {short(self.outputs)}")
        set_(self, "outputs", {k: _immutable(v) for k, v in (self.outputs or {}).items()})  # None: no outputs
        set_(self, "names", {k: _immutable(v) for k, v in self.names.items()})
        self._check_names()
        set_(self, "has_loss", self.loss is not None)
        set_(self, "loss", _normalised_loss(0 if self.loss is None else self.loss))
        for out_name, expr in self.outputs.items():
            if isinstance(expr, sp.Basic):
                _check_no_sum(expr, f"the output {out_name!r}")
        for value_name, expr in self.names.items():
            if not isinstance(expr, sp.Basic):
                raise ModelError(f"names maps {value_name!r} to {short(repr(expr))}, not a SymPy expression")
            _check_no_sum(expr, f"the value named {value_name!r}")
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
            seen[out_name] = "output"
        for value_name in self.names:
            if not isinstance(value_name, str) or not value_name:
                raise ModelError(f"names of intermediates must be non-empty strings; got {value_name!r}")
            if value_name == "loss" or value_name in seen:
                what = "the loss" if value_name == "loss" else f"the {seen[value_name]} of that name"
                raise ModelError(f"the intermediate named {value_name!r} clashes with {what}; rename one")

    @property
    def differentiated(self) -> tuple[Leaf, ...]:
        """The leaves gradients are taken against: params, then grad inputs."""
        return self.params + self.grad_inputs
