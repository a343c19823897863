"""The module cache trusts nothing it finds: damaged entries are rebuilt
(never loaded), memos are JSON (never unpickled), folders and files of
other users or writable by others are refused, -march=native is keyed on
the CPU, relative and ~ cache paths work, memo failures only warn, and
built modules export nothing but PyInit_.

Loading a damaged library can crash the process (SIGBUS on a truncated
one), so every check that loads one after damaging it runs in a child.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import pwd
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import sympy as sp

import symbackprop as sbp
import symbackprop.toolchain.builder as build_module
import symbackprop.toolchain.compiler as compiler_module
import symbackprop.toolchain.key as cache_key_module
import symbackprop.toolchain.memo as memo_module
from symbackprop.pipeline import generate
from symbackprop.plan import DEFAULT_FUNCTIONS
from symbackprop.run.runtime import model_fingerprint
from symbackprop.toolchain.builder import BuildOptions, cache_entry, cache_key
from symbackprop.toolchain.compiler import EXT_SUFFIX
from symbackprop.toolchain.key import digest
from symbackprop.toolchain.memo import read_memo, write_memo

ROOT = Path(__file__).resolve().parents[2]
AS_ROOT = hasattr(os, "getuid") and os.getuid() == 0
NOBODY = pwd.getpwnam("nobody").pw_uid if AS_ROOT else None
a, x = sp.symbols("a x")

MODEL_CODE = textwrap.dedent(
    """
    import json, logging, math, sys
    import sympy as sp
    import symbackprop as sbp
    import symbackprop.log
    symbackprop.log.enable(logging.WARNING)
    a, x = sp.symbols("a x")
    def model(salt, name="cache_safety"):
        return sbp.Model(name, inputs=[x], params=[a], loss=sp.sin(a * x) + salt * a**2)
    """
)


def _model(salt: int) -> sbp.Model:
    return sbp.Model("cache_safety", inputs=[x], params=[a], loss=sp.sin(a * x) + salt * a**2)


def _expected(salt: int, xv: float = 0.5, av: float = 2.0) -> tuple[float, float]:
    """The closed form: loss sin(a x) + salt a^2 and its derivative in a."""
    return math.sin(av * xv) + salt * av * av, xv * math.cos(av * xv) + 2 * salt * av


def _entry(model: sbp.Model, cache: Path) -> Path:
    emitted, _ = generate(model)
    return cache_entry(emitted.prefix, emitted.source, emitted.header, emitted.cdef, BuildOptions(cache_dir=cache))


def _child(code: str, cache: Path | str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "SYMBACKPROP_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-c", MODEL_CODE + textwrap.dedent(code)], env=environment, cwd=cwd,
                          capture_output=True, text=True, timeout=300)


CHECK_SALT = """
    mod = sbp.compile(model({salt}))
    loss, grads = mod.value_and_grad(x=0.5, a=2.0)
    print(json.dumps([float(loss), float(grads["a"]), str(mod.folder)]))
