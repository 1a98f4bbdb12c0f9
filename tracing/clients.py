"""The client libraries whose calls the instrumentor captures, one row each: :data:`CLIENTS`.

The protocols (:mod:`lightspan.tracing.protocols`) say what is asked and answered; a client's row
says what differs between the libraries that speak them: how the body its ``post`` gets becomes
plain JSON (openai 1.x leaves ``NOT_GIVEN`` in it, anthropic 2.x ``omit`` and pydantic blocks),
whether an answer converted from a chat completion can reach the caller through it (it must pass
through lightspan's JSON hook or its SSE decoder), whether it opens a span of its own per call
(the ``anthropic`` SDK's tracing, which lightspan adopts: :mod:`.spans`), and its stream and raw
response types (imported when first needed: a library may not be installed).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from itertools import compress
from operator import not_
from typing import NamedTuple

from lightspan.tracing import hooks


class Types(NamedTuple):
    """A client library's classes the instrumentor works with."""
    sse_event: type          # its ``ServerSentEvent`` (lightspan's events subclass it)
    sse_decoder: type        # its own SSE decoder (a stream with another keeps it)
    legacy_response: type | None   # its legacy raw response (``with_raw_response``), if any
    responses: tuple         # its ``APIResponse`` types (``with_streaming_response``)


@dataclass(frozen=True)
class Client:
    name: str
    """The library's import name (its ``_base_client`` module's ``post`` is wrapped)."""
    plain: Callable
    """(the body its ``post`` gets) -> the body as JSON data, as the library will send it."""
    given: Callable
    """(the body its ``post`` gets) -> the body without the library's top-level sentinels (its
    arguments left unset), nothing else changed: ``plain``'s first step, all of it for a body of
    JSON data (a protocol's common shape checks that: ``Protocol.common``)."""
    cannot_convert: Callable
    """(client instance, stream) -> why a converted answer cannot reach the caller through it, or None."""
    own_spans: bool
    """Whether it may open a span of its own for a call (read per client: ``_tracer``)."""
    eager_stream: bool
    """Whether its ``Stream`` makes its events' generator in ``__init__`` (openai) or at first use
    (anthropic, on a copy of the stream)."""
    types: Callable
    """() -> its :class:`Types` (cached)."""
    straight: bool = False
    """Whether its sync ``post`` first offers a call to the straight line of its common plain call
    (:mod:`lightspan.tracing.straight`; anything else goes the general way)."""


_SENTINELS = frozenset({"NotGiven", "Omit"})


def _given(body: dict) -> dict:
    """The body without the top-level ``NOT_GIVEN`` / ``omit`` sentinels that the openai 1.x client
    leaves in the body it posts and strips only as it sends it (its arguments left unset)."""
    if not any(type(v).__name__ in _SENTINELS for v in body.values()):
        return body
    return {k: v for k, v in body.items() if type(v).__name__ not in _SENTINELS}


def _converts(instance, stream: bool) -> None:
    """(The openai client's answers pass through the JSON hook; a stream with an SSE decoder of the
    client's own is counted ``unparsed_response`` when the stream is tapped: :mod:`.streams`.)"""
    return None


@functools.cache
def _openai_types() -> Types:
    from openai._legacy_response import LegacyAPIResponse
    from openai._response import APIResponse, AsyncAPIResponse
    from openai._streaming import ServerSentEvent, SSEDecoder
    return Types(ServerSentEvent, SSEDecoder, LegacyAPIResponse, (APIResponse, AsyncAPIResponse))


@functools.cache
def _anthropic_types() -> Types:
    from anthropic._response import APIResponse, AsyncAPIResponse
    from anthropic._streaming import ServerSentEvent, SSEDecoder
    return Types(ServerSentEvent, SSEDecoder, None, (APIResponse, AsyncAPIResponse))


# --- anthropic ------------------------------------------------------------------------------------

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


def _anthropic_given(body: dict) -> dict:
    """An ``anthropic`` request body without its top-level ``omit`` / ``NOT_GIVEN`` sentinels (each
    value's type looked up in a set, in C: a posted body holds a dozen sentinels)."""
    sentinel = _anthropic_prepare()[2]
    return dict(compress(body.items(), map(not_, map(sentinel, map(type, body.values())))))


def _anthropic_plain(body: dict) -> dict:
    """An ``anthropic`` request body as JSON-ready data: anthropic 2.x hands ``post`` its arguments
    with ``omit`` sentinels and pydantic blocks (a previous answer's ``content`` sent back).

    A body that is plain data but for its top-level sentinels (most calls) loses them here; the
    rest goes through the client's own ``prepare_request_data`` (its copy costs three times more)."""
    prepare_request_data, sentinels, _ = _anthropic_prepare()
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
    """(anthropic's ``prepare_request_data`` or None, its sentinel types, whether a type is one of them)."""
    try:
        from anthropic._types import NotGiven, Omit
        from anthropic._utils import prepare_request_data
    except ImportError:
        return None, (), frozenset().__contains__
    return prepare_request_data, (NotGiven, Omit), frozenset({NotGiven, Omit}).__contains__


def _anthropic_cannot_convert(instance, stream: bool) -> str | None:
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


CLIENTS: dict[str, Client] = {
    "openai": Client("openai", plain=_given, given=_given, cannot_convert=_converts, own_spans=False, eager_stream=True,
                     types=_openai_types),
    "anthropic": Client("anthropic", plain=_anthropic_plain, given=_anthropic_given,
                        cannot_convert=_anthropic_cannot_convert, own_spans=True, eager_stream=False,
                        types=_anthropic_types, straight=True),
}
"""The client libraries by name; each speaks the protocols whose row names it."""
