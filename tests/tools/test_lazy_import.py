"""`import symbackprop` imports the model language and not the compiler
(symbackprop/__init__'s names imported on first use, PEP 562): a process
that only declares models, and the command line's quick answers, skip the
stages, Jinja and cffi. Checked in a fresh interpreter (this one has
imported everything): what the import leaves out, then that every public
name still resolves, to the object its module defines, and is listed."""

import json
import subprocess
import sys

from conftest import ROOT

CHILD = """
import json, sys
import symbackprop
loaded = sorted(sys.modules)
from symbackprop import compile
import symbackprop.run.runtime as runtime
import symbackprop.run.module as module
import symbackprop.run.optim as optim
resolved = {name: getattr(symbackprop, name) is not None for name in symbackprop.__all__}
try:
    symbackprop.no_such_name
    missing = "no AttributeError"
except AttributeError as error:
    missing = str(error)
print(json.dumps({"loaded": loaded, "resolved": resolved, "dir": dir(symbackprop), "missing": missing,
                  "same": [compile is runtime.compile, symbackprop.CompiledModule is module.CompiledModule,
                           symbackprop.Adam is optim.Adam],
                  "bridges": sorted(__import__("symbackprop.run.bridge").run.bridge.BRIDGES)}))
"""

# the compiler's stages and what only they need
NOT_AT_IMPORT = ["jinja2", "cffi", "numpy.ma", "symbackprop.pipeline", "symbackprop.emit.codegen",
                 "symbackprop.schedule.scheduler", "symbackprop.diff.autodiff", "symbackprop.run.optim"]


def test_the_package_imports_the_compiler_on_first_use():
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, check=True, timeout=300)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert [m for m in NOT_AT_IMPORT if m in found["loaded"]] == []
    assert "symbackprop.declare.model" in found["loaded"]  # the model language is there
    assert all(found["resolved"].values()), found["resolved"]
    assert set(found["resolved"]) <= set(found["dir"])
    assert "no_such_name" in found["missing"]
    assert all(found["same"])
    assert found["bridges"] == ["jax", "torch"]  # mod.as_torch and mod.as_jax are registered without the compiler


HIT = """
import json, sys
import numpy as np
import sympy as sp
import symbackprop as sbp
x, w = sp.symbols("x w")
mod = sbp.compile(sbp.Model("lazy_hit", params=[w], inputs=[x], loss=(w * x - 1) ** 2))
loss, grads = mod.value_and_grad(w=np.array([[2.0]]), x=np.array([[3.0]]))
print(json.dumps({"loaded": sorted(sys.modules), "loss": float(loss), "grad": float(grads["w"])}))
"""

# what loading a module from the cache does not need: the code generator
NOT_ON_A_HIT = ["jinja2", "symbackprop.pipeline", "symbackprop.emit.codegen", "symbackprop.schedule.scheduler",
                "symbackprop.diff.autodiff", "symbackprop.ir.lower"]


def test_a_module_loaded_from_the_cache_imports_no_compiler(tmp_path):
    import os

    env = dict(os.environ, SYMBACKPROP_CACHE_DIR=str(tmp_path))
    runs = [json.loads(subprocess.run([sys.executable, "-c", HIT], cwd=ROOT, env=env, capture_output=True, text=True,
                                      check=True, timeout=300).stdout.strip().splitlines()[-1]) for _ in range(2)]
    miss, hit = runs
    assert "symbackprop.pipeline" in miss["loaded"]  # the first compile generated the C
    assert [m for m in NOT_ON_A_HIT if m in hit["loaded"]] == []
    for run in runs:  # (2*3 - 1)^2 and its derivative 2*(w*x - 1)*x, worked by hand
        assert run["loss"] == 25.0 and run["grad"] == 30.0
