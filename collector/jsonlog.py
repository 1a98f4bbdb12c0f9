"""The collector's logs: JSON lines (the service default) or text, and rate-limited warnings.

``log_format = "json"`` writes one JSON object per line on stderr::

    {"ts": "2026-11-30T06:20:12.345Z", "level": "info", "logger": "lightspan.collector.server",
     "msg": "flushed 512 spans and 0 log records to Parquet", "spans": 512, "log_records": 0,
     "wal_segments": 1, "seconds": 0.031}

``ts`` is UTC with milliseconds, ``level`` the lower-case level name, ``logger`` the logger's
name, ``msg`` the formatted message; every ``extra={...}`` field of the call follows as its own
key (values JSON cannot hold are written as their ``str``), and ``exc`` holds a traceback.
``log_format = "text"`` writes the same line for people: ``ts level logger: msg key=value ...``.

:class:`RateLimit` keeps a flood (a client retrying a refused export in a loop) to one line per
key and interval, saying how many were left out.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from datetime import datetime, timezone

from lightspan.core.config import redact_logs

FORMATS = ("json", "text")
# attributes every LogRecord has: anything else on a record came from ``extra=``
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


def fields(record: logging.LogRecord) -> dict:
    """The ``extra=`` fields of a record."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


def _ts(record: logging.LogRecord) -> str:
    moment = datetime.fromtimestamp(record.created, timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, then the record's extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": _ts(record), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        for key, value in fields(record).items():
            # NaN and infinities are not JSON: written as text, so every line stays parseable
            doc.setdefault(key, value if not isinstance(value, float) or math.isfinite(value) else str(value))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exc"] = record.exc_text
        return json.dumps(doc, ensure_ascii=False, default=str, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """``ts level logger: msg key=value ...`` for a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_ts(record)} {record.levelname} {record.name}: {record.getMessage()}"
        extra = fields(record)
        if extra:
            line += " " + " ".join(f"{k}={v}" for k, v in extra.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure(log_format: str, level: int | str = logging.INFO, stream=None) -> None:
    """Format every handler of the root logger with ``log_format`` ("json" or "text"); add a
    stderr handler when there is none. For the collector's process (``serve``), not a library."""
    formatter = {"json": JsonFormatter, "text": TextFormatter}[log_format]()
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler(stream or sys.stderr))
    for handler in root.handlers:
        handler.setFormatter(formatter)
    redact_logs(root)                   # no line shows a URL's credentials (an S3 endpoint, an upstream)
    root.setLevel(level)


class RateLimit:
    """At most one line per key every ``interval_s`` seconds; counts what it left out."""

    def __init__(self, interval_s: float = 10.0, clock=time.monotonic):
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def check(self, key: str) -> int | None:
        """None when the line should be left out; else how many were left out since the last one."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return None
            self._last[key] = now
            return self._suppressed.pop(key, 0)