"""


def _compile_in_child(salt: int, cache: Path | str, **kw) -> tuple[float, float, Path, str]:
    """Compile model(salt) in a fresh process; its loss, gradient, entry and stderr."""
    done = _child(CHECK_SALT.format(salt=salt), cache, **kw)
    assert done.returncode == 0, f"the child failed ({done.returncode}): {done.stderr[-3000:]}"
    loss, grad, folder = json.loads(done.stdout.strip().splitlines()[-1])
    return loss, grad, Path(folder), done.stderr


def _built(salt: int, cache: Path) -> Path:
    """An entry built and checked by this process: its folder."""
    mod = sbp.compile(_model(salt), options=BuildOptions(cache_dir=cache))
    assert mod.value_and_grad(x=0.5, a=2.0)[0] == pytest.approx(_expected(salt)[0])
    return mod.folder


def _library(folder: Path) -> Path:
    return next(folder.glob(f"*{EXT_SUFFIX}"))


# --- damaged entries: detected, moved aside, rebuilt, never loaded ------------

def _replace(path: Path, data: bytes) -> None:
    """New contents in a new file: this process has the old one mapped, and
    truncating a mapped library in place would crash it (SIGBUS)."""
    new = path.with_name(path.name + ".new")
    new.write_bytes(data)
    new.chmod(path.stat().st_mode)
    os.replace(new, path)


def _truncate(folder: Path) -> None:
    lib = _library(folder)
    _replace(lib, lib.read_bytes()[: lib.stat().st_size // 2])


def _empty(folder: Path) -> None:
    _replace(_library(folder), b"")


def _garbage_same_size(folder: Path) -> None:
    lib = _library(folder)
    _replace(lib, os.urandom(lib.stat().st_size))


def _appended(folder: Path) -> None:
    lib = _library(folder)
    _replace(lib, lib.read_bytes() + b"\0" * 4096)


def _flipped_byte(folder: Path) -> None:
    lib = _library(folder)
    data = bytearray(lib.read_bytes())
    data[len(data) // 2] ^= 0xFF
    _replace(lib, bytes(data))


def _no_manifest(folder: Path) -> None:
    (folder / "manifest.json").unlink()


def _garbage_manifest(folder: Path) -> None:
    (folder / "manifest.json").write_text("{not json")


def _manifest_naming_outside(folder: Path) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["../../etc/passwd"] = {"size": 1, "sha256": "0"}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _library_is_a_link(folder: Path) -> None:
    lib = _library(folder)
    copy = folder.parent / "elsewhere.so"
    shutil.copyfile(lib, copy)
    lib.unlink()
    lib.symlink_to(copy)


def _entry_is_a_file(folder: Path) -> None:
    shutil.rmtree(folder)
    folder.write_bytes(b"\x7fELF")


DAMAGE = [_truncate, _empty, _garbage_same_size, _appended, _flipped_byte, _no_manifest, _garbage_manifest,
          _manifest_naming_outside, _library_is_a_link, _entry_is_a_file]


CHECK_SALTS = """
    for salt in {salts}:
        print(f"@@ {{salt}}", file=sys.stderr, flush=True)  # what follows on stderr is this salt's
        mod = sbp.compile(model(salt))
        loss, grads = mod.value_and_grad(x=0.5, a=2.0)
        print(json.dumps([salt, float(loss), float(grads["a"]), str(mod.folder)]), flush=True)
