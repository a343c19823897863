"""The build cache: one entry per content key, safe under concurrent
builds and killed builds, keyed on everything the binary depends on, and
clear BuildErrors when the compiler is missing or fails."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import sympy as sp

import symbackprop as sbp
import symbackprop.toolchain.builder as build_module
from symbackprop.pipeline import generate
from symbackprop.toolchain.builder import BuildOptions, build, cache_entry, cache_key

ROOT = Path(__file__).resolve().parents[2]

# The model children and the parent both build: `SALT` makes its C (and so
# its key) unique to one test, so no other test's cache entry is reused.
MODEL_CODE = textwrap.dedent(
    """
    import sympy as sp
    import symbackprop as sbp
    a, x = sp.symbols("a x")
    def model(salt):
        return sbp.Model("cache_probe", inputs=[x], params=[a], loss=sp.sin(a * x) + salt * a**2)
    """
)


def _model(salt: int) -> sbp.Model:
    scope: dict = {}
    exec(MODEL_CODE, scope)
    return scope["model"](salt)


def _key(model: sbp.Model) -> str:
    """The name of the model's cache entry under the default options."""
    emitted, _ = generate(model)
    return cache_entry(emitted.prefix, emitted.source, emitted.header, emitted.cdef).name


def _child(code: str, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "SYMBACKPROP_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", MODEL_CODE + textwrap.dedent(code)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _entries(cache: Path) -> list[str]:
    """Module folders of the cache (entries, named by their key, and
    unfinished builds), not lock files, logs or other caches' folders."""
    return sorted(p.name for p in cache.iterdir() if p.is_dir() and re.match(r"^(tmp-)?[0-9a-f]{32}", p.name))


def test_processes_building_at_once_leave_one_entry(tmp_path):
    start = time.time() + 1.5  # every child waits for the same moment, then builds
    code = f"""
        import time
        time.sleep(max(0.0, {start} - time.time()))
        mod = sbp.compile(model(1))
        print(mod.value_and_grad(x=0.5, a=2.0)[0])
    """
    children = [_child(code, tmp_path) for _ in range(4)]
    results = [child.communicate(timeout=120) for child in children]
    assert [child.returncode for child in children] == [0] * 4, [err for _, err in results]
    assert len({out for out, _ in results}) == 1
    assert _entries(tmp_path) == [_key(_model(1))]


def test_a_build_killed_before_it_is_published_leaves_no_entry(tmp_path):
    """The worst moment: the library is complete in the private folder, the
    rename into the cache has not happened."""
    marker = tmp_path / "about-to-publish"
    cache = tmp_path / "cache"
    code = f"""
        import os, time
        real_rename = os.rename
        def stalled_rename(src, dst):
            if os.path.basename(dst).startswith("fastcall-"):  # the call hot path, built beside: not this test's
                return real_rename(src, dst)
            open({str(marker)!r}, "w").close()
            time.sleep(120)
            real_rename(src, dst)
        os.rename = stalled_rename
        sbp.compile(model(2))
    """
    child = _child(code, cache)
    _wait_for(lambda: marker.exists(), child)
    child.send_signal(signal.SIGKILL)
    child.wait()
    key = _key(_model(2))
    assert not (cache / key).exists()
    assert [name for name in _entries(cache) if name.startswith(f"tmp-{key}")]  # the abandoned private folder
    _assert_builds_and_loads(_model(2), cache)


def test_a_build_killed_while_compiling_leaves_no_entry(tmp_path):
    cache = tmp_path / "cache"
    child = _child("sbp.compile(model(3))", cache)
    _wait_for(lambda: cache.is_dir() and any(n.startswith("tmp-") for n in _entries(cache)), child)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not (cache / _key(_model(3))).exists()
    _assert_builds_and_loads(_model(3), cache)


def test_an_incomplete_entry_is_rebuilt_not_loaded(tmp_path):
    model = _model(4)
    broken = tmp_path / _key(model)
    broken.mkdir(parents=True)
    (broken / "half-written.c").write_text("int")
    _assert_builds_and_loads(model, tmp_path)
    assert not (broken / "half-written.c").exists()


def _wait_for(condition, child: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        if child.poll() is not None:
            pytest.fail(f"the child ended early: {child.communicate()}")
        if time.time() > deadline:
            child.kill()
            pytest.fail("the child never reached the point to kill it at")
        time.sleep(0.005)


def _assert_builds_and_loads(model: sbp.Model, cache: Path) -> None:
    mod = sbp.compile(model, options=BuildOptions(cache_dir=cache))
    assert mod.folder == cache / _key(model)
    loss, _ = mod.value_and_grad(x=0.5, a=2.0)
    assert loss == pytest.approx(float(sp.sin(1.0)) + model.loss.coeff(sp.Symbol("a") ** 2) * 4)


def test_the_key_covers_source_flags_compiler_and_version(monkeypatch, tmp_path):
    emitted, _ = generate(_model(5))
    parts = (emitted.prefix, emitted.source, emitted.header, emitted.cdef, ("-O2",))
    base = cache_key(*parts)
    assert cache_key(*parts) == base  # deterministic
    variants = {
        "source": cache_key(parts[0], parts[1] + "\n", *parts[2:]),
        "header": cache_key(parts[0], parts[1], parts[2] + " ", *parts[3:]),
        "cdef": cache_key(*parts[:3], parts[3] + " ", parts[4]),
        "flags": cache_key(*parts[:4], ("-O3",)),
        "prefix": cache_key("other", *parts[1:]),
    }
    wrapper = tmp_path / "cc-wrapper"
    wrapper.write_text('#!/bin/sh\nexec cc "$@"\n')
    wrapper.chmod(0o755)
    with monkeypatch.context() as patch:
        patch.setenv("CC", str(wrapper))
        variants["compiler"] = cache_key(*parts)
    with monkeypatch.context() as patch:
        patch.setenv("CC", "cc -DSYMBACKPROP_SOMETHING")
        variants["compiler options"] = cache_key(*parts)
    with monkeypatch.context() as patch:
        patch.setattr(build_module, "__version__", "999.0")
        variants["version"] = cache_key(*parts)
    assert base not in variants.values()
    assert len(set(variants.values())) == len(variants), variants


def test_new_flags_make_a_new_entry_and_old_ones_are_reused(tmp_path):
    model = _model(6)
    first = sbp.compile(model, options=BuildOptions(flags=("-O1",), cache_dir=tmp_path))
    library = next(first.folder.glob("*.so"))
    built_at = library.stat().st_mtime_ns
    again = sbp.compile(model, options=BuildOptions(flags=("-O1",), cache_dir=tmp_path))
    assert again.folder == first.folder and library.stat().st_mtime_ns == built_at
    other = sbp.compile(model, options=BuildOptions(flags=("-O2",), cache_dir=tmp_path))
    assert other.folder != first.folder
    assert len(_entries(tmp_path)) == 2


def test_missing_compiler_is_a_build_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(sbp.BuildError) as info:
        sbp.compile(_model(7), options=BuildOptions(cache_dir=tmp_path))
    message = str(info.value)
    assert "no working C compiler" in message and "/nonexistent/cc" in message and "set CC" in message


def test_failing_compiler_names_its_log(monkeypatch, tmp_path):
    fake = tmp_path / "fake-cc"
    fake.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo fake 1.0; exit 0; fi\n'
                    'echo "fake-cc: error: the compiler exploded" >&2\nexit 3\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with pytest.raises(sbp.BuildError) as info:
        sbp.compile(_model(8), options=BuildOptions(cache_dir=tmp_path / "cache"))
    message = str(info.value)
    assert "exit status 3" in message and "the compiler exploded" in message
    log = Path(message.rsplit(" are in ", 1)[1])
    assert log.is_file()
    text = log.read_text()
    assert str(fake) in text.splitlines()[0]  # the command comes first
    assert "the compiler exploded" in text
    assert not list(_entries(tmp_path / "cache"))  # nothing half-built is kept


def test_a_rejected_flag_is_a_build_error_with_the_compilers_words(tmp_path):
    with pytest.raises(sbp.BuildError) as info:
        sbp.compile(_model(9), options=BuildOptions(flags=("-fno-such-option-anywhere",), cache_dir=tmp_path))
    message = str(info.value)
    assert "-fno-such-option-anywhere" in message and ".log" in message


def test_an_unwritable_cache_is_a_build_error(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with pytest.raises(sbp.BuildError) as info:
        sbp.compile(_model(10), options=BuildOptions(cache_dir=not_a_folder / "cache"))
    assert "cannot write the module cache" in str(info.value) and str(not_a_folder) in str(info.value)


def test_threads_building_different_modules_at_once(tmp_path):
    """Builds change no process-wide state: the working folder and stdout
    stay as they were, and every thread gets its module."""
    cwd, stdout = os.getcwd(), os.fstat(1)
    results: dict[int, float] = {}
    errors: list[BaseException] = []

    def work(salt: int) -> None:
        try:
            mod = sbp.compile(_model(100 + salt), options=BuildOptions(cache_dir=tmp_path))
            results[salt] = mod.value_and_grad(x=0.5, a=2.0)[0]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(salt,)) for salt in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert results == {salt: pytest.approx(float(sp.sin(1.0)) + (100 + salt) * 4) for salt in range(4)}
    assert os.getcwd() == cwd and os.fstat(1).st_ino == stdout.st_ino
    assert len(_entries(tmp_path)) == 4


def test_a_loaded_module_is_not_rebuilt_by_build(tmp_path):
    emitted, _ = generate(_model(11))
    first, folder = build(emitted.prefix, emitted.source, emitted.header, emitted.cdef, BuildOptions(cache_dir=tmp_path))
    second, again = build(emitted.prefix, emitted.source, emitted.header, emitted.cdef, BuildOptions(cache_dir=tmp_path))
    assert first is second and folder == again


def test_private_folders_of_builds_killed_long_ago_are_removed(tmp_path):
    cache = tmp_path / "cache"
    old, recent = cache / "tmp-0123-abandoned", cache / "tmp-4567-in-progress"
    for folder in (old, recent):
        folder.mkdir(parents=True)
    day_ago = time.time() - 2 * 24 * 3600
    os.utime(old, (day_ago, day_ago))
    _assert_builds_and_loads(_model(3), cache)
    assert not old.exists() and recent.exists()


def test_the_default_cache_dir_is_the_environment_else_platformdirs(monkeypatch, tmp_path):
    """BuildOptions.cache_dir, then $SYMBACKPROP_CACHE_DIR, then the user
    cache folder platformdirs names for this platform."""
    import platformdirs

    monkeypatch.setenv(build_module.CACHE_ENV, str(tmp_path / "from-env"))
    assert build_module.cache_root() == tmp_path / "from-env"
    assert build_module.cache_root(BuildOptions(cache_dir=tmp_path / "given")) == tmp_path / "given"
    for unset in ("", None):
        if unset is None:
            monkeypatch.delenv(build_module.CACHE_ENV)
        else:
            monkeypatch.setenv(build_module.CACHE_ENV, unset)  # set but empty: as if unset
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        root = build_module.cache_root()
        assert root == Path(platformdirs.user_cache_dir("symbackprop", appauthor=False))
        assert root.name == "symbackprop" or root.parent.name == "symbackprop"  # Windows adds \Cache
        assert root.is_relative_to(platformdirs.user_cache_dir())
        if sys.platform.startswith("linux"):
            assert root == tmp_path / "xdg" / "symbackprop"
