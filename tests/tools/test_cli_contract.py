"""The command line's contract, run as a user runs it (a child process in
a temporary folder): name collisions refused, files written atomically and
only after every check, a check that checked nothing fails, the model-file
contract (docs/model_files.md) checked before anything is written, and user
errors reported on one line with status 2, never as a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCALAR_MODEL = """
import sympy as sp
import symbackprop as sbp

x, w, c = sp.symbols("x w c")
{var} = sbp.Model({name!r}, inputs=[x], params=[w, c], loss=(w * x - c) ** 2)
"""
SAMPLE = """
def sample_data(rng):
    return {"x": 2.0, "w": 0.3, "c": 1.0}
"""


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "symbackprop", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def user_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """Status 2, one 'symbackprop: error:' line, no traceback; the fragments are in it."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stderr.startswith("symbackprop: error: "), result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, f"{fragment!r} not in {result.stderr!r}"
    return result.stderr


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


def test_names_that_map_to_one_identifier_are_refused_and_nothing_is_written(tmp_path):
    write(tmp_path / "a.py", SCALAR_MODEL.format(var="model", name="net-1"))
    write(tmp_path / "b.py", SCALAR_MODEL.format(var="other", name="net_1"))
    result = run("build", "a.py", "b.py", "--out", "gen", cwd=tmp_path)
    user_error(result, "'net-1' (a.py:model)", "'net_1' (b.py:other)", "gen/net_1/", "rename one")
    assert files_under(tmp_path / "gen") == []


def test_a_collision_inside_one_file_is_refused(tmp_path):
    write(tmp_path / "m.py", SCALAR_MODEL.format(var="first", name="Big Net") + "\n"
          + SCALAR_MODEL.format(var="second", name="big_net").replace("(w * x - c)", "(w * x + c)"))
    user_error(run("build", "m.py", "--out", "gen", cwd=tmp_path), "m.py:first", "m.py:second", "big_net")
    assert not (tmp_path / "gen").exists()


