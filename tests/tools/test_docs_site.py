"""The documentation site builds with `mkdocs build --strict` (any warning
fails: a page of docs/ missing from the nav of mkdocs.yml, a link or anchor
that does not resolve, a docstring griffe cannot match to its signature),
and its API reference documents every public name of the package."""

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")

import symbackprop

ROOT = Path(__file__).resolve().parents[2]
ANCHOR = re.compile(r'\bid="([\w.]+)"')

# Public modules without an __all__, and the stage module whose functions
# and classes they re-export (the public path stays; the code lives there).
REEXPORTS = {"symbackprop.nn": "symbackprop.declare.nn", "symbackprop.optim": "symbackprop.run.optim",
             "symbackprop.errors": "symbackprop.errors"}
# Public modules with an __all__ that import an optional framework: checked where it is installed.
OPTIONAL = ("symbackprop.dask", "symbackprop.interop.torch", "symbackprop.interop.jax")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built from this checkout, in a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (
        "mkdocs build --strict failed: a page of docs/ missing from the nav of mkdocs.yml, a broken link or anchor, "
        "or a docstring griffe warns about:\n" + run.stdout + run.stderr)
    return out


@pytest.fixture(scope="module")
def anchors(site):
    """The ids of the objects the API reference documents, e.g. symbackprop.compile."""
    found = set()
    for page in (site / "api").rglob("*.html"):
        found.update(ANCHOR.findall(page.read_text()))
    return found


def _assert_documented(anchors, public):
    """Each (public path, object) is documented under its public path or where it is defined."""
    missing = [path for path, obj in public
               if not {path, f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"} & anchors]
    assert not missing, f"public but not in the API reference (add them to a page of docs/api/): {missing}"


def _public_names(module, defined_in):
    """The functions and classes of module that defined_in defines."""
    return [name for name, obj in vars(module).items()
            if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == defined_in]


def _optional(path):
    """The module, or None where its framework is not installed."""
    try:
        return importlib.import_module(path)
    except ImportError:
        return None


def test_site_builds_and_the_api_reference_has_the_main_calls(anchors):
    for path in ("symbackprop.compile", "symbackprop.Model", "symbackprop.CompiledModule.value_and_grad",
                 "symbackprop.CompiledModule.forward", "symbackprop.scan", "symbackprop.map_examples"):
        assert path in anchors, path


def test_every_public_name_is_in_the_api_reference(anchors):
    cls = symbackprop.CompiledModule
    _assert_documented(anchors, [(f"symbackprop.{name}", getattr(symbackprop, name))
                                 for name in symbackprop.__all__ if not name.startswith("__")])
    _assert_documented(anchors, [(f"symbackprop.CompiledModule.{name}", getattr(cls, name))
                                 for name in dir(cls) if not name.startswith("_")])


def test_every_name_of_the_public_modules_is_in_the_api_reference(anchors):
    public = {path: _public_names(importlib.import_module(path), origin) for path, origin in REEXPORTS.items()}
    public.update((path, module.__all__) for path in OPTIONAL if (module := _optional(path)) is not None)
    assert public["symbackprop.nn"] and public["symbackprop.optim"] and public["symbackprop.errors"]
    _assert_documented(anchors, [(f"{path}.{name}", getattr(importlib.import_module(path), name))
                                 for path, names in public.items() for name in names])
