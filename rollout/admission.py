"""The gateway's shared state: who may call vLLM now, and which policy version it serves.

:class:`Admission` holds the in-flight bound and the pause/drain of a weight update under one
condition variable (the request handlers on the event loop and ``serve``'s signal handling on the
main thread both use it); :class:`PolicyVersion` is the version recorded on the spans; :func:`admin`
answers the gateway's admin routes over both.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from urllib.parse import parse_qs

from lightspan import store
from lightspan.core import web

_ADMIN_BODY_BYTES = 64 << 10


class Admission:
    """Pause/drain and the in-flight bound, under one condition variable (thread-safe)."""

    def __init__(self, limit: int):
        self.limit, self.in_flight, self.paused = limit, 0, False
        self.cond = threading.Condition()
        self.counts = {"requests": 0, "refused_paused": 0, "refused_full": 0, "refused_invalid": 0,
                       "upstream_errors": 0, "replica_failovers": 0,
                       "rewards_posted": 0, "rewards_refused": 0}   # POST /rollouts/{id}/reward (rollout/rewards.py)

    def enter(self) -> str | None:
        """None when admitted, else why not (``paused`` or ``full``)."""
        with self.cond:
            if self.paused:
                self.counts["refused_paused"] += 1
                return "paused"
            if self.in_flight >= self.limit:
                self.counts["refused_full"] += 1
                return "full"
            self.in_flight += 1
            self.counts["requests"] += 1
            return None

    def leave(self) -> None:
        with self.cond:
            self.in_flight -= 1
            self.cond.notify_all()

    def pause(self, timeout_s: float) -> bool:
        """Refuse new requests at once; True when the in-flight ones have all finished in time."""
        with self.cond:
            self.paused = True
            return self.cond.wait_for(lambda: self.in_flight == 0, timeout=timeout_s)

    def resume(self) -> None:
        with self.cond:
            self.paused = False

    def count(self, name: str) -> None:
        with self.cond:
            self.counts[name] += 1


class PolicyVersion:
    """The served policy version: set at resume, else ``policy.json`` (re-read when it changes);
    with several policies, each named one's (:meth:`published`)."""

    def __init__(self, data_dir: str):
        self.data_dir = data_dir
        self.location = store.Location.of(data_dir)
        self.override: int | None = None
        self._cached: tuple[float, dict[str, store.policy.Policy]] = (-1.0, {})

    def published(self) -> dict[str, store.policy.Policy]:
        """Every published policy by name (``""``: the unnamed one); {} before any is published. An
        unreadable file keeps what was read last."""
        try:
            # its time on disk; in a bucket, with no cheap stat, a tick: the object is read again every 2 s
            mtime = self.location.changed_at(store.policy.FILE)
        except OSError:
            return {}
        if mtime != self._cached[0]:
            published = store.policy.read_all(self.data_dir)
            if not published:
                return self._cached[1]
            self._cached = (mtime, published)
        return self._cached[1]

    def get(self) -> int | None:
        """The unnamed policy's version (0 before any is published); None when only named policies are."""
        if self.override is not None:
            return self.override
        published = self.published()
        if not published:
            return 0  # no policy published yet: the initial model
        policy = published.get("")
        return policy.version if policy is not None else None


def admin(request: web.Request, admission: Admission, version: PolicyVersion, status: Callable[[], dict],
          drain_timeout_s: float) -> web.Response:
    """``GET /admin/status``, ``POST /admin/pause`` (``?timeout_s=``: 200 drained, 504 still
    draining) and ``POST /admin/resume`` (optional ``{"model_version": N}``) of an authorised caller."""
    routes = {("GET", "/admin/status"): None, ("POST", "/admin/pause"): _pause, ("POST", "/admin/resume"): _resume}
    if (request.method, request.path) not in routes:
        if request.path in ("/admin/status", "/admin/pause", "/admin/resume"):
            raise web.HTTPError(405, f"method {request.method} not allowed on {request.path}")
        raise web.HTTPError(404, "admin routes: GET /admin/status, POST /admin/pause, POST /admin/resume")
    run = routes[(request.method, request.path)]
    return web.json_response(200, status()) if run is None else run(request, admission, version, status,
                                                                      drain_timeout_s)


def _pause(request: web.Request, admission: Admission, version, status, drain_timeout_s: float) -> web.Response:
    request.body(_ADMIN_BODY_BYTES)   # read and ignored
    value = (parse_qs(request.query).get("timeout_s") or [drain_timeout_s])[0]
    try:
        timeout = float(value)
        if not (math.isfinite(timeout) and timeout >= 0):
            raise ValueError(value)
    except ValueError:
        raise web.HTTPError(400, f"timeout_s={str(value)[:40]!r} is not a number of seconds >= 0") from None
    drained = admission.pause(timeout)
    return web.json_response(200 if drained else 504, {"drained": drained, **status()})


def _resume(request: web.Request, admission: Admission, version: PolicyVersion, status, _timeout) -> web.Response:
    number = None
    if request.content_length:
        doc = request.json(_ADMIN_BODY_BYTES)
        if doc is not None and not isinstance(doc, dict):
            raise web.HTTPError(400, 'body must be JSON like {"model_version": 3}')
        number = (doc or {}).get("model_version")
        if number is not None and (isinstance(number, bool) or not isinstance(number, int)
                                   or not 0 <= number < 1 << 63):
            raise web.HTTPError(400, f"model_version must be a whole number >= 0, got {str(number)[:40]}")
    else:
        request.body(0)
    if number is not None:
        version.override = number
    admission.resume()
    return web.json_response(200, status())
