"""Never silent: the agent process counts its LLM calls by capture outcome and says why, once.

Every generation call the instrumentor sees is counted: ``ok``, a capture status that is not
(``no_logprobs``, ``stream_incomplete``, …, with its reason), ``other_url`` (a call to a server
that is not a capture URL, by URL: the agent's base URL and ``LIGHTSPAN_CAPTURE_URLS`` disagree, or
it calls a hosted API), or ``gateway`` (``LIGHTSPAN_CAPTURE_URLS=none``: a lightspan gateway
captures it). Each reason is logged once per process, as a warning, with the fix. With
``LIGHTSPAN_CAPTURE_REPORT=FILE`` (``lightspan rollout`` sets it per rollout) the counts are written
there as JSON when the process exits, for the runner's summary::

    {"calls": 3, "captured": 2, "not_captured": {"no_logprobs": 1},
     "reasons": {"no_logprobs": "…"}, "other_urls": {"http://10.0.0.5:8000/v1": 0}}
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from collections import Counter

log = logging.getLogger("lightspan.tracing")

REPORT_ENV = "LIGHTSPAN_CAPTURE_REPORT"
CAPTURED = "ok"
OTHER_URL = "other_url"
GATEWAY = "gateway"


class Report:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.reasons: dict[str, str] = {}
        self.urls: Counter = Counter()
        self.logged: set[str] = set()

    def count(self, status: str, reason: str | None = None, url: str | None = None) -> None:
        """One call with this outcome; the first time a reason comes up it is logged."""
        if reason is None and not url:   # (a captured call: nothing to log)
            with self.lock:
                self.counts[status] += 1
            return
        key = f"{status} {url}" if url else status
        with self.lock:
            self.counts[status] += 1
            if url:
                self.urls[url] += 1
            if reason and status not in self.reasons:
                self.reasons[status] = reason
            first = reason is not None and key not in self.logged
            if first:
                self.logged.add(key)
        if first:
            log.warning("lightspan: a call%s was not captured (%s): %s", f" to {url}" if url else "", status, reason)

    def captured(self) -> None:
        """``count(CAPTURED)``: one call captured (the straight line's)."""
        with self.lock:
            self.counts[CAPTURED] += 1

    def summary(self) -> dict:
        with self.lock:
            counts = dict(self.counts)
            calls = sum(counts.values())
            return {"calls": calls, "captured": counts.get(CAPTURED, 0),
                    "not_captured": {k: v for k, v in sorted(counts.items()) if k != CAPTURED},
                    "reasons": dict(sorted(self.reasons.items())), "other_urls": dict(self.urls)}

    def write(self, path: str) -> None:
        try:
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.summary(), f)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("lightspan: could not write the capture report %s: %s", path, e)


REPORT = Report()
_registered = False


def register() -> None:
    """Write the report at exit when ``LIGHTSPAN_CAPTURE_REPORT`` names a file (once per process)."""
    global _registered
    path = os.environ.get(REPORT_ENV, "").strip()
    if path and not _registered:
        _registered = True
        atexit.register(REPORT.write, path)


def restart() -> None:
    """In a process forked from a warm interpreter (a rollout worker's child, rollout/zygote.py):
    forget the parent's counts and write this process's report, named by its own environment."""
    global _registered
    REPORT.__init__()  # in place: the capture modules hold this object
    _registered = False
    register()