"""


def _compile_all_in_child(salts: list[int], cache: Path) -> tuple[dict[int, tuple], dict[int, str]]:
    """Compile model(salt) for each salt in one fresh process: per salt, its
    (loss, gradient, entry) and what it wrote on stderr."""
    done = _child(CHECK_SALTS.format(salts=salts), cache)
    assert done.returncode == 0, f"the child failed ({done.returncode}): {done.stderr[-3000:]}"
    results = {}
    for line in done.stdout.strip().splitlines():
        salt, loss, grad, folder = json.loads(line)
        results[salt] = (loss, grad, Path(folder))
    stderr: dict[int, str] = {}
    for part in done.stderr.split("@@ ")[1:]:
        salt_text, _, text = part.partition("\n")
        stderr[int(salt_text)] = text
    assert sorted(results) == sorted(stderr) == sorted(salts)
    return results, stderr


def test_damaged_entries_are_rebuilt_with_a_warning_in_a_new_process(tmp_path):
    """Each kind of damage (DAMAGE) done to an entry of its own; one fresh
    process compiles them all (one process per kind cost 2 s each): each is
    rebuilt in place with a warning naming it, and a second process loads
    them all quietly."""
    salts = {damage: 10 + index for index, damage in enumerate(DAMAGE)}
    folders = {}
    for damage, salt in salts.items():
        folders[damage] = _built(salt, tmp_path)
        damage(folders[damage])
    results, stderr = _compile_all_in_child(list(salts.values()), tmp_path)
    for damage, salt in salts.items():
        kind, folder = damage.__name__.strip("_"), folders[damage]
        loss, grad, again = results[salt]
        assert (loss, grad) == pytest.approx(_expected(salt)), kind
        assert again == folder, kind
        assert "damaged or untrusted module cache entry" in stderr[salt] and str(folder) in stderr[salt], kind
        assert build_module.entry_ok(folder, _library(folder).name), kind  # whole again
        assert not _library(folder).is_symlink(), kind
    _, quiet = _compile_all_in_child(list(salts.values()), tmp_path)
    assert not any("damaged" in text for text in quiet.values()), quiet


def test_a_damaged_entry_is_rebuilt_in_this_process_too(tmp_path, caplog):
    model = _model(30)
    emitted, _ = generate(model)
    options = BuildOptions(cache_dir=tmp_path)
    folder = _entry(model, tmp_path)
    folder.mkdir(mode=0o700)
    (folder / _library_name(folder, emitted.prefix)).write_bytes(b"\x7fELF\x02\x01\x01" + b"\0" * 57)  # a header only
    with caplog.at_level(logging.WARNING, logger="symbackprop"):
        module, built = build_module.build(emitted.prefix, emitted.source, emitted.header, emitted.cdef, options)
    assert built == folder and hasattr(module.lib, f"{emitted.prefix}_value_and_grad")
    assert any("damaged or untrusted" in r.getMessage() for r in caplog.records)


def _library_name(folder: Path, prefix: str) -> str:
    return f"{build_module.module_name(prefix, folder.name)}{EXT_SUFFIX}"


def test_a_library_that_fails_its_check_is_a_build_error_not_a_crash(tmp_path, monkeypatch):
    """load_built (a memo's folder) and load_checked never load an unchecked library."""
    folder = _built(31, tmp_path)
    _truncate(folder)
    name = build_module.module_name("cache_safety", folder.name)
    monkeypatch.delitem(sys.modules, name)  # as in a new process
    assert build_module.load_built(folder, "cache_safety", BuildOptions(cache_dir=tmp_path)) is None
    with pytest.raises(sbp.BuildError, match="not the file that was built"):
        build_module.load_checked(folder, name)


def test_load_built_refuses_a_folder_outside_the_cache(tmp_path):
    folder = _built(32, tmp_path / "cache")
    outside = tmp_path / "outside" / folder.name
    shutil.copytree(folder, outside)
    assert build_module.load_built(outside, "cache_safety", BuildOptions(cache_dir=tmp_path / "cache")) is None
    assert build_module.load_built(folder, "cache_safety", BuildOptions(cache_dir=tmp_path / "cache")) is not None


# --- other users' files and loose permissions ------------------------------------

needs_root = pytest.mark.skipif(not AS_ROOT, reason="chown to another user needs root")


def _loosen(path: Path) -> None:
    path.chmod(path.stat().st_mode | 0o020)


def _give_to_nobody(path: Path) -> None:
    for item in [path, *path.rglob("*")]:
        os.chown(item, NOBODY, NOBODY)


@pytest.mark.parametrize("how", ["entry-group-writable", "library-world-writable", "manifest-group-writable",
                                 pytest.param("entry-owned-by-nobody", marks=needs_root),
                                 pytest.param("library-owned-by-nobody", marks=needs_root)])
def test_an_entry_others_could_write_is_not_loaded(tmp_path, how):
    salt = 40 + ["entry-group-writable", "library-world-writable", "manifest-group-writable", "entry-owned-by-nobody",
                 "library-owned-by-nobody"].index(how)
    folder = _built(salt, tmp_path)
    if how == "entry-group-writable":
        _loosen(folder)
    elif how == "library-world-writable":
        _library(folder).chmod(0o757)
    elif how == "manifest-group-writable":
        _loosen(folder / "manifest.json")
    elif how == "entry-owned-by-nobody":
        _give_to_nobody(folder)
    else:
        os.chown(_library(folder), NOBODY, NOBODY)
    problem = build_module.entry_problem(folder, _library(folder).name)
    assert problem and ("another user" in problem or "can be written by" in problem), problem
    loss, grad, again, stderr = _compile_in_child(salt, tmp_path)
    assert (loss, grad) == pytest.approx(_expected(salt)) and again == folder
    assert "damaged or untrusted" in stderr
    assert folder.stat().st_uid == os.getuid() and not folder.stat().st_mode & 0o022
    assert build_module.entry_problem(folder, _library(folder).name) is None


def test_a_cache_folder_others_can_write_is_refused(tmp_path):
    cache = tmp_path / "shared"
    cache.mkdir(mode=0o700)
    cache.chmod(0o775)
    with pytest.raises(sbp.BuildError) as info:
        sbp.compile(_model(50), options=BuildOptions(cache_dir=cache))
    message = str(info.value)
    assert str(cache) in message and "0o775" in message and "chmod go-w" in message
    assert not list(cache.iterdir())  # nothing built, nothing loaded


@needs_root
def test_a_cache_folder_of_another_user_is_refused(tmp_path):
    cache = tmp_path / "theirs"
    cache.mkdir(mode=0o700)
    os.chown(cache, NOBODY, NOBODY)
    with pytest.raises(sbp.BuildError, match="belongs to another user"):
        sbp.compile(_model(51), options=BuildOptions(cache_dir=cache))


def test_new_cache_folders_and_files_are_private_whatever_the_umask(tmp_path):
    """With umask 0 the folders would be 0o777 and files 0o666."""
    cache = tmp_path / "a" / "b" / "cache"
    done = _child("import os\nos.umask(0)\n" + textwrap.dedent(CHECK_SALT.format(salt=52)), cache)
    assert done.returncode == 0, done.stderr
    for folder in (tmp_path / "a", tmp_path / "a" / "b", cache):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
    entry = Path(json.loads(done.stdout.splitlines()[-1])[2])
    assert entry.stat().st_mode & 0o077 == 0
    for path in entry.iterdir():
        assert not path.stat().st_mode & 0o022, path


# --- memos: JSON only, and every failure a warning --------------------------------

class Planted:
    """Unpickling this would create the marker file: code run by reading."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _memo_path(cache: Path, key: str) -> Path:
    folder = cache / memo_module.MEMO_FOLDER
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder / f"{key}.json"


def test_memos_round_trip_as_json(tmp_path):
    options = BuildOptions(cache_dir=tmp_path)
    value = {"prefix": "m", "numbers": [1, 2.5, None], "nested": {"ok": True}}
    write_memo("k1", value, options)
    assert read_memo("k1", options) == value
    path = tmp_path / memo_module.MEMO_FOLDER / "k1.json"
    assert json.loads(path.read_text()) == value
    assert read_memo("absent", options) is None


@pytest.mark.parametrize("content", [
    pytest.param(b"[1, 2, 3]", id="list"),
    pytest.param(b'"a string"', id="string"),
    pytest.param(b"null", id="null"),
    pytest.param(b"", id="empty"),
    pytest.param(b"{\"truncated\": [1, 2", id="truncated"),
    pytest.param(b"\xff\xfe\x00garbage", id="not-utf8"),
    pytest.param(b"[" * 100000 + b"]" * 100000, id="deeply-nested"),
    pytest.param("pickle", id="pickle-payload"),
])
def test_a_damaged_memo_is_ignored_with_a_warning(tmp_path, caplog, content):
    marker = tmp_path / "code-ran"
    if content == "pickle":
        content = pickle.dumps(Planted(marker), protocol=pickle.HIGHEST_PROTOCOL)
    _memo_path(tmp_path, "k2").write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="symbackprop"):
        assert read_memo("k2", BuildOptions(cache_dir=tmp_path)) is None
    assert any("ignoring a model memo" in r.getMessage() for r in caplog.records)
    assert not marker.exists()


def test_an_old_pickle_memo_for_the_real_key_is_never_unpickled(tmp_path):
    """A pickle planted where the old code looked (<key>.pickle), and one
    with the new name, for the key compile() computes: compile works, and
    the payload never runs."""
    marker = tmp_path / "code-ran"
    model = _model(60)
    options = BuildOptions(cache_dir=tmp_path / "cache")
    key = model_fingerprint(model, "float64", tuple(DEFAULT_FUNCTIONS), None, None, options)
    payload = pickle.dumps(Planted(marker))
    _memo_path(tmp_path / "cache", key).write_bytes(payload)
    _memo_path(tmp_path / "cache", key).with_suffix(".pickle").write_bytes(payload)
    mod = sbp.compile(model, options=options)
    assert mod.value_and_grad(x=0.5, a=2.0)[0] == pytest.approx(_expected(60)[0])
    assert not marker.exists()


def test_a_memo_too_large_is_ignored(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(memo_module, "MEMO_MAX_BYTES", 100)
    _memo_path(tmp_path, "k3").write_text(json.dumps({"x": "y" * 200}))
    with caplog.at_level(logging.WARNING, logger="symbackprop"):
        assert read_memo("k3", BuildOptions(cache_dir=tmp_path)) is None
    assert "larger than 100 bytes" in caplog.text


@pytest.mark.parametrize("how", ["group-writable", "symlink", "folder-world-writable",
                                 pytest.param("owned-by-nobody", marks=needs_root)])
def test_a_memo_others_could_write_is_ignored(tmp_path, caplog, how):
    options = BuildOptions(cache_dir=tmp_path)
    write_memo("k4", {"v": 1}, options)
    path = tmp_path / memo_module.MEMO_FOLDER / "k4.json"
    assert read_memo("k4", options) == {"v": 1}
    if how == "group-writable":
        path.chmod(0o664)
    elif how == "symlink":
        real = tmp_path / "real.json"
        real.write_text('{"v": 2}')
        path.unlink()
        path.symlink_to(real)
    elif how == "folder-world-writable":
        path.parent.chmod(0o777)
    else:
        os.chown(path, NOBODY, NOBODY)
    with caplog.at_level(logging.WARNING, logger="symbackprop"):
        assert read_memo("k4", options) is None
    assert "ignoring a model memo" in caplog.text


def _deep(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"v": value}
    return value


def _circular() -> dict:
    value: dict = {}
    value["self"] = value
    return value


@pytest.mark.parametrize("value", [
    pytest.param(_deep(100000), id="recursion"),
    pytest.param(_circular(), id="circular"),
    pytest.param({"x": object()}, id="not-serializable"),
    pytest.param({1j: 1}, id="bad-key"),
    pytest.param(("a", "tuple"), id="not-a-dict"),
])
def test_a_memo_that_cannot_be_written_is_a_warning_and_leaves_no_file(tmp_path, caplog, value):
    with caplog.at_level(logging.WARNING, logger="symbackprop"):
        write_memo("k5", value, BuildOptions(cache_dir=tmp_path))
    assert "not storing the model memo k5" in caplog.text
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_a_memo_write_failing_on_disk_is_a_warning_and_leaves_no_tmp_file(tmp_path, monkeypatch, caplog):
    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(build_module.os, "replace", full_disk)
    with caplog.at_level(logging.WARNING, logger="symbackprop"):
        write_memo("k6", {"v": 1}, BuildOptions(cache_dir=tmp_path))
    assert "No space left on device" in caplog.text
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_memos_in_an_unwritable_cache_only_warn(tmp_path, caplog):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    options = BuildOptions(cache_dir=not_a_folder / "cache")
    with caplog.at_level(logging.WARNING, logger="symbackprop"):
        write_memo("k7", {"v": 1}, options)
        assert read_memo("k7", options) is None
    assert "not storing the model memo k7" in caplog.text
    with pytest.raises(sbp.BuildError, match="cannot write the module cache"):
        sbp.compile(_model(61), options=options)


# --- where the cache is -----------------------------------------------------------

def test_a_relative_cache_dir_works_from_any_working_folder(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    loss, grad, folder, _ = _compile_in_child(70, "relative/cache", cwd=work)
    assert (loss, grad) == pytest.approx(_expected(70))
    assert folder.is_absolute() and folder.parent == work / "relative" / "cache"
    assert build_module.entry_ok(folder, _library(folder).name)


def test_a_cache_dir_with_tilde_is_under_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    loss, grad, folder, _ = _compile_in_child(71, "~/sbp-cache", env={"HOME": str(home)})
    assert (loss, grad) == pytest.approx(_expected(71))
    assert folder.parent == home / "sbp-cache"
    assert not (ROOT / "~").exists()
    monkeypatch.setenv("HOME", str(home))
    assert build_module.cache_root(BuildOptions(cache_dir=Path("~/x"))) == home / "x"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(build_module.CACHE_ENV, "rel")
    assert build_module.cache_root() == tmp_path / "rel"


# --- the key knows the CPU -------------------------------------------------------

@pytest.mark.default_flags  # BuildOptions() must mean -march=native here
def test_march_native_is_keyed_on_the_cpu_it_means(monkeypatch):
    emitted, _ = generate(_model(80))
    parts = (emitted.prefix, emitted.source, emitted.header, emitted.cdef)
    native, plain = cache_key(*parts, ("-O2", "-march=native")), cache_key(*parts, ("-O2",))
    resolved = cache_key_module.target_cpu((*build_module.compiler_command(), "-march=native"))
    assert "native" not in resolved and resolved.startswith(("compiler: ", "cpu: "))
    if resolved.startswith("compiler: ") and "gcc" in compiler_module.compiler_identity(
            tuple(build_module.compiler_command())).lower():
        assert "-march=" in resolved  # what gcc picked for this host
    model = _model(80)
    default = BuildOptions()
    fingerprint = model_fingerprint(model, "float64", ("forward",), None, None, default)
    monkeypatch.setattr(compiler_module, "target_cpu", lambda command: "compiler: -march=another-host -mno-avx512f")
    monkeypatch.setattr(build_module, "host_cpu", lambda: "x86_64; model name=another host; flags=fpu sse")
    assert cache_key(*parts, ("-O2", "-march=native")) != native  # another CPU, another entry
    assert cache_key(*parts, ("-O2",)) == plain  # code for no CPU in particular is shared
    plain_options = BuildOptions(flags=("-O2",))
    plain_fingerprint = model_fingerprint(model, "float64", ("forward",), None, None, plain_options)
    assert model_fingerprint(model, "float64", ("forward",), None, None, default) != fingerprint
    monkeypatch.undo()
    assert model_fingerprint(model, "float64", ("forward",), None, None, plain_options) == plain_fingerprint
    for flag in ("-mcpu=native", "-mtune=native"):
        assert cache_key_module.asks_for_host_cpu(["-O2", flag])
    assert not cache_key_module.asks_for_host_cpu(["-O2", "-march=x86-64-v2"])


def test_without_a_compiler_answer_the_cpu_comes_from_the_host():
    text = cache_key_module.target_cpu(("/nonexistent/cc", "-march=native"))
    assert text == f"cpu: {cache_key_module.host_cpu()}"
    if Path("/proc/cpuinfo").is_file():
        assert "flags=" in text or "Features=" in text


def test_digest_cannot_confuse_parts():
    assert digest("k", "ab", "c") != digest("k", "a", "bc")
    assert digest("k", "a\0", "b") != digest("k", "a", "\0b")
    assert digest("k", "a") != digest("j", "a")
    assert len(digest("k", "a")) == 32 and len(digest("k", "a", length=24)) == 24


# --- exported symbols ------------------------------------------------------------

def test_a_module_exports_only_its_init_function(tmp_path):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm")
    folder = _built(90, tmp_path)
    out = subprocess.run([nm, "-D", "--defined-only", str(_library(folder))], capture_output=True, text=True, check=True)
    functions = [line.split()[-1] for line in out.stdout.splitlines() if line.split()[-2:-1] in (["T"], ["W"])]
    assert functions == [f"PyInit_{build_module.module_name('cache_safety', folder.name)}"], functions


def test_two_dtypes_of_one_model_loaded_globally_keep_their_own_functions(tmp_path):
    """RTLD_GLOBAL puts the first module's symbols before the second's: with
    exported names, the float32 module called the float64 functions."""
    code = """
        import os
        sys.setdlopenflags(os.RTLD_NOW | os.RTLD_GLOBAL)
        out = []
        for dtype in ("float64", "float32", "float64"):
            mod = sbp.compile(model(3, name="same_name"), dtype=dtype)
            loss, grads = mod.value_and_grad(x=0.5, a=2.0)
            out.append([float(loss), float(grads["a"])])
        print(json.dumps(out))
    """
    done = _child(code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    for (loss, grad), rel in zip(results, (1e-12, 1e-5, 1e-12)):
        assert loss == pytest.approx(_expected(3)[0], rel=rel) and grad == pytest.approx(_expected(3)[1], rel=rel)


def test_a_damaged_call_hot_path_extension_is_rebuilt(tmp_path):
    """The fastcall extension lives in the same cache and gets the same check."""
    check = "import symbackprop.run.fastcall as f\nprint(f.extension() is not None)\n"
    code = textwrap.dedent(CHECK_SALT.format(salt=95)) + check
    from_cache = {"SYMBACKPROP_FASTCALL_FROM_CACHE": "1"}  # not the copy installed with the package
    first = _child(code, tmp_path, env=from_cache)
    assert first.returncode == 0 and first.stdout.split()[-1] == "True", first.stderr
    (folder,) = [p for p in tmp_path.glob("fastcall-*") if p.is_dir()]
    _truncate(folder)
    again = _child(code, tmp_path, env=from_cache)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.split()[-1] == "True" and "damaged or untrusted" in again.stderr
    assert json.loads(again.stdout.splitlines()[-2])[:2] == pytest.approx(_expected(95)), again.stdout


def test_a_whole_entry_whose_library_cannot_load_here_is_a_build_error(tmp_path):
    """A checked entry that links a library missing on this host (built
    elsewhere, say): a BuildError naming the library, not an ImportError."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or sys.platform != "linux":
        pytest.skip("needs a C compiler on Linux")
    libdir = tmp_path / "lib"
    libdir.mkdir()
    (libdir / "extra.c").write_text("int sbp_extra_function(void) { return 1; }\n")
    subprocess.run([cc, "-shared", "-fPIC", str(libdir / "extra.c"), "-o", str(libdir / "libsbpextra.so")], check=True)
    flags = ("-O1", f"-L{libdir}", "-Wl,--no-as-needed", "-lsbpextra", f"-Wl,-rpath,{libdir}")
    code = f"""
        from symbackprop.toolchain.builder import BuildOptions
        try:
            sbp.compile(model(96), options=BuildOptions(flags={flags!r}))
            print("loaded")
        except sbp.BuildError as exc:
            print("BuildError:", exc)
    """
    assert _child(code, tmp_path).stdout.strip().endswith("loaded")
    (libdir / "libsbpextra.so").unlink()
    done = _child(code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "BuildError: cannot load the compiled module" in done.stdout and "libsbpextra" in done.stdout


def test_what_a_rejected_entry_leaves_behind(tmp_path):
    """A damaged entry is taken out of the cache whole; nothing of it stays."""
    for damage in (_truncate, _entry_is_a_file):
        folder = _built(97 + DAMAGE.index(damage), tmp_path)
        damage(folder)
        build_module.build_once(folder, lambda f: False, lambda staging: (staging / "x").write_text("x"))
        assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "x"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tmp-")]
