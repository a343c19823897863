"""Code review tools: `symbackprop diff` (what changed in a model's math,
between two files or git revisions), the pre-commit hook and the CI recipes
of docs/review.md, each run for real (git, pre-commit, the recipe's command)
where the tool is installed."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from symbackprop.cli import main, models_in
from symbackprop.review.mathdiff import diff_models, model_math

ROOT = Path(__file__).resolve().parents[2]
MLP = (ROOT / "examples" / "mlp.py").read_text()


def edited(text: str, *replacements: tuple[str, str]) -> str:
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new)
    return text


# the second layer gets an activation
TANH_OUTPUT = edited(MLP, ("Y = nn.linear(H, W2, b2)", "Y = nn.tanh(nn.linear(H, W2, b2))"))
# a third layer: 3 -> 4 -> 4 -> 2
THREE_LAYERS = edited(
    MLP,
    ('W2 = sp.MatrixSymbol("W2", 4, 2)', 'W2 = sp.MatrixSymbol("W2", 4, 4)'),
    ('b2 = sp.MatrixSymbol("b2", 1, 2)',
     'b2 = sp.MatrixSymbol("b2", 1, 4)\nW3 = sp.MatrixSymbol("W3", 4, 2)\nb3 = sp.MatrixSymbol("b3", 1, 2)'),
    ("Y = nn.linear(H, W2, b2)", "H2 = nn.sigmoid(nn.linear(H, W2, b2))\nY = nn.linear(H2, W3, b3)"),
    ("params=[W1, b1, W2, b2]", "params=[W1, b1, W2, b2, W3, b3]"),
)


def model_of(tmp_path: Path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return models_in(str(path))[0].model


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def _renamed_lines(lines, renamed: dict[str, str]) -> set[str]:
    return {re.sub(r"[A-Za-z_]\w*", lambda m: renamed.get(m.group(), m.group()), line) for line in lines}


def test_an_activation_changed_shows_only_the_equations_that_read_it(tmp_path):
    old, new = model_of(tmp_path, "old.py", MLP), model_of(tmp_path, "new.py", TANH_OUTPUT)
    change = diff_models(old, new)
    # Y, the squared error of Y and its adjoint (fused into the loss's loop) read tanh now;
    # the backward pass reads that adjoint, grad_add_W2 (the adjoint of b2 + mm_W2 now, not of the
    # residual), under its new name: its equations are the same
    assert change.names("changed", "forward") == {"Y", "sq_Y", "grad_add_W2"}
    assert change.names("changed", "backward") == set()
    assert change.names("added") == change.names("removed") == set()
    assert change.renamed == (("grad_add_Y", "grad_add_W2"),)
    assert not change.leaves and not change.kept and not change.memory_changed
    assert change.changed


def test_a_layer_added_shows_that_layer_and_what_reads_it(tmp_path):
    old, new = model_of(tmp_path, "old.py", MLP), model_of(tmp_path, "new.py", THREE_LAYERS)
    change = diff_models(old, new)
    assert change.names("added", "forward") == {"sigmoid_W2", "mm_W3"}  # sigmoid(b2 + mm_W2), sigmoid_W2 @ W3
    # the adjoint of b2 + mm_W2 is written over grad_sigmoid_W2 (schedule/inplace.py): no name of its own
    assert change.names("added", "backward") == {"grad_sigmoid_W2", "grad_W3", "grad_b3"}
    # what reads the new layer: Y = b3 + mm_W3, the loss and its adjoint; the first layer's
    # adjoint and W2's gradient read the new layer's adjoint
    assert change.names("changed") == {"Y", "sq_Y", "grad_add_Y", "grad_sigmoid_W1", "grad_W2", "grad_b2"}
    assert change.names("removed") == set()
    renamed = dict(change.renamed)
    assert renamed == {}  # no name moved: the old layers keep theirs
    # the oracle, by text: every equation not reported is an old one under the new numbers
    before, after = model_math(old), model_math(new)
    reported = change.names("added") | change.names("changed")
    unchanged_new = {line for name, step in after.steps.items() if name not in reported for line in step.lines}
    old_kept = [s for name, s in before.steps.items() if renamed.get(name, name) not in change.names("changed")]
    assert unchanged_new == _renamed_lines([line for s in old_kept for line in s.lines], renamed)
    # the names stay, so a by-name comparison of the text agrees
    by_name = {n for n, s in after.steps.items() if n in before.steps and before.steps[n].lines != s.lines}
    assert by_name == change.names("changed")
    kept = {row.label: row.kind for row in change.kept}
    assert kept == {"sigmoid_W2": "added"}
    memory = {row.label: (row.before, row.after) for row in change.memory}
    # sigmoid_W2 (n x 4) is kept now: 8 * 4 * n more bytes
    assert memory["kept for the backward pass"] == ("48*n", "80*n")
    assert {row.label for row in change.leaves} == {"W2", "b2", "W3", "b3"}


def test_identical_models_are_no_change_and_status_0(tmp_path, capsys):
    (tmp_path / "a.py").write_text(MLP)
    (tmp_path / "b.py").write_text("# the same model, written again\n" + MLP.replace("model = ", "renamed_variable = "))
    status, out, _ = run_cli(["diff", str(tmp_path / "a.py"), str(tmp_path / "b.py")], capsys)
    assert status == 0 and "no change in the math" in out
    status, out, _ = run_cli(["diff", str(tmp_path / "a.py"), str(tmp_path / "b.py"), "--format", "markdown"], capsys)
    assert status == 0 and "**No change in the math.**" in out


def test_a_model_without_a_loss_has_no_backward_pass():
    import sympy as sp

    import symbackprop as sbp
    from symbackprop import nn
    from symbackprop.review.mathdiff import render_text

    x, w = sp.MatrixSymbol("x", 2, 1), sp.MatrixSymbol("w", 1, 2)
    tanh = sbp.Model("f", inputs=[x], params=[w], outputs={"y": nn.tanh(w * x)})
    sigmoid = sbp.Model("f", inputs=[x], params=[w], outputs={"y": nn.sigmoid(w * x)})
    change = diff_models(tanh, sigmoid)
    assert change.names("changed") == {"y"} and change.sections == ("forward",)
    assert "Adjoint" not in render_text(change, "a", "b")
    assert not diff_models(tanh, tanh).changed


def test_a_scan_model_is_no_change_against_itself():
    """lstm_lm keeps buffers its loop writes, which no equation defines."""
    model = models_in(str(ROOT / "examples" / "lstm_lm.py"))[0].model
    change = diff_models(model, model)
    assert not change.changed and model_math(model).kept


def test_a_change_is_status_1_with_minus_and_plus_lines(tmp_path, capsys):
    (tmp_path / "a.py").write_text(MLP)
    (tmp_path / "b.py").write_text(TANH_OUTPUT)
    status, out, _ = run_cli(["diff", str(tmp_path / "a.py"), str(tmp_path / "b.py")], capsys)
    assert status == 1
    assert "  changed Y:\n    - Y = b2 + mm_W2\n    + Y = tanh(b2 + mm_W2)\n" in out
    assert "Adjoint equations (backward pass): no change" in out


def _cells(line: str) -> list[str]:
    """A Markdown table row's cells (a pipe escaped as \\| stays in its cell)."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]


