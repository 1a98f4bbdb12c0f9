"""The lightspan instrumentor: token ids and logprobs on every GenAI span, with no code change.

``opentelemetry-instrument`` loads it through the ``opentelemetry_instrumentor`` entry point.
It wraps the ``openai`` client's ``post`` (sync and async), which runs inside whichever GenAI
span the OpenAI instrumentation opened (traceloop's or OTel's), so the attributes land on it:

1. requests bound for an RL endpoint (``LIGHTSPAN_CAPTURE_URLS``, comma-separated base URLs;
   loopback addresses when unset) ask vLLM for ``return_token_ids`` and sampled-token
   ``logprobs``; hosted APIs, which reject unknown fields, are never touched;
2. the response's prompt ids, completion ids (one list per choice) and logprobs are recorded
   as little-endian bytes (DESIGN §3.1), with the serving policy version
   (``LIGHTSPAN_MODEL_VERSION``) and ``lightspan.capture.status``;
3. when no span is recording (no OpenAI instrumentation installed), it opens a GenAI span of
   its own around the call.

Not yet: streaming responses (recorded as ``capture.status=unsupported_stream``).
"""

from __future__ import annotations

import os
from collections.abc import Collection
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.instrumentation.utils import unwrap
from wrapt import wrap_function_wrapper

from lightspan.tracing import semconv

_LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
_TRACER_NAME = "lightspan.instrumentor"


def capture_urls() -> list[str]:
    raw = os.environ.get("LIGHTSPAN_CAPTURE_URLS", "")
    return [u.strip().rstrip("/") for u in raw.split(",") if u.strip()]


def should_capture(base_url: str, path: str, urls: list[str]) -> bool:
    """Capture only chat/completions calls to a configured RL endpoint (loopback by default)."""
    if _operation(path) is None:
        return False
    base = str(base_url).rstrip("/")
    if urls:
        return any(base == u or base.startswith(u + "/") for u in urls)
    return (urlsplit(base).hostname or "") in _LOOPBACK


def _operation(path: str) -> str | None:
    path = "/" + str(path).strip("/")
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/completions"):
        return "text_completion"
    return None


def with_capture(body: dict, operation: str) -> dict:
    """The request body plus the fields that make vLLM return token ids and logprobs."""
    body = dict(body)
    body["return_token_ids"] = True
    if operation == "chat":
        if not body.get("logprobs"):
            body["logprobs"] = True
    elif body.get("logprobs") is None:
        body["logprobs"] = 0  # completions: sampled token's logprob only
    return body


def _extra(obj) -> dict:
    return getattr(obj, "model_extra", None) or {}


def attributes_from_response(resp, operation: str) -> dict:
    """Span attributes from a parsed ChatCompletion / Completion carrying vLLM's extra fields."""
    choices = getattr(resp, "choices", None)
    if choices is None:
        return {semconv.CAPTURE_STATUS: "unparsed_response"}
    prompt_ids = _extra(resp).get("prompt_token_ids")
    completions, logprobs = [], []
    for choice in choices:
        extra = _extra(choice)
        if prompt_ids is None:
            prompt_ids = extra.get("prompt_token_ids")
        ids = extra.get("token_ids")
        if ids is None:
            return {semconv.CAPTURE_STATUS: "no_token_ids"}
        completions.append(semconv.encode_ids(ids))
        lp = getattr(choice, "logprobs", None)
        if operation == "chat":
            values = [t.logprob for t in (getattr(lp, "content", None) or [])]
        else:
            values = list(getattr(lp, "token_logprobs", None) or [])
        if len(values) != len(ids):
            return {semconv.CAPTURE_STATUS: "logprobs_mismatch"}
        logprobs.append(semconv.encode_floats(values))
    if prompt_ids is None:
        return {semconv.CAPTURE_STATUS: "no_token_ids"}
    attrs = {
        semconv.PROMPT_TOKEN_IDS: semconv.encode_ids(prompt_ids),
        semconv.COMPLETION_TOKEN_IDS: tuple(completions),
        semconv.COMPLETION_LOGPROBS: tuple(logprobs),
        semconv.CAPTURE_STATUS: "ok",
    }
    version = os.environ.get("LIGHTSPAN_MODEL_VERSION", "")
    if version.strip().lstrip("-").isdigit():
        attrs[semconv.MODEL_VERSION] = int(version)
    return attrs


def _prepare(instance, args, kwargs):
    """(operation, kwargs to call with) when this call is to be captured, else (None, kwargs)."""
    path = args[0] if args else kwargs.get("path", "")
    body = kwargs.get("body")
    operation = _operation(path)
    if not isinstance(body, dict) or not should_capture(getattr(instance, "base_url", ""), path, capture_urls()):
        return None, kwargs
    if kwargs.get("stream") or body.get("stream"):
        return "stream", kwargs
    return operation, {**kwargs, "body": with_capture(body, operation)}


def _own_span(operation: str, kwargs):
    model = (kwargs.get("body") or {}).get("model", "")
    return trace.get_tracer(_TRACER_NAME).start_as_current_span(
        f"{operation} {model}".strip(), kind=trace.SpanKind.CLIENT,
        attributes={semconv.GEN_AI_OPERATION_NAME: operation, semconv.GEN_AI_REQUEST_MODEL: model})


def _record(span, operation, resp) -> None:
    if span.is_recording():
        span.set_attributes(attributes_from_response(resp, operation))


def _sync_post(wrapped, instance, args, kwargs):
    operation, kwargs = _prepare(instance, args, kwargs)
    if operation is None:
        return wrapped(*args, **kwargs)
    span = trace.get_current_span()
    if operation == "stream":
        if span.is_recording():
            span.set_attribute(semconv.CAPTURE_STATUS, "unsupported_stream")
        return wrapped(*args, **kwargs)
    if not span.is_recording():
        with _own_span(operation, kwargs) as own:
            resp = wrapped(*args, **kwargs)
            _record(own, operation, resp)
            return resp
    resp = wrapped(*args, **kwargs)
    _record(span, operation, resp)
    return resp


async def _async_post(wrapped, instance, args, kwargs):
    operation, kwargs = _prepare(instance, args, kwargs)
    if operation is None:
        return await wrapped(*args, **kwargs)
    span = trace.get_current_span()
    if operation == "stream":
        if span.is_recording():
            span.set_attribute(semconv.CAPTURE_STATUS, "unsupported_stream")
        return await wrapped(*args, **kwargs)
    if not span.is_recording():
        with _own_span(operation, kwargs) as own:
            resp = await wrapped(*args, **kwargs)
            _record(own, operation, resp)
            return resp
    resp = await wrapped(*args, **kwargs)
    _record(span, operation, resp)
    return resp


class LightspanInstrumentor(BaseInstrumentor):
    """Adds token-id and logprob capture to the ``openai`` client (see the module docstring)."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return ("openai >= 1.0.0",)

    def _instrument(self, **kwargs):
        wrap_function_wrapper("openai._base_client", "SyncAPIClient.post", _sync_post)
        wrap_function_wrapper("openai._base_client", "AsyncAPIClient.post", _async_post)

    def _uninstrument(self, **kwargs):
        import openai._base_client as base

        unwrap(base.SyncAPIClient, "post")
        unwrap(base.AsyncAPIClient, "post")
