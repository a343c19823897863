"""The front cache: a model's generated code and plan, by fingerprint, as
JSON memos beside the built modules (never pickles: reading one runs no
code), valid only for the package code that made them (package_digest)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from functools import lru_cache

from symbackprop._version import __version__
from symbackprop.base import trust as cache_trust
from symbackprop.base.trust import secure_root, warn
from symbackprop.errors import BuildError
from symbackprop.toolchain.builder import BuildOptions, cache_root
from symbackprop.toolchain.key import digest

MEMO_FOLDER = "models"


@lru_cache(maxsize=1)
def package_digest() -> str:
    """A hash of symbackprop's own code and templates: a memo made by other
    code is never used (no hand-bumped cache versions). One walk with
    os.walk and plain strings (pathlib's rglob and Path sorting took 3x as
    long: this runs in every cached compile)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # every stage's code, templates and C
    named = []
    if not os.path.isdir(os.path.join(package, "templates")):  # a checkout's: emit.templatecache.TEMPLATES
        templates = os.path.join(os.path.dirname(package), "templates")
        named += [(f"templates/{name}", os.path.join(templates, name)) for name in os.listdir(templates)
                  if name.endswith(".j2")]
    for folder, subfolders, files in os.walk(package):
        subfolders[:] = [name for name in subfolders if name != "__pycache__"]
        relative = os.path.relpath(folder, package).replace(os.sep, "/")
        named += [(name if relative == "." else f"{relative}/{name}", os.path.join(folder, name))
                  for name in files if name.endswith((".py", ".j2", ".c"))]
    parts: list[str | bytes] = []
    for name, path in sorted(named):
        with open(path, "rb") as handle:
            parts += [name, handle.read()]
    return digest("package", __version__, *parts, length=64)


MEMO_MAX_BYTES = 64 << 20  # far above any memo; a bigger file is not one of ours


def read_memo(key: str, options: BuildOptions | None = None) -> dict | None:
    """The dict write_memo stored under key, or None: absent, or (with a
    logged warning) unreadable, not JSON, not a dict, too large, or in a
    file or folder that is not this user's alone. Reading runs no code."""
    try:
        folder = cache_root(options) / MEMO_FOLDER
    except OSError:
        return None
    path = folder / f"{key}.json"
    if not os.path.lexists(path):
        return None
    problem = cache_trust.untrusted(folder, "folder") or cache_trust.untrusted(path, "file")
    if problem is None:
        try:
            with open(path, "rb") as handle:  # the size again on the open file: it may have changed
                data = handle.read(MEMO_MAX_BYTES + 1)
            if len(data) > MEMO_MAX_BYTES:
                problem = f"{path} is larger than {MEMO_MAX_BYTES} bytes"
            else:
                value = json.loads(data.decode("utf-8"))
                problem = None if isinstance(value, dict) else f"{path} holds a {type(value).__name__}, not a dict"
        except (OSError, ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            problem = f"{path} is not a readable JSON memo ({type(exc).__name__}: {exc})"
    if problem is not None:
        warn("ignoring a model memo (it is made again): %s", problem)
        return None
    return value


def write_memo(key: str, value: object, options: BuildOptions | None = None) -> None:
    """Store the JSON-serializable dict `value` under key, atomically (a
    reader sees all of it or none). The memo only saves time: any failure
    (a value JSON cannot hold, a full disk) is a logged warning, and leaves
    no temporary file."""
    try:
        if not isinstance(value, dict):
            raise TypeError(f"a memo is a dict, not a {type(value).__name__}")
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError) as exc:
        warn("not storing the model memo %s: %s: %s", key, type(exc).__name__, exc)
        return
    temporary: str | None = None
    try:
        root = cache_root(options)
        folder = root / MEMO_FOLDER
        secure_root(root)
        cache_trust.make_private_folder(folder)
        problem = cache_trust.untrusted(folder, "folder")
        if problem:
            raise OSError(problem)
        handle, temporary = tempfile.mkstemp(dir=folder, prefix="tmp-", suffix=".json")
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.replace(temporary, folder / f"{key}.json")
        temporary = None
    except (OSError, BuildError) as exc:
        warn("not storing the model memo %s: %s", key, exc)
    finally:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
