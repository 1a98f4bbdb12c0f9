"""The web UI on the collector's API port: static pages under ``/ui/`` and JSON under ``/api/ui/``.

:func:`routes` is what the composing process (``lightspan collector``) hands the collector: its API
port then answers ``/`` and ``/ui/...`` with :func:`static` (open, like ``/healthz``: the files hold
no data) and ``/api/ui/...`` with :func:`api` (behind the bearer token when one is set). Each answer
is a :class:`~lightspan.core.web.routes.Response`. Queries run on a
fresh read-only connection from :func:`lightspan.store.sql.sql_connection` — the views
``lightspan sql`` uses, with external access off — under the collector's ``sql_timeout_s``.
"""

from __future__ import annotations

import collections
import json
import logging
import mimetypes
import re
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, unquote

import duckdb

from lightspan import store
from lightspan.core.web.routes import CollectorState, Response, Route
from lightspan.store.sql import sql_connection, time_limit
from lightspan.core.config import ConfigError, option, resolve
from lightspan.dashboards import health, quality, ui

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
UI_PREFIX = "/ui/"
API_PREFIX = "/api/ui/"
RATE_WINDOW_S = 60.0       # ingest rates are averaged over this many seconds of health polls
_SAMPLES_KEPT = 256
_STATIC_NAME = re.compile(r"[A-Za-z0-9_-]+\.(html|js|css|svg|png|ico)")
# the pages build every element with textContent: nothing from the store runs as markup or script
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "connect-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True)
class DashboardConfig:
    tokenizer: str = option(
        "", "Tokenizer that decodes completion token ids in the rollout view: a tokenizer.json file or a "
            "directory holding one. Empty = the published policy's (data_dir/policy.json); without one the "
            "view shows token ids.")

    def __post_init__(self):
        if self.tokenizer and not _tokenizer_file(Path(self.tokenizer)):
            raise ConfigError("dashboards", "tokenizer", f"no tokenizer.json at {self.tokenizer!r}",
                              "give a tokenizer.json file or a model directory that has one")


def json_response(status: int, doc, headers: dict | None = None) -> Response:
    body = json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()
    return Response(status, "application/json", body, {**SECURITY_HEADERS, **(headers or {})})


def error(status: int, message: str, headers: dict | None = None) -> Response:
    return json_response(status, {"error": message}, headers)


# --- static files --------------------------------------------------------------------------------

def static(path: str) -> Response:
    """``/`` redirects to ``/ui/``; ``/ui/`` is index.html; ``/ui/NAME`` a file of static/."""
    if path in ("/", "/ui"):
        return Response(302, "text/plain; charset=utf-8", b"see /ui/\n", {"Location": UI_PREFIX})
    name = path[len(UI_PREFIX):] or "index.html"
    file = STATIC_DIR / name
    if not _STATIC_NAME.fullmatch(name) or not file.is_file():
        return Response(404, "text/plain; charset=utf-8", f"not found: {path}\n".encode(), dict(SECURITY_HEADERS))
    kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
    if kind.startswith("text/") or kind.endswith("javascript"):
        kind += "; charset=utf-8"
    return Response(200, kind, file.read_bytes(), dict(SECURITY_HEADERS))


# --- tokenizer -----------------------------------------------------------------------------------

def _tokenizer_file(path: Path) -> Path | None:
    candidate = path / "tokenizer.json" if path.is_dir() else path
    return candidate if candidate.is_file() else None


_tokenizers: dict[tuple[str, float], object] = {}
_tokenizer_lock = threading.Lock()


def decoder(data_dir: Path, config: DashboardConfig):
    """A function decoding token ids one by one with the configured or published policy's
    tokenizer, or None when there is none (the view then shows ids)."""
    source = Path(config.tokenizer) if config.tokenizer else None
    if source is None:
        # several policies are adapters over one base: any of them carries the base's tokenizer
        published = sorted(store.policy.read_all(data_dir).values(), key=lambda p: -p.time_unix_nano)
        if not published:
            return None
        source = Path(published[0].path)
    file = _tokenizer_file(source)
    if file is None:
        return None
    try:
        key = (str(file), file.stat().st_mtime)
    except OSError:           # pruned by the trainer a moment ago: show token ids instead
        return None
    with _tokenizer_lock:
        tokenizer = _tokenizers.get(key)
        if tokenizer is None:
            from tokenizers import Tokenizer   # a Rust library, light: not transformers

            try:
                tokenizer = Tokenizer.from_file(str(file))
            except Exception as exc:   # a broken file: show ids rather than fail the page
                log.warning("cannot load the tokenizer %s (%s): the rollout view shows token ids", file, exc)
                return None
            _tokenizers.clear()
            _tokenizers[key] = tokenizer

    def decode(ids: list[int]) -> list[str] | None:
        try:
            return tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
        except Exception as exc:   # ids of another model's vocabulary: show the ids
            log.debug("cannot decode token ids with %s: %s", file, exc)
            return None
    return decode


