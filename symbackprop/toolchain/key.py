"""One way to make every cache key, and what `-march=native` means here.

Every key (a module's cache entry, a model's memo, the call hot path's
extension, a dask ModuleSpec) is `digest(kind, *parts)`: SHA-256 over the
kind and the parts, each prefixed by its length, so no two different lists
of parts give the same bytes (a separator could appear inside a part).

`-march=native` as text says nothing about the code it makes: a cache
shared between hosts would hand AVX-512 code to a CPU without it. So a
command that asks for the host's CPU is keyed on what the compiler
resolves it to on this host (its `-###` output: the -march it picks and
every -m feature switch, or clang's -target-cpu and -target-feature),
else on the CPU's model and flags from /proc/cpuinfo.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterable
from functools import cache, lru_cache

_TAKES_VALUE = ("--param", "-target-cpu", "-target-feature", "-tune-cpu")


def digest(kind: str, *parts: str | bytes, length: int = 32) -> str:
    """The hex SHA-256 (first `length` digits) of the kind and the parts."""
    hasher = hashlib.sha256()
    for part in (kind, *parts):
        data = part if isinstance(part, bytes) else str(part).encode("utf-8", "surrogatepass")
        hasher.update(len(data).to_bytes(8, "little"))
        hasher.update(data)
    return hasher.hexdigest()[:length]


def asks_for_host_cpu(arguments: Iterable[str]) -> bool:
    """Whether a compiler command tunes for the machine it runs on
    (-march=native, -mcpu=native, -mtune=native, ...)."""
    return any(arg.startswith("-m") and "native" in arg for arg in arguments)


@cache
def target_cpu(command: tuple[str, ...]) -> str:
    """What `command` (a compiler, its own options and the host-dependent
    flags) targets on this host; computed once per process."""
    try:
        out = subprocess.run([*command, "-###", "-E", "-x", "c", os.devnull],
                             capture_output=True, text=True, timeout=60)
        resolved = _target_options(out.stderr + out.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError):
        resolved = ""
    return f"compiler: {resolved}" if resolved else f"cpu: {host_cpu()}"


def _target_options(text: str) -> str:
    """The target switches of the compiler proper's command line in `-###`
    output (gcc's cc1, clang's -cc1), without any still saying 'native'."""
    for line in text.splitlines():
        words = shlex.split(line) if ("cc1" in line or "-cc1" in line) and not line.startswith("COLLECT") else []
        if not words:
            continue
        picked = []
        for k, word in enumerate(words):
            if word in _TAKES_VALUE and k + 1 < len(words):
                picked.append(f"{word} {words[k + 1]}")
            elif re.match(r"^-m[\w.+-]+(=\S+)?$", word):
                picked.append(word)
        picked = [word for word in picked if "native" not in word]
        if picked:
            return " ".join(picked)
    return ""


def executable_stamp(command: Iterable[str]) -> str:
    """Which files a command's programs are (each word that names one on
    PATH: the compiler, or ccache and the compiler): real path, size,
    modification time and inode. A different or reinstalled compiler has
    another stamp; taking it runs nothing (`--version` costs a process)."""
    stamps = []
    for word in command:
        found = shutil.which(word) if not word.startswith("-") else None
        if found:
            real = os.path.realpath(found)
            info = os.stat(real)
            stamps.append(f"{real} {info.st_size} {info.st_mtime_ns} {info.st_ino}")
    return "\n".join(stamps)


@lru_cache(maxsize=1)
def host_cpu() -> str:
    """The CPU's model and feature flags (Linux /proc/cpuinfo), else what
    the platform module says."""
    lines = []
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:  # the first processor is enough
                if not line.strip():
                    break
                lines.append(line)
    except OSError:
        pass
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    wanted = ("vendor_id", "cpu family", "model", "model name", "flags", "Features", "CPU implementer", "CPU part")
    found = [f"{key}={fields[key]}" for key in wanted if key in fields]
    return "; ".join([platform.machine(), *found])


__all__ = ["asks_for_host_cpu", "digest", "executable_stamp", "host_cpu", "target_cpu"]
