"""One intercepted generation call, recorded: :class:`Call` holds its capture and its span, and
records the capture on the span when the answer (or its stream) ends, counting the outcome
(:mod:`.report`). What the agent's variables say is read at once per call (:func:`settings`).
"""

from __future__ import annotations

import functools
import logging
from itertools import compress
from operator import not_
from typing import NamedTuple

from lightspan.tracing import messages, semconv, spans
from lightspan.tracing.clients import Client
from lightspan.tracing.protocols import Protocol
from lightspan.tracing.protocols.base import REASONS
from lightspan.tracing.report import CAPTURED, REPORT

log = logging.getLogger(__name__)


_VARIABLES = ("LIGHTSPAN_CAPTURE_URLS", "AGL_OPENAI_BASE_URL", "TRACELOOP_TRACE_CONTENT",
              "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", semconv.SEMCONV_OPT_IN_ENV,
              semconv.POLICY_VERSIONS_ENV, "LIGHTSPAN_MODEL_VERSION")


class Settings(NamedTuple):
    """What the variables a call reads say, read at once (:func:`settings`)."""
    capture_urls: str
    """``LIGHTSPAN_CAPTURE_URLS`` (:mod:`.urls`)."""
    agl_base_url: str
    """``AGL_OPENAI_BASE_URL``: Agent Lightning's proxy, whose agents read ids without asking."""
    content: bool
    """Whether spans lightspan opens record the messages (off when the GenAI instrumentations' own
    switches say so: ``TRACELOOP_TRACE_CONTENT=false``, ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=false``)."""
    opt_in: str
    """``OTEL_SEMCONV_STABILITY_OPT_IN`` (which GenAI names to write: ``semconv.genai``)."""
    policy_versions: dict
    """``LIGHTSPAN_POLICY_VERSIONS``: {policy (model name): version} with several policies served."""
    model_version: int | None
    """``LIGHTSPAN_MODEL_VERSION``: the version of the one policy served."""


def settings() -> Settings:
    """The variables' :class:`Settings` now (read per call: a runner may change them between calls;
    cached on their values, one dict read each)."""
    return _settings(semconv.env_raw(_VARIABLES))


@functools.lru_cache(maxsize=16)
def _settings(raw: tuple) -> Settings:
    urls_raw, agl, traceloop, otel, opt_in, versions, version = semconv.env_text(raw)
    version = version.strip()
    return Settings(urls_raw, agl, traceloop.strip().lower() != "false" and otel.strip().lower() != "false", opt_in,
                    semconv.parse_policy_versions(versions), int(version) if version.lstrip("-").isdigit() else None)


def model_version() -> int | None:
    return settings().model_version


def served_policy(model: str | None, now: Settings | None = None) -> tuple[str | None, int | None]:
    """(policy, version) that served a call to ``model``: with several policies served
    (``LIGHTSPAN_POLICY_VERSIONS``) the policy of that model name, else none and
    ``LIGHTSPAN_MODEL_VERSION``'s version (``now``: the settings read already)."""
    now = now or settings()
    versions = now.policy_versions
    if model in versions:
        return model, versions[model]
    return None, now.model_version


def content_on() -> bool:
    """Whether spans lightspan opens record the messages (:attr:`Settings.content`)."""
    return settings().content


# what the client library's own span of a call records itself (the anthropic SDK's)
_LIBRARY_RECORDS = frozenset({semconv.GEN_AI_OPERATION_NAME, semconv.GEN_AI_REQUEST_MODEL, semconv.GEN_AI_RESPONSE_MODEL,
                              semconv.GEN_AI_USAGE_INPUT_TOKENS, semconv.GEN_AI_USAGE_OUTPUT_TOKENS})


