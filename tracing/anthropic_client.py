"""What the instrumentor needs of the ``anthropic`` client to convert its calls to chat completions
(:mod:`.anthropic_convert`): the request body as plain JSON data, and whether the answer can be
converted back on its way to the client (it must pass through lightspan's JSON hook or its SSE
decoder)."""

from __future__ import annotations

import functools
import sys

from lightspan.tracing import hooks

_SCALARS = (str, int, float, bool, type(None))


def _json_ready(value, depth: int = 0) -> bool:
    """Whether ``value`` is made of dicts, lists and scalars alone (exact types), not too deep to walk."""
    kind = type(value)
    if kind in _SCALARS:
        return True
    if depth > 32:
        return False
    if kind is dict:
        for item in value.values():
            if type(item) not in _SCALARS and not _json_ready(item, depth + 1):
                return False
        return True
    if kind is list:
        for item in value:
            if type(item) not in _SCALARS and not _json_ready(item, depth + 1):
                return False
        return True
    return False


def plain(body: dict) -> dict:
    """An ``anthropic`` request body as JSON-ready data: anthropic 2.x hands ``post`` its arguments
    with ``omit`` sentinels and pydantic blocks (a previous answer's ``content`` sent back).

    A body that is plain data but for its top-level sentinels (most calls) loses them here; the
    rest goes through the client's own ``prepare_request_data`` (its copy costs three times more)."""
    prepare_request_data, sentinels = _anthropic_prepare()
    if prepare_request_data is None:   # older releases transform the body before post
        return body
    out = {}
    for key, value in body.items():
        kind = type(value)
        if kind in sentinels:
            continue
        if kind not in _SCALARS and not _json_ready(value):
            return prepare_request_data(body, location="body")
        out[key] = value
    return out


@functools.cache
def _anthropic_prepare():
    """(anthropic's ``prepare_request_data`` or None, its sentinel types)."""
    try:
        from anthropic._types import NotGiven, Omit
        from anthropic._utils import prepare_request_data
    except ImportError:
        return None, ()
    return prepare_request_data, (NotGiven, Omit)


def cannot_convert(instance, stream: bool) -> str | None:
    """Why an Anthropic call cannot be converted here, else None: its answer must pass through the
    JSON hook (a response) or lightspan's decoder (a stream)."""
    base = sys.modules.get("anthropic._base_client")
    http = getattr(base, "httpx2", None) or getattr(base, "httpx", None)
    if http is None or not hooks.hooked(http.Response):
        return "a client whose HTTP library lightspan does not hook"
    if stream and not _own_decoder(instance):
        return "a client with a server-sent-event decoder of its own"
    return None


def _own_decoder(instance) -> bool:
    """Whether an anthropic client decodes its streams with anthropic's own SSE decoder (one whose
    class and self do not override ``_make_sse_decoder`` does, without making one to see)."""
    if _class_decoder(type(instance)) and "_make_sse_decoder" not in getattr(instance, "__dict__", ()):
        return True
    from anthropic._streaming import SSEDecoder
    return type(instance._make_sse_decoder()) is SSEDecoder


@functools.lru_cache(maxsize=8)
def _class_decoder(cls: type) -> bool:
    from anthropic._base_client import BaseClient
    return getattr(cls, "_make_sse_decoder", None) is getattr(BaseClient, "_make_sse_decoder", False)