_config: DashboardConfig | None = None


def dashboard_config() -> DashboardConfig:
    """The UI's config from the environment (``LIGHTSPAN_DASHBOARDS_TOKENIZER``), resolved once."""
    global _config
    if _config is None:
        _config = resolve(DashboardConfig, section="dashboards")
    return _config


# --- ingest rates --------------------------------------------------------------------------------

_RATED = {"spans_per_second": "spans_accepted_total", "log_records_per_second": "log_records_accepted_total",
          "refusals_per_second": "requests_refused_total"}
_samples: "weakref.WeakKeyDictionary[object, collections.deque]" = weakref.WeakKeyDictionary()
_samples_lock = threading.Lock()


def _rates(collector: CollectorState, doc: dict) -> dict:
    """Record this poll's counters for ``collector`` and return the rates over RATE_WINDOW_S."""
    now = time.monotonic()
    values = {rate: (doc["refused_total"] if counter == "requests_refused_total" else
                     doc["counters"].get(counter, 0.0)) for rate, counter in _RATED.items()}
    with _samples_lock:
        history = _samples.setdefault(collector, collections.deque(maxlen=_SAMPLES_KEPT))
        history.append((now, values))
        points = list(history)
    return {rate: health.rate([(t, v[rate]) for t, v in points], RATE_WINDOW_S) for rate in _RATED}


# --- JSON endpoints ------------------------------------------------------------------------------

def routes() -> tuple[Route, ...]:
    """The web UI's routes on the collector's API port."""
    return (Route(paths=("/", "/ui"), prefix=UI_PREFIX, handler=lambda path, _query, _state: static(path), open=True),
            Route(paths=(), prefix=API_PREFIX, handler=api))


def api(path: str, query: str, collector: CollectorState) -> Response:
    """Answer ``GET /api/ui/...``: 200 with JSON, 400 for bad parameters, 404 for an unknown path
    or rollout, 503 when the store cannot answer within ``sql_timeout_s``."""
    try:
        params = parse_qs(query, keep_blank_values=True, strict_parsing=False, max_num_fields=64)
    except ValueError as exc:
        return error(400, f"bad query string: {exc}")
    route = path[len(API_PREFIX):]
    try:
        if route == "health":
            ui.check_known(params, ())
            doc = health.health(collector.health(), rates={})
            doc["rates"] = _rates(collector, doc)
            return json_response(200, doc)
        if route == "rollouts":
            filters = ui.rollout_filters(params)
            return _answer(_query(collector, lambda con: ui.rollouts(con, filters)))
        if route == "facets":
            return _answer(_query(collector, lambda con: ui.facets(con, params)))
        if route in _PAGES:
            page = _PAGES[route]
            return _answer(_query(collector, lambda con: page(con, params)))
        if route.startswith("rollouts/"):
            ui.check_known(params, ())
            key = unquote(route[len("rollouts/"):])
            decode = decoder(collector.data_dir, dashboard_config())
            answer = _query(collector, lambda con: ui.rollout(con, key, decode))
            if answer is None:
                return error(404, f"no rollout {key!r}: no span has this rollout id or trace id")
            return _answer(answer)
    except ui.BadParameter as exc:
        return error(400, str(exc))
    except ConfigError as exc:
        return error(503, f"the dashboards are misconfigured: {exc}")
    except Exception as exc:   # our bug, not the client's: say so instead of dropping the connection
        log.exception("web UI endpoint %s failed", path)
        return error(500, f"internal error: {type(exc).__name__}: {exc}")
    return error(404, f"not found: {path}; the UI's endpoints are {API_PREFIX}rollouts, {API_PREFIX}rollouts/<id>, "
                      f"{API_PREFIX}facets, {API_PREFIX}training, {API_PREFIX}queue, {API_PREFIX}quality, {API_PREFIX}health")


# the endpoints that are one query function of their parameters
_PAGES = {"training": quality.training, "queue": quality.queue, "quality": quality.quality}


def _answer(result) -> Response:
    return result if isinstance(result, Response) else json_response(200, result)


def _query(collector: CollectorState, fn):
    """``fn(con)`` on a read-only connection under sql_timeout_s, or the error :class:`Response`."""
    timeout_s = collector.sql_timeout_s

    def attempt():
        con = sql_connection(collector.data_dir)
        try:
            with time_limit(con, timeout_s, start=True) as deadline:
                try:
                    return fn(con)
                except duckdb.Error:
                    if deadline.is_set():
                        raise TimeoutError(timeout_s) from None
                    raise
        finally:
            con.close()

    try:
        return store.retry_vanished(attempt)
    except ui.BadParameter:
        raise
    except TimeoutError:
        return error(503, f"the query ran past sql_timeout_s={timeout_s:g} s", {"Retry-After": "5"})
    except duckdb.Error as exc:
        log.exception("dashboard query failed")
        return error(503, f"the store could not answer: {type(exc).__name__}: {exc}", {"Retry-After": "5"})
