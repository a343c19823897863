"""What the module cache trusts: folders and files only this user (or root)
can write, and entries whose files match the manifest written when they
were built.

Like ssh with its keys, a cache folder, entry or file that another user
owns, or that group or others may write, is not used: whoever can write it
could put code there that this process would then run. A built entry has
a manifest (`manifest.json`: the size and SHA-256 of each file), checked
before its library is loaded, so a truncated, emptied or overwritten
library (which dlopen would load and then crash on, with SIGBUS) is found
and rebuilt instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import stat
from pathlib import Path

from symbackprop.errors import BuildError
from symbackprop.log import logger

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
NOT_IN_MANIFEST = ("build.log", MANIFEST)  # the compiler's log may be read by people, never loaded
ABSENT = "absent"  # an entry not built yet: a plain cache miss, no warning


def _trusted_owner(uid: int) -> bool:
    return not hasattr(os, "getuid") or uid in (os.getuid(), 0)


def untrusted(path: Path, kind: str, follow: bool = False) -> str | None:
    """Why `path` (a "folder" or "file") must not be trusted, or None: it is
    missing, a link (unless `follow`), of the other kind, owned by another
    user, or writable by group or others."""
    try:
        info = os.stat(path) if follow else os.lstat(path)
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror})"
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link"
    if (kind == "folder") != stat.S_ISDIR(info.st_mode) or (kind == "file" and not stat.S_ISREG(info.st_mode)):
        return f"{path} is not a {'folder' if kind == 'folder' else 'regular file'}"
    if not hasattr(os, "getuid"):
        return None  # Windows: no uid and mode bits to check
    if not _trusted_owner(info.st_uid):
        return f"{path} belongs to another user (uid {info.st_uid}, this process runs as uid {os.getuid()})"
    if info.st_mode & 0o022:
        return f"{path} can be written by its group or others (mode {oct(info.st_mode & 0o777)})"
    return None


def make_private_folder(path: Path) -> None:
    """Create `path` and any missing parents, each 0o700 (OSError where it cannot)."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made by another process meanwhile
            folder.mkdir(mode=0o700)


def secure_root(root: Path) -> Path:
    """The cache folder `root`, created 0o700 if missing.

    Raises:
        BuildError: it cannot be created, or another user owns it, or group
            or others may write it (whoever can write it chooses the code
            this process runs).
    """
    try:
        make_private_folder(root)
    except OSError as exc:
        raise BuildError(f"cannot write the module cache in {root} ({exc}); set SYMBACKPROP_CACHE_DIR to a "
                         "writable folder") from exc
    problem = untrusted(root, "folder", follow=True)  # the root may be a link the user made
    if problem:
        raise BuildError(f"refusing the module cache folder: {problem}; code loaded from it could have been put "
                         "there by someone else. Use a folder only you can write (chmod go-w, or set "
                         "SYMBACKPROP_CACHE_DIR)")
    return root


def file_digest(path: Path) -> tuple[int, str]:
    """The size and SHA-256 of a file."""
    hasher = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            hasher.update(block)
            size += len(block)
    return size, hasher.hexdigest()


def write_manifest(folder: Path) -> None:
    """Make the files of a freshly built entry writable by this user only,
    and record their sizes and hashes in its manifest."""
    files = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.is_symlink():
            path.chmod(path.stat().st_mode & 0o755)
            if path.name not in NOT_IN_MANIFEST:
                size, sha = file_digest(path)
                files[path.name] = {"size": size, "sha256": sha}
    text = json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1, sort_keys=True)
    (folder / MANIFEST).write_text(text)
    (folder / MANIFEST).chmod(0o644)


def entry_problem(folder: Path, library: str) -> str | None:
    """Why the cache entry `folder` must not be loaded (ABSENT where it does
    not exist), or None: it and its files are this user's only and match
    its manifest, which lists the library `library`."""
    if not os.path.lexists(folder):
        return ABSENT
    problem = untrusted(folder, "folder") or untrusted(folder / MANIFEST, "file")
    if problem:
        return problem
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"] if isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT else None
    except (OSError, ValueError, KeyError) as exc:
        return f"its manifest cannot be read ({exc})"
    if not isinstance(files, dict) or library not in files:
        return f"its manifest does not list {library}"
    for name, want in files.items():
        path = folder / name
        problem = untrusted(path, "file") if name == os.path.basename(name) else f"its manifest names {name!r}"
        if problem:
            return problem
        try:
            size, sha = file_digest(path)
        except OSError as exc:
            return f"{path} cannot be read ({exc})"
        if not isinstance(want, dict) or (size, sha) != (want.get("size"), want.get("sha256")):
            return f"{path} is not the file that was built ({size} bytes, SHA-256 {sha[:12]}; the manifest says {want})"
    return None


def move_aside(folder: Path) -> None:
    """Take a damaged or untrusted entry out of the cache (one rename, so a
    reader never sees half of it), then delete what this user may delete."""
    if not os.path.lexists(folder):
        return
    aside = folder.with_name(f"tmp-rejected-{folder.name}-{secrets.token_hex(4)}")
    os.rename(folder, aside)
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)  # what another user owns may stay (tmp-*: retried later)
    else:
        aside.unlink()


def warn(text: str, *args: object) -> None:
    """A damaged or refused cache file: worth a WARNING, never an exception."""
    logger.warning(text, *args)
