"""Progress bars (rich) for the long jobs: rollouts, transition builds, training, model preparation.

One function, :func:`progress`, yields an object with ``advance(n=1)`` and ``update(text)``.
Bars go to stderr and only when stderr is a terminal (or ``LIGHTSPAN_PROGRESS=1``); otherwise
(CI, logs redirected to a file, ``LIGHTSPAN_PROGRESS=0``) the same object does nothing, so jobs
never branch on whether a bar is shown.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator


class _Null:
    """The bar when none is shown."""

    def advance(self, n: float = 1) -> None:
        pass

    def update(self, text: str) -> None:
        pass


class _Bar:
    def __init__(self, progress, task):
        self._progress, self._task = progress, task

    def advance(self, n: float = 1) -> None:
        self._progress.advance(self._task, n)

    def update(self, text: str) -> None:
        self._progress.update(self._task, status=text)


def enabled() -> bool:
    """Whether bars are shown: ``LIGHTSPAN_PROGRESS`` (1/0) if set, else whether stderr is a TTY."""
    forced = os.environ.get("LIGHTSPAN_PROGRESS", "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    return sys.stderr.isatty()


@contextmanager
def progress(description: str, total: float | None = None, *, unit: str = "",
             show: bool = True) -> Iterator[_Bar | _Null]:
    """A progress bar for one job; ``total=None`` shows a spinner with a count. ``show=False``
    (e.g. on every rank but rank 0) gives the bar that does nothing."""
    if not (show and enabled()):
        yield _Null()
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    columns = [SpinnerColumn(), TextColumn("[bold]{task.description}")]
    if total is not None:
        columns += [BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()]
    else:
        columns += [TextColumn("{task.completed:.0f}" + (f" {unit}" if unit else ""))]
    columns += [TimeElapsedColumn(), TextColumn("{task.fields[status]}")]
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(description, total=total, status="")
        yield _Bar(bar, task)
