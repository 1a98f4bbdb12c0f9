"""One generation call through the gateway, per protocol: what vLLM is asked, what the caller gets.

An :class:`Exchange` is made of the caller's request body; the gateway (:mod:`.gateway`) sends
:meth:`~Exchange.body` to :attr:`~Exchange.upstream`, hands vLLM's answer to :meth:`~Exchange.answer`
(a response) or each line of its event stream to :meth:`~Exchange.frames` (then
:meth:`~Exchange.end`), and writes back what they return. :meth:`~Exchange.attributes` are the
span's: the same as the in-process instrumentor records for the protocol, because the captures and
message conversions are the instrumentor's own (``lightspan.tracing.capture``,
``capture_responses``, ``capture_anthropic``, ``messages``); only the HTTP framing is here.

- chat completions and completions (:class:`ChatExchange`): ``return_token_ids`` and
  ``logprobs`` added, set back to ``null`` in the answer unless the caller asked for them;
- the Responses API (:class:`ResponsesExchange`): converted to a chat completion as vLLM converts
  it (``lightspan.tracing.responses_convert``), sent to ``/v1/chat/completions`` with the capture
  fields, and converted back into the Response or event stream ``/v1/responses`` answers (vLLM's
  Responses route gives no logprobs for tool calls and streamed end-of-turn tokens); a request the
  conversion cannot reproduce goes to ``/v1/responses`` with ``enable_response_messages`` and the
  output-text logprobs ``include``, hidden the same way (``no_logprobs`` with the reason where it falls short);
- Anthropic Messages (:class:`MessagesExchange`): converted to a chat completion as vLLM converts
  it, sent to ``/v1/chat/completions`` with the capture fields, and converted back into the
  Anthropic message or event stream that vLLM's own ``/v1/messages`` answers. A request that
  conversion cannot reproduce goes to ``/v1/messages`` as it is (``unsupported_request``).

Errors are the provider's shape (:func:`error_body`): OpenAI's ``{"error": {...}}``, Anthropic's
``{"type": "error", "error": {"type", "message"}}``. A request field the gateway reads itself
(:data:`FIELDS`: ``stream``, ``include``, ``logprobs``, …) with the wrong JSON type is refused with
400 and the field's name (:func:`invalid`) before anything reaches vLLM. Pure: no I/O.
"""

from __future__ import annotations

import logging

from lightspan.rollout.protocols import dumps
from lightspan.tracing import capture_responses, messages, semconv, urls
from lightspan.tracing.anthropic_convert import to_error
from lightspan.tracing.capture import REASONS, Capture, loads, only_for_capture, with_capture
from lightspan.tracing.capture_anthropic import PATH as CHAT_PATH
from lightspan.tracing.capture_anthropic import AnthropicCapture
from lightspan.tracing.capture_responses import PATH as RESPONSES_CHAT_PATH
from lightspan.tracing.capture_responses import ConvertedCapture, ResponsesCapture

log = logging.getLogger(__name__)

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


_OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def error_body(api: str | None, status: int, message: str, param: str | None = None) -> bytes:
    """The gateway's own error answer in the shape of the protocol the caller speaks: OpenAI's
    ``{"error": {"message", "type", "param", "code"}}`` (``code`` the status, as vLLM sends it), or
    Anthropic's for ``/v1/messages``."""
    if api == urls.MESSAGES:
        kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        return dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()
    kind = _OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()


# The request fields the gateway itself reads (to capture, route, stream), per protocol, with the
# JSON types it reads them as; anything else in a body is vLLM's to judge. ``None`` (null) is
# always allowed: it is what an unset field is.
_NUMBER = (int, float)
_COMMON = {"model": (str, "a string"), "stream": (bool, "a boolean"), "temperature": (_NUMBER, "a number")}
FIELDS = {
    urls.CHAT: {**_COMMON, "logprobs": (bool, "a boolean"), "return_token_ids": (bool, "a boolean")},
    urls.TEXT_COMPLETION: {**_COMMON, "logprobs": (int, "an integer"), "return_token_ids": (bool, "a boolean")},
    # the Response envelope the gateway writes for a converted call echoes the sampling settings as numbers
    urls.RESPONSES: {**_COMMON, "include": (list, "an array of strings"), "background": (bool, "a boolean"),
                     "enable_response_messages": (bool, "a boolean"), "top_p": (_NUMBER, "a number"),
                     "presence_penalty": (_NUMBER, "a number"), "frequency_penalty": (_NUMBER, "a number")},
    urls.MESSAGES: _COMMON,
}


