"""The web UI's collector page: the collector's own numbers as JSON, and ingest rates from its polls."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence


def rate(samples: Sequence[tuple[float, float]], window_s: float) -> float | None:
    """Per-second increase of a counter over the samples (time, value) of the last ``window_s``
    seconds before the newest; None with fewer than two. A counter reset restarts from zero."""
    if len(samples) < 2:
        return None
    newest_t = samples[-1][0]
    recent = [s for s in samples if s[0] >= newest_t - window_s]
    if len(recent) < 2:
        recent = list(samples[-2:])
    increase = sum(b[1] - a[1] if b[1] >= a[1] else b[1] for a, b in zip(recent, recent[1:]))
    elapsed = recent[-1][0] - recent[0][0]
    return increase / elapsed if elapsed > 0 else None


def health(numbers: Mapping, *, rates: Mapping[str, float | None]) -> dict:
    """The collector's health page from its numbers (``Collector.health()``): counters, refusals by
    reason, queue and WAL bytes, mean flush and fsync times, and ``rates``."""
    refused = dict(numbers["requests_refused_total"])
    counters = {k: v for k, v in numbers.items() if k.endswith("_total") and k != "requests_refused_total"}

    def mean(name: str):
        count = numbers.get(f"{name}_count")
        return numbers[f"{name}_sum"] / count if count else None

    return {"running": numbers["running"], "counters": counters, "refused": refused,
            "refused_total": sum(refused.values()), "queue_bytes": numbers["queue_bytes"],
            "wal_bytes": numbers["wal_bytes"], "flush_seconds_mean": mean("flush_seconds"),
            "fsync_seconds_mean": mean("fsync_seconds"), "rates": dict(rates), "limits": dict(numbers["limits"]),
            "time_unix_nano": time.time_ns()}