def _tables(markdown: str) -> dict[str, list[list[str]]]:
    """heading -> rows (header first) of the table under it."""
    tables: dict[str, list[list[str]]] = {}
    heading = ""
    for line in markdown.splitlines():
        if line.startswith("#### "):
            heading = line[5:]
        elif line.startswith("|") and not set(line) <= set("|-"):
            tables.setdefault(heading, []).append(_cells(line))
        elif line.startswith("|"):
            assert line == "|" + "---|" * len(tables[heading][0]), line  # the separator fits the header
    return tables


def test_markdown_is_one_table_per_section(tmp_path, capsys):
    (tmp_path / "a.py").write_text(MLP)
    (tmp_path / "b.py").write_text(THREE_LAYERS)
    status, out, _ = run_cli(["diff", str(tmp_path / "a.py"), str(tmp_path / "b.py"), "--format", "markdown"], capsys)
    assert status == 1 and out.startswith("### Math diff of `mlp`\n")
    tables = _tables(out)
    forward, backward = tables["Forward pass (up to the loss)"], tables["Adjoint equations (backward pass)"]
    for table in (forward, backward, tables["Memory (bytes)"], tables["Kept for the backward pass"]):
        assert all(len(row) == 4 for row in table)
    assert forward[0] == backward[0] == ["change", "value", "before", "after"]
    rows = {row[1].strip("`"): row for row in forward[1:] + backward[1:]}
    assert {name for name, row in rows.items() if row[0] == "added"} == {"sigmoid_W2", "mm_W3", "grad_sigmoid_W2",
                                                                     "grad_W3", "grad_b3"}
    assert rows["Y"] == ["changed", "`Y`", "`Y = b2 + mm_W2`", "`Y = b3 + mm_W3`"]
    assert rows["sigmoid_W2"][2] == ""  # added: nothing before
    memory = {row[0]: row[1:] for row in tables["Memory (bytes)"][1:]}
    assert memory["kept for the backward pass"] == ["`48*n`", "`80*n`", "`+32*n`"]


