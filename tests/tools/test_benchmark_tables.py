"""The benchmark tables of README.md and docs/ are what benchmarks/tables.py
renders from the result files of benchmarks/results/, and those files say
where their numbers come from."""

import json
import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import tables  # noqa: E402


def test_every_marked_table_is_what_its_data_renders():
    assert tables.stale() == [], "run python benchmarks/tables.py"


def test_the_readme_has_a_table_from_data_with_its_command():
    readme = (ROOT / "README.md").read_text()
    names = re.findall(r"<!-- table:([\w.-]+) -->", readme)
    assert len(names) == 1
    assert f"`{tables.load(names[0])['command']}`" in readme


def test_every_result_file_names_its_source_and_every_cell_a_column():
    files = sorted(tables.RESULTS.glob("*.json"))
    assert files
    for path in files:
        data = tables.load(path.stem)
        assert all(data[field] for field in ("machine", "date", "commit", "command", "source")), path
        keys = {column["key"] for column in data["columns"]}
        for row in data["rows"]:
            assert set(row["seconds"]) <= keys, (path, row["label"])
        assert data.get("baseline") in keys | {None}


def test_render_shows_the_medians_ratios_and_notes(tmp_path, monkeypatch):
    data = {"title": "T", "machine": "M", "date": "D", "commit": "C", "command": "run it", "conditions": "one thread",
            "source": "S", "row_header": "workload", "baseline": "a",
            "columns": [{"key": "a", "label": "A", "ratio": False}, {"key": "b", "label": "B", "ratio": True}],
            "rows": [{"label": "W1", "seconds": {"a": 2.5e-6, "b": 5e-6}},
                     {"label": "W2", "seconds": {"a": 0.002, "b": [0.003, 0.004]}, "note": "later"},
                     {"label": "W3", "seconds": {"a": 1.5, "b": 1.2}, "ratios": {"b": [0.8, 0.7, 0.9]}}]}
    (tmp_path / "x.json").write_text(json.dumps(data))
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    text = tables.render("x")
    assert "| workload | A | B |" in text
    assert "| W1 | 2.5 us | 5 us (2.00) |" in text
    assert "| W2 [1] | 2 ms | 3-4 ms |" in text and "[1] later" in text
    assert "| W3 | 1.5 s | 1.2 s (0.80, 0.70-0.90) |" in text
    assert "`run it` on M, D, commit C" in text and "`benchmarks/results/x.json`" in text
    page = tmp_path / "page.md"
    page.write_text("before\n<!-- table:x -->\nold\n<!-- /table -->\nafter\n")
    assert tables.refresh(page.read_text()) == f"before\n<!-- table:x -->\n{text}<!-- /table -->\nafter\n"


def test_run_py_writes_a_result_file_the_tables_render(tmp_path, monkeypatch):
    run = pytest.importorskip("benchmarks.run")
    records = [{"peer": "symbackprop", "variant": "symbackprop", "workload": "W1", "dtype": "float64",
                "status": "ok", "median_s": 2e-6},
               {"peer": "jax_jit", "variant": "jax_jit", "workload": "W1", "dtype": "float64",
                "status": "ok", "median_s": 6e-6},
               {"peer": "torch_eager", "variant": "torch_eager", "workload": "W1", "dtype": "float64",
                "status": "not installed"}]
    args = types.SimpleNamespace(threads=1, batch=None, no_pin=False, quick=True, workloads=[], dtype=["float64"])
    data = run.results_file(records, args, ["--workloads", "W1", "--save", "x"])
    (tmp_path / "x.json").write_text(json.dumps(data))
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    text = tables.render("x")
    assert "| W1 float64 | 2 us | 6 us (3.00) |" in text
    assert "`python benchmarks/run.py --workloads W1 --save x`" in text


