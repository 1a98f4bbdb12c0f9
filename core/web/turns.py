"""Turns: at most ``running`` handlers in one kind of work at once, ``waiting`` more queued, the rest
told to retry; and an :class:`Allowance` of bytes of one kind of work in progress (see :mod:`lightspan.core.web`).

A server gives each kind of work that must not crowd out another its own :class:`Turns` (the
collector: one for queries, one for reward posts), so a flood of one kind is refused with 429 +
``Retry-After`` while the other kind still gets its turn. An :class:`Allowance` bounds work by its
size instead of its count (the collector's OTLP/JSON decoding, which holds several times a body's
size): small pieces run beside a big one, never queued behind it.
"""

from __future__ import annotations

import contextlib
import threading

from lightspan.core.web.request import retry_later


class Turns:
    """``with turns.take():`` runs the block in one of ``running`` turns; with ``waiting`` requests
    queued already, or no turn within ``wait_s``, it raises 429 + ``Retry-After``. ``what`` names the
    work and the setting that bounds it, for the refusal's message."""

    def __init__(self, running: int, waiting: int, wait_s: float, retry_after_s: int, what: str):
        self.running, self.waiting, self.wait_s, self.retry_after_s, self.what = (running, waiting, wait_s,
                                                                                retry_after_s, what)
        self._turns = threading.BoundedSemaphore(running)
        self._queued = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def take(self):
        with self._lock:
            if self._queued >= self.waiting:
                raise retry_later(429, f"too many {self.what} at once; retry later", self.retry_after_s)
            self._queued += 1
        try:
            got = self._turns.acquire(timeout=self.wait_s)
        finally:
            with self._lock:
                self._queued -= 1
        if not got:
            raise retry_later(429, f"no turn for {self.what} within {self.wait_s:g} s; retry later",
                              self.retry_after_s)
        try:
            yield
        finally:
            self._turns.release()


class Allowance:
    """At most ``limit`` bytes of one kind of work in progress at once, across threads. ``take(n)``
    waits until ``n`` more fit (an idle allowance admits any one piece, however big), up to
    ``wait_s``; False when they did not fit in time. No queue: a piece that fits goes at once, so
    small ones pass beside a big one (a big one waits only while others hold the room it needs)."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self._cond = threading.Condition()

    def take(self, n: int, wait_s: float) -> bool:
        with self._cond:
            if not self._cond.wait_for(lambda: self.held == 0 or self.held + n <= self.limit, timeout=wait_s):
                return False
            self.held += n
            return True

    def give(self, n: int) -> None:
        with self._cond:
            self.held -= n
            self._cond.notify_all()
