"""What the pipeline is doing and how long it takes, through `logging`.

Every stage (lower, differentiate, emit, the C compile) is logged at INFO
level to the logger "symbackprop" with its duration, and so are cache
hits and misses with the cache folder::

    import logging
    logging.basicConfig(level=logging.INFO)      # or: symbackprop.log.enable()
    symbackprop.compile(model)
    # INFO symbackprop: lower mlp: 0.004 s
    # INFO symbackprop: differentiate mlp: 0.051 s (forward: 6 -> 6 scalar ops after CSE; ...)
    # INFO symbackprop: emit mlp: 0.020 s
    # INFO symbackprop: cache miss: /home/me/.cache/symbackprop/<key>
    # INFO symbackprop: compiling mlp: 412 lines of C, cache key 3f9a0c1d2e4b
    # INFO symbackprop: C compile mlp: 0.812 s

While the C compiler runs, a line every 2 s (build.PROGRESS_SECONDS)
shows that a long compile is still going: `still compiling mlp: 4.0 s
elapsed`; the "C compile" line gives the time when it is done.

`symbackprop build -v` turns this on for the command line (to stderr).
Nothing is logged unless the application configures logging (the
library adds no handler of its own).

Long work is not silent, though: a compile (`sbp.compile`, and the C
functions built on first use inside `fit`, `train_step`, `vjp`, `jvp`,
`hvp`) that is still running after SLOW_SECONDS says so in one line,
naming the model and the stage it is in (`slow_work`): to the logger
where the application configured logging, else to stderr where stderr is
a terminal (as progress bars, symbackprop.progress).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from symbackprop.progress import is_terminal  # where a bar shows, a notice does

logger = logging.getLogger("symbackprop")

SLOW_SECONDS = 1.0  # a compile running longer says so (slow_work)
# what is told when a stage starts: the last stage's name (slow_work reads
# it), and the functions called with it (a build's progress bar)
_stages: dict[str, Any] = {"now": "", "listeners": []}


class stage:
    """Time a pipeline stage and log `<name>: <seconds> s (<details>)` at
    INFO when it ends without an exception. Use it as a context manager, or
    with `start()` and `stop()` around code that cannot be indented.
    `detail(text)` adds to the line (text may be a function that writes it,
    called only when the line is logged)."""

    def __init__(self, name: str, subject: str = "") -> None:
        self.name = f"{name} {subject}" if subject else name
        self.details: list[str | Callable[[], str]] = []
        self.began = 0.0

    def start(self) -> stage:
        self.began = time.perf_counter()
        _stages["now"] = self.name
        for listener in list(_stages["listeners"]):
            listener(self.name)
        return self

    def detail(self, text: str | Callable[[], str]) -> None:
        self.details.append(text)

    def stop(self) -> float:
        seconds = time.perf_counter() - self.began
        if logger.isEnabledFor(logging.INFO):
            written = [d if isinstance(d, str) else d() for d in self.details]
            more = f" ({'; '.join(written)})" if written else ""
            logger.info("%s: %.3f s%s", self.name, seconds, more)
        return seconds

    def __enter__(self) -> stage:
        return self.start()

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        if kind is None:
            self.stop()


def on_stage(listener: Callable[[str], None]) -> Callable[[], None]:
    """Call listener(name) as each stage starts; returns the call that stops it."""
    _stages["listeners"].append(listener)
    return lambda: _stages["listeners"].remove(listener)


def notice(text: str) -> None:
    """One line a user should see without configuring anything: to the
    logger (INFO) where logging is configured, else to stderr where it is
    a terminal, else nowhere."""
    if logger.hasHandlers():
        logger.info("%s", text)
    elif is_terminal(sys.stderr):
        print(f"symbackprop: {text}", file=sys.stderr, flush=True)


class slow_work:
    """A context around a compile: where it is still running after
    SLOW_SECONDS, one line says what (`what`, naming the model) and the
    stage it is in (`notice`).

    Args:
        what: e.g. "compiling 'mlp'" or "compiling train_step of 'mlp' (built on first use)".
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.said = False
        self._timer: threading.Timer | None = None

    def _say(self) -> None:
        self.said = True
        now = _stages["now"]
        notice(f"{self.what}: more than {SLOW_SECONDS:g} s so far" + (f" (now: {now})" if now else ""))

    def __enter__(self) -> slow_work:
        self._timer = threading.Timer(SLOW_SECONDS, self._say)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()


def event(text: str, *args: Any) -> None:
    """One INFO line (a cache hit or miss)."""
    logger.info(text, *args)


def op_counts(plans: Any) -> str:
    """'kind: before -> after scalar ops after CSE' for each planned function."""
    return "; ".join(f"{fn.schedule.name}: {fn.schedule.op_counts[0]} -> {fn.schedule.op_counts[1]} scalar ops after CSE"
                     for fn in plans)


def enable(level: int = logging.INFO, stream: Any = None) -> logging.Handler:
    """Log symbackprop's stages to `stream` (default: stderr); returns the handler."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("symbackprop: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler


__all__ = ["SLOW_SECONDS", "enable", "event", "logger", "notice", "on_stage", "op_counts", "slow_work", "stage"]
