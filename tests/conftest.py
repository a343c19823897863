import functools
import importlib.util
import os
import sys
from pathlib import Path

import pytest

from symbackprop.build.builder import CACHE_ENV
from symbackprop.declare.model import Model

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/oracles.py and helpers


def load_example(name: str):
    """Import examples/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def example_names() -> list[str]:
    """The example files that define a `model` (scripts such as
    train_digits.py define none, and `symbackprop build` skips them too)."""
    files = sorted(p.stem for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))
    return [name for name in files if isinstance(getattr(load_example(name), "model", None), Model)]


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")
    parser.addoption("--update-golden", action="store_true", default=False, help="rewrite tests/golden/")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: pass --runslow to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def module_cache(tmp_path_factory):
    """Compiled modules go to a fresh cache for the session (child
    processes inherit it through the environment), never the user's. The
    workers of one parallel session share it (a model several test files
    compile is built once; the cache is safe for processes building at once)."""
    saved = os.environ.get(CACHE_ENV)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.getbasetemp().parent / "module-cache"
        path.mkdir(mode=0o700, exist_ok=True)
    else:
        path = tmp_path_factory.mktemp("module-cache")
    os.environ[CACHE_ENV] = str(path)
    yield path
    if saved is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = saved
