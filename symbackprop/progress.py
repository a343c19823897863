"""Progress of long work (epochs of training, models of a build): a tqdm bar
when tqdm is installed (an optional dependency), else nothing.

Every long loop takes `progress=`:

- None (the default): a bar on stderr only when stderr is a terminal;
- True: a bar even when it is not (a log file, a notebook);
- False: nothing;
- a callable: called as ``progress(done, total, info)`` after each unit
  (``info``: a dict such as ``{"loss": 0.31}``), for a logger or a UI.

Progress never changes a result: it only reads what the loop reports.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Union

ProgressCallback = Callable[[int, int, dict], None]
ProgressArg = Union[bool, None, ProgressCallback]  # noqa: UP007  (the alias is evaluated at run time)


class Progress:
    """One loop's progress: `step(**info)` after each unit; the bar ends
    after the last unit, or at `close()` (or the end of a `with` block) when
    the loop stops early.

    Args:
        total: the number of units.
        what: the unit's name, shown on the bar ("epoch", "model").
        progress: see the module's docstring.
    """

    def __init__(self, total: int, what: str, progress: ProgressArg = None) -> None:
        self.total, self.done = total, 0
        self._callback = progress if callable(progress) else None
        self._bar = None if callable(progress) else _tqdm_bar(total, what, progress)

    def step(self, **info: Any) -> None:
        """One more unit done; `info` is shown beside the bar (or passed to the callback)."""
        self.done += 1
        if self._callback is not None:
            self._callback(self.done, self.total, dict(info))
        elif self._bar is not None:
            if info:
                self._bar.set_postfix(info, refresh=False)
            self._bar.update(1)
        if self.done >= self.total:
            self.close()

    def note(self, **info: Any) -> None:
        """What the current unit is doing (a stage), shown beside the bar
        now; the callback is not told (it hears of whole units)."""
        if self._bar is not None:
            self._bar.set_postfix(info, refresh=True)

    def close(self) -> None:
        """End the bar (a no-op without one)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tqdm_bar(total: int, what: str, progress: bool | None) -> Any:
    """A tqdm bar on stderr, or None: not asked for, not a terminal, or no tqdm."""
    if progress is False or (progress is None and not is_terminal(sys.stderr)):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # optional: no bar, silently (pip install symbackprop[progress] adds it)
        return None
    return tqdm(total=total, unit=what, desc=what + "s", file=sys.stderr, dynamic_ncols=True)


def is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


__all__ = ["Progress", "ProgressArg", "ProgressCallback"]
