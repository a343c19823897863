"""Jinja's compiled templates, kept between processes in the module cache.

Jinja turns each template into Python code and compiles it: 0.2-0.3 s of CPU
in every process that generates C (GradBench ports: 0.16-0.24 s of a cold
compile of 2-4 s), the same work each time. Its bytecode cache keeps the
result in the module cache's folder `jinja` (the default cache, as the call
hot path's extension: run.fastcall), under a name keyed on the template's
name and checked against a hash of its source (an edited template is
compiled again) and Jinja's and Python's versions. It is only a shortcut:
where that folder cannot be made, or is not this user's alone (build.trust:
whoever could write it could put code there that this process would run),
templates compile as without it.
"""

from __future__ import annotations

import contextlib

import jinja2
from jinja2.bccache import Bucket

from symbackprop.build.cachedir import cache_folder
from symbackprop.build.trust import make_private_folder, untrusted

FOLDER = "jinja"


class _QuietCache(jinja2.FileSystemBytecodeCache):
    """A cache that is only ever a shortcut: a file it cannot read or write
    (another process renaming it, a full disk) means compiling as without.
    Its key also holds the settings that change the compiled code, so an
    overlay that escapes (derivation.html) never loads a plain one's."""

    def get_bucket(self, environment: jinja2.Environment, name: str, filename: str | None, source: str) -> Bucket:
        settings = (environment.autoescape, environment.trim_blocks, environment.lstrip_blocks,
                    environment.keep_trailing_newline)
        return super().get_bucket(environment, f"{name}|{settings!r}", filename, source)

    def load_bytecode(self, bucket: Bucket) -> None:
        try:
            super().load_bytecode(bucket)
        except (OSError, EOFError, ValueError):
            bucket.reset()

    def dump_bytecode(self, bucket: Bucket) -> None:
        with contextlib.suppress(OSError):
            super().dump_bytecode(bucket)


def template_bytecode_cache() -> jinja2.BytecodeCache | None:
    """The templates' bytecode cache, or None where none may be kept (see
    the module's docstring)."""
    folder = cache_folder() / FOLDER
    try:
        make_private_folder(folder)
    except OSError:
        return None
    if untrusted(folder.parent, "folder", follow=True) or untrusted(folder, "folder"):
        return None
    return _QuietCache(str(folder), "%s.cache")


__all__ = ["template_bytecode_cache"]
