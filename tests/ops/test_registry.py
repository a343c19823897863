"""The op registry (symbackprop/ops): a missing op or field is an error
that names both, and every registered op is complete for the stages it
reaches (a kernel has an emitter and a template block that exists)."""

import re
from pathlib import Path

import pytest

from symbackprop.base.registry import MissingRule, OpRecord, record, records, reductions, register, rule
from symbackprop.declare.tensor import Reduce

TEMPLATES = Path(__file__).resolve().parents[2] / "templates"


def test_a_missing_op_is_named():
    with pytest.raises(MissingRule, match="op 'no_such_op' is not registered"):
        record("no_such_op")


def test_a_missing_field_names_the_op_and_the_field():
    with pytest.raises(MissingRule, match="op 'transpose' has no kernel"):
        rule("transpose", "kernel")


def test_an_op_registered_twice_is_refused():
    with pytest.raises(ValueError, match="'matmul' is registered twice"):
        register(OpRecord("matmul"))


def test_every_kernel_has_an_emitter_and_a_template_that_exists():
    macros = set(re.findall(r"{% macro (\w+)\(", (TEMPLATES / "macros.j2").read_text()))
    runtime = (TEMPLATES / "runtime.h.j2").read_text()  # the helper blocks: the templates the runtime header includes
    helpers = "".join((TEMPLATES / name).read_text() for name in re.findall(r'{% include "(\w+\.c\.j2)" %}', runtime))
    for op in records():
        if op.kernel is None and op.group_kernel is None and op.fused != "elementwise":
            continue
        assert op.emit is not None or op.name == "scan_vjp", op.name  # scan_vjp's kernel is a "scan" kernel
        if op.template is not None:
            assert op.template in macros or (TEMPLATES / op.template).is_file(), (op.name, op.template)
        if op.helper:
            assert f'"{op.name}"' in helpers, f"{op.name}: no C helper block in the runtime header's templates"


def test_every_builtin_op_has_rules_and_a_numpy_reference():
    for name in ("map", "matmul", "transpose", "element", "pack", "emap", "cumsum", *reductions()):
        op = record(name)
        assert op.vjp and op.jvp and op.evaluate and op.grad_fn, name


def test_the_reduction_names_are_written_once():
    assert set(reductions()) == {"sum", "logsumexp", "max", "min", "prod"}
    assert set(Reduce.ops()) == set(reductions()) | {"mean"}
