"""Routes that one part adds to another's server (the web UI on the collector's API port), and
what they answer.

The collector imports no dashboards, lightningrl or trainer code and the dashboards no collector
code: the process that composes the services (``lightspan collector``, :mod:`lightspan.cli`)
builds a tuple of :class:`Route` and hands it to the collector. A route's handler is a plain
function of the request's path and query string and of a :class:`CollectorState`; it returns a
:class:`Response`, whatever HTTP server carries it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from lightspan.core.web.request import Response

__all__ = ["CollectorState", "Response", "Route", "find"]


class CollectorState(Protocol):
    """What a route may read of the collector: where its data is, its limits, its numbers."""

    data_dir: Path
    sql_timeout_s: float

    def health(self) -> Mapping:
        """``Collector.health()``: running, counters, refusals by reason, queue and WAL bytes."""


@dataclass(frozen=True)
class Route:
    paths: tuple[str, ...]         # exact paths this route answers, e.g. ("/", "/ui")
    prefix: str                    # and every path under this prefix, e.g. "/ui/" ("" for none)
    handler: Callable[[str, str, CollectorState], Response]   # (path, query string, state)
    open: bool = False             # answered without the bearer token (static files that hold no data)

    def matches(self, path: str) -> bool:
        return path in self.paths or bool(self.prefix) and path.startswith(self.prefix)


def find(routes: tuple[Route, ...], path: str) -> Route | None:
    return next((r for r in routes if r.matches(path)), None)
