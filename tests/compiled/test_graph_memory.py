"""The backward graph in grad_fn style, and the memory report."""

import shutil
import subprocess

import numpy as np
import pytest
import sympy as sp
from conftest import ROOT, load_example

import symbackprop as sbp
from symbackprop.cli import main
from symbackprop.declare import nn
from symbackprop.emit.graph import graph_text
from symbackprop.pipeline import plan


def one_layer():
    X, T = sp.MatrixSymbol("X", 5, 3), sp.MatrixSymbol("T", 5, 2)
    W, b = sp.MatrixSymbol("W", 3, 2), sp.MatrixSymbol("b", 1, 2)
    return sbp.Model("one", inputs=[X, T], params=[W, b], loss=nn.mse(nn.sigmoid(nn.linear(X, W, b)), T))


def test_linear_sigmoid_mse_graph(capsys):
    sbp.compile(one_layer()).print_graph()
    text = capsys.readouterr().out
    assert text.splitlines() == [
        "MseLossBackward",
        "└── SigmoidBackward",
        "    └── MatMulWithBiasBackward",
        "        ├── AccumulateGrad (b)",
        "        └── AccumulateGrad (W)",  # X @ W transposes nothing: no Transpose node
    ]


def test_graph_shows_retained_intermediates():
    example = load_example("mlp")
    text = graph_text(plan(example.model, wrt=["W2", "Y"]))
    assert "AccumulateGrad (retained gradient)" in text
    assert "W1" not in text  # not differentiated: not in the graph


def test_graph_command_text_and_dot(capsys):
    assert main(["graph", str(ROOT / "examples" / "mnist_mlp.py")]) == 0
    assert capsys.readouterr().out.startswith("SoftmaxCrossEntropyLossBackward\n")
    assert main(["graph", str(ROOT / "examples" / "relu_net.py"), "--format", "dot"]) == 0
    dot = capsys.readouterr().out
    assert dot.startswith("digraph backward {") and 'label="AccumulateGrad\\nW1"' in dot
    if shutil.which("dot"):
        subprocess.run(["dot", "-Tsvg"], input=dot, text=True, check=True, capture_output=True)


def test_memory_report_matches_the_buffer_plan():
    example = load_example("mlp")
    mod = sbp.compile(example.model)
    report = mod.memory(n=100)
    # the derivation lists the kept values: t1 (n x 4) and g0 (n x 2)
    derivation = mod.emitted.derivation.split("## Values kept", 1)[1].split("## Operations per kernel", 1)[0]
    kept = [line for line in derivation.splitlines() if line.startswith("| `")]
    kept_elements = 0
    for line in kept:
        rows, cols = line.split("|")[2].strip().split(" x ")
        kept_elements += (100 if rows == "n" else int(rows)) * (100 if cols == "n" else int(cols))
    assert report["kept_for_backward"] == 8 * kept_elements > 0
    fn = mod.function("value_and_grad")
    assert report["value_and_grad"] == 8 * fn.work_len(100)
    assert report["prediction"] == 8 * mod.function("forward").work_len(100)
    assert report["prediction"] < report["value_and_grad"]
    with pytest.raises(sbp.ArgumentError, match="needs the dimensions"):
        mod.memory()


def test_memory_of_fixed_shapes_float32():
    mod = sbp.compile(one_layer(), dtype="float32")
    report = mod.memory()
    assert report["value_and_grad"] == 4 * mod.function("value_and_grad").work_len()
    assert np.all(np.array(list(report.values())) >= 0)


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_graph_command_draws_svg_and_png(tmp_path, capsys):
    import xml.etree.ElementTree as ET

    model = str(ROOT / "examples" / "mlp.py")
    assert main(["graph", model, "--format", "svg", "-o", str(tmp_path / "g.svg")]) == 0
    root = ET.fromstring((tmp_path / "g.svg").read_bytes())
    labels = {t.text for t in root.iter("{http://www.w3.org/2000/svg}text")}
    assert {"MseLossBackward", "SigmoidBackward", "AccumulateGrad", "W1", "b2"} <= labels
    assert "TransposeBackward" not in labels
    assert main(["graph", model, "--format", "png", "-o", str(tmp_path / "g.png")]) == 0
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert main(["graph", model, "--format", "svg"]) == 0  # to stdout
    assert ET.fromstring(capsys.readouterr().out.encode()).tag.endswith("svg")


def test_graph_command_without_graphviz_names_how_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot there
    target = tmp_path / "g.svg"
    assert main(["graph", str(ROOT / "examples" / "mlp.py"), "--format", "svg", "-o", str(target)]) == 2
    err = capsys.readouterr().err
    assert "Graphviz's `dot`" in err and "apt install graphviz" in err and "--format dot" in err
    assert not target.exists()


def test_graph_command_text_to_a_file(tmp_path, capsys):
    target = tmp_path / "g.txt"
    assert main(["graph", str(ROOT / "examples" / "mlp.py"), "-o", str(target)]) == 0
    assert target.read_text().splitlines()[0] == "MseLossBackward" and capsys.readouterr().out == ""
