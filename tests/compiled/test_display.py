"""A compiled module in Jupyter: _repr_html_ / _repr_markdown_ / _repr_svg_.
Checked by parsing what they return (html.parser, an XML parser for the
SVG Graphviz draws), against the module's own plan and memory()."""

import html
import re
import shutil
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest
import sympy as sp
from conftest import load_example

import symbackprop as sbp
from symbackprop import nn
from symbackprop.errors import ToolMissing


class Collect(HTMLParser):
    """The text of an HTML fragment and its tags, checked for balance."""

    VOID = frozenset({"br", "hr", "img", "meta", "link", "input"})

    def __init__(self) -> None:
        super().__init__()
        self.open: list[str] = []
        self.tags: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag not in self.VOID:
            self.open.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)

    def handle_endtag(self, tag):
        assert self.open and self.open[-1] == tag, (tag, self.open[-3:])
        self.open.pop()

    def handle_data(self, data):
        self.text.append(data)


def parse(fragment: str) -> Collect:
    parser = Collect()
    parser.feed(fragment)
    parser.close()
    assert parser.open == [], parser.open  # every element closed
    return parser


@pytest.fixture(scope="module")
def mlp():
    return sbp.compile(load_example("mlp").model)


def test_html_shows_arguments_memory_graph_and_equations(mlp):
    page = parse(mlp._repr_html_())
    text = "".join(page.text)
    assert {"h3", "table", "ol", "li"} <= set(page.tags)
    for name in ("W1", "b1", "W2", "b2", "X", "T"):
        assert f"{name}" in text
    sizes = mlp.memory_plan().sizes()  # the expressions memory(n=...) substitutes into
    assert sizes["kept_for_backward"] == 48 * sp.Symbol("n", integer=True, positive=True)
    for size in sizes.values():
        assert str(size) in text
    # the adjoint equations of the derivation file, as LaTeX for MathJax
    equations = [line.split("$$")[1] for line in mlp.emitted.derivation.splitlines() if line.startswith("1. $$") and
                 line.count("$$") == 2]
    assert equations and all(f"$${e}$$" in text for e in equations)
    for node in ("MseLossBackward", "SigmoidBackward", "MatMulWithBiasBackward", "AccumulateGrad"):
        assert node in text  # an SVG's <text>, or the tree in a <pre>


def test_markdown_is_the_derivation_memory_and_graph(mlp):
    markdown = mlp._repr_markdown_()
    assert markdown.startswith(mlp.emitted.derivation)
    assert "| `value_and_grad` | workspace of value_and_grad | 128*n + 128 |" in markdown
    assert "```text\n" + str(mlp.graph) + "\n```" in markdown


def test_memory_report_is_a_dict_and_a_table(mlp):
    report = mlp.memory(n=1000)
    # generated/mlp/derivation.md: kept 48*n, workspaces 112*n + 128 and 128*n + 128 bytes (the sigmoid's adjoint in
    # place; the 3 fixed entries take 16, so that the n x 4 buffers start on a 64-byte line)
    assert report == {"kept_for_backward": 48_000, "prediction": 112_128, "value_and_grad": 128_128}
    page = parse(report._repr_html_())
    cells = [t for t in page.text if t.strip()]
    assert "Memory for n = 1000" in cells
    for name, size in report.items():
        at = cells.index(name)
        assert cells[at + 2] == str(size)
    assert "| `prediction` | workspace of a prediction-only forward pass | 112128 | 110 KiB |" in report._repr_markdown_()


def test_user_names_are_escaped():
    X = sp.MatrixSymbol("X", 4, 2)
    model = sbp.Model("a<b>&c", inputs=[X], params=[], loss=nn.sum_all(X))
    mod = sbp.compile(model, wrt=["X"])
    fragment = mod._repr_html_()
    assert "<b>" not in fragment and "a&lt;b&gt;&amp;c" in fragment
    assert "a<b>&c" in "".join(parse(fragment).text)


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_svg_is_valid_xml_with_the_node_labels(mlp):
    svg = mlp.graph._repr_svg_()
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    labels = {t.text for t in root.iter("{http://www.w3.org/2000/svg}text")}
    assert labels == {"MseLossBackward", "MatMulWithBiasBackward", "SigmoidBackward", "AccumulateGrad",
                      "W1", "b1", "W2", "b2"}
    inline = mlp.graph._repr_html_()  # the SVG, in a block MathJax leaves alone
    assert inline.startswith('<div class="tex2jax_ignore mathjax_ignore"><svg') and inline.endswith("</svg>\n</div>")


def test_without_dot_the_graph_is_the_tree_not_dot_text(mlp, monkeypatch):
    monkeypatch.setenv("PATH", "")  # no dot to find
    assert mlp.graph._repr_svg_() is None  # IPython then shows another representation
    with pytest.raises(ToolMissing, match="install Graphviz"):
        mlp.graph.svg()
    for fragment in (mlp.graph._repr_html_(), mlp._repr_html_()):
        page = parse(fragment)
        text = "".join(page.text)
        assert "pre" in page.tags and "digraph" not in text and "->" not in text
        assert str(mlp.graph) in text  # the grad_fn-style tree
        assert "Graphviz" in text