def test_gradbench_run_writes_a_result_file_the_tables_render(tmp_path, monkeypatch):
    gradbench = pytest.importorskip("benchmarks.gradbench.run")
    timed = lambda seconds: {"median_s": seconds, "min_s": seconds}  # noqa: E731
    records = [{"eval": "lse", "label": "n=4", "derivative": "gradient", "peers": {
        "symbackprop": {"status": "ok", "primal": timed(1e-6), "derivative": timed(2e-6)},
        "jax": {"status": "ok", "primal": timed(3e-6), "derivative": timed(8e-6)},
        "torch": {"status": "failed verification"}}}]
    args = types.SimpleNamespace(peers=["symbackprop", "jax", "torch"], plan="quick", no_pin=False, small=True)
    data = gradbench.results_file(records, args, ["--evals", "lse"])
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    tables.save("g", data)
    text = tables.render("g")
    assert "| eval | symbackprop primal | jax primal | symbackprop derivative | jax derivative |" in text
    assert "| lse n=4, gradient | 1 us | 3 us | 2 us | 8 us (4.00) |" in text
    cells = {key for row in data["rows"] for key in row["seconds"]}
    assert cells == {column["key"] for column in data["columns"]}  # every cell a column, every column a cell


def test_render_shows_bytes_where_the_file_says_so(tmp_path, monkeypatch):
    data = {"title": "T", "machine": "M", "date": "D", "commit": "C", "command": "run it", "conditions": "c",
            "source": "S", "row_header": "workload", "baseline": "a", "unit": "bytes",
            "columns": [{"key": "a", "label": "A", "ratio": False}, {"key": "b", "label": "B", "ratio": True}],
            "rows": [{"label": "W3", "seconds": {"a": 576600, "b": 1060945}},
                     {"label": "tiny", "seconds": {"a": 512, "b": 3 * 2**30}}]}
    (tmp_path / "x.json").write_text(json.dumps(data))
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    text = tables.render("x")
    assert "| W3 | 563 KiB | 1.01 MiB (1.84) |" in text
    assert "| tiny | 512 B | 3 GiB (6291456) |" in text
    assert "bytes over symbackprop's" in text


def test_a_ratio_note_says_what_the_ratios_divide_by(tmp_path, monkeypatch):
    data = {"title": "T", "machine": "M", "date": "D", "commit": "C", "command": "run it", "conditions": "c",
            "source": "S", "row_header": "workload", "baseline": "b", "ratio_note": "over B's",
            "columns": [{"key": "a", "label": "A", "ratio": True}, {"key": "b", "label": "B", "ratio": False}],
            "rows": [{"label": "W1", "seconds": {"a": 3e-6, "b": 2e-6}}]}
    (tmp_path / "x.json").write_text(json.dumps(data))
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    text = tables.render("x")
    assert "| W1 | 3 us (1.50) | 2 us |" in text
    assert "T: c; over B's. `run it`" in text and "symbackprop's" not in text


def test_a_negative_difference_shows_in_its_unit():
    """A part found by difference (real_sizes.py --breakdown's rest) may be negative: in ms, not ns."""
    assert tables.format_seconds(-8.72e-4) == "-872 us"
    assert tables.format_seconds(-7.24e-3) == "-7.24 ms"
    assert tables.format_seconds(2.5e-3) == "2.5 ms"


def test_depth_scale_writes_a_result_file_the_tables_render(tmp_path, monkeypatch):
    depth = pytest.importorskip("benchmarks.depth_scale")
    records = [{"version": "before", "case": "gru", "size": 300, "outcome": "error",
                "message": "RecursionError: maximum recursion depth exceeded"},
               {"version": "after", "case": "gru", "size": 300, "outcome": "ok", "declare_cpu_s": 2.0,
                "compile_cpu_s": 80.0},
               {"version": "before", "case": "mlp", "size": 10, "outcome": "timeout", "declare_cpu_s": 0.5}]
    args = types.SimpleNamespace(timeout=60.0, before_commit="abc1234", after_commit=None)
    versions = {"before": tmp_path, "after": ROOT}
    data = depth.results_file(records, versions, args, ["--cases", "gru"])
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    tables.save("d", data)
    text = tables.render("d")
    assert "| model | declare (before) | declare (after) | compile (before) | compile (after) |" in text
    assert "| GRU, hidden 8, 300 steps [1] |  | 2 s |  | 80 s |" in text
    assert "| tanh MLP, width 8, 10 layers [2] | 500 ms |  |  |  |" in text  # no compile time past a timeout
    assert "[1] before: error (RecursionError" in text and "[2] before: timeout" in text
    assert "commit before abc1234" in text