# --- git revisions ---------------------------------------------------------------------------------------------------

def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@example.com", *args], cwd=repo, check=True,
                   capture_output=True)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git repository with three versions of models/net.py: two commits
    (the second changes only its neighbour module act.py, which it
    imports) and an uncommitted third layer."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = tmp_path / "repo"
    (root / "models").mkdir(parents=True)
    net = edited(MLP, ("H = nn.sigmoid(", "from act import ACT\n\nH = ACT("))
    (root / "models" / "net.py").write_text(net)
    (root / "models" / "act.py").write_text("from symbackprop import nn\n\nACT = nn.sigmoid\n")
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-qm", "sigmoid")
    (root / "models" / "act.py").write_text("from symbackprop import nn\n\nACT = nn.tanh\n")
    git(root, "commit", "-qam", "tanh")
    (root / "models" / "net.py").write_text(edited(THREE_LAYERS, ("H = nn.sigmoid(", "from act import ACT\n\nH = ACT(")))
    monkeypatch.chdir(root)
    return root


def test_two_revisions_read_the_model_and_its_neighbours_then(repo, capsys):
    status, out, _ = run_cli(["diff", "--rev", "HEAD~1", "--rev", "HEAD", "models/net.py"], capsys)
    assert status == 1
    assert "math diff of mlp: models/net.py at HEAD~1 -> models/net.py at HEAD" in out
    assert "    - sigmoid_W1 = sigmoid(b1 + mm_W1)\n    + tanh_W1 = tanh(b1 + mm_W1)\n" in out  # act.py as it was in each commit
    assert "added" not in out and "removed" not in out
    status, out, _ = run_cli(["diff", "--rev", "HEAD", "--rev", "HEAD", "models/net.py"], capsys)
    assert status == 0 and "no change in the math" in out


