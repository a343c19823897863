"""`symbackprop diff`: load the two versions of a model (two files, or one
file at git revisions) and print what changed in the math.

    symbackprop diff OLD NEW                   two model files, FILE[:NAME]
    symbackprop diff --rev REV MODEL           MODEL at REV -> MODEL in the working tree
    symbackprop diff --rev REV1 --rev REV2 MODEL   MODEL at REV1 -> MODEL at REV2

Exit status, as diff(1): 0 no change in the math, 1 changed, 2 error.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

from symbackprop.declare.model import Model
from symbackprop.errors import SymbackpropError
from symbackprop.review.mathdiff import RENDERERS, diff_models
from symbackprop.review.revisions import file_at

USAGE = "diff takes OLD NEW (two model files), or --rev REV [--rev REV2] MODEL_FILE[:NAME]"


def run_diff(models: Sequence[str], revisions: Sequence[str], fmt: str, load: Callable[[str], Model],
             split: Callable[[str], tuple[Path, str]]) -> int:
    """Print the diff (fmt: "text" or "markdown") and return the exit status.

    Args:
        models: the model specs (two, or one with revisions).
        revisions: the git revisions (none, one or two).
        fmt: a key of RENDERERS.
        load: the one Model a FILE[:NAME] spec names.
        split: a FILE[:NAME] spec into the file and the name ('' when none).

    Raises:
        SymbackpropError: bad arguments, a revision or file git cannot
            find, or a model that cannot be loaded or compiled.
    """
    if len(models) != (1 if revisions else 2) or len(revisions) > 2:
        raise SymbackpropError(USAGE)
    specs = list(models) * 2 if revisions else list(models)
    versions = [*revisions, None, None][:2]  # the new version of one file: the working tree
    found, labels = [], []
    with ExitStack() as stack:
        for spec, revision in zip(specs, versions):
            if revision is None:
                found.append(load(spec))
                labels.append(spec)
                continue
            path, name = split(spec)
            copy = stack.enter_context(file_at(revision, path))
            try:
                found.append(load(f"{copy}:{name}" if name else str(copy)))
            except SymbackpropError as exc:
                message = str(exc).replace(str(copy), str(path))  # the file as the user named it
                raise SymbackpropError(f"at revision {revision}: {message}") from None
            labels.append(f"{spec} at {revision}")
        result = diff_models(*found)
    sys.stdout.write(RENDERERS[fmt](result, *labels))
    return 1 if result.changed else 0


__all__ = ["USAGE", "run_diff"]
