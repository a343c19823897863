"""The templates' bytecode cache (emit.templatecache): a second environment
loads what the first compiled, renders the same text, recompiles an edited
template, keeps escaping and plain compiles apart, and is skipped where
its folder is not this user's alone or has gone."""

from __future__ import annotations

import os
import shutil
import sys

import jinja2
import pytest

from symbackprop.emit import templatecache


def _env(folder, cache, **settings) -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(folder)), bytecode_cache=cache,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, **settings)


class _Counting:
    """Counts the templates an environment compiles from source."""

    def __init__(self, monkeypatch):
        self.names: list[str] = []
        original = jinja2.Environment.compile

        def compile_(env, source, name=None, filename=None, raw=False, defer_init=False):
            self.names.append(name)
            return original(env, source, name, filename, raw, defer_init)

        monkeypatch.setattr(jinja2.Environment, "compile", compile_)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMBACKPROP_CACHE_DIR", str(tmp_path / "cache"))
    found = templatecache.template_bytecode_cache()
    assert found is not None
    return found


def test_second_environment_loads_the_compiled_template(cache, tmp_path, monkeypatch):
    folder = tmp_path / "templates"
    folder.mkdir()
    (folder / "t.j2").write_text("{% for v in xs %}\n{{ v * 2 }};\n{% endfor %}\n")
    counting = _Counting(monkeypatch)
    first = _env(folder, cache).get_template("t.j2").render(xs=[1, 2])
    assert counting.names == ["t.j2"]
    second = _env(folder, cache).get_template("t.j2").render(xs=[1, 2])
    assert counting.names == ["t.j2"]  # loaded, not compiled again
    assert first == second == "2;\n4;\n"


def test_edited_template_is_compiled_again(cache, tmp_path, monkeypatch):
    folder = tmp_path / "templates"
    folder.mkdir()
    (folder / "t.j2").write_text("a {{ x }}\n")
    assert _env(folder, cache).get_template("t.j2").render(x=1) == "a 1\n"
    (folder / "t.j2").write_text("b {{ x }}\n")
    assert _env(folder, cache).get_template("t.j2").render(x=1) == "b 1\n"


def test_escaping_and_plain_compiles_are_kept_apart(cache, tmp_path):
    folder = tmp_path / "templates"
    folder.mkdir()
    (folder / "t.j2").write_text("{{ x }}\n")
    assert _env(folder, cache).get_template("t.j2").render(x="<a>") == "<a>\n"
    assert _env(folder, cache, autoescape=True).get_template("t.j2").render(x="<a>") == "&lt;a&gt;\n"
    assert _env(folder, cache).get_template("t.j2").render(x="<a>") == "<a>\n"


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="no mode bits to check")
def test_folder_others_may_write_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMBACKPROP_CACHE_DIR", str(tmp_path / "cache"))
    assert templatecache.template_bytecode_cache() is not None
    os.chmod(tmp_path / "cache" / templatecache.FOLDER, 0o777)
    assert templatecache.template_bytecode_cache() is None


def test_gone_folder_means_compiling_as_without(cache, tmp_path):
    folder = tmp_path / "templates"
    folder.mkdir()
    (folder / "t.j2").write_text("c {{ x }}\n")
    shutil.rmtree(tmp_path / "cache")
    assert _env(folder, cache).get_template("t.j2").render(x=2) == "c 2\n"


def test_unusable_root_gives_no_cache(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SYMBACKPROP_CACHE_DIR", str(tmp_path / "file" / "cache"))  # under a file: cannot be made
    assert templatecache.template_bytecode_cache() is None


def test_a_fresh_process_renders_from_the_cache(tmp_path):
    """Across processes, as in use: the second compiles no template."""
    import subprocess

    code = ("import jinja2, sys\n"
            "names = []\n"
            "original = jinja2.Environment.compile\n"
            "def compile_(env, source, name=None, *a, **k):\n"
            "    names.append(name); return original(env, source, name, *a, **k)\n"
            "jinja2.Environment.compile = compile_\n"
            "from symbackprop.emit.codegen import runtime_header\n"
            "text = runtime_header()\n"
            "import hashlib\n"
            "print(len(names), hashlib.sha256(text.encode()).hexdigest())\n")
    env = dict(os.environ, SYMBACKPROP_CACHE_DIR=str(tmp_path / "cache"))
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
            for _ in range(2)]
    assert int(runs[0][0]) >= 1 and int(runs[1][0]) == 0
    assert runs[0][1] == runs[1][1]  # the same header
