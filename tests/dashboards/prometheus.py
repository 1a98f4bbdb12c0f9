"""Reading the Prometheus text the services serve on /metrics (what a scraper sees)."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Samples of a Prometheus text exposition: name -> [(labels, value)]."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if line.startswith("#") or not match:
            continue
        labels = dict(_LABEL.findall(match.group(3) or ""))
        out.setdefault(match.group(1), []).append((labels, float(match.group(4))))
    return out
