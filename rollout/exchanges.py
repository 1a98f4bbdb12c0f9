"""One generation call through the gateway: the HTTP side of a protocol's row.

An :class:`Exchange` is made of the caller's request body and its protocol's row
(:data:`lightspan.tracing.protocols.PROTOCOLS`, the instrumentor's own: the captures, request
rewrites, conversions and message shapes are one home for both transports); the gateway
(:mod:`.gateway`) sends :meth:`~Exchange.body` to :attr:`~Exchange.upstream`, hands vLLM's answer
to :meth:`~Exchange.answer` (a response) or each line of its event stream to
:meth:`~Exchange.frames` (then :meth:`~Exchange.end`), and writes back what they return.
:meth:`~Exchange.attributes` are the span's, as the instrumentor records them.

A call its protocol converts (Responses, Anthropic Messages: to the chat completion vLLM's own
route would make) goes to ``/v1/chat/completions`` with the capture fields, and each chat chunk
becomes the caller's events (the capture's ``events``); any other call goes to its own path with
the capture fields added, its answer or stream relayed as the protocol's row says (``frames``,
``end``), the fields only the gateway asked for set back to ``null`` unless the caller asked too.

Errors are the protocol's shape (:func:`error_body`). A request field the gateway reads itself
(the row's ``fields``: ``stream``, ``include``, ``logprobs``, …) with the wrong JSON type is
refused with 400 and the field's name (:func:`invalid`) before anything reaches vLLM. Pure: no I/O.
"""

from __future__ import annotations

import logging

from lightspan.tracing import messages, semconv
from lightspan.tracing.protocols import Protocol
from lightspan.tracing.protocols.base import REASONS, converted_path, loads, openai_error, sse_data, sse_event

log = logging.getLogger(__name__)


def error_body(protocol: Protocol | None, status: int, message: str, param: str | None = None) -> bytes:
    """The gateway's own error answer in the shape of the protocol the caller speaks (OpenAI's
    where it speaks none: ``GET /v1/models``, an unknown path)."""
    return (protocol.error if protocol is not None else openai_error)(status, message, param)


def invalid(protocol: Protocol, asked: dict) -> tuple[str, str] | None:
    """(param, message) for the first field of ``asked`` the gateway reads that has the wrong JSON
    type (``include: 5``), else None: such a call is answered 400, as OpenAI answers it."""
    for name, (kind, what) in protocol.fields.items():
        value = asked.get(name)
        if value is None:
            continue
        # bool is an int in Python, never in JSON; a number may be an integer
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if not ok:
            return name, f"Invalid type for '{name}': expected {what}, but got {_json_type(value)} instead."
        if name == "include":
            bad = next((item for item in value if not isinstance(item, str)), None)
            if bad is not None or None in value:
                return name, f"Invalid type for '{name}': expected {what}, but an item is {_json_type(bad)}."
    return None


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "an integer" if isinstance(value, int) else "a number"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


class Exchange:
    """A call in flight: its capture, where it goes, what the caller gets, the span's attributes."""

    def __init__(self, protocol: Protocol, asked: dict, upstream: str, strip: bool, content: bool = True):
        self.protocol, self.asked, self.strip = protocol, asked, strip
        self.finished = False     # vLLM's answer was read to its end marker
        self.cap = protocol.capture(asked)   # a body it cannot convert goes as it is (vLLM judges it)
        self.upstream = converted_path(upstream, protocol) if self.cap.converted else upstream
        # the answer's messages, read as it passes (only when the span records them)
        self.output = protocol.output(self.cap, bool(asked.get("stream"))) if content else None

    # --- what is sent -----------------------------------------------------------------------
    def body(self) -> dict:
        return self.protocol.request(self.cap, self.asked)

    def inputs(self) -> list:
        return self.protocol.inputs(self.asked)

    # --- what comes back --------------------------------------------------------------------
    def answer(self, payload):
        """What the caller gets for vLLM's (decoded) response."""
        self.finished = True
        if not self.cap.converted:
            self.read(payload)
            return payload
        if not isinstance(payload, dict):
            return payload
        if self.output is not None:
            self.output.add(payload)
        return self.cap.message(payload)

    def frames(self, line: bytes) -> list[bytes]:
        """What the caller gets for one line of vLLM's event stream (without its line end)."""
        if not self.cap.converted:
            return self.protocol.frames(self, line)
        data = sse_data(line)
        if data == b"[DONE]":
            self.finished = True
            return []                # the last events go out from end(), once the span has ended
        if data is None or not data.startswith(b"{"):
            return []                # the chat stream's framing is not the caller's
        chunk = loads(data)
        if not isinstance(chunk, dict):
            return []
        try:
            events = self.cap.events(chunk)
        except (TypeError, AttributeError, KeyError) as e:   # no event of the caller's can be made of it
            raise ValueError(f"an unreadable chat completion chunk: {e!r}") from e
        return [sse_event(name, event) for name, event in events]

    def end(self) -> list[bytes]:
        """vLLM's stream has ended (cleanly): the caller's last frames, which the gateway sends once
        the span has ended (a caller that has the whole stream can count on the span)."""
        if not self.cap.converted:
            return self.protocol.end(self)
        return [sse_event(name, event) for name, event in self.cap.end()] if self.finished else []

    def error(self, content_type: str, body: bytes) -> tuple[str, bytes]:
        """vLLM's error answer as the caller gets it (content type, body)."""
        return self.protocol.upstream_error(self.cap, content_type, body)

    def read(self, payload) -> None:
        """Fold a response or stream payload of the protocol's own into the capture; what lightspan
        cannot read is marked, never raised (the caller's answer goes out as it came)."""
        if not isinstance(payload, dict) or not self.cap.readable:
            return
        try:
            self.cap.add(payload, hide=self.strip)
            if self.output is not None:
                self.output.add(payload)
        except Exception:   # a shape no parser expected: the span says capture_error
            log.debug("gateway: unreadable answer", exc_info=True)
            self.cap.readable = False

    # --- the span ---------------------------------------------------------------------------
    def attributes(self, model_version: int | None, content: bool) -> dict:
        """The capture's span attributes (and ``gen_ai.output.messages`` when ``content``)."""
        if not self.cap.readable:
            return {semconv.CAPTURE_STATUS: "capture_error", semconv.CAPTURE_REASON: REASONS["capture_error"]}
        attrs = {**self.cap.attributes(model_version), **self.cap.genai_attributes()}
        if content:
            try:
                out = self.protocol.outputs(self.cap, self.output)
                if out is not None:
                    attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = messages.dumps(out)
            except Exception:
                log.debug("gateway: could not read the answer's messages", exc_info=True)
        return attrs
