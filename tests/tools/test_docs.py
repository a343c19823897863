"""Every ```python block of docs/*.md runs: each page's blocks in order, in
one namespace, in a temporary working folder, so the docs cannot rot."""

import logging
import re
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
REQUIRES = re.compile(r"<!-- requires: ([\w ]+) -->")
# what a log of work periods looks like: a dated heading, a clock time, a session tag
DIARY = re.compile(r"^#+ .*\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d(-\d\d:\d\d)? UTC\b|\bs\d\d\)|\bsession\b", re.MULTILINE)


def pages():
    return sorted(p.name for p in DOCS.glob("*.md"))


def test_every_task_has_a_page_with_code():
    for name in ("declare.md", "compile_and_call.md", "review.md", "train.md", "performance.md", "interop.md"):
        assert BLOCK.search((DOCS / name).read_text()), name


def test_no_page_is_a_diary():
    """The pages describe the software; how a period of work went is in the commits."""
    root = DOCS.parent
    for page in [*DOCS.glob("*.md"), root / "README.md", root / "benchmarks" / "README.md"]:
        found = DIARY.search(page.read_text())
        assert found is None, f"{page.name}: {found.group(0)!r}"
    assert len((DOCS / "ROADMAP.md").read_text().splitlines()) <= 150


@pytest.fixture
def restored_global_state():
    """Pages may configure logging and JAX; undo it for the other tests."""
    root, ours = logging.getLogger(), logging.getLogger("symbackprop")
    saved = (list(root.handlers), root.level, list(ours.handlers), ours.level)
    jax = sys.modules.get("jax")
    x64 = jax.config.jax_enable_x64 if jax is not None else None
    yield
    root.handlers[:], ours.handlers[:] = saved[0], saved[2]
    root.setLevel(saved[1])
    ours.setLevel(saved[3])
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.config.update("jax_enable_x64", bool(x64))


@pytest.mark.parametrize("page", pages())
def test_page_runs(page, tmp_path, monkeypatch, restored_global_state):
    text = (DOCS / page).read_text()
    for requirement in REQUIRES.findall(text):
        for module in requirement.split():
            pytest.importorskip(module)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"docs_{page[:-3]}"}
    for number, block in enumerate(BLOCK.findall(text), 1):
        code = compile(block, f"docs/{page} (python block {number})", "exec")
        exec(code, namespace)
