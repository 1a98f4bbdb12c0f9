"""Which span a captured call's attributes go on, so that one LLM call is one LLM span.

The instrumentor records on the LLM span that describes the call:

1. the current span, when it is an LLM span (traceloop's or OTel's OpenAI instrumentation opens
   it around ``chat.completions.create``);
2. else, when a framework instrumentation opened the call's LLM span without making it current
   and asked the instrumentations below it to stand aside (traceloop's LangChain instrumentation
   starts ``ChatOpenAI.chat``, detaches it and sets ``suppress_language_model_instrumentation``),
   the LLM span most recently started in this context, if it is still open and holds no capture;
3. else, for a client library that starts the call's LLM span itself inside the call (the
   ``anthropic`` SDK's ``anthropic.messages.create`` span, on by default in anthropic 2.x), that
   span, adopted as it starts (:meth:`Nesting.on_start`): a second span of the same call would
   cost the agent more than the capture itself (bench/capture_overhead.py);
4. else a GenAI span of its own (:func:`open_span`; also when a span to adopt never started).

Nested LLM spans of one call are marked ``capture.status=duplicate`` with ``capture.duplicate_of``
= the span that carries the ids: the spans enclosing the recorded one (both OpenAI
instrumentations installed, or a framework's span around the client's), an LLM span that a
client library starts inside lightspan's own span, and traceloop's ``openai.response`` span, which its Responses
wrapper starts only after the call returned, beside lightspan's span instead of around it.
Seeing those spans start needs a span processor on the SDK tracer provider (:class:`Nesting`,
added at ``instrument()``); with no SDK there are no spans to mark.
"""

from __future__ import annotations

import contextvars
import weakref

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor

from lightspan.tracing import semconv

TRACER_NAME = "lightspan.instrumentor"
# the context key (opentelemetry-semantic-conventions-ai) with which a framework's instrumentation
# that already opened the call's LLM span tells the client instrumentations below it to stand aside
SUPPRESS_LLM_KEY = "suppress_language_model_instrumentation"
# the span traceloop's Responses wrapper starts after the call (opentelemetry-instrumentation-openai)
TRACELOOP_RESPONSES_SPAN = "openai.response"


def is_llm_span(span) -> bool:
    """A live SDK span that describes one LLM call (GenAI or traceloop's older operation name)."""
    attrs = getattr(span, "attributes", None)
    if attrs is None:   # (an empty mapping reads no operation: no ``len`` asked of the SDK's attributes)
        return False
    op = attrs.get(semconv.GEN_AI_OPERATION_NAME) or attrs.get(semconv.LLM_REQUEST_TYPE)
    return op in semconv.LLM_OPERATIONS


def span_id(span) -> str:
    return format(span.get_span_context().span_id, "016x")


def mark_duplicate(span, of) -> None:
    """Mark ``span`` as describing the call that span ``of`` (a span, or its hex id) carries."""
    if span.is_recording():
        span.set_attributes({semconv.CAPTURE_STATUS: "duplicate",
                             semconv.CAPTURE_DUPLICATE_OF: of if isinstance(of, str) else span_id(of)})