def test_one_revision_is_compared_with_the_working_tree(repo, capsys, monkeypatch):
    status, out, _ = run_cli(["diff", "--rev", "HEAD", "models/net.py:mlp"], capsys)
    assert status == 1 and "-> models/net.py:mlp" in out
    assert "  added grad_W3:\n    + grad_W3 = sigmoid_W2^T @ grad_add_Y\n" in out
    (repo / "sub").mkdir()
    monkeypatch.chdir(repo / "sub")  # a path from a subfolder
    status, out, _ = run_cli(["diff", "--rev", "HEAD", "../models/net.py"], capsys)
    assert status == 1 and "added grad_W3" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["diff", "missing.py", "models/net.py"], "no model file missing.py"),
    (["diff", "models/net.py"], "diff takes OLD NEW"),
    (["diff", "models/net.py", "models/net.py", "models/net.py"], "diff takes OLD NEW"),
    (["diff", "--rev", "HEAD", "models/net.py", "models/net.py"], "diff takes OLD NEW"),
    (["diff", "--rev", "HEAD", "--rev", "HEAD", "--rev", "HEAD", "models/net.py"], "diff takes OLD NEW"),
    (["diff", "--rev", "HEAD; touch pwned", "models/net.py"], "is not a git revision"),
    (["diff", "--rev=--output=pwned", "models/net.py"], "is not a git revision"),
    (["diff", "--rev", "HEAD~1..HEAD", "models/net.py"], "is not a git revision"),
    (["diff", "--rev", "no-such-branch", "models/net.py"], "'no-such-branch' names no commit"),
    (["diff", "--rev", "HEAD", "models/other.py"], "models/other.py is not a file at revision HEAD"),
    (["diff", "--rev", "HEAD", "models/net.py:$(touch pwned)"], "at revision HEAD: models/net.py has no Model named"),
    (["diff", "models/net.py:`touch pwned`", "models/net.py"], "has no Model named '`touch pwned`'"),
    (["diff", "--rev", "HEAD", "models"], "models is not a file at revision HEAD"),
])
def test_bad_input_is_a_clear_error_and_status_2(repo, capsys, argv, message):
    status, out, err = run_cli(argv, capsys)
    assert status == 2 and out == ""
    assert err.startswith("symbackprop: error: ") and message in err, err
    assert not list(repo.rglob("pwned"))


def _commit_links(repo, links: dict[str, str]) -> None:
    for name, target in links.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, repo / name)
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "links")


@pytest.mark.parametrize("link", ["link.py", "deep/link.py", "linked/net.py", "chain.py"])
def test_a_symbolic_link_is_followed_at_a_revision_as_in_the_working_tree(repo, capsys, link):
    """--rev follows the link inside the revision's tree, and the model
    imports the neighbours of the file it names (act.py), as build does."""
    if not hasattr(os, "symlink"):
        pytest.skip("no symbolic links here")
    git(repo, "stash", "-q")  # the working tree as HEAD: the two-layer model
    _commit_links(repo, {"link.py": "models/net.py", "deep/link.py": "../models/net.py", "linked": "models",
                         "chain.py": "link.py"})
    status, out, err = run_cli(["diff", "--rev", "HEAD", link], capsys)
    assert (status, err) == (0, ""), err
    assert "no change in the math" in out
    status, plain, _ = run_cli(["diff", link, "models/net.py"], capsys)  # the working tree follows it too
    assert status == 0 and "no change in the math" in plain
    (repo / "models" / "act.py").write_text("from symbackprop import nn\n\nACT = nn.sigmoid\n")
    status, out, _ = run_cli(["diff", "--rev", "HEAD", link], capsys)  # act.py as it is at HEAD: tanh
    assert status == 1 and "+ sigmoid_W1 = sigmoid(b1 + mm_W1)" in out


@pytest.mark.parametrize(("target", "message"), [
    ("/etc/passwd", "points outside the git repository"),
    ("../outside.py", "points outside the git repository"),
    ("models/../../outside.py", "points outside the git repository"),
    ("loop.py", "too many levels of symbolic links"),
    ("models/missing.py", "is not a file at revision HEAD"),
])
def test_a_link_out_of_the_revision_is_refused(repo, capsys, target, message):
    if not hasattr(os, "symlink"):
        pytest.skip("no symbolic links here")
    (repo.parent / "outside.py").write_text("open('pwned', 'w').close()\n")
    _commit_links(repo, {"loop.py": "loop.py"} if target == "loop.py" else {"bad.py": target})
    status, out, err = run_cli(["diff", "--rev", "HEAD", "--rev", "HEAD", "loop.py" if target == "loop.py" else
                                "bad.py"], capsys)
    assert status == 2 and out == "" and message in err, err
    assert not list(repo.parent.rglob("pwned"))


