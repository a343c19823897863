"""A model file as it was at a git revision, for `symbackprop diff --rev`.

The file and its neighbours (the *.py files of its folder, which it may
import) are read from the revision with `git ls-tree` and `git cat-file`
into a temporary folder, and the model is loaded from there. git runs
without a shell, with the revision checked first: it must look like a
revision (no option, no space, no shell character) and name a commit.

Symbolic links are followed as `build` and a plain `diff` follow them in
the working tree (the model's neighbours are those of the file a link
names), but inside the revision's tree only: each link's target is read
from the revision (git stores it as a blob), and a link that points
outside the repository (an absolute target, or `..` above its top) is
refused, so nothing from outside the revision is read or run.
"""

from __future__ import annotations

import os
import posixpath
import re
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from symbackprop.errors import SymbackpropError

LINK_MODE = "120000"  # git's mode of a symbolic link (its blob: the target path)
MAX_LINKS = 40  # as the kernel's ELOOP

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


def _entry(top: Path, commit: str, name: str) -> tuple[str, str, str] | None:
    """(mode, type, object) of the path `name` (from the top) at the commit,
    or None where there is none."""
    listing = _git(["--literal-pathspecs", "ls-tree", "-z", commit, "--", name], top)
    for entry in listing.split(b"\0"):
        info, _, found = entry.decode(errors="surrogateescape").partition("\t")
        if found == name:
            mode, kind, obj = info.split(" ")
            return mode, kind, obj
    return None


def resolved_at(top: Path, commit: str, name: str, revision: str) -> str:
    """The path (from the top) that `name` names at the commit once every
    symbolic link on the way is followed, within the revision's tree.

    Args:
        revision: how messages name the revision.

    Raises:
        SymbackpropError: a link points outside the repository, too many
            links, or the path is not there.
    """
    parts, links = name.split("/"), 0
    done: list[str] = []
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not done:
                raise SymbackpropError(f"{name} at revision {revision} is a symbolic link that points outside "
                                       f"the git repository at {top}")
            done.pop()
            continue
        entry = _entry(top, commit, "/".join([*done, part]))
        if entry is None:
            raise SymbackpropError(f"{name} is not a file at revision {revision} ({commit[:12]})")
        if entry[0] == LINK_MODE:
            links += 1
            target = _git(["cat-file", "blob", entry[2]], top).decode(errors="surrogateescape")
            if links > MAX_LINKS or posixpath.isabs(target) or not target:
                reason = "too many levels of symbolic links" if links > MAX_LINKS else "points outside the git repository"
                raise SymbackpropError(f"{name} at revision {revision} is a symbolic link that {reason} at {top}")
            parts = target.split("/") + parts  # relative to the link's folder: `done`
            continue
        done.append(part)
    return "/".join(done)


def _neighbours(top: Path, commit: str, prefix: str) -> dict[str, str]:
    """{name from the top: blob} of the *.py files of a folder at the
    commit (`prefix`: the folder from the top, with its slash, or ""); a
    link among them is read as the file it names, left out where it
    points outside the repository or at no file."""
    listing = _git(["--literal-pathspecs", "ls-tree", "-z", commit, "--", prefix or "."], top)
    blobs = {}
    for entry in listing.split(b"\0"):
        info, _, name = entry.decode(errors="surrogateescape").partition("\t")
        mode, kind, obj = ([*info.split(" "), "", "", ""])[:3]
        if kind != "blob" or not name.endswith(".py") or "/" in name[len(prefix):]:
            continue
        if mode == LINK_MODE:
            try:
                target = resolved_at(top, commit, name, commit)
            except SymbackpropError:
                continue
            found = _entry(top, commit, target)
            if found is None or found[1] != "blob" or found[0] == LINK_MODE:
                continue
            obj = found[2]
        blobs[name] = obj
    return blobs


@contextmanager
def file_at(revision: str, path: Path) -> Iterator[Path]:
    """The model file `path` (as named in the working tree) at the git
    revision, with its folder's other *.py files, in a temporary folder
    that lives as long as the context. Where the file (or a folder on its
    way) is a symbolic link at the revision, the file it names and that
    file's neighbours.

    Raises:
        SymbackpropError: git is missing, the file is outside a git
            repository, the revision is bad, the file is not in it, or a
            link on its way points outside the repository.
    """
    folder = _existing_folder(path)
    top = Path(_git(["rev-parse", "--show-toplevel"], folder).decode().strip())
    commit = commit_of(revision, top)
    inside = os.path.relpath(os.path.realpath(Path(os.path.abspath(path)).parent), os.path.realpath(top))
    if inside.startswith(".."):
        raise SymbackpropError(f"{path} is not inside the git repository at {top}")
    named = ("" if inside == "." else Path(inside).as_posix() + "/") + Path(os.path.abspath(path)).name
    where = resolved_at(top, commit, named, revision)
    prefix = posixpath.dirname(where) + "/" if "/" in where else ""
    blobs = _neighbours(top, commit, prefix)
    if where not in blobs:
        raise SymbackpropError(f"{named} is not a file at revision {revision} ({commit[:12]})")
    with tempfile.TemporaryDirectory(prefix="symbackprop-rev-") as tmp:
        for name, blob in blobs.items():
            Path(tmp, name[len(prefix):]).write_bytes(_git(["cat-file", "blob", blob], top))
        yield Path(tmp, where[len(prefix):])


__all__ = ["commit_of", "file_at", "resolved_at"]