class Nesting(SpanProcessor):
    """Remembers, for each span started under an LLM span, the nearest enclosing LLM span, and
    marks the LLM spans that start for a call lightspan already holds a span for.

    A child span knows only its parent's id; the parent span object is in the context only at the
    moment the child starts, so it is looked up here. Weak keys: nothing outlives its span.
    """

    def __init__(self):
        self.enclosing: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.owned: weakref.WeakSet = weakref.WeakSet()   # lightspan's own open call spans
        # the span most recently started in this context (thread or task), weakly (docstring, 2.)
        self.last_started: contextvars.ContextVar = contextvars.ContextVar("lightspan_last_started", default=None)
        # the hex id of lightspan's span of the Responses call that just returned here (the span may be
        # gone by then: it has ended): traceloop's span of the call starts next
        self.responses_call: contextvars.ContextVar = contextvars.ContextVar("lightspan_responses_call", default=None)
        # the call whose LLM span the client library starts itself, during the call (docstring, 3.)
        self.adopting: contextvars.ContextVar = contextvars.ContextVar("lightspan_adopting", default=None)
        self.active = True

    def pending_llm_span(self):
        """The LLM span just started here but not current, when a framework asked for suppression."""
        if not otel_context.get_value(SUPPRESS_LLM_KEY):
            return None
        ref = self.last_started.get()
        span = ref() if ref is not None else None
        if span is None or not span.is_recording() or not is_llm_span(span):
            return None
        if semconv.CAPTURE_STATUS in span.attributes:  # already holds another call's capture
            return None
        return span

    def on_start(self, span, parent_context=None) -> None:
        if not self.active:
            return
        try:
            self.last_started.set(weakref.ref(span))
        except TypeError:  # a span type that cannot be weakly referenced
            return
        call = self.adopting.get()
        if call is not None:
            attrs = getattr(span, "attributes", None)   # (``is_llm_span``, written out)
            if attrs is not None and (attrs.get(semconv.GEN_AI_OPERATION_NAME)
                                      or attrs.get(semconv.LLM_REQUEST_TYPE)) in semconv.LLM_OPERATIONS:
                self.adopting.set(None)
                nested = self._nest(span, parent_context)
                call.adopt(span)
                if nested:   # (else no LLM span encloses it)
                    mark_enclosing(span)
                return
        ours = self.responses_call.get()
        if ours is not None:
            self.responses_call.set(None)
            if getattr(span, "name", None) == TRACELOOP_RESPONSES_SPAN:
                mark_duplicate(span, ours)
                return
        self._nest(span, parent_context)

    def stop_adopting(self, token) -> None:
        """The call that set ``adopting`` (``token``) returned: adopt nothing more for it."""
        try:
            self.adopting.reset(token)
        except ValueError:   # (a token of another context: never break the agent's call over telemetry)
            self.adopting.set(None)

    def _nest(self, span, parent_context) -> bool:
        """Remember the LLM span enclosing ``span``, if any; whether there is one."""
        parent = trace.get_current_span(parent_context)
        if not parent.is_recording():
            return False
        try:
            if parent in self.owned and is_llm_span(span):
                mark_duplicate(span, parent)   # a client library's own span of our call
                return False
            outer = parent if is_llm_span(parent) else self.enclosing.get(parent)
            if outer is not None:
                self.enclosing[span] = outer
                return True
        except TypeError:  # a span type that cannot be weakly referenced: no nesting to track
            pass
        return False


NESTING = Nesting()
_PROVIDERS: weakref.WeakSet = weakref.WeakSet()
_tracer_provider = None


def add_processor(provider) -> None:
    """Put :data:`NESTING` on an SDK tracer provider (once: the SDK cannot remove a processor, so
    ``uninstrument()`` switches it off with ``active``)."""
    if hasattr(provider, "add_span_processor") and provider not in _PROVIDERS:
        provider.add_span_processor(NESTING)
        _PROVIDERS.add(provider)
    NESTING.active = True


def set_tracer_provider(provider) -> None:
    global _tracer_provider
    _tracer_provider = provider


def tracer_provider():
    """The provider given to ``instrument(tracer_provider=...)``, or None."""
    return _tracer_provider


def mark_enclosing(inner) -> None:
    """Mark every LLM span enclosing ``inner`` as a duplicate of it."""
    outer = NESTING.enclosing.get(inner)
    while outer is not None:
        mark_duplicate(outer, inner)
        outer = NESTING.enclosing.get(outer)


_TRACER: list = [None, None]   # the provider of the last call, its tracer


def _tracer():
    """lightspan's tracer of the instrumentor's provider (else the global one), cached per provider:
    the SDK's ``get_tracer`` hands back the same tracer each time, after ~10 µs of building its key
    and resetting a warnings filter."""
    provider = _tracer_provider if _tracer_provider is not None else trace.get_tracer_provider()
    if provider is not _TRACER[0]:
        _TRACER[:] = [provider, provider.get_tracer(TRACER_NAME)]
    return _TRACER[1]


def open_span(name: str, attributes: dict, start_time: int | None = None):
    """A GenAI client span of lightspan's own for one call (docstring, 4.); ``start_time`` (ns) for
    one opened after the call began."""
    span = _tracer().start_span(name, kind=trace.SpanKind.CLIENT, attributes=attributes, start_time=start_time)
    NESTING.owned.add(span)
    mark_enclosing(span)  # an LLM span further up (under a framework's own span) describes this call too
    return span


def target(name: str, attributes, adopt: bool = False):
    """(span to record on, whether lightspan opened it) for one call; ``attributes()`` gives a
    span of our own its start attributes (built only then). ``adopt``: the client library starts
    the call's span itself (docstring, 3.): (None, False), and the call's span is adopted then."""
    current = trace.get_current_span()
    if is_llm_span(current):
        mark_enclosing(current)
        return current, False
    pending = NESTING.pending_llm_span() if NESTING.active else None
    if pending is not None:
        mark_enclosing(pending)
        return pending, False
    if adopt:
        return None, False
    return open_span(name, attributes()), True
