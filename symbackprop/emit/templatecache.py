"""The templates' environment, and their compiled code kept between processes.

Jinja turns each template into Python code and compiles it: 0.2-0.3 s of CPU
in every process that generates C (GradBench ports: 0.16-0.24 s of a cold
compile of 2-4 s), the same work each time. Two copies of the result are
kept, both as Jinja's bytecode cache files (the code, marshalled, after a
header of Python's version and the SHA-1 of the template's source):

- built with the package: setup.py calls `write_compiled` into the
  package's folder `templates_compiled` (`pip install`, `pip install -e .`,
  a wheel), every template in the settings it is loaded with, so that the
  first model compiled into an empty cache compiles no template;
- in the module cache's folder `jinja` (the default cache, as the call hot
  path's extension: run.fastcall): what the first copy lacks.

A copy is used only where it was compiled from this template's source (an
edited template, or one the installed copy predates, compiles again), by
this Python and this Jinja (their versions are in the header and the key),
in the same settings (an overlay that escapes, derivation.html, never loads
a plain one's); otherwise the template compiles as without, into the module
cache. The second copy is only a shortcut: where that folder cannot be
made, or is not this user's alone (base.trust: whoever could write it
could put code there that this process would run), it is not used. The
first is part of the package, as trusted as its Python files.

This module imports nothing of symbackprop at its top: setup.py loads it
from its file, before the package is installed.
"""

from __future__ import annotations

import contextlib
import pickle
import types
from pathlib import Path

import jinja2
from jinja2.bccache import Bucket

FOLDER = "jinja"  # in the module cache
HERE = Path(__file__).resolve().parent
PACKAGE = HERE.parent
# The templates: the top-level templates/ of a checkout (and of an editable
# install), which pyproject.toml's package-dir mapping ships in the wheel as
# symbackprop/templates, beside the code. (toolchain.memo.package_digest hashes
# the same folder.)
TEMPLATES = PACKAGE / "templates" if (PACKAGE / "templates").is_dir() else PACKAGE.parent / "templates"
COMPILED = HERE / "templates_compiled"  # built with the package (setup.py); absent in a plain checkout

def environment(loader: jinja2.BaseLoader, bytecode_cache: jinja2.BytecodeCache | None) -> jinja2.Environment:
    """An environment in the templates' settings (codegen.template_environment)."""
    return jinja2.Environment(loader=loader, bytecode_cache=bytecode_cache, undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)


def html(environment: jinja2.Environment) -> jinja2.Environment:
    """The overlay of the templates that write HTML (*.html.j2: derivation.html.j2)."""
    return environment.overlay(autoescape=True)


def _jinja_version() -> str:
    version = getattr(jinja2, "__version__", None)  # Jinja 3.1 has it; later ones may not
    if not version:
        from importlib.metadata import version as installed

        version = installed("jinja2")
    return str(version)


def _settings(environment: jinja2.Environment) -> str:
    """What the compiled code depends on besides the source: Jinja's version
    and the settings of its lexer and code generator."""
    e = environment
    return repr((_jinja_version(), e.block_start_string, e.block_end_string, e.variable_start_string,
                 e.variable_end_string, e.comment_start_string, e.comment_end_string, e.line_statement_prefix,
                 e.line_comment_prefix, e.trim_blocks, e.lstrip_blocks, e.newline_sequence,
                 e.keep_trailing_newline, e.autoescape, e.optimized, sorted(e.extensions), e.is_async))


class _QuietCache(jinja2.FileSystemBytecodeCache):
    """A folder of compiled templates that is only ever a shortcut: a file it
    cannot read or write (another process renaming it, a full disk) means
    compiling as without. Its key holds the settings (`_settings`), and the
    template's path unless `anywhere` (the package's copy, built elsewhere)."""

    def __init__(self, directory: str, anywhere: bool = False) -> None:
        super().__init__(directory, "%s.cache")
        self.anywhere = anywhere

    def get_bucket(self, environment: jinja2.Environment, name: str, filename: str | None, source: str) -> Bucket:
        return super().get_bucket(environment, f"{name}|{_settings(environment)}",
                                  None if self.anywhere else filename, source)

    def load_bytecode(self, bucket: Bucket) -> None:
        try:
            super().load_bytecode(bucket)
        except (OSError, EOFError, ValueError, TypeError, pickle.UnpicklingError):  # cut short, damaged
            bucket.reset()

    def dump_bytecode(self, bucket: Bucket) -> None:
        with contextlib.suppress(OSError):
            super().dump_bytecode(bucket)


def _relocated(code: types.CodeType, filename: str) -> types.CodeType:
    """`code` as if compiled from `filename` (the template's path here, not
    where the package was built), for tracebacks and Template.filename."""
    if code.co_filename == filename:
        return code
    consts = tuple(_relocated(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


class _Caches(jinja2.BytecodeCache):
    """The package's copy first (read only), then the module cache's."""

    def __init__(self, installed: _QuietCache | None, private: _QuietCache | None) -> None:
        self.installed = installed
        self.private = private

    def get_bucket(self, environment: jinja2.Environment, name: str, filename: str | None, source: str) -> Bucket:
        if self.installed is not None:
            bucket = self.installed.get_bucket(environment, name, filename, source)
            if bucket.code is not None:
                if filename is not None:
                    bucket.code = _relocated(bucket.code, filename)
                return bucket
        if self.private is not None:
            return self.private.get_bucket(environment, name, filename, source)
        return Bucket(environment, "", "")  # empty: compiled, not kept

    def set_bucket(self, bucket: Bucket) -> None:
        if self.private is not None and bucket.key:
            self.private.set_bucket(bucket)


def template_bytecode_cache(installed: bool = True) -> jinja2.BytecodeCache | None:
    """The templates' bytecode caches (see the module's docstring): the
    package's copy (COMPILED) where `installed` and it was built, then the
    module cache's where it may be kept; None where neither."""
    from symbackprop.base.cachedir import cache_folder
    from symbackprop.base.trust import make_private_folder, untrusted

    shipped = _QuietCache(str(COMPILED), anywhere=True) if installed and COMPILED.is_dir() else None
    private: _QuietCache | None = None
    folder = cache_folder() / FOLDER
    with contextlib.suppress(OSError):
        make_private_folder(folder)
        if not (untrusted(folder.parent, "folder", follow=True) or untrusted(folder, "folder")):
            private = _QuietCache(str(folder))
    if shipped is None and private is None:
        return None
    return _Caches(shipped, private)


def write_compiled(folder: Path, templates: Path = TEMPLATES) -> list[str]:
    """Compile every template into `folder` in the settings it is loaded
    with (HTML's too for *.html.j2), as the package's copy (setup.py).
    Returns the names compiled."""
    folder.mkdir(parents=True, exist_ok=True)
    plain = environment(jinja2.FileSystemLoader(str(templates)), _QuietCache(str(folder), anywhere=True))
    names = []
    for path in sorted(templates.glob("*.j2")):
        for env in [plain] + ([html(plain)] if path.name.endswith(".html.j2") else []):
            env.get_template(path.name)
            names.append(path.name)
    return names


__all__ = ["COMPILED", "TEMPLATES", "environment", "html", "template_bytecode_cache", "write_compiled"]