def invalid(api: str, asked: dict) -> tuple[str, str] | None:
    """(param, message) for the first field of ``asked`` the gateway reads that has the wrong JSON
    type (``include: 5``), else None: such a call is answered 400, as OpenAI answers it."""
    for name, (kind, what) in FIELDS[api].items():
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


def _data(line: bytes) -> bytes | None:
    """The payload of an SSE ``data:`` line, else None."""
    return line[5:].strip() if line.startswith(b"data:") else None


class Exchange:
    """The protocol-independent part: the span's messages and the capture's attributes."""

    system = "openai"
    api = urls.CHAT

    def __init__(self, asked: dict, upstream: str, strip: bool):
        self.asked, self.upstream, self.strip = asked, upstream, strip
        self.finished = False     # vLLM's answer was read to its end marker
        self.cap = None
        self.output: messages.ChatOutput | None = None

    # --- what is sent -----------------------------------------------------------------------
    def body(self) -> dict:
        raise NotImplementedError

    def inputs(self) -> list:
        return messages.chat_input(self.asked)

    # --- what comes back --------------------------------------------------------------------
    def answer(self, payload) -> dict:
        """What the caller gets for vLLM's (decoded) response."""
        self._read(payload)
        self.finished = True
        return payload

    def frames(self, line: bytes) -> list[bytes]:
        """What the caller gets for one line of vLLM's event stream (without its line end)."""
        raise NotImplementedError

    def end(self) -> list[bytes]:
        """vLLM's stream has ended (cleanly): the caller's last frames, which the gateway sends once
        the span has ended (a caller that has the whole stream can count on the span)."""
        return []

    def error(self, content_type: str, body: bytes) -> tuple[str, bytes]:
        """vLLM's error answer as the caller gets it (content type, body)."""
        return content_type, body

    def _read(self, payload) -> None:
        """Fold a response or stream payload into the capture; what lightspan cannot read is marked,
        never raised (the caller's answer goes out as it came)."""
        if not isinstance(payload, dict) or not self.cap.readable:
            return
        try:
            self._add(payload)
        except Exception:   # a shape no parser expected: the span says capture_error
            log.debug("gateway: unreadable answer", exc_info=True)
            self.cap.readable = False

    def _add(self, payload: dict) -> None:
        self.cap.add(payload, hide=self.strip)
        if self.output is not None:
            self.output.add(payload)

    # --- the span ---------------------------------------------------------------------------
    def outputs(self) -> list | None:
        return self.output.messages(getattr(self.cap, "stop_reason", None)) if self.output is not None else None

    def attributes(self, model_version: int | None, content: bool) -> dict:
        """The capture's span attributes (and ``gen_ai.output.messages`` when ``content``)."""
        if not self.cap.readable:
            return {semconv.CAPTURE_STATUS: "capture_error", semconv.CAPTURE_REASON: REASONS["capture_error"]}
        attrs = {**self.cap.attributes(model_version), **self.cap.genai_attributes()}
        if content:
            try:
                out = self.outputs()
                if out is not None:
                    attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = messages.dumps(out)
            except Exception:
                log.debug("gateway: could not read the answer's messages", exc_info=True)
        return attrs


class ChatExchange(Exchange):
    """``/v1/chat/completions`` and ``/v1/completions``: vLLM's answer, the added fields nulled."""

    def __init__(self, api: str, asked: dict, upstream: str, strip: bool):
        super().__init__(asked, upstream, strip)
        self.api = api
        self.cap = Capture.for_request(asked, api)
        self.output = messages.ChatOutput()

    def body(self) -> dict:
        return with_capture(self.asked, self.api)

    def frames(self, line: bytes) -> list[bytes]:
        data = _data(line)
        if data is None:
            return [line + b"\n"] if line else []   # event:, id:, comments: as they came
        if data == b"[DONE]":
            self.finished = True
            return []                                # sent by end(), once the span has ended
        if data.startswith(b"{"):
            chunk = loads(data)
            self._read(chunk)
            if self.strip:
                if self.cap.drops_empty_chunks and type(chunk) is dict and only_for_capture(chunk):
                    return []                        # sent only because the gateway asked for ids
                data = dumps(chunk).encode()
        return [b"data: " + data + b"\n\n"]

    def end(self) -> list[bytes]:
        return [b"data: [DONE]\n\n"] if self.finished else []