def test_diff_help_names_the_exit_statuses(capsys):
    with pytest.raises(SystemExit):
        main(["diff", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "0 the same, 1 different, 2 an error" in text


def test_a_file_outside_a_repository_is_an_error(tmp_path, capsys):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    (tmp_path / "net.py").write_text(MLP)
    status, _, err = run_cli(["diff", "--rev", "HEAD", str(tmp_path / "net.py")], capsys)
    assert status == 2 and "git rev-parse failed" in err


# --- pre-commit and CI ------------------------------------------------------------------------------------------------

def _yaml():
    return pytest.importorskip("yaml")  # PyYAML (pre-commit depends on it)


def hook() -> dict:
    hooks = _yaml().safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    assert [h["id"] for h in hooks] == ["symbackprop-check"]
    return hooks[0]


def checked_project(root: Path) -> None:
    """A project with models/net.py and its fresh generated/ (by the CLI)."""
    (root / "models").mkdir(parents=True)
    (root / "models" / "net.py").write_text(MLP)
    subprocess.run([sys.executable, "-m", "symbackprop", "build", "models/net.py", "--out", "generated"], cwd=root,
                   check=True, capture_output=True)


def as_python(command: list[str]) -> list[str]:
    """`symbackprop ...` run by this interpreter (the package under test)."""
    assert command[0] == "symbackprop", command
    return [sys.executable, "-m", "symbackprop", *command[1:]]


def test_the_hook_is_build_check_on_the_models_in_args():
    h = hook()
    assert h["entry"] == "symbackprop build --check" and h["language"] == "python"
    assert h["pass_filenames"] is False
    files = re.compile(h["files"])
    assert files.search("models/net.py") and files.search("generated/mlp/mlp.c") and files.search("a/generated/x.h")
    assert not files.search("README.md")


def test_pre_commit_runs_the_hook_on_a_project(tmp_path):
    """pre-commit itself, on a project, with the hook's own entry, files and
    pass_filenames (its environment the running interpreter, as a `system`
    hook: a `python` hook installs from the package index; see the slow
    try-repo test)."""
    pytest.importorskip("pre_commit")
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = tmp_path / "project"
    checked_project(root)
    local = {**hook(), "language": "system", "entry": shlex.join(as_python(shlex.split(hook()["entry"]))),
             "args": ["models/net.py", "--out", "generated"], "files": "^(models/|generated/)"}
    (root / ".pre-commit-config.yaml").write_text(_yaml().safe_dump({"repos": [{"repo": "local", "hooks": [local]}]}))
    (root / "notes.txt").write_text("notes\n")
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-qm", "a model and its generated code")
    env = {**os.environ, "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home")}

    def pre_commit(*files: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pre_commit", "run", "--files", *files], cwd=root, env=env,
                              capture_output=True, text=True)

    fresh = pre_commit("models/net.py")
    assert fresh.returncode == 0 and "Passed" in fresh.stdout, fresh.stdout + fresh.stderr
    (root / "models" / "net.py").write_text(TANH_OUTPUT)  # the model changed, generated/ not
    stale = pre_commit("models/net.py")
    assert stale.returncode == 1 and "generated file(s) are stale" in stale.stdout, stale.stdout
    (root / "models" / "net.py").write_text(MLP)
    with open(root / "generated" / "mlp" / "mlp.c", "a") as handle:  # a generated file edited by hand
        handle.write("/* edited */\n")
    assert pre_commit("generated/mlp/mlp.c").returncode == 1
    skipped = pre_commit("notes.txt")  # neither a model nor generated: the hook does not run
    assert skipped.returncode == 0 and "Skipped" in skipped.stdout


@pytest.mark.slow
def test_pre_commit_try_repo_installs_and_runs_the_hook(tmp_path):
    """`pre-commit try-repo` on this repository: pre-commit installs the
    package with pip (from the package index: needs the network) and runs
    the hook with no args, on examples/ into generated/."""
    pytest.importorskip("pre_commit")
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = tmp_path / "project"
    (root / "examples").mkdir(parents=True)
    (root / "examples" / "mlp.py").write_text(MLP)
    subprocess.run([sys.executable, "-m", "symbackprop", "build"], cwd=root, check=True, capture_output=True)
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-qm", "model")
    env = {**os.environ, "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home")}
    env.pop("PYTHONPATH", None)  # the hook's own environment, not this checkout

    def try_repo() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pre_commit", "try-repo", str(ROOT), "symbackprop-check",
                               "--all-files"], cwd=root, env=env, capture_output=True, text=True, timeout=1200)

    fresh = try_repo()
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    (root / "examples" / "mlp.py").write_text(TANH_OUTPUT)
    stale = try_repo()
    assert stale.returncode == 1 and "stale" in stale.stdout, stale.stdout + stale.stderr


