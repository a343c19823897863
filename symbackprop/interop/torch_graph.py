"""What from_torch must know about a network that torch.fx's graph does not
show, read before the graph is translated (symbackprop.interop.from_torch).

* Hooks: a traced forward runs no module hook (forward, pre-forward, full
  backward) and the compiled gradient no tensor hook, so a network with one
  is refused, as is a parametrized layer (its weight is computed).
* Grad mode: each node records whether autograd was on when it was traced
  (off in a ``torch.no_grad()`` block or a forward decorated with it), so
  that what torch does not differentiate is not differentiated through.
* In-place writes: ``y += b``, ``y.mul_(2)``, ``torch.relu_(y)``,
  ``F.relu(y, inplace=True)`` and ``ReLU(inplace=True)`` overwrite y, and
  every name for the same tensor sees the new value. `Writes` lists them
  (so dead-code elimination keeps them even where their result is unused)
  and the tensors that share their memory: a write to a tensor that is the
  same as another (a layer's inplace result, Identity, Flatten, Dropout
  and Dropout2d in eval) renames all of them (the flattening of images is
  a view of the same memory in the same order, their NCHW matrix); one to a
  view (``h.t()``, ``h[:, :2]``) or to a tensor with a view, or to a
  parameter, is refused: the translation computes values, not memory.
"""

from __future__ import annotations

import functools
import inspect
import operator
import traceback
from typing import Any

from symbackprop.errors import ModelError
from symbackprop.interop.torch_ops import functions, layers, op_name


def _torch() -> Any:
    import torch

    return torch


# --- hooks ---------------------------------------------------------------------------

_MODULE_HOOKS = (
    ("_forward_pre_hooks", "forward pre-hook"),
    ("_forward_hooks", "forward hook"),
    ("_backward_pre_hooks", "backward pre-hook"),
    ("_backward_hooks", "backward hook"),
)


def refuse_hooks(module: Any) -> None:
    """Raise ModelError naming the module path (and the kind) of the first
    hook on the network, global hooks of every module included, or of a
    parametrized layer; nothing a traced forward would skip."""
    torch = _torch()
    everywhere = torch.nn.modules.module
    for attr, kind in _MODULE_HOOKS:
        if getattr(everywhere, f"_global{attr}", None):
            raise ModelError(f"a global module {kind} is registered (torch.nn.modules.module.register_module_"
                             f"{kind.replace(' ', '_').replace('-', '_')}): from_torch's translation would not run "
                             "it; remove it first")
    named = module.named_modules() if hasattr(module, "named_modules") else ()
    for path, sub in named:
        where = path or f"the module ({type(sub).__name__})"
        for attr, kind in _MODULE_HOOKS:
            if getattr(sub, attr, None):
                raise ModelError(f"{where}: a {kind} is registered on {type(sub).__name__}; from_torch translates "
                                 "the forward alone and would not run it (remove the hook, or write what it does "
                                 "into the forward)")
        if torch.nn.utils.parametrize.is_parametrized(sub):
            raise ModelError(f"{where}: a parametrization ({', '.join(sub.parametrizations)}); from_torch translates "
                             "a layer's own parameters, not ones computed from others")
        for key, tensor in sub.named_parameters(recurse=False):
            if getattr(tensor, "_backward_hooks", None) or getattr(tensor, "_post_accumulate_grad_hooks", None):
                name = f"{path}.{key}" if path else key
                raise ModelError(f"{name}: a gradient hook (Tensor.register_hook) is registered on the parameter; "
                                 "the compiled gradient would not run it")


# --- tracing ------------------------------------------------------------------------

# y op= b on a tensor writes into y (the Proxy has no __iadd__: Python would trace y = y + b)
IN_PLACE_OPERATORS = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ipow: operator.pow, operator.imatmul: operator.matmul,
    operator.ifloordiv: operator.floordiv, operator.imod: operator.mod, operator.iand: operator.and_,
    operator.ior: operator.or_, operator.ixor: operator.xor, operator.ilshift: operator.lshift,
    operator.irshift: operator.rshift,
}


@functools.cache
def tracer_class() -> type:
    """A torch.fx Tracer that records `y op= b` as the in-place operator
    (operator.iadd, ...) and, on each node, meta["grad_enabled"]."""
    torch = _torch()
    proxy_base: Any = torch.fx.Proxy
    tracer_base: Any = torch.fx.Tracer

    class InPlaceProxy(proxy_base):
        pass

    def in_place(op: Any) -> Any:
        def method(self: Any, other: Any) -> Any:
            return self.tracer.create_proxy("call_function", op, (self, other), {})

        return method

    for op in IN_PLACE_OPERATORS:
        setattr(InPlaceProxy, f"__{op.__name__}__", in_place(op))

    class Tracer(tracer_base):
        def proxy(self, node: Any) -> Any:
            return InPlaceProxy(node, self)

        def create_node(self, *args: Any, **kwargs: Any) -> Any:
            node = super().create_node(*args, **kwargs)
            node.meta["grad_enabled"] = torch.is_grad_enabled()
            return node

    return Tracer


