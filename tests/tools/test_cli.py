"""The command line: demo, build, and the staleness check CI relies on."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

from symbackprop.cli import main


def test_generated_folder_is_up_to_date(capsys):
    """generated/ holds what the examples generate now (CI fails otherwise)."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        status = main(["build", "--check"])
    finally:
        os.chdir(cwd)
    out = capsys.readouterr()
    assert status == 0, out.out + out.err


def test_check_reports_a_stale_file_with_a_diff(tmp_path, capsys):
    out_dir = tmp_path / "gen"
    spec = str(ROOT / "examples" / "relu_net.py")
    assert main(["build", spec, "--out", str(out_dir)]) == 0
    source = out_dir / "relu_net" / "relu_net.c"
    source.write_text(source.read_text().replace("    return 0;\n}", "    return 7;\n}", 1))
    capsys.readouterr()
    assert main(["build", spec, "--out", str(out_dir), "--check"]) == 1
    captured = capsys.readouterr()
    assert "-    return 7;" in captured.out and "+    return 0;" in captured.out
    assert "symbackprop build" in captured.err


def test_build_names_a_missing_model(tmp_path, capsys):
    assert main(["build", str(tmp_path / "nope.py")]) == 2
    assert "no model file" in capsys.readouterr().err


def test_build_names_a_model_file_python_cannot_import(tmp_path, capsys):
    path = tmp_path / "model.txt"  # no loader for the suffix: once an AttributeError
    path.write_text("x = 1\n")
    assert main(["build", str(path)]) == 2
    assert "cannot import" in capsys.readouterr().err


def test_demo_runs_and_reports(tmp_path):
    """The README's main job: build, write, call, check, time."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    result = subprocess.run([sys.executable, "-m", "symbackprop", "demo"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "loss = " in result.stdout
    assert "max relative error" in result.stdout
    assert "us per call" in result.stdout
    assert (tmp_path / "generated" / "mlp" / "mlp.c").is_file()


def test_output_is_identical_across_hash_seeds(tmp_path):
    """Byte-identical C across processes with different PYTHONHASHSEED, for
    models with every kind of kernel: products, per-example maps with
    gathers, a scan, reductions (the whole of generated/ is checked against
    its files by test_generated_folder_is_up_to_date)."""
    outputs = []
    models = ["examples/gmm.py", "examples/bundle_adjustment.py", "examples/lstm_lm.py", "examples/mlp.py"]
    for seed in ("0", "12345"):
        out = tmp_path / f"gen{seed}"
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, "-m", "symbackprop", "build", *models, "--out", str(out)],
                       cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
        outputs.append({p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()})
    assert outputs[0] == outputs[1]
    assert any(str(p).endswith(".c") for p in outputs[0])


def test_generated_files_hold_no_paths_or_dates():
    for path in (ROOT / "generated").rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert str(ROOT) not in text and "/root" not in text and "2026" not in text, path
            library = path.name in ("CMakeLists.txt", "Makefile") or path.name.endswith(".pc.in")  # build --library
            assert Path(path).suffix in (".c", ".h", ".md") or library, path
