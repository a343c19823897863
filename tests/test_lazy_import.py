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
import symbackprop.run.optim as optim
resolved = {name: getattr(symbackprop, name) is not None for name in symbackprop.__all__}
try:
    symbackprop.no_such_name
    missing = "no AttributeError"
except AttributeError as error:
    missing = str(error)
print(json.dumps({"loaded": loaded, "resolved": resolved, "dir": dir(symbackprop), "missing": missing,
                  "same": [compile is runtime.compile, symbackprop.CompiledModule is runtime.CompiledModule,
                           symbackprop.Adam is optim.Adam],
                  "bridges": sorted(__import__("symbackprop.run.bridge").run.bridge.BRIDGES)}))
"""

# the compiler's stages and what only they need
NOT_AT_IMPORT = ["jinja2", "cffi", "numpy.ma", "symbackprop.pipeline", "symbackprop.emit.codegen",
                 "symbackprop.build.builder", "symbackprop.run.runtime", "symbackprop.schedule.scheduler"]


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