PACKING_REFUSED = ("packed sequences (torch.nn.utils.rnn.pack_padded_sequence, pack_sequence, "
                   "pad_packed_sequence) are not translated: from_torch runs an LSTM or GRU over every step of "
                   "sequences of one length; pass it the padded (batch, L, features) tensor itself")


def _in_packing(error: BaseException) -> bool:
    """Whether tracing failed inside torch.nn.utils.rnn (its packing branches on the lengths)."""
    rnn_utils = _torch().nn.utils.rnn.__file__
    return any(frame.filename == rnn_utils for frame in traceback.extract_tb(error.__traceback__))


def trace(module: Any) -> Any:
    """The module's forward as a torch.fx Graph (torch.nn layers left as
    calls), with grad mode on around it (as training runs it), its dead code
    removed but for what writes in place."""
    torch = _torch()
    tracer = tracer_class()()
    try:
        with torch.enable_grad():
            graph = tracer.trace(module)
    except Exception as error:  # TraceError, or whatever the forward raised given a Proxy
        stack = list(getattr(tracer, "module_stack", {}))  # the modules whose forward was being traced
        path = stack[-1] if stack else ""
        where = path or type(module).__name__
        if _in_packing(error):
            raise ModelError(f"{where}: {PACKING_REFUSED}") from error
        kind = type(module.get_submodule(path)).__name__
        raise ModelError(f"{where}: torch.fx cannot trace {kind}.forward ({type(error).__name__}: {error}); "
                         "from_torch reads a forward torch.fx can trace (no control flow on the data)") from error
    graph = torch.fx.GraphModule(module, graph).graph  # owned by a module: dead code elimination asks it
    # what the output does not use is not translated, except a write in place: its result may be unused and
    # what it overwrote used (y.mul_(2); return y)
    graph.eliminate_dead_code(is_impure_node=lambda node: node.is_impure() or writes_in_place(node, module))
    return graph


# --- in-place writes ----------------------------------------------------------------


def _name(target: Any) -> str:
    return getattr(target, "__name__", "") if not isinstance(target, str) else target


def _binds_inplace(target: Any, args: tuple, kwargs: dict) -> bool:
    if kwargs.get("inplace") is True:
        return True
    try:
        bound = inspect.signature(target).bind(*args, **kwargs)
    except (TypeError, ValueError):  # a builtin without a signature, or arguments it does not take
        return False
    return bound.arguments.get("inplace") is True


def writes_in_place(node: Any, root: Any) -> bool:
    """Whether the node overwrites a tensor (its first argument, or an out= one)."""
    if node.op == "call_module":
        return getattr(root.get_submodule(node.target), "inplace", False) is True
    if node.op not in ("call_function", "call_method"):
        return False
    if "out" in node.kwargs:
        return True
    name = _name(node.target)
    if node.op == "call_method":
        return name.endswith("_") and not name.startswith("_")
    if node.target in IN_PLACE_OPERATORS or node.target is operator.setitem:
        return True
    if getattr(node.target, "__module__", None) == "_operator" or node.target in (getattr, operator.getitem):
        return False  # operator.and_ is &, not a write
    if name.endswith("_") and not name.startswith("_"):  # torch.relu_, F.relu_, torch.nn.init.normal_
        return True
    return _binds_inplace(node.target, node.args, node.kwargs)


def written(node: Any) -> Any:
    """The node whose tensor an in-place call writes into (its first
    argument, or torch.nn.init's tensor=), None if not a node."""
    Node = _torch().fx.Node
    if node.args:
        return node.args[0] if isinstance(node.args[0], Node) else None
    found = [node.kwargs.get(key) for key in ("input", "tensor", "self")]
    return next((value for value in found if isinstance(value, Node)), None)


def out_of_place(node: Any) -> tuple[Any, str]:
    """(the converter of what an in-place call computes, its name as written):
    y.mul_(2) is y * 2 written into y, torch.relu_(y) torch.relu(y)."""
    torch = _torch()
    if node.op == "call_method":
        fn = getattr(torch, node.target[:-1], None) if node.target.endswith("_") else getattr(torch, node.target, None)
        return functions().get(fn) if fn is not None else None, f"Tensor.{node.target}()"
    name = op_name(node.target)
    if node.target in IN_PLACE_OPERATORS:
        return functions().get(IN_PLACE_OPERATORS[node.target]), name
    if node.target is operator.setitem:
        return None, "an assignment into a tensor (h[...] = v)"
    if _name(node.target).endswith("_"):
        owner = {"F": torch.nn.functional, "torch": torch}.get(name.split(".")[0])
        fn = getattr(owner, _name(node.target)[:-1], None) if owner is not None else None
        return functions().get(fn) if fn is not None else None, name
    return functions().get(node.target), name  # F.relu(y, inplace=True): its converter ignores inplace