class Call:
    """A call being captured: its capture, its span, and what its answer's reader needs."""

    __slots__ = ("client", "protocol", "cap", "span", "owned", "output", "stream", "converted", "ended", "path",
                 "adopted", "deferred", "start", "name", "content")

    def __init__(self, client: Client, protocol: Protocol, cap, stream: bool):
        self.client, self.protocol, self.cap, self.stream = client, protocol, cap, stream
        self.converted = cap is not None and cap.converted
        self.span, self.owned, self.output, self.ended, self.path = None, False, None, False, None
        self.adopted = False
        self.deferred = None   # (adopting's reset token, start ns) while the span to adopt is awaited
        self.start = None      # the start attributes of a span of our own (a function)
        self.name = None       # a span of our own's name
        self.content = False   # whether the span records the messages

    def adopt(self, span) -> None:
        """The client library's span of this call started (spans.Nesting): record on it."""
        self.span, self.adopted = span, True

    def settle(self) -> None:
        """The client's ``post`` returned (or raised): a span awaited that never started is one of
        our own now, started when the call did."""
        if self.deferred is None:
            return
        token, start_ns = self.deferred
        self.deferred = None
        spans.NESTING.stop_adopting(token)
        if self.span is None:
            self.span, self.owned = spans.open_span(self.name, self.start(), start_time=start_ns), True

    def _live(self):
        """The span to record on: an adopted span that ended already (its library ends it before
        ``post`` returns when it reads the answer itself) gives way to one of our own."""
        if self.adopted and getattr(self.span, "end_time", None) is not None:
            self.span, self.owned, self.adopted = spans.open_span(
                self.name, self.start(), start_time=self.span.start_time), True, False
        return self.span

    @property
    def fed(self) -> int:
        return self.cap.fed

    def args(self, args: tuple) -> tuple:
        """The positional arguments of ``post``, with the path a converted call goes to."""
        return (self.path, *args[1:]) if self.path is not None and args else args

    def unreadable(self) -> None:
        log.debug("lightspan: unreadable response or stream chunk", exc_info=True)
        self.cap.readable = False

    def set_status(self, status: str, reason: bool = False) -> None:
        span = self._live()
        if span.is_recording():
            span.set_attribute(semconv.CAPTURE_STATUS, status)
            if reason:
                span.set_attribute(semconv.CAPTURE_REASON, REASONS[status])

    def returned(self) -> None:
        """The client's call returned: the instrumentation's span of a protocol whose span starts
        late (traceloop's Responses wrapper) starts next."""
        if self.protocol.late_span and self.span is not None and (self.owned or self.cap is None):
            spans.NESTING.responses_call.set(spans.span_id(self.span))

    def passed(self, resp):
        """A call this process does not capture (a gateway does) but holds a span for."""
        self.returned()
        if self.owned:
            self.span.end()
        return resp

    def finish(self, complete: bool, counted: bool = False) -> None:
        """The answer is in (``complete``) or the stream was left: record, count, end our span."""
        if self.ended:
            return
        self.ended = True
        if complete:
            self._record()
        else:
            status = "unparsed_response" if counted else "stream_incomplete"
            self.set_status(status, reason=True)
            REPORT.count(status, REASONS[status])
        if self.owned:
            self.span.end()

    def _record(self) -> None:
        cap, span = self.cap, self._live()
        try:
            if cap.readable:
                now = settings()
                # the model name the call went to (the answer's, else the request's) names its policy
                policy, version = served_policy(cap.model or getattr(span, "attributes", {}).get(
                    semconv.GEN_AI_REQUEST_MODEL), now)
                attrs = cap.attributes(version)
                if policy is not None:
                    attrs[semconv.POLICY_NAME] = policy
                if self.adopted:   # the library's span: what it does not record itself
                    attrs.update(self.start(adopted=True, opt_in=now.opt_in))
                    genai = cap.genai_attributes()   # (filtered in C, in order)
                    attrs.update(compress(genai.items(), map(not_, map(_LIBRARY_RECORDS.__contains__, genai))))
                elif self.owned:
                    attrs.update(cap.genai_attributes())
                if self.content and (self.owned or self.adopted):
                    out = self.protocol.outputs(cap, self.output)
                    if out is not None:
                        attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = messages.dumps(out)
            else:
                attrs = {semconv.CAPTURE_STATUS: "capture_error", semconv.CAPTURE_REASON: REASONS["capture_error"]}
        except Exception:  # never break the agent's call over telemetry
            log.debug("lightspan: could not record token ids", exc_info=True)
            attrs = {semconv.CAPTURE_STATUS: "capture_error", semconv.CAPTURE_REASON: REASONS["capture_error"]}
        if span.is_recording():
            span.set_attributes(attrs)
        status = attrs.get(semconv.CAPTURE_STATUS)
        REPORT.count(status, attrs.get(semconv.CAPTURE_REASON) if status != CAPTURED else None)


def _start_attributes(protocol: Protocol, model: str, body: dict, content: list, on: bool, adopted: bool = False,
                      opt_in: str | None = None) -> dict:
    """A span of our own's start attributes, with the messages when ``on`` (:func:`content_on`, read
    as the call began); ``content`` gets True when they hold them. ``adopted``: less what the
    client library's span records itself. ``opt_in``: ``OTEL_SEMCONV_STABILITY_OPT_IN``, read already."""
    attrs = dict(_start_names(protocol.operation, model, protocol.provider,
                              settings().opt_in if opt_in is None else opt_in, adopted))
    if on:
        content.append(True)
        try:
            attrs[semconv.GEN_AI_INPUT_MESSAGES] = messages.dumps(protocol.inputs(body))
        except Exception:
            log.debug("lightspan: could not read the request's messages", exc_info=True)
    return attrs


@functools.lru_cache(maxsize=64)
def _start_names(operation: str, model: str, provider: str, opt_in: str, adopted: bool = False) -> dict:
    """The GenAI start attributes of a call (``semconv.genai``'s names for ``OTEL_SEMCONV_STABILITY_OPT_IN=opt_in``;
    ``adopted``: less what the client library's span records itself; cached: an agent calls a few
    models; the caller copies them)."""
    names = semconv.genai({semconv.GEN_AI_OPERATION_NAME: operation, semconv.GEN_AI_REQUEST_MODEL: model,
                           semconv.GEN_AI_PROVIDER_NAME: provider}, {semconv.SEMCONV_OPT_IN_ENV: opt_in})
    return {k: v for k, v in names.items() if k not in _LIBRARY_RECORDS} if adopted else names
