"""What changed in a model's math between two versions of it: the equations
of the forward pass and the adjoint equations of the backward pass (as the
derivation file lists them), the values the forward pass keeps for the
backward pass, the inputs and parameters, and the memory, as expressions in
the dimensions. Built from the plan (pipeline.plan), never from the C text.

The C names an intermediate after its op and the param or input nearest
it (mm_W2, sigmoid_W1, grad_sigmoid_W1: schedule.naming), so most values
keep their names across an edit; one whose op changed (sigmoid_W1 ->
tanh_W1) gets a new one. The diff matches the two versions' values by
name, then by structure:

- the user's names (inputs, params, outputs, the loss, the gradients,
  Model(names=...)) match by name, and so do intermediates of one name;
- bottom up: an intermediate matches the other version's intermediate
  whose defining equation is the same, in terms already matched (so the
  unchanged layers below a change match, whatever their numbers);
- top down: where a matched equation reads an unmatched intermediate at
  the place where the other version's reads one, they match (so the
  gradient of the first layer, which reads the adjoint flowing down from a
  changed layer, matches its old self).

A value matched in both versions whose equations differ (in matched terms)
has changed, unless its equations read the same (under the same name); one
left unmatched was added or removed. A renaming alone is no change.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Any

import sympy as sp

from symbackprop.base.cnames import sanitize
from symbackprop.declare.model import Model
from symbackprop.emit.derivation import derive, itemsize_of, memory_plan
from symbackprop.pipeline import DEFAULT_FUNCTIONS, plan
from symbackprop.schedule.kernel import Equation

SECTIONS = {"forward": "Forward pass (up to the loss)", "backward": "Adjoint equations (backward pass)"}
MEMORY = {
    "kept": "kept for the backward pass",
    "forward": "workspace of forward (prediction)",
    "gradient": "workspace of value_and_grad",
}
_TOKEN = re.compile(r"[A-Za-z_]\w*|\d+(?:\.\d+)?|\*\*|\S")


@dataclass(frozen=True)
class Step:
    """One value the functions compute, and the equations that define it.

    Args:
        name: its name in the C source (t3, grad_W1, Y).
        section: "forward" (up to the loss) or "backward".
        lines: each equation as the C comments read it, "t3 = b1 + t2".
        rhs: each equation's assignment and right side, as tokens.
    """

    name: str
    section: str
    lines: tuple[str, ...]
    rhs: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class ModelMath:
    """One version of a model, as the diff compares it.

    Args:
        name: the model's name.
        steps: its values by name, in the order the C computes them.
        anchors: the user's names (they match by name).
        leaves: each input and param's shape, "rows x cols".
        kept: each value the backward pass keeps: (shape, bytes).
        memory: bytes by MEMORY key, in the dimensions.
    """

    name: str
    steps: dict[str, Step]
    anchors: frozenset[str]
    leaves: dict[str, str]
    kept: dict[str, tuple[str, sp.Expr]]
    memory: dict[str, sp.Expr]


def _shape(shape: tuple) -> str:
    return f"{shape[0]} x {shape[1]}"


def model_math(model: Model, dtype: str = "float64") -> ModelMath:
    """Plan the model's forward and value_and_grad (forward alone when it
    has no loss) and gather what the diff compares.

    Raises:
        ModelError: the model cannot be compiled.
    """
    the_plan = plan(model, DEFAULT_FUNCTIONS if model.has_loss else ("forward",))
    lowered, itemsize = the_plan.lowered, itemsize_of(dtype)
    forward = the_plan.function("forward").schedule
    kept: dict[str, tuple[str, sp.Expr]] = {}
    if model.has_loss:
        gradient = the_plan.function("value_and_grad").schedule
        derived = derive(model.name, forward, gradient, dtype, list(lowered.leaves))
        sections: tuple[tuple[str, tuple[Equation, ...]], ...] = (
            ("forward", derived.forward), ("backward", derived.backward))
        memory = memory_plan(forward, gradient, itemsize)
        kept = {name: (_shape(shape), size) for name, shape, size in memory.kept}
        sizes = {"kept": memory.kept_bytes, "forward": memory.forward_work_bytes,
                 "gradient": memory.gradient_work_bytes}
    else:
        sections = (("forward", tuple(e for k in forward.kernels for e in k.equations)),)
        sizes = {"forward": sp.expand(forward.work_size * itemsize)}
    anchors = set(lowered.leaves) | set(lowered.outputs) | {sanitize(name) for name, _ in lowered.named}
    anchors |= {name for fn in the_plan.functions for name, _ in fn.schedule.results}
    return ModelMath(model.name, _steps(sections), frozenset(anchors),
                     {name: _shape(node.shape) for name, node in lowered.leaves.items()}, kept, sizes)


def _steps(sections: Iterable[tuple[str, Iterable[Equation]]]) -> dict[str, Step]:
    """The equations grouped by the value they define (several when a loop
    adds into one place), each in the section where it is first written."""
    lines: dict[str, list[str]] = defaultdict(list)
    rhs: dict[str, list[tuple[str, ...]]] = defaultdict(list)
    where: dict[str, str] = {}
    for section, equations in sections:
        for e in equations:
            where.setdefault(e.lhs, section)
            lines[e.lhs].append(e.comment)
            rhs[e.lhs].append((e.assign, *_TOKEN.findall(e.text)))
    return {name: Step(name, where[name], tuple(lines[name]), tuple(rhs[name])) for name in where}


# A token in matched terms: ("@", the new version's name) for a matched
# value, ("old", name) / ("new", name) for one not (yet) matched, ("", token)
# for anything else (an input, a function name, an operator).
Canon = tuple[str, str]


@dataclass
class _Matching:
    """The old version's values paired with the new one's (see the module's
    docstring)."""

    old: ModelMath
    new: ModelMath
    to_new: dict[str, str] = field(default_factory=dict)
    to_old: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.old.steps:
            if name in self.old.anchors and name in self.new.anchors and name in self.new.steps:
                self._pair(name, name)
        for name in self.old.steps:  # an intermediate's name says what it is (its op, its layer's param)
            if name not in self.to_new and name in self.new.steps and name not in self.new.anchors:
                self._pair(name, name)
        while self._bottom_up() or self._top_down(loose=False) or self._top_down(loose=True):
            pass  # each round pairs at least one more value; the exact rules before the loose one

    def _pair(self, old: str, new: str) -> None:
        self.to_new[old], self.to_old[new] = new, old

    def canon_old(self, token: str) -> Canon:
        if token in self.to_new:
            return ("@", self.to_new[token])
        return ("old", token) if token in self.old.steps and token not in self.old.anchors else ("", token)

    def canon_new(self, token: str) -> Canon:
        if token in self.to_old:
            return ("@", token)
        return ("new", token) if token in self.new.steps and token not in self.new.anchors else ("", token)

    def signature_old(self, name: str) -> tuple[tuple[Canon, ...], ...]:
        return tuple(tuple(map(self.canon_old, rhs)) for rhs in self.old.steps[name].rhs)

    def signature_new(self, name: str) -> tuple[tuple[Canon, ...], ...]:
        return tuple(tuple(map(self.canon_new, rhs)) for rhs in self.new.steps[name].rhs)

    def _unmatched(self, version: ModelMath, matched: dict[str, str]) -> list[str]:
        return [n for n in version.steps if n not in version.anchors and n not in matched]

    def _bottom_up(self) -> bool:
        """Pair intermediates defined alike in matched terms, in order."""
        alike: dict[tuple, list[str]] = defaultdict(list)
        for name in self._unmatched(self.old, self.to_new):
            signature = self.signature_old(name)
            if all(c[0] != "old" for rhs in signature for c in rhs):
                alike[signature].append(name)
        grew = False
        for name in self._unmatched(self.new, self.to_old):
            candidates = alike.get(self.signature_new(name))
            if candidates:
                self._pair(candidates.pop(0), name)
                grew = True
        return grew

    def _top_down(self, loose: bool) -> bool:
        """Pair the unmatched intermediates that matched equations read at
        the same place: exactly (the same right side but for them), or
        loosely (within the stretches that two changed right sides share)."""
        grew = False
        for old, new in list(self.to_new.items()):
            for x, y in zip(self.old.steps[old].rhs, self.new.steps[new].rhs):
                for a, b in _aligned(list(map(self.canon_old, x)), list(map(self.canon_new, y)), loose):
                    if a not in self.to_new and b not in self.to_old:
                        self._pair(a, b)
                        grew = True
        return grew


def _aligned(x: list[Canon], y: list[Canon], loose: bool) -> list[tuple[str, str]]:
    """(old, new) unmatched names at the same place of two right sides."""
    if not loose:
        if len(x) != len(y) or any(s != t and (s[0], t[0]) != ("old", "new") for s, t in zip(x, y)):
            return []
        return [(s[1], t[1]) for s, t in zip(x, y) if s != t]
    def blank(c: Canon) -> Canon:
        return ("?", "") if c[0] in ("old", "new") else c
    blocks = SequenceMatcher(None, list(map(blank, x)), list(map(blank, y)), autojunk=False).get_matching_blocks()
    return [(x[i + k][1], y[j + k][1]) for i, j, size in blocks for k in range(size) if x[i + k][0] == "old"]


@dataclass(frozen=True)
class Change:
    """A value whose equations were added, removed or changed.

    Args:
        kind: "added", "removed" or "changed".
        old: the old version's Step (None when added).
        new: the new version's Step (None when removed).
    """

    kind: str
    old: Step | None
    new: Step | None

    @property
    def step(self) -> Step:
        """The new version's Step (the old one's, when removed)."""
        step = self.new or self.old
        assert step is not None, "a Change has an old or a new Step"
        return step

    @property
    def name(self) -> str:
        return self.step.name

    @property
    def section(self) -> str:
        return self.step.section


@dataclass(frozen=True)
class Row:
    """One line of a before/after table (a kept value, a leaf, a memory size).

    Args:
        label: what it is.
        before: its old value as text ('' when added).
        after: its new value as text ('' when removed).
    """

    label: str
    before: str
    after: str

    @property
    def kind(self) -> str:
        return "added" if not self.before else "removed" if not self.after else "changed"


@dataclass(frozen=True)
class MathDiff:
    """What diff_models found.

    Args:
        model: the model's name (old -> new when it changed).
        equations: the values whose equations changed, in the new order,
            then the removed ones in the old order.
        renamed: (old, new) names of intermediates that are the same math
            under a new number.
        leaves: the inputs and params added, removed or reshaped.
        kept: the values kept for the backward pass added, removed or resized.
        memory: every memory size, before and after (bytes).
        sections: the keys of SECTIONS either version has (no backward
            pass without a loss).
    """

    model: str
    equations: tuple[Change, ...]
    renamed: tuple[tuple[str, str], ...]
    leaves: tuple[Row, ...]
    kept: tuple[Row, ...]
    memory: tuple[Row, ...]
    sections: tuple[str, ...] = tuple(SECTIONS)

    @property
    def memory_changed(self) -> bool:
        return any(row.before != row.after for row in self.memory)

    @property
    def changed(self) -> bool:
        """Whether anything differs (a renaming alone is no change)."""
        return bool(self.equations or self.leaves or self.kept or self.memory_changed)

    def names(self, kind: str, section: str | None = None) -> set[str]:
        """The names of the values with this kind of change (in a section)."""
        return {c.name for c in self.equations if c.kind == kind and section in (None, c.section)}


def diff_models(old: Model, new: Model) -> MathDiff:
    """The change in the math from `old` to `new` (see the module's docstring).

    Raises:
        ModelError: either model cannot be compiled.
    """
    return diff_math(model_math(old), model_math(new))


def diff_math(old: ModelMath, new: ModelMath) -> MathDiff:
    """diff_models on what model_math gathered."""
    matching = _Matching(old, new)
    changes = []
    for name, step in new.steps.items():
        was = matching.to_old.get(name)
        if was is None:
            changes.append(Change("added", None, step))
        elif matching.signature_old(was) != matching.signature_new(name) and old.steps[was].lines != step.lines:
            changes.append(Change("changed", old.steps[was], step))
    changes += [Change("removed", step, None) for name, step in old.steps.items() if name not in matching.to_new]
    renamed = tuple((a, b) for a, b in matching.to_new.items() if a != b)
    leaves = _rows(old.leaves, new.leaves, lambda shape: shape)
    # a kept buffer no equation defines (a loop's) keeps its name; an unmatched intermediate has none now
    kept_names = {name: matching.to_new.get(name, name) for name in old.kept
                  if name in matching.to_new or name not in old.steps or name in old.anchors}
    kept = _rows(old.kept, new.kept, lambda value: f"{value[0]}, {value[1]} bytes", kept_names)
    memory = tuple(Row(MEMORY[key], str(old.memory.get(key, "")), str(new.memory.get(key, "")))
                   for key in MEMORY if key in old.memory or key in new.memory)
    title = old.name if old.name == new.name else f"{old.name} -> {new.name}"
    present = {step.section for version in (old, new) for step in version.steps.values()}
    return MathDiff(title, tuple(changes), renamed, leaves, kept, memory, tuple(s for s in SECTIONS if s in present))


def _rows(old: dict, new: dict, text: Callable[[Any], str], to_new: Mapping[str, str] | None = None) -> tuple[Row, ...]:
    """The entries added, removed or different; `to_new` renames the old
    keys (one it leaves out is gone; a removed one is labelled "old (now new)")."""
    to_new = to_new or {key: key for key in old}
    before = {to_new[key]: text(value) for key, value in old.items() if key in to_new}
    rows = [Row(key, before.get(key, ""), text(value)) for key, value in new.items() if before.get(key) != text(value)]
    for key, value in old.items():
        now = to_new.get(key)
        if now not in new:
            rows.append(Row(key if now in (None, key) else f"{key} (now {now})", text(value), ""))
    return tuple(rows)


def _memory_change(row: Row) -> str:
    if not row.before or not row.after:
        return ""
    delta = sp.expand(sp.sympify(row.after) - sp.sympify(row.before))
    return "" if delta == 0 else f"{'+' if not str(delta).startswith('-') else ''}{delta}"


def render_text(diff: MathDiff, old_label: str, new_label: str) -> str:
    """The diff as plain text, diff(1) style: '-' old, '+' new."""
    out = [f"math diff of {diff.model}: {old_label} -> {new_label}"]
    if not diff.changed:
        return "\n".join([*out, "no change in the math", *_renamed_text(diff)]) + "\n"
    for section in diff.sections:
        title = SECTIONS[section]
        changes = [c for c in diff.equations if c.section == section]
        out.append(f"\n{title}:" + ("" if changes else " no change"))
        for change in changes:
            out.append(f"  {change.kind} {change.name}:")
            out += [f"    - {line}" for line in (change.old.lines if change.old else ())]
            out += [f"    + {line}" for line in (change.new.lines if change.new else ())]
    for title, rows in (("Inputs and parameters", diff.leaves), ("Kept for the backward pass", diff.kept)):
        if rows:
            out.append(f"\n{title}:")
            out += [f"  {row.kind} {row.label}: {row.before or '-'} -> {row.after or '-'}" for row in rows]
    out.append("\nMemory, in bytes:" + ("" if diff.memory_changed else " no change"))
    for row in diff.memory:
        delta = _memory_change(row)
        out.append(f"  {row.label}: {row.before or '-'} -> {row.after or '-'}" + (f" ({delta})" if delta else ""))
    return "\n".join(out + _renamed_text(diff)) + "\n"


def _renamed_text(diff: MathDiff, most: int = 20) -> list[str]:
    if not diff.renamed:
        return []
    shown = ", ".join(f"{a} -> {b}" for a, b in diff.renamed[:most])
    more = f" and {len(diff.renamed) - most} more" if len(diff.renamed) > most else ""
    return [f"\nRenamed (the same math under a new name): {shown}{more}"]


def _code(text: str) -> str:
    """Inline code in a Markdown table cell."""
    return "`" + text.replace("`", "'").replace("|", "\\|") + "`" if text else ""


def render_markdown(diff: MathDiff, old_label: str, new_label: str) -> str:
    """The diff as Markdown tables, to paste into a pull request."""
    out = [f"### Math diff of `{diff.model}`", "", f"{_code(old_label)} → {_code(new_label)}", ""]
    if not diff.changed:
        return "\n".join([*out, "**No change in the math.**", *_renamed_text(diff)]) + "\n"
    for section in diff.sections:
        title = SECTIONS[section]
        changes = [c for c in diff.equations if c.section == section]
        out += [f"#### {title}", ""]
        if not changes:
            out += ["No change.", ""]
            continue
        out += ["| change | value | before | after |", "|---|---|---|---|"]
        for change in changes:
            before = "<br>".join(_code(line) for line in (change.old.lines if change.old else ()))
            after = "<br>".join(_code(line) for line in (change.new.lines if change.new else ()))
            out.append(f"| {change.kind} | {_code(change.name)} | {before} | {after} |")
        out.append("")
    for title, rows in (("Inputs and parameters", diff.leaves), ("Kept for the backward pass", diff.kept)):
        if rows:
            out += [f"#### {title}", "", "| change | value | before | after |", "|---|---|---|---|"]
            out += [f"| {r.kind} | {_code(r.label)} | {r.before} | {r.after} |" for r in rows]
            out.append("")
    out += ["#### Memory (bytes)", "", "| | before | after | change |", "|---|---|---|---|"]
    out += [f"| {r.label} | {_code(r.before)} | {_code(r.after)} | {_code(_memory_change(r))} |" for r in diff.memory]
    return "\n".join(out + _renamed_text(diff)) + "\n"


RENDERERS = {"text": render_text, "markdown": render_markdown}

__all__ = ["RENDERERS", "Change", "MathDiff", "ModelMath", "Row", "diff_math", "diff_models", "model_math",
           "render_markdown", "render_text"]