def test_a_model_imported_by_its_neighbour_is_written_once(tmp_path):
    write(tmp_path / "base.py", SCALAR_MODEL.format(var="model", name="base"))
    write(tmp_path / "user.py", "from base import model\n")
    result = run("build", "base.py", "user.py", "--out", "gen", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert files_under(tmp_path / "gen") == ["base", "base/base.c", "base/base.h", "base/derivation.md", "symbackprop_runtime.h"]


def test_neighbours_of_the_same_name_in_two_folders_are_each_their_own(tmp_path):
    write(tmp_path / "a" / "common.py", "import sympy as sp\nSIZE = 2\n")
    write(tmp_path / "b" / "common.py", "import sympy as sp\nSIZE = 5\n")
    for folder in ("a", "b"):
        write(tmp_path / folder / "net.py", f"""
            import sympy as sp
            import symbackprop as sbp
            from common import SIZE
            W = sp.MatrixSymbol("W", SIZE, 1)
            model = sbp.Model("net_{folder}", params=[W], loss=(W.T * W))
            """)
    result = run("build", "a/net.py", "b/net.py", "--out", "gen", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "W: input, 2 x 1" in (tmp_path / "gen/net_a/net_a.h").read_text()
    assert "W: input, 5 x 1" in (tmp_path / "gen/net_b/net_b.h").read_text()  # b's own common.py


@pytest.mark.parametrize("out, fragment", [("afile", "is not a folder"), ("afile/sub", "cannot create the output folder")])
def test_an_unusable_out_is_a_one_line_error(tmp_path, out, fragment):
    write(tmp_path / "m.py", SCALAR_MODEL.format(var="model", name="m"))
    (tmp_path / "afile").write_text("not a folder\n")
    user_error(run("build", "m.py", "--out", out, cwd=tmp_path), fragment)
    assert (tmp_path / "afile").read_text() == "not a folder\n"


def test_a_model_folder_blocked_by_a_file_is_an_error(tmp_path):
    write(tmp_path / "m.py", SCALAR_MODEL.format(var="model", name="m"))
    write(tmp_path / "gen" / "m", "a file where the model's folder goes\n")
    user_error(run("build", "m.py", "--out", "gen", cwd=tmp_path), "gen/m", "not a folder")


@pytest.mark.parametrize("extra", [["--check"], []])
def test_finding_no_model_fails(tmp_path, extra):
    write(tmp_path / "examples" / "script.py", "print('a training script, no Model')\n")
    user_error(run("build", *extra, cwd=tmp_path), "found no model", "examples/")
    assert files_under(tmp_path / "generated") == []


def test_check_against_an_empty_folder_is_stale(tmp_path):
    write(tmp_path / "m.py", SCALAR_MODEL.format(var="model", name="m"))
    result = run("build", "m.py", "--out", "gen", "--check", cwd=tmp_path)
    assert result.returncode == 1 and "stale" in result.stderr and "+++ gen/m/m.c" in result.stdout
    assert not (tmp_path / "gen").exists()  # a check writes nothing


def test_writes_are_atomic_replacements(tmp_path):
    write(tmp_path / "m.py", SCALAR_MODEL.format(var="model", name="m"))
    assert run("build", "m.py", "--out", "gen", cwd=tmp_path).returncode == 0
    source = tmp_path / "gen" / "m" / "m.c"
    keep = tmp_path / "kept.c"
    os.link(source, keep)  # a second name for the old file: written in place, it would change too
    source.write_text("stale\n")
    assert run("build", "m.py", "--out", "gen", cwd=tmp_path).returncode == 0
    assert keep.read_text() == "stale\n" and source.read_text() != "stale\n"
    assert os.stat(source).st_ino != os.stat(keep).st_ino
    # no temporary left
    assert files_under(tmp_path / "gen") == ["m", "m/derivation.md", "m/m.c", "m/m.h", "symbackprop_runtime.h"]
    assert oct(source.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_name_chooses_by_variable_or_by_model_name(tmp_path):
    write(tmp_path / "m.py", SCALAR_MODEL.format(var="fit", name="line-fit") + "alias = fit\n")
    results = {}
    for spec in ("m.py:fit", "m.py:line-fit", "m.py:alias"):
        out = f"gen_{len(results)}"
        assert run("build", spec, "--out", out, cwd=tmp_path).returncode == 0, spec
        results[spec] = (tmp_path / out / "line_fit" / "line_fit.c").read_text()
    assert len(set(results.values())) == 1
    user_error(run("build", "m.py:nope", cwd=tmp_path), "no Model named 'nope'", "fit (Model 'line-fit')")
    graph = run("graph", "m.py:line-fit", cwd=tmp_path)
    assert graph.returncode == 0 and "AccumulateGrad" in graph.stdout


def test_demo_refuses_a_file_without_sample_data_before_writing(tmp_path):
    write(tmp_path / "m.py", SCALAR_MODEL.format(var="model", name="m"))
    user_error(run("demo", "m.py", cwd=tmp_path), "sample_data(rng)", "docs/model_files.md")
    assert not (tmp_path / "generated").exists()


@pytest.mark.parametrize("body, fragments", [
    ("return {'x': 2.0, 'w': 0.3}", ("missing ['c']",)),
    ("return {'x': 2.0, 'w': 0.3, 'c': 1.0, 'extra': 1}", ("unknown ['extra']",)),
    ("return [2.0, 0.3, 1.0]", ("must return a dict",)),
    ("return {'x': [[1.0, 2.0]], 'w': 0.3, 'c': 1.0}", ("does not fit the model", "x")),
    ("raise RuntimeError('no data')", ("RuntimeError: no data", "line")),
])
def test_demo_checks_sample_data_before_writing(tmp_path, body, fragments):
    write(tmp_path / "m.py", SCALAR_MODEL.format(var="model", name="m") + f"\ndef sample_data(rng):\n    {body}\n")
    user_error(run("demo", "m.py", cwd=tmp_path), *fragments)
    assert not (tmp_path / "generated").exists()


def test_demo_of_one_model_among_several_by_its_name_importing_a_neighbour(tmp_path):
    write(tmp_path / "models" / "shapes.py", "import sympy as sp\nx, w, c = sp.symbols('x w c')\n")
    write(tmp_path / "models" / "two.py", textwrap.dedent("""
        import symbackprop as sbp
        from shapes import x, w, c
        first = sbp.Model("first", inputs=[x], params=[w, c], loss=(w * x - c) ** 2)
        second = sbp.Model("second-one", inputs=[x], params=[w, c], loss=(w * x - c) ** 4)
        """) + SAMPLE)
    user_error(run("demo", "models/two.py", cwd=tmp_path), "defines 2", "models/two.py:first")
    result = run("demo", "models/two.py:second-one", "--out", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "loss = 0.0256" in result.stdout and "max relative error" in result.stdout
    assert (tmp_path / "out" / "second_one" / "second_one.c").is_file()


@pytest.mark.parametrize("source, fragments", [
    ("import symbackprop\n\ny = undefined_name + 1\n", ("NameError", "undefined_name", "line 3 of m.py")),
    ("x = (\n", ("SyntaxError",)),
    ("import nonexistent_neighbour\n", ("ModuleNotFoundError", "nonexistent_neighbour")),
    ("import sympy as sp, symbackprop as sbp\nx = sp.Symbol('x')\nm = sbp.Model('m', inputs=[x], params=[x], loss=x)\n",
     ("m.py (line 3 of m.py)", "declared twice")),
    ("""import sympy as sp\nfrom symbackprop import nn\nY = sp.MatrixSymbol('Y', 4, 2)\nlam = sp.Symbol('lam')
loss = nn.sum_all(Y) + lam\n""", ("Mix of Matrix and Scalar", "sbp.as_scalar(m) + s")),
    ("import sys\nsys.exit(3)\n", ("SystemExit",)),
])
def test_a_broken_model_file_is_one_line_naming_the_cause(tmp_path, source, fragments):
    write(tmp_path / "m.py", source)
    user_error(run("build", "m.py", "--out", "gen", cwd=tmp_path), *fragments)
    assert not (tmp_path / "gen").exists()


def test_a_model_error_at_compile_time_is_a_one_line_error(tmp_path):
    write(tmp_path / "m.py", """
        import sympy as sp
        import symbackprop as sbp
        x, w, y = sp.symbols("x w y")
        model = sbp.Model("m", inputs=[x], params=[w], loss=(w * x - y) ** 2)
        """)
    user_error(run("build", "m.py", "--out", "gen", cwd=tmp_path), "y is neither an input nor a param")
    assert not (tmp_path / "gen").exists()


def test_loading_forgets_neighbours_but_not_modules_from_below_the_folder(tmp_path, monkeypatch):
    """A neighbour is forgotten after the load (another folder's module of
    that name is imported afresh); a module found through another sys.path
    entry that lies below the folder (a virtual environment, a checkout)
    stays: importing it twice would give two copies of its classes."""
    from symbackprop.cli import load_file

    write(tmp_path / "common.py", "VALUE = 1\n")
    write(tmp_path / "site" / "deep_pkg_for_test" / "__init__.py", "class Thing:\n    pass\n")
    write(tmp_path / "m.py", "import common\nimport deep_pkg_for_test\nVALUE = common.VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    before = list(sys.path)
    module = load_file(tmp_path / "m.py")
    assert module.VALUE == 1 and sys.path == before
    assert "common" not in sys.modules
    assert sys.modules["deep_pkg_for_test"].Thing is module.deep_pkg_for_test.Thing
    del sys.modules["deep_pkg_for_test"]


def test_demo_refuses_a_model_without_a_loss(tmp_path):
    write(tmp_path / "m.py", """
        import sympy as sp
        import symbackprop as sbp
        x, w = sp.symbols("x w")
        model = sbp.Model("m", inputs=[x], params=[w], outputs={"y": w * x})
        def sample_data(rng):
            return {"x": 1.0, "w": 2.0}
        """)
    user_error(run("demo", "m.py", cwd=tmp_path), "has no loss")
    assert not (tmp_path / "generated").exists()
    user_error(run("build", str(tmp_path), cwd=tmp_path), "is a folder")


def test_a_later_run_does_not_overwrite_another_models_folder(tmp_path):
    write(tmp_path / "a.py", SCALAR_MODEL.format(var="model", name="net-1"))
    write(tmp_path / "b.py", SCALAR_MODEL.format(var="other", name="net_1"))
    assert run("build", "a.py", "--out", "gen", cwd=tmp_path).returncode == 0
    before = (tmp_path / "gen" / "net_1" / "net_1.h").read_text()
    user_error(run("build", "b.py", "--out", "gen", cwd=tmp_path), 'model "net-1"', "'net_1' (b.py:other)", "delete gen/net_1/")
    assert (tmp_path / "gen" / "net_1" / "net_1.h").read_text() == before
    assert run("build", "a.py", "--out", "gen", cwd=tmp_path).returncode == 0  # regenerating the same model is fine
