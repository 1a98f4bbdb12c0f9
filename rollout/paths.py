"""The gateway's paths: which upstream paths it serves, and what a request's URL and headers say.

:data:`ENDPOINTS` is the table from an upstream path (vLLM's, under ``/v1``) to what the gateway
does with it: capture it as a generation call of a protocol (``/v1`` + each path of
:data:`lightspan.tracing.protocols.PROTOCOLS`: chat completions, completions, the Responses API,
Anthropic Messages; :mod:`lightspan.rollout.exchanges`), or pass it through untouched and untraced. A path that is not in the table is answered 404 and never reaches vLLM:
vLLM's unauthenticated routes (``/pause``, ``/collective_rpc``, ``/sleep``,
``/v1/load_lora_adapter``, …) are not in it, and a path with dot segments (``/v1/../sleep``, which
an HTTP client would normalise into ``/sleep``) is refused before the table is read. A further
protocol is a row of the protocol table; its path is served here by that.

:func:`route` reads the rollout, task and split from a URL prefix (``/rollouts/{id}/tasks/{id}/
splits/{split}/v1/...``, in any order); :func:`call_attributes` lets headers win over it, and adds
the agent's name from ``x-lightspan-agent``. :func:`reward_route` reads the same prefix before
``/reward``, the session reward route (:mod:`lightspan.rollout.rewards`).
Everything here is a function of its arguments: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from lightspan.rollout.headers import header_attributes
from lightspan.tracing import semconv
from lightspan.tracing.protocols import PROTOCOLS, Protocol

HEADER_ROLLOUT_ID = "x-lightspan-rollout-id"
HEADER_TASK_ID = "x-lightspan-task-id"
HEADER_SPLIT = "x-lightspan-split"
_PREFIX = re.compile(r"^((?:/(?:rollouts|tasks|splits)/[^/]+)*)(/v1(?:/.*)?)$")
_REWARD = re.compile(r"^((?:/(?:rollouts|tasks|splits)/[^/]+)*)/reward$")
_PREFIX_KEYS = {"rollouts": semconv.ROLLOUT_ID, "tasks": semconv.TASK_ID, "splits": semconv.SPLIT}
_HEADER_KEYS = {HEADER_ROLLOUT_ID: semconv.ROLLOUT_ID, HEADER_TASK_ID: semconv.TASK_ID, HEADER_SPLIT: semconv.SPLIT}


@dataclass(frozen=True)
class Endpoint:
    methods: tuple[str, ...]
    protocol: Protocol | None = None   # captured as a call of this protocol; None: passed through


ENDPOINTS: dict[str, Endpoint] = {
    **{"/v1" + p.path: Endpoint(("POST",), p) for p in PROTOCOLS.values()},
    "/v1/models": Endpoint(("GET",)),
    "/v1/embeddings": Endpoint(("POST",)),
    "/v1/messages/count_tokens": Endpoint(("POST",)),   # Anthropic clients size their prompts with it
}


def unsafe(raw_path: str) -> str | None:
    """Why a request path may not be routed (dot segments, backslashes), or None."""
    if "\\" in raw_path or "%5c" in raw_path.lower():
        return "backslashes are not allowed in the path"
    if any(unquote(segment) in (".", "..") for segment in raw_path.split("/")):
        return "dot segments ('.' and '..') are not allowed in the path"
    return None


def route(path: str) -> tuple[dict[str, str], str] | None:
    """(rollout/task/split attributes from the URL prefix, upstream path and query), or None if
    the path is not under ``/v1`` (``path`` is the request target as sent, percent-encoded)."""
    parts = urlsplit(path)
    m = _PREFIX.match(parts.path)
    if m is None:
        return None
    return _prefix_attributes(m.group(1)), m.group(2) + (f"?{parts.query}" if parts.query else "")


def reward_route(path: str) -> dict[str, str] | None:
    """The rollout/task/split attributes of a session reward path (``/rollouts/{id}/reward``, the
    prefix as :func:`route` reads it; ``path`` as sent), or None if ``path`` is not one."""
    m = _REWARD.match(urlsplit(path).path)
    return None if m is None else _prefix_attributes(m.group(1))


def _prefix_attributes(prefix: str) -> dict[str, str]:
    attrs, segments = {}, prefix.strip("/").split("/") if prefix else []
    for key, value in zip(segments[::2], segments[1::2]):
        attrs[_PREFIX_KEYS[key]] = unquote(value)
    return attrs


def endpoint(upstream: str) -> Endpoint | None:
    """The table entry of an upstream path (its query string ignored), or None."""
    return ENDPOINTS.get(upstream.split("?", 1)[0])


def protocol_of(raw_path: str) -> Protocol | None:
    """The protocol whose error shape an answer to ``raw_path`` takes: the one whose path it is or
    lies under (Anthropic's for ``/v1/messages/count_tokens``), else None (OpenAI's)."""
    routed = route(raw_path)
    upstream = routed[1].split("?", 1)[0] if routed else ""
    for protocol in PROTOCOLS.values():
        path = "/v1" + protocol.path
        if upstream == path or upstream.startswith(path + "/"):
            return protocol
    return None


def call_attributes(path_attrs: dict[str, str], headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Rollout, task and split of a call (headers first, then the URL prefix), and the agent that
    names itself in ``x-lightspan-agent`` (:mod:`lightspan.rollout.headers`). ``headers``: (name,
    value) pairs as they came, repeats kept: of a header sent twice the first value wins, as the
    docs say (a mapping would hold the values joined, ``"first, second"``)."""
    pairs = [(name.lower(), value) for name, value in headers]
    attrs = dict(path_attrs)
    for header, key in _HEADER_KEYS.items():
        value = next((v for name, v in pairs if name == header and v), None)
        if value:
            attrs[key] = value
    attrs.update(header_attributes(pairs))
    return attrs
