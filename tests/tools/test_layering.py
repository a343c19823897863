"""The package's modules import one another without cycles: values flow one
way (declare -> IR -> differentiate -> schedule -> emit -> build -> run,
with interop and Dask on top). An import inside a function counts (it is
still an arrow between the modules); one under `if TYPE_CHECKING:` does
not (it never runs)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "symbackprop"


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