def written_as(node: Any, root: Any) -> str:
    """An in-place call as a user writes it: Tensor.mul_(), ReLU(inplace=True)."""
    if node.op == "call_module":
        return f"{type(root.get_submodule(node.target)).__name__}(inplace=True)"
    name = out_of_place(node)[1]
    return f"{name}(inplace=True)" if _binds_inplace(node.target, node.args, node.kwargs) else name


# what returns its input itself (the same tensor: torch's `y is x`), not a new one
def _same_functions() -> set:
    torch = _torch()
    return {torch.flatten, torch.nn.functional.dropout, torch.nn.functional.dropout2d}


def _same_layers() -> tuple:
    tnn = _torch().nn
    return (tnn.Identity, tnn.Flatten, tnn.Dropout, tnn.Dropout2d)


def _kind(node: Any, root: Any) -> str:
    """"same" (the output is the input tensor), "view" (it shares the
    input's memory, or may), "new" (a fresh tensor), or "leaf"."""
    if node.op in ("placeholder", "get_attr", "output"):
        return "leaf"
    if writes_in_place(node, root):
        return "same"
    if node.op == "call_module":
        kind = type(root.get_submodule(node.target))
        if kind in _same_layers():
            return "same"
        return "new" if kind in layers() else "view"
    torch = _torch()
    if (node.op == "call_method" and node.target == "size") or (node.target is getattr and node.args[1:] == ("shape",)):
        return "leaf"  # a shape, not a tensor
    fn = getattr(torch, node.target, None) if node.op == "call_method" else node.target
    if fn in _same_functions():
        return "same"
    if fn in (torch.t, getattr, torch.reshape, operator.getitem) or fn not in functions():
        return "view"  # t, .T, and what from_torch does not translate: it may be a view
    return "new"


class Writes:
    """The in-place writes of a graph and the tensors they overwrite.

    Attributes:
        storage: {node: the node whose tensor it is or views} ("same" and
            "view" nodes chained back to a fresh tensor, an input or a parameter).
    """

    def __init__(self, graph: Any, root: Any, where: Any) -> None:
        """Read the graph in order; raise ModelError (named by
        where(node)) at a write that is not translated as torch runs it."""
        self.storage: dict[Any, Any] = {}
        self._order: dict[Any, int] = {}
        views: dict[Any, list] = {}  # storage -> its view nodes so far
        for index, node in enumerate(graph.nodes):
            self._order[node] = index
            kind = _kind(node, root)
            first = written(node)
            if kind in ("same", "view") and first is not None:
                self.storage[node] = self.storage[first]
                if kind == "view":
                    views.setdefault(self.storage[node], []).append(node)
            else:
                self.storage[node] = node
            if writes_in_place(node, root):
                self._check(node, root, views, where)

    def _check(self, node: Any, root: Any, views: dict, where: Any) -> None:
        name = written_as(node, root)
        if "out" in node.kwargs:
            raise ModelError(f"{where(node)}: {name} with out=: a write into another tensor is not translated")
        if written(node) is None:
            raise ModelError(f"{where(node)}: {name} writes into {node.args[0] if node.args else 'nothing'!r}, "
                             "not a tensor of the forward")
        base = self.storage[node]
        if base.op == "get_attr":
            raise ModelError(f"{where(node)}: {name} writes into the parameter or buffer {base.target!r}: "
                             "a write into the network's state is not translated")
        if not node.meta.get("grad_enabled", True):
            raise ModelError(f"{where(node)}: {name} inside torch.no_grad(): a write autograd does not record "
                             "is not translated")
        seen = views.get(base, [])
        if seen:
            target = written(node)
            view = next((v for v in seen if self.storage[v] is base and _is_chain(target, v)), None)
            what = (f"on a view ({_node_name(view)})" if view is not None
                    else f"of a tensor with a view ({_node_name(seen[0])}) in use")
            raise ModelError(f"{where(node)}: {name} {what}: a write through shared memory is not translated; "
                             "write it out of place (y = y * 2)")

    def aliases(self, node: Any, values: dict) -> list:
        """The translated nodes that are the same tensor as `node` (it included)."""
        base = self.storage[node]
        return [other for other in values if self.storage.get(other) is base]


def _is_chain(node: Any, view: Any) -> bool:
    """Whether `view` is node or one of the nodes node is derived from by "same"/"view" steps."""
    while node is not None:
        if node is view:
            return True
        node = node.args[0] if node.args and isinstance(node.args[0], type(node)) else None
    return False


def _node_name(node: Any) -> str:
    if node.op == "call_method":
        return f"Tensor.{node.target}()"
    if node.op == "call_function":
        if node.target is getattr:
            return f"Tensor.{node.args[1]}"
        return op_name(node.target)
    return str(node.target)


__all__ = ["IN_PLACE_OPERATORS", "PACKING_REFUSED", "Writes", "out_of_place", "refuse_hooks", "trace", "tracer_class",
           "writes_in_place", "written", "written_as"]
