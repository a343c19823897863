"""A long generated function is cut into parts (symbackprop/cparts.py): the
parts' boundaries, what each part declares, and that the C of a deep model
grows linearly with its depth and computes what numpy computes."""

import re
import sys
from pathlib import Path

import numpy as np

from symbackprop.emit.cparts import PART_KERNELS, part_ranges, prelude
from symbackprop.pipeline import generate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import itertools

from test_depth import _check_gradients, mlp_data, mlp_model, mlp_numpy


def test_short_functions_are_one_part():
    assert part_ranges(PART_KERNELS, None) == ()
    assert part_ranges(3, 1) == ()


def test_parts_cover_the_kernels_and_the_split_is_a_boundary():
    ranges = part_ranges(3 * PART_KERNELS + 5, PART_KERNELS + 7)
    assert ranges[0][0] == 0 and ranges[-1][1] == 3 * PART_KERNELS + 5
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert PART_KERNELS + 7 in [start for start, _ in ranges]
    assert all(end - start <= PART_KERNELS for start, end in ranges)


def test_prelude_takes_only_the_parameters_and_pointers_the_part_uses():
    params = [(name, f"decl {name}") for name in ("n", "X", "W", "work", "with_grads", "t0", "t1", "t2")]
    found = prelude(params, "t3[i] = t2[i] * X[i] + t0[i]; /* t1 and W^T in a comment use nothing */")
    assert [name for name, _ in found.params] == ["X", "t0", "t2"]  # -Wunused: a comment's words are no use
    unused = prelude(params, "W[0] = 1;")
    assert unused.params == (("W", "decl W"),)


def _lines(depth: int) -> list[str]:
    emitted, _ = generate(mlp_model(depth), "float64")
    return emitted.source.splitlines()


def test_the_c_of_a_deep_model_grows_linearly_with_its_depth():
    """Each part declares only what it uses: no part's text grows with the
    function's length (it once took every parameter: quadratic)."""
    short, long = _lines(20), _lines(40)
    assert any("_part1(" in line for line in long)
    assert len(long) / len(short) < 2.2, (len(short), len(long))
    assert len(_part_parameters(long)) > 2
    # a part that took every parameter and pointer of the function would
    # make the parts' parameter lists grow as depth squared (4x here)
    taken_short, taken_long = sum(_part_parameters(short)), sum(_part_parameters(long))
    assert taken_long / taken_short < 3, (taken_short, taken_long)


def _part_parameters(lines: list[str]) -> list[int]:
    """How many parameter lines each part's signature has."""
    source = "\n".join(lines)
    head = r"(?:static|\w+_SHARED) void \w+_part\d+\("  # _SHARED: in units
    parts = re.findall(head + r"\n(.*?)\n\)", source, re.S)
    return [part.count("\n") + 1 for part in parts]


def test_a_model_cut_into_parts_computes_what_numpy_computes():
    import symbackprop as sbp

    depth = 12
    mod = sbp.compile(mlp_model(depth))
    assert "_part2(" in mod.source
    probes = [("W0", (0, 1)), (f"W{depth - 1}", (1, 0)), ("V", (1, 0))]
    _check_gradients(mod, mlp_data(depth), lambda a: mlp_numpy(depth, a), probes)
    forward = mod.forward(**mlp_data(depth))  # the forward-only call returns at the split, between parts
    assert np.isclose(forward["loss"], mlp_numpy(depth, mlp_data(depth)))


def test_a_long_straight_kernel_is_a_part_of_its_own():
    assert part_ranges(3, 1, [1]) == ((0, 1), (1, 2), (2, 3))
    assert part_ranges(4, 2, [0]) == ((0, 1), (1, 2), (2, 4))
    assert part_ranges(2, None, [1]) == ((0, 1), (1, 2))
