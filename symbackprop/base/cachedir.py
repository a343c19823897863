"""Where compiled modules and other per-user caches are kept: one rule for
the builder and for the emit stage's template cache (a module of its own,
so that emit need not import the builder, which imports emit)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SYMBACKPROP_CACHE_DIR"


def cache_folder(given: str | os.PathLike[str] | None = None) -> Path:
    """`given` (BuildOptions.cache_dir), else $SYMBACKPROP_CACHE_DIR, else
    the platform's user cache folder from platformdirs (~/.cache/symbackprop
    or $XDG_CACHE_HOME/symbackprop on Linux, ~/Library/Caches/symbackprop on
    macOS, %LOCALAPPDATA%\\symbackprop\\Cache on Windows)."""
    if given is not None:
        path = str(given)
    elif os.environ.get(CACHE_ENV):
        path = os.environ[CACHE_ENV]
    else:
        import platformdirs

        path = platformdirs.user_cache_dir("symbackprop", appauthor=False)
    # absolute: the compiler runs in the build folder, where a relative path means another place
    return Path(os.path.abspath(os.path.expanduser(path)))
