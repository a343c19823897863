"""A model file as it was at a git revision, for `symbackprop diff --rev`.

The file and its neighbours (the *.py files of its folder, which it may
import) are read from the revision with `git ls-tree` and `git cat-file`
into a temporary folder, and the model is loaded from there. git runs
without a shell, with the revision checked first: it must look like a
revision (no option, no space, no shell character) and name a commit.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from symbackprop.errors import SymbackpropError

# branch and tag names, hashes, HEAD~2, main^, @{u}, origin/main; not an option
_REVISION = re.compile(r"[A-Za-z0-9_@][A-Za-z0-9_.@/~^{}+-]*")


def _git(args: Sequence[str], cwd: Path) -> bytes:
    """git's output; its own message when it fails."""
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, check=False)
    except FileNotFoundError:
        raise SymbackpropError("--rev needs git, and git is not installed (or not on PATH)") from None
    if done.returncode:
        message = done.stderr.decode(errors="replace").strip().splitlines()
        raise SymbackpropError(f"git {args[0]} failed: {message[-1] if message else f'status {done.returncode}'}")
    return done.stdout


def commit_of(revision: str, cwd: Path) -> str:
    """The commit a revision names (its full hash).

    Raises:
        SymbackpropError: it does not look like a revision, or names no commit.
    """
    if not _REVISION.fullmatch(revision) or ".." in revision:
        raise SymbackpropError(f"--rev {revision!r} is not a git revision (a branch, tag, hash or HEAD~N; "
                               "no spaces, ':' or shell characters)")
    try:
        return _git(["rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"], cwd).decode().strip()
    except SymbackpropError:
        raise SymbackpropError(f"--rev {revision!r} names no commit of the git repository at {cwd}") from None


def _existing_folder(path: Path) -> Path:
    """The nearest folder above `path` that exists (the file may be gone)."""
    folder = Path(os.path.abspath(path)).parent
    while not folder.is_dir():
        folder = folder.parent
    return folder


@contextmanager
def file_at(revision: str, path: Path) -> Iterator[Path]:
    """The model file `path` (as named in the working tree) at the git
    revision, with its folder's other *.py files, in a temporary folder
    that lives as long as the context.

    Raises:
        SymbackpropError: git is missing, the file is outside a git
            repository, the revision is bad, or the file is not in it.
    """
    folder = _existing_folder(path)
    top = Path(_git(["rev-parse", "--show-toplevel"], folder).decode().strip())
    commit = commit_of(revision, top)
    inside = os.path.relpath(os.path.realpath(Path(os.path.abspath(path)).parent), os.path.realpath(top))
    if inside.startswith(".."):
        raise SymbackpropError(f"{path} is not inside the git repository at {top}")
    prefix = "" if inside == "." else Path(inside).as_posix() + "/"
    where = prefix + Path(os.path.abspath(path)).name  # as git names it, from the top
    listing = _git(["--literal-pathspecs", "ls-tree", "-z", commit, "--", prefix or "."], top)
    blobs = {}
    for entry in listing.split(b"\0"):
        info, _, name = entry.decode(errors="surrogateescape").partition("\t")
        if info.split(" ")[1:2] == ["blob"] and name.endswith(".py") and "/" not in name[len(prefix):]:
            blobs[name] = info.split(" ")[2]
    if where not in blobs:
        raise SymbackpropError(f"{where} is not a file at revision {revision} ({commit[:12]})")
    with tempfile.TemporaryDirectory(prefix="symbackprop-rev-") as tmp:
        for name, blob in blobs.items():
            Path(tmp, name[len(prefix):]).write_bytes(_git(["cat-file", "blob", blob], top))
        yield Path(tmp, where[len(prefix):])


__all__ = ["commit_of", "file_at"]