class ResponsesExchange(Exchange):
    """``/v1/responses``: a chat completion underneath, the Response or its events on top; a request
    the conversion cannot reproduce goes to ``/v1/responses``, whose ids come in
    ``input_messages``/``output_messages`` (nulled unless asked)."""

    api = urls.RESPONSES

    def __init__(self, asked: dict, upstream: str, strip: bool):
        super().__init__(asked, upstream, strip)
        self.cap = ResponsesCapture.for_request(asked)
        self.converted = isinstance(self.cap, ConvertedCapture)
        if self.converted:
            query = upstream.partition("?")[2]
            self.upstream = RESPONSES_CHAT_PATH + (f"?{query}" if query else "")

    def body(self) -> dict:
        if self.converted:
            return self.cap.request()
        return self.asked if self.cap.unsupported else capture_responses.with_capture(self.asked)

    def inputs(self) -> list:
        return messages.responses_input(self.asked)

    def answer(self, payload) -> dict:
        if not self.converted:
            return super().answer(payload)
        self.finished = True
        return self.cap.message(payload) if isinstance(payload, dict) else payload

    def end(self) -> list[bytes]:
        if not self.converted:
            return []
        return [_event(name, event) for name, event in self.cap.end()] if self.finished else []

    def frames(self, line: bytes) -> list[bytes]:
        if self.converted:
            return self._converted_frames(line)
        data = _data(line)
        if data is None:
            return [line + b"\n"] if line else []   # the event: line before its data
        if data.startswith(b"{"):
            event = loads(data)
            self._read(event)
            self.finished = self.finished or self.cap.done   # the terminal event holds the response
            if self.strip:
                data = dumps(event).encode()
        return [b"data: " + data + b"\n\n"]

    def _converted_frames(self, line: bytes) -> list[bytes]:
        data = _data(line)
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
        except (TypeError, AttributeError, KeyError) as e:   # no Responses event can be made of it
            raise ValueError(f"an unreadable chat completion chunk: {e!r}") from e
        return [_event(name, event) for name, event in events]

    def outputs(self) -> list | None:
        if self.cap.response is None:
            return None
        return messages.responses_output(self.cap.response, self.cap.finish_reason)


class MessagesExchange(Exchange):
    """``/v1/messages``: a chat completion underneath, Anthropic's message or events on top."""

    system = "anthropic"
    api = urls.MESSAGES

    def __init__(self, asked: dict, upstream: str, strip: bool):
        super().__init__(asked, upstream, strip)
        self.cap = AnthropicCapture(asked)   # a body it cannot convert goes as it is (vLLM judges it)
        if self.cap.converted:
            query = upstream.partition("?")[2]
            self.upstream = CHAT_PATH + (f"?{query}" if query else "")
            self.output = messages.ChatOutput()

    def body(self) -> dict:
        return self.cap.request() if self.cap.converted else self.asked

    def inputs(self) -> list:
        return messages.anthropic_input(self.asked)

    def answer(self, payload) -> dict:
        self.finished = True
        if not self.cap.converted or not isinstance(payload, dict):
            return payload
        if self.output is not None:
            self.output.add(payload)
        return self.cap.message(payload)

    def frames(self, line: bytes) -> list[bytes]:
        if not self.cap.converted:   # vLLM's own Anthropic stream, as it came
            return [line + b"\n"]
        data = _data(line)
        if data == b"[DONE]":
            self.finished = True
            return []
        if data is None or not data.startswith(b"{"):
            return []                # the chat stream's framing is not the caller's
        chunk = loads(data)
        if not isinstance(chunk, dict):
            return []
        try:
            if self.output is not None:
                self.output.add(chunk)
            events = self.cap.events(chunk)
        except (TypeError, AttributeError, KeyError) as e:   # no Anthropic event can be made of it
            raise ValueError(f"an unreadable chat completion chunk: {e!r}") from e
        return [_event(name, event) for name, event in events]

    def end(self) -> list[bytes]:
        if not self.cap.converted:
            self.finished = True
            return []
        return [_event(name, event) for name, event in self.cap.end()] if self.finished else []

    def error(self, content_type: str, body: bytes) -> tuple[str, bytes]:
        if not self.cap.converted:   # vLLM's /v1/messages errors are Anthropic's already
            return content_type, body
        try:
            doc = loads(body)
        except ValueError:
            doc = None
        return "application/json", dumps(to_error(doc)).encode()


def _event(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + dumps(data).encode() + b"\n\n"


def exchange(api: str, asked: dict, upstream: str, strip: bool) -> Exchange:
    """The exchange of a call of ``api`` (an ``ENDPOINTS`` entry's) with request body ``asked``."""
    if api == urls.RESPONSES:
        return ResponsesExchange(asked, upstream, strip)
    if api == urls.MESSAGES:
        return MessagesExchange(asked, upstream, strip)
    return ChatExchange(api, asked, upstream, strip)
