"""The templates' bytecode caches (emit.templatecache): a second environment
loads what the first compiled, renders the same text, recompiles an edited
template, keeps escaping and plain compiles apart, and the module cache's
is skipped where its folder is not this user's alone or has gone. The
package's copy (write_compiled, as setup.py builds it): every template
loads from it and renders the same text as compiled from source; a
template edited after it was built, a copy from another Jinja, a damaged
or missing copy compile from source (into the module cache)."""

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
    found = templatecache.template_bytecode_cache(installed=False)
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
    assert templatecache.template_bytecode_cache(installed=False) is not None
    os.chmod(tmp_path / "cache" / templatecache.FOLDER, 0o777)
    assert templatecache.template_bytecode_cache(installed=False) is None


def test_gone_folder_means_compiling_as_without(cache, tmp_path):
    folder = tmp_path / "templates"
    folder.mkdir()
    (folder / "t.j2").write_text("c {{ x }}\n")
    shutil.rmtree(tmp_path / "cache")
    assert _env(folder, cache).get_template("t.j2").render(x=2) == "c 2\n"


def test_unusable_root_gives_no_cache(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SYMBACKPROP_CACHE_DIR", str(tmp_path / "file" / "cache"))  # under a file: cannot be made
    assert templatecache.template_bytecode_cache(installed=False) is None


def test_a_fresh_process_renders_from_the_cache(tmp_path):
    """Across processes, as in use: the second compiles no template."""
    import subprocess

    code = ("import jinja2, sys\n"
            "names = []\n"
            "original = jinja2.Environment.compile\n"
            "def compile_(env, source, name=None, *a, **k):\n"
            "    names.append(name); return original(env, source, name, *a, **k)\n"
            "jinja2.Environment.compile = compile_\n"
            "from symbackprop.emit import templatecache\n"
            "templatecache.COMPILED = templatecache.COMPILED.parent / 'not-built'  # as a checkout: none installed\n"
            "from symbackprop.emit.codegen import runtime_header\n"
            "text = runtime_header()\n"
            "import hashlib\n"
            "print(len(names), hashlib.sha256(text.encode()).hexdigest())\n")
    env = dict(os.environ, SYMBACKPROP_CACHE_DIR=str(tmp_path / "cache"))
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
            for _ in range(2)]
    assert int(runs[0][0]) >= 1 and int(runs[1][0]) == 0
    assert runs[0][1] == runs[1][1]  # the same header


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A templates folder and the package's copy of its compiled code, built
    elsewhere (as setup.py does in a build folder), in place as COMPILED."""
    built = tmp_path / "build" / "templates"
    built.mkdir(parents=True)
    (built / "t.j2").write_text("{% for v in xs %}\n{{ v }};\n{% endfor %}\n")
    (built / "page.html.j2").write_text("<p>{{ x }}</p>\n")
    compiled = tmp_path / "compiled"
    assert sorted(templatecache.write_compiled(compiled, templates=built)) == ["page.html.j2", "page.html.j2", "t.j2"]
    here = tmp_path / "here"
    shutil.copytree(built, here)
    monkeypatch.setattr(templatecache, "COMPILED", compiled)
    monkeypatch.setenv("SYMBACKPROP_CACHE_DIR", str(tmp_path / "cache"))
    return here


def _installed_env(folder) -> jinja2.Environment:
    return templatecache.environment(jinja2.FileSystemLoader(str(folder)), templatecache.template_bytecode_cache())


def test_the_installed_copy_is_loaded_where_it_matches(installed, tmp_path, monkeypatch):
    counting = _Counting(monkeypatch)
    env = _installed_env(installed)
    template = env.get_template("t.j2")
    assert template.render(xs=[1, 2]) == "1;\n2;\n"
    assert templatecache.html(env).get_template("page.html.j2").render(x="<a>") == "<p>&lt;a&gt;</p>\n"
    assert env.get_template("page.html.j2").render(x="<a>") == "<p><a></p>\n"
    assert counting.names == []  # nothing compiled from source
    assert not list((tmp_path / "cache" / templatecache.FOLDER).iterdir())  # nor kept in the module cache
    # the code reads as compiled from the template here, not where it was built
    assert template.filename == str(installed / "t.j2")
    assert template.root_render_func.__code__.co_filename == str(installed / "t.j2")


def test_the_package_templates_all_load_from_an_installed_copy(tmp_path, monkeypatch):
    compiled = tmp_path / "compiled"
    templatecache.write_compiled(compiled)
    monkeypatch.setattr(templatecache, "COMPILED", compiled)
    monkeypatch.setenv("SYMBACKPROP_CACHE_DIR", str(tmp_path / "cache"))
    counting = _Counting(monkeypatch)
    env = _installed_env(templatecache.TEMPLATES)
    for path in sorted(templatecache.TEMPLATES.glob("*.j2")):
        env.get_template(path.name)
    templatecache.html(env).get_template("derivation.html.j2")
    assert counting.names == []


@pytest.mark.parametrize("change", ["edited", "other jinja", "damaged", "missing"])
def test_a_stale_or_missing_installed_copy_compiles_from_source(installed, tmp_path, monkeypatch, change):
    if change == "edited":  # a template edited after the copy was built (an editable install)
        (installed / "t.j2").write_text("{% for v in xs %}\n[{{ v }}]\n{% endfor %}\n")
    elif change == "other jinja":
        monkeypatch.setattr(jinja2, "__version__", "0.0.0")
    elif change == "damaged":
        for path in templatecache.COMPILED.iterdir():
            path.write_bytes(path.read_bytes()[:40])
    else:
        shutil.rmtree(templatecache.COMPILED)
    counting = _Counting(monkeypatch)
    expected = "[1]\n[2]\n" if change == "edited" else "1;\n2;\n"
    assert _installed_env(installed).get_template("t.j2").render(xs=[1, 2]) == expected
    assert counting.names == ["t.j2"]
    assert len(list((tmp_path / "cache" / templatecache.FOLDER).iterdir())) == 1  # kept in the module cache
    assert _installed_env(installed).get_template("t.j2").render(xs=[1, 2]) == expected
    assert counting.names == ["t.j2"]  # the next environment loads it from there