def ci_snippets() -> dict[str, dict]:
    """The GitHub Actions and GitLab CI YAML of docs/review.md, parsed."""
    text = (ROOT / "docs" / "review.md").read_text()
    blocks = [_yaml().safe_load(b) for b in re.findall(r"^```yaml\n(.*?)^```", text, re.DOTALL | re.MULTILINE)]
    github = [b for b in blocks if "jobs" in b]
    gitlab = [b for b in blocks if any(isinstance(v, dict) and "script" in v for v in b.values())]
    assert len(github) == len(gitlab) == 1
    return {"github": github[0], "gitlab": gitlab[0]}


def ci_commands() -> dict[str, list[str]]:
    """Each recipe's shell commands."""
    github, gitlab = ci_snippets()["github"], ci_snippets()["gitlab"]
    assert github.get("on", github.get(True)) == "pull_request"  # YAML 1.1 reads the key `on` as True
    runs = [step["run"] for job in github["jobs"].values() for step in job["steps"] if "run" in step]
    scripts = [line for job in gitlab.values() for line in job["script"]]
    assert gitlab["generated"]["rules"] == [{"if": '$CI_PIPELINE_SOURCE == "merge_request_event"'}]
    return {"github": runs, "gitlab": scripts}


def test_the_ci_recipes_fail_on_stale_generated_code(tmp_path):
    commands = ci_commands()
    checks = {name: [c for c in cmds if c.startswith("symbackprop build --check")] for name, cmds in commands.items()}
    assert checks["github"] == checks["gitlab"] and len(checks["github"]) == 1
    command = as_python(shlex.split(checks["github"][0]))
    root = tmp_path / "project"
    checked_project(root)
    fresh = subprocess.run(command, cwd=root, capture_output=True, text=True)
    assert fresh.returncode == 0, fresh.stderr
    (root / "models" / "net.py").write_text(THREE_LAYERS)
    stale = subprocess.run(command, cwd=root, capture_output=True, text=True)
    assert stale.returncode == 1 and "stale" in stale.stderr


def test_the_github_summary_step_fails_only_on_an_error(tmp_path):
    """The recipe's math-diff step: a change (status 1) passes, an error
    (status 2) fails the step."""
    if shutil.which("bash") is None or shutil.which("git") is None:
        pytest.skip("bash and git needed")
    step = next(c for c in ci_commands()["github"] if c.startswith("symbackprop diff"))
    root = tmp_path / "project"
    checked_project(root)
    git(root, "init", "-q", "-b", "main")
    git(root, "add", ".")
    git(root, "commit", "-qm", "base")
    git(root, "update-ref", "refs/remotes/origin/main", "HEAD")  # as actions/checkout with fetch-depth 0 leaves it
    (root / "models" / "net.py").write_text(THREE_LAYERS)
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "symbackprop").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m symbackprop "$@"\n')
    (shim / "symbackprop").chmod(0o755)
    summary = tmp_path / "summary.md"
    env = {**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}", "GITHUB_STEP_SUMMARY": str(summary)}
    changed = subprocess.run(["bash", "-e", "-c", step], cwd=root, env={**env, "GITHUB_BASE_REF": "main"})
    assert changed.returncode == 0 and "| added | `grad_W3` |" in summary.read_text()
    broken = subprocess.run(["bash", "-e", "-c", step], cwd=root, env={**env, "GITHUB_BASE_REF": "no-such-branch"},
                            capture_output=True, text=True)
    assert broken.returncode != 0 and "names no commit" in broken.stderr
