"""Every public callable has a docstring (with an "Args:" section when it
takes arguments) and type hints.

The public API walked here: everything in symbackprop.__all__; the public
classes (their docstrings, and the public methods, properties and __call__
they define); and the public functions and classes defined in the modules
users call directly (nn, optim, graph, derivation, the interop modules) and
cli.main. Private helpers (a leading underscore) are not walked.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import symbackprop

# modules whose every public function and class is part of the API
MODULES = ["declare.nn", "declare.activations", "declare.losses", "declare.reductions", "run.optim", "emit.graph",
           "emit.derivation", "declare.tensor", "interop.torch", "interop.jax", "interop.dask"]
# modules that need an optional dependency to import
OPTIONAL = {"interop.torch": "torch", "interop.jax": "jax", "interop.dask": "distributed"}
# public classes besides those in __all__ and the modules above
CLASSES = [
    ("run.module", "CompiledModule"),
    ("run.function", "Function"),
    ("run.function", "PreparedCall"),
    ("run.derivatives", "Derivatives"),  # CompiledModule's vjp, jvp, hvp, hessian, jacobian
    ("run.train", "Training"),  # CompiledModule's train_step, train_epoch, optimizer_state
    ("declare.model", "Model"),
    ("run.train", "Trainer"),
    ("toolchain.builder", "BuildOptions"),
]
FUNCTIONS = [("cli", "main")]


def _module(name: str) -> Any:
    if name in OPTIONAL:
        pytest.importorskip(OPTIONAL[name])
    return importlib.import_module(f"symbackprop.{name}")


def _defined_in(module: Any) -> Iterator[tuple[str, Any]]:
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj) or inspect.isclass(obj):
            yield f"{module.__name__}.{name}", obj


def _members(cls: type) -> Iterator[tuple[str, Any]]:
    """The public methods and properties a class itself defines, and __call__."""
    for name, attr in vars(cls).items():
        if name.startswith("_") and name != "__call__":
            continue
        if isinstance(attr, (staticmethod, classmethod)):
            attr = attr.__func__
        if inspect.isfunction(attr) or isinstance(attr, property):
            yield f"{cls.__module__}.{cls.__qualname__}.{name}", attr


def _api(module_names: list[str], core: bool = True) -> Iterator[tuple[str, Any]]:
    """(qualified name, object) for each class, function, method, property
    of the modules named, and with `core` of __all__, CLASSES and FUNCTIONS."""
    seen: set[int] = set()
    roots: list[tuple[str, Any]] = []
    for name in symbackprop.__all__ if core else ():
        obj = getattr(symbackprop, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            roots.append((f"symbackprop.{name}", obj))
    for module, name in CLASSES + FUNCTIONS if core else ():
        roots.append((f"symbackprop.{module}.{name}", getattr(_module(module), name)))
    for module in module_names:
        roots.extend(_defined_in(_module(module)))
    for qualname, obj in roots:
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        yield qualname, obj
        if inspect.isclass(obj):
            yield from _members(obj)


def _constructor(cls: type) -> Any:
    """The __init__ (or else __new__) the class itself defines, or None."""
    for name in ("__init__", "__new__"):
        if name in vars(cls):
            method = vars(cls)[name]
            return method.__func__ if isinstance(method, staticmethod) else method
    return None


def _arguments(obj: Any) -> list[inspect.Parameter]:
    """The parameters a caller passes (self and cls left out); for a class,
    those of the constructor it defines (its dataclass fields, say)."""
    if isinstance(obj, property):
        return []
    if inspect.isclass(obj):
        obj = _constructor(obj)
        if obj is None:
            return []
    params = list(inspect.signature(obj).parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    return params


def _problems(qualname: str, obj: Any) -> list[str]:
    doc = inspect.getdoc(obj.fget if isinstance(obj, property) else obj) if not inspect.isclass(obj) else obj.__doc__
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and doc and doc.startswith(obj.__name__ + "("):
        doc = None  # the signature dataclasses writes when there is no docstring
    if not doc or not doc.strip():
        return [f"{qualname}: no docstring"]
    where = _documents_arguments(obj)
    if _arguments(obj) and "Args:" not in (doc if where is obj else inspect.getdoc(where) or ""):
        return [f"{qualname}: takes arguments but its {'' if where is obj else '__new__ '}docstring has no 'Args:' section"]
    return []


def _documents_arguments(obj: Any) -> Any:
    """Whose docstring has obj's "Args:": a class that defines __new__ and
    no __init__ (a SymPy class) documents them on __new__, since the API
    reference (griffe, in mkdocs.yml) matches a class's to __init__ only."""
    if inspect.isclass(obj) and "__init__" not in vars(obj) and "__new__" in vars(obj):
        return _constructor(obj)
    return obj


def _unannotated(qualname: str, obj: Any) -> list[str]:
    if isinstance(obj, property):
        obj = obj.fget
        if "return" not in obj.__annotations__:
            return [f"{qualname}: no return annotation"]
        return []
    if inspect.isclass(obj):
        constructor = _constructor(obj)
        if constructor is None or dataclasses.is_dataclass(obj):
            return []
        obj, qualname = constructor, f"{qualname}.{constructor.__name__}"
    missing = [p.name for p in _arguments(obj) if p.annotation is inspect.Parameter.empty]
    problems = [f"{qualname}: no annotation for {', '.join(missing)}"] if missing else []
    if "return" not in obj.__annotations__:
        problems.append(f"{qualname}: no return annotation")
    return problems


def _check(part: str, rule: Callable[[str, Any], list[str]]) -> None:
    walk = _api(CORE) if part == "core" else _api([part], core=False)
    problems = [p for qualname, obj in walk for p in rule(qualname, obj)]
    assert not problems, "\n".join(problems)


CORE = [m for m in MODULES if m not in OPTIONAL]
PARTS = ["core", *OPTIONAL]  # the interop modules are skipped where torch or jax is missing


@pytest.mark.parametrize("part", PARTS)
def test_public_api_has_docstrings(part: str) -> None:
    _check(part, _problems)


@pytest.mark.parametrize("part", PARTS)
def test_public_api_has_type_hints(part: str) -> None:
    _check(part, _unannotated)


def test_the_walk_finds_the_api() -> None:
    names = {qualname for qualname, _ in _api(CORE)}
    for expected in [
        "symbackprop.compile",
        "symbackprop.run.module.CompiledModule.value_and_grad",
        "symbackprop.run.function.PreparedCall.__call__",
        "symbackprop.run.derivatives.Derivatives.hessian",
        "symbackprop.run.train.Training.train_epoch",
        "symbackprop.declare.nn.linear",
        "symbackprop.Adam",
        "symbackprop.run.train.Trainer.epoch",
        "symbackprop.cli.main",
    ]:
        assert expected in names
