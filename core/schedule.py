"""Run a job now and then on a fixed period until SIGINT or SIGTERM: the schedule of jobs that have
none of their own (``lightspan transitions build --every``; the trainer's ``--mode every`` keeps its
own loop, whose ranks must stop together).

A job that raises is logged with its error and counted, and the next tick runs on time: a store
that is briefly unreachable does not end the schedule. A job that runs past its slot skips the
ticks it missed rather than running back to back. The first signal lets the running job finish;
a second one stops at once (KeyboardInterrupt).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def every(period_s: float, job: Callable[[], object], *, stop: threading.Event | None = None,
          name: str = "job") -> int:
    """Run ``job`` every ``period_s`` seconds until ``stop`` is set (by SIGINT or SIGTERM when this is
    the main thread). Returns 0 if the last run succeeded, 1 if it raised."""
    stop = stop or threading.Event()
    previous = install_stop_handlers(stop, "run")
    failures, last_ok = 0, True
    try:
        deadline = time.monotonic()
        while not stop.is_set():
            try:
                job()
                last_ok = True
            except Exception as exc:        # logged and counted; the schedule goes on
                failures, last_ok = failures + 1, False
                log.error("%s failed (%d so far), next in %.0f s: %s", name, failures, period_s, exc,
                          exc_info=log.isEnabledFor(logging.DEBUG))
            deadline = max(deadline + period_s, time.monotonic())
            stop.wait(deadline - time.monotonic())
    finally:
        restore_handlers(previous)
    return 0 if last_ok else 1


def install_stop_handlers(stop: threading.Event, what: str) -> dict:
    """SIGINT and SIGTERM set ``stop`` (the current ``what`` finishes first); a second one raises
    KeyboardInterrupt. Only in the main thread; returns the handlers replaced (:func:`restore_handlers`)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum, frame):
        if stop.is_set():                     # a second signal: stop now
            raise KeyboardInterrupt
        log.info("%s: finishing the current %s, then stopping", signal.Signals(signum).name, what)
        stop.set()

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def restore_handlers(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
