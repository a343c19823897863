"""Shared fixtures, and the suite's compiler flags.

The tests sit in folders by what they exercise: ops/ (an op's or an op
family's values and derivative rules), compiled/ (the compiled module, its
C, build, cache and runtime), models/ (examples, models, training, the
PyTorch/JAX/Dask bridges) and tools/ (command line, review, docs,
packaging, lint, layering). Their helpers (helpers.py, oracles.py,
c_driver.py, diff_models.py) and tests/golden/ stay here, importable from
every folder (the sys.path line below). The tiers are markers (slow), not
folders.

Build flags: the suite builds its C at TEST_FLAGS (-O1, no -march=native;
IEEE arithmetic, never -ffast-math) through $SYMBACKPROP_CFLAGS, which
child processes inherit: GCC at -O3 -march=native was most of the suite's
CPU time, and results differ only within rounding (the tests compare at
1e-10 or so; the cache key holds the flags). A test, class or module that
checks speed, vector code, assembly, the build flags themselves or
bit-exact rounding against a number made with the production flags is
marked `@pytest.mark.default_flags` (or `pytestmark = ...` for a module,
needed where a module-scoped fixture builds): it builds at DEFAULT_FLAGS.
A build whose BuildOptions names its flags (test_fuzz's -O1, the sanitizer
builds' -O0, a fixture's flags=DEFAULT_FLAGS) is not affected.
`pytest --production-flags` runs the whole suite at DEFAULT_FLAGS.
"""

import functools
import importlib.util
import os
import sys
from pathlib import Path

# Under xdist every core already runs a worker: BLAS threads on top of them
# only spin (a test child's 200 calls: 9 of 12 CPU s). Set before numpy
# (its OpenBLAS) or a module's BLAS loads; children inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")  # where the mkl wheel is the BLAS (toolchain/blas.py)

import pytest

from symbackprop.declare.model import Model
from symbackprop.toolchain.builder import CACHE_ENV, FLAGS_ENV

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
    parser.addoption("--production-flags", action="store_true", default=False,
                     help="build every test's C at DEFAULT_FLAGS, not at the suite's cheaper TEST_FLAGS")
    parser.addoption("--module-cache", metavar="DIR", default=None,
                     help="keep the suite's compiled modules in DIR between runs (default: a fresh cache per run)")


# The suite's flags (see the docstring): -O1 builds a model in a third of
# -O3 -march=native's CPU time (transformer_lm: 0.7 s against 3.6 s).
TEST_FLAGS = "-O1 -fno-math-errno -std=c99"


def pytest_configure(config):
    config.addinivalue_line("markers", "default_flags: build this test's C at the production DEFAULT_FLAGS")
    if not config.getoption("--production-flags"):
        os.environ.setdefault(FLAGS_ENV, TEST_FLAGS)  # a developer's own choice wins
    if sys.dont_write_bytecode and not os.environ.get("PYTEST_XDIST_WORKER"):
        _compile_package()


def _compile_package():
    """Where Python writes no bytecode (PYTHONDONTWRITEBYTECODE), each of the
    suite's child interpreters (about 80: the command line's, test_review's,
    test_depth's, ...) and each worker would compile symbackprop's modules
    from source again: 0.3-0.4 s of CPU apiece, most of their `import
    symbackprop`'s own time. Compiled once here into __pycache__ (ignored by
    git), they read it; Python checks each file against its source's mtime."""
    import compileall

    compileall.compile_dir(str(ROOT / "symbackprop"), quiet=2)


def _production_flags(node):
    """Unset the suite's flags while a node marked default_flags runs."""
    if node.get_closest_marker("default_flags") is None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(FLAGS_ENV, raising=False)
        yield


@pytest.fixture(scope="module", autouse=True)
def module_build_flags(request):
    """A module marked default_flags: its module-scoped fixtures build at DEFAULT_FLAGS too."""
    yield from _production_flags(request.node)


@pytest.fixture(autouse=True)
def build_flags(request):
    """A test (or its class or module) marked default_flags builds at DEFAULT_FLAGS."""
    yield from _production_flags(request.node)


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: pass --runslow to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def module_cache(tmp_path_factory, request):
    """Compiled modules go to a fresh cache for the session (child
    processes inherit it through the environment), never the user's. The
    workers of one parallel session share it (a model several test files
    compile is built once; the cache is safe for processes building at once).
    `--module-cache=DIR` keeps them in DIR instead, so that a second run
    builds only what changed (with a space, pytest's first look at the
    arguments takes an existing DIR for a folder of tests: write the `=`)."""
    saved = os.environ.get(CACHE_ENV)
    kept = request.config.getoption("--module-cache")
    if kept:
        path = Path(kept).resolve()
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    elif os.environ.get("PYTEST_XDIST_WORKER"):
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


@pytest.fixture(scope="module")
def mlp_example():
    """examples/mlp.py, loaded once a test module."""
    return load_example("mlp")


@pytest.fixture(scope="module")
def mlp_module(mlp_example):
    """examples/mlp.py's model, compiled once a test module."""
    import symbackprop as sbp

    return sbp.compile(mlp_example.model)


@pytest.fixture(scope="module")
def jax_x64():
    """JAX in float64 while a module's tests run (its oracles compare at
    1e-10), as it was before. A module that imports jax asks for it with
    `pytestmark = pytest.mark.usefixtures("jax_x64")`."""
    import jax  # only modules that skip without jax ask for it

    saved = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", saved)
