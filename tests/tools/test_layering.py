"""The package's layering: its stages in one order, bottom first (STAGES,
listed again in docs/architecture.md), each importing only the stages before
it; no import cycle among its modules; no private name imported across
modules. An import inside a function counts (it is still an arrow between
the modules); one under `if TYPE_CHECKING:` does not (it never runs). The
op families register their records with base/registry.py, which imports
them by name on the first look-up: a registration, not an import arrow."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())  # wherever tests/ nests it
PACKAGE = ROOT / "symbackprop"

# The stages, bottom first. A unit is a top-level module of the package or
# one of its subpackages ("__init__": the package's own __init__.py); a unit
# imports only itself and the units before it.
STAGES = (
    "_version", "messages", "errors", "progress", "log", "deep", "gcpause",  # top-level leaves
    "base",  # shared leaves: op registry, scalar functions, C printer and names, ABI, cache trust
    "declare", "ir", "diff", "schedule",
    "plan",  # what a module computes: the lowered IR and its schedules, data for emit
    "emit",
    "ops",  # the op families: they register the rules the stages above look up by tag
    "loops", "pipeline", "toolchain", "run",
    "review", "interop", "dask", "nn", "optim", "cli", "__main__", "__init__",
)


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, here: str, is_package: bool, annotations: bool) -> set[str]:
    """The modules that `tree` imports, anywhere but under `if
    TYPE_CHECKING:` (there too with `annotations`)."""
    found: set[str] = set()
    base = here.split(".") if is_package else here.split(".")[:-1]
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not annotations:
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            origin = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            found.add(origin)
            found.update(f"{origin}.{alias.name}" for alias in node.names)  # `from . import x` names a module
        stack.extend(ast.iter_child_nodes(node))
    return found


@functools.cache  # read by several tests; none changes it
def import_graph(package: Path = PACKAGE, annotations: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a submodule's import
    also imports its packages' __init__); with `annotations`, the imports
    under `if TYPE_CHECKING:` too."""
    paths = {module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        targets = set()
        for imported in _imports(tree, name, path.name == "__init__.py", annotations):
            parts = imported.split(".")
            for k in range(1, len(parts) + 1):  # importing a.b.c runs a, a.b and a.b.c
                prefix = ".".join(parts[:k])
                if prefix in paths and prefix != name and prefix != package.name:
                    targets.add(prefix)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _edges_within(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    members = set(component)
    return [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]


def _report(graph: dict[str, set[str]], found: list[list[str]]) -> str:
    return "\n".join(f"  {', '.join(c)}: {'; '.join(_edges_within(graph, c))}" for c in found)


def unit(module: str) -> str:
    """The stage unit of a module: "symbackprop.emit.codegen" -> "emit"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def stage_violations(graph: dict[str, set[str]], stages: tuple[str, ...] = STAGES) -> list[str]:
    """The arrows from a unit to a later unit (or to a unit not in `stages`)."""
    rank = {name: k for k, name in enumerate(stages)}
    found = []
    for module in sorted(graph):
        here = unit(module)
        for target in sorted(graph[module]):
            there = unit(target)
            if here == there:
                continue
            if here not in rank or there not in rank:
                found.append(f"{module} -> {target}: {(here if here not in rank else there)!r} is not in STAGES")
            elif rank[there] > rank[here]:
                found.append(f"{module} -> {target}: {here} imports {there}, a later stage")
    return found


def _module_of(node: ast.ImportFrom, here: str, is_package: bool) -> str:
    base = here.split(".") if is_package else here.split(".")[:-1]
    if not node.level:
        return node.module or ""
    return ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))


def private_reaches(package: Path = PACKAGE) -> list[str]:
    """The private names (`_x`, not dunders) one module of `package` takes
    from another: `from m import _x`, or `m._x` where m is a module of the
    package bound by an import."""
    paths = {module_name(p, package): p for p in package.rglob("*.py")}
    found = []
    for name, path in sorted(paths.items()):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules: set[str] = set()  # local names bound to the package's modules
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                origin = _module_of(node, name, path.name == "__init__.py")
                if origin not in paths:
                    continue
                for alias in node.names:
                    if f"{origin}.{alias.name}" in paths:
                        modules.add(alias.asname or alias.name)
                    elif alias.name.startswith("_") and not alias.name.startswith("__") and origin != name:
                        found.append(f"{name}:{node.lineno} imports {alias.name} from {origin}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in paths and alias.asname:
                        modules.add(alias.asname)
        found.extend(f"{name}:{node.lineno} reads {node.value.id}.{node.attr}" for node in ast.walk(tree)
                     if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                     and node.value.id in modules and node.attr.startswith("_") and not node.attr.startswith("__"))
    return found


def documented_stages(text: str) -> tuple[str, ...]:
    """The units of the first fenced block under "## Stages" of
    docs/architecture.md, one a line ("emit/", "errors.py", "__init__.py")."""
    section = text.split("\n## Stages\n", 1)[1]
    block = section.split("```", 2)[1].split("\n", 1)[1]
    return tuple(line.split()[0].removesuffix("/").removesuffix(".py") for line in block.splitlines() if line.strip())


def test_each_stage_imports_only_the_stages_before_it():
    found = stage_violations(import_graph())
    assert not found, "imports against the stage order (tests/test_layering.py STAGES):\n  " + "\n  ".join(found)


def test_every_unit_is_in_the_stage_order():
    units = {unit(module) for module in import_graph()}
    assert units == set(STAGES), f"missing from STAGES: {sorted(units - set(STAGES))}; " \
        f"in STAGES, not in the package: {sorted(set(STAGES) - units)}"


def test_no_private_name_is_imported_across_modules():
    found = private_reaches()
    assert not found, "private names used outside their module (make them public, or move them):\n  " + \
        "\n  ".join(found)


def test_the_architecture_document_lists_the_stages():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert documented_stages(text) == STAGES


def test_the_checkers_find_a_later_stage_and_a_private_reach(tmp_path):
    """On a tiny package: an arrow to a later stage, one inside a function
    included, is reported, one under TYPE_CHECKING is not; a private name is
    reported imported or read through a module, a dunder or a name of the
    module itself is not."""
    package = tmp_path / "pkg"
    (package / "low").mkdir(parents=True)
    (package / "high").mkdir()
    for folder in (package, package / "low", package / "high"):
        (folder / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text("_hidden = 1\n__all__ = []\ndef f():\n    from pkg.high.b import g\n")
    (package / "low" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import b\n")
    (package / "high" / "b.py").write_text(
        "from pkg.low import a\nfrom pkg.low.a import _hidden, __all__\ng = a._hidden\n")
    graph = import_graph(package)
    assert stage_violations(graph, ("low", "high", "__init__")) == [
        "pkg.low.a -> pkg.high: low imports high, a later stage",
        "pkg.low.a -> pkg.high.b: low imports high, a later stage"]
    assert stage_violations(graph, ("high", "low", "__init__")) == [
        "pkg.high.b -> pkg.low: high imports low, a later stage",
        "pkg.high.b -> pkg.low.a: high imports low, a later stage"]
    assert stage_violations(graph, ("low", "__init__"))[0].endswith("'high' is not in STAGES")
    assert private_reaches(package) == ["pkg.high.b:2 imports _hidden from pkg.low.a", "pkg.high.b:3 reads a._hidden"]
    assert documented_stages("# A\n\n## Stages\n\nText.\n\n```text\nerrors.py  x\nbase/  y\n\n__init__.py\n```\n") \
        == ("errors", "base", "__init__")


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles among symbackprop's modules:\n" + _report(graph, found)


def test_annotations_make_no_cycle_either():
    """A TYPE_CHECKING import is an arrow in the design even where it never
    runs: runtime <-> interop/train and compiler <-> epoch were cycles of
    that kind (issue 14), broken by moving the shared types down (plan.py)
    and by letting the upper module register with the lower one."""
    graph = import_graph(annotations=True)
    found = cycles(graph)
    assert not found, "cycles through TYPE_CHECKING imports:\n" + _report(graph, found)


def test_the_checker_finds_a_cycle(tmp_path):
    """The walk sees top-level and function-level imports, and skips
    TYPE_CHECKING ones: a checker that cannot fail checks nothing."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from .b import g\n")
    (package / "b.py").write_text("from . import a\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import x\n")
    (package / "d.py").write_text("import pkg.c\n")
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.c"] == set() and graph["pkg.d"] == {"pkg.c"}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    assert cycles(import_graph(package, annotations=True)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


# --- sizes: no module over 600 lines, no function over 80 (issue 43) --------

MODULE_LINES_MAX = 600
FUNCTION_LINES_MAX = 80  # a def's first line to its last, methods and nested functions too


def too_long(package: Path = PACKAGE) -> list[str]:
    """Each module of the package over MODULE_LINES_MAX lines and each
    function (method, nested function) over FUNCTION_LINES_MAX, as
    "path: lines" and "path:line name: lines"."""
    found = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(package.parent).as_posix()
        count = len(text.splitlines())
        if count > MODULE_LINES_MAX:
            found.append(f"{where}: {count} lines (module, at most {MODULE_LINES_MAX})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                length = node.end_lineno - node.lineno + 1
                if length > FUNCTION_LINES_MAX:
                    found.append(f"{where}:{node.lineno} {node.name}: {length} lines "
                                 f"(function, at most {FUNCTION_LINES_MAX})")
    return found


def test_no_module_or_function_is_too_long():
    found = too_long()
    assert not found, "too long (split by purpose, moving whole blocks):\n  " + "\n  ".join(found)


def test_the_size_check_finds_what_is_too_long(tmp_path):
    """At the limits passes, one line over fails: a module, a method, a
    nested function, an async one; every offender is listed."""
    package = tmp_path / "pkg"
    package.mkdir()

    def function(name: str, lines: int, indent: str = "") -> str:  # `lines` lines from def to last
        return f"{indent}def {name}():\n" + f"{indent}    pass\n" * (lines - 1)

    (package / "__init__.py").write_text("")
    (package / "fits.py").write_text(function("f", FUNCTION_LINES_MAX)
                                     + "x = 1\n" * (MODULE_LINES_MAX - FUNCTION_LINES_MAX))
    (package / "long.py").write_text("x = 1\n" * (MODULE_LINES_MAX + 1))
    (package / "method.py").write_text("class C:\n" + function("m", FUNCTION_LINES_MAX + 1, "    "))
    (package / "nested.py").write_text("def outer():\n" + function("inner", FUNCTION_LINES_MAX + 1, "    "))
    (package / "slow.py").write_text("async " + function("a", FUNCTION_LINES_MAX + 1))
    found = too_long(package)
    assert [entry.split(" ")[0] for entry in found] == [
        "pkg/long.py:", "pkg/method.py:2", "pkg/nested.py:1", "pkg/nested.py:2", "pkg/slow.py:1"], found
    assert "fits" not in " ".join(found)