def test_repr_in_a_terminal_names_the_module_dtype_functions_and_shapes(mlp):
    text = repr(mlp)
    assert " object at 0x" not in text and text.startswith("<CompiledModule 'mlp' (float64)")
    assert "functions: forward, value_and_grad; on first use: vjp, jvp, hvp" in text
    assert "inputs: X (n x 3), T (n x 2)" in text
    assert "params: W1 (3 x 4), b1 (1 x 4), W2 (4 x 2), b2 (1 x 2)" in text
    assert "outputs: loss (1 x 1), Y (n x 2)" in text and "dimensions bound at call time: n" in text
    assert str(mlp) == text


def test_repr_follows_what_is_built_and_the_dtype():
    x, y = sp.symbols("x y")
    mod = sbp.compile(sbp.Model("repr_scalar", params=[x, y], loss=x**2 * y), dtype="float32",
                      optimizer=sbp.SGD(lr=0.1))
    assert repr(mod).startswith("<CompiledModule 'repr_scalar' (float32)")
    assert "params: x (scalar), y (scalar)" in repr(mod) and "inputs" not in repr(mod)
    assert "train_step" in repr(mod).split("on first use:")[1]
    mod.jvp({"x": 1.0}, x=0.5, y=2.0)
    assert "functions: forward, value_and_grad, jvp;" in repr(mod)
    X, index = sp.MatrixSymbol("X", 3, 2), sbp.Index("I", 3)
    outputs_only = sbp.compile(sbp.Model("repr_outputs", inputs=[X, index], params=[],
                                         outputs={"Z": sbp.gather(X, index)}))
    text = repr(outputs_only)
    assert "value_and_grad" not in text and "inputs: X (3 x 2), I (3 x 1)" in text and "outputs: Z (3 x 2)" in text


def test_ipython_formatter_picks_them_up(mlp):
    formatters = pytest.importorskip("IPython.core.formatters")
    data, _ = formatters.DisplayFormatter().format(mlp)
    assert data["text/html"] == mlp._repr_html_()
    assert data["text/markdown"] == mlp._repr_markdown_()


HOSTILE_NAMES = [
    r"x}\href{javascript:alert(1)}{y",
    r"a$$\href{javascript:alert(2)}{b}$$c",
    r"p\def\x{1}",
    "w{#1}^~%&_ z",
    r"q\\}",
]


def _math_blocks(text: str) -> list[str]:
    """The $$...$$ a renderer typesets: outside code (MathJax skips <code> and
    <pre>, and elements of its ignore classes; Jupyter's Markdown takes code
    spans and fences out before math)."""
    ignored = r'<div class="tex2jax_ignore mathjax_ignore">.*?</div>'
    for code in (ignored, r"<code>.*?</code>", r"<pre>.*?</pre>", r"```.*?```", r"`[^`\n]*`"):
        text = re.sub(code, "", text, flags=re.DOTALL)
    return re.findall(r"\$\$(.*?)\$\$", text, re.DOTALL)


def _balanced(latex: str) -> bool:
    """Braces balanced, escaped ones (\\{ \\}) aside: no name closed a group it did not open."""
    depth = 0
    for token in re.findall(r"\\[{}]|\\\\|[{}]", latex):
        depth += {"{": 1, "}": -1}.get(token, 0)
        if depth < 0:
            return False
    return depth == 0


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_names_reach_the_math_escaped_for_latex(name):
    """A parameter's name in the $$...$$ of the notebook view and of the
    derivation file: set as text, never as LaTeX commands."""
    X = sp.MatrixSymbol("X", 3, 2)
    W = sp.MatrixSymbol(name, 2, 2)
    model = sbp.Model("latex_names", inputs=[X], params=[W], loss=nn.sum_all(nn.tanh(X * W)))
    mod = sbp.compile(model)
    for text in (mod._repr_html_(), mod.emitted.derivation or "", mod._repr_markdown_()):
        blocks = _math_blocks(text)
        assert blocks
        for block in blocks:
            assert not re.search(r"\\(href|def|url|style|class|html)", block), block
            assert _balanced(block), block
    shown = [html.unescape(b) for b in _math_blocks(mod._repr_html_())]
    assert any(r"\mathtt{" in b for b in shown) and not any(re.search(r"\\(href|def)", b) for b in shown)


def test_plain_names_keep_their_math():
    from symbackprop.schedule.kernel import latex_name

    assert latex_name("W1") == "W_{1}" and latex_name("alpha") == r"\alpha"
    assert latex_name("grad_W1") == r"\frac{\partial L}{\partial W_{1}}"
    assert latex_name("x}y") == r"\mathtt{x\}y}" and latex_name("a$b") == r"\mathtt{a\unicode{36}b}"
