"""Anthropic Messages captured through vLLM's chat completions (see :mod:`.anthropic_convert`).

:class:`AnthropicCapture` holds the converted request and a chat-completions
:class:`~lightspan.tracing.capture.Capture` of vLLM's answer: it reads the answer's ids and
logprobs, and turns the answer into what the caller asked for (:meth:`message` for a response,
:meth:`events` for each stream chunk). The interface is the chat capture's, so the instrumentor
and a gateway treat the three protocols alike.
"""

from __future__ import annotations

from lightspan.tracing import semconv
from lightspan.tracing.anthropic_convert import MessageStream, Unsupported, to_chat, to_message
from lightspan.tracing.capture import CHAT, Capture, with_capture

PATH = "/v1/chat/completions"
"""Where a converted request goes (the caller's path ends in ``/v1/messages``)."""


class AnthropicCapture:
    api = "messages"
    operation = "chat"

    def __init__(self, body: dict):
        self.body = body   # the caller's request, as JSON-ready data
        self.unsupported: str | None = None
        self.chat_body: dict | None = None
        try:
            self.chat_body = to_chat(body)
        except Unsupported as e:
            self.unsupported = str(e)
        except (TypeError, AttributeError, KeyError) as e:   # malformed: the server refuses it, not lightspan
            self.unsupported = f"a malformed body ({type(e).__name__}: {e})"
        # the Anthropic answer has no field for ids or logprobs: nothing of the chat answer's is shown
        self.chat = Capture(CHAT, caller_ids=False, caller_logprobs=False)
        temperature = body.get("temperature")
        if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
            self.chat.temperature = float(temperature)
        self.stream = MessageStream() if body.get("stream") else None
        self.stop_reason: str | None = None
        self.done = False

    @classmethod
    def for_request(cls, body: dict) -> "AnthropicCapture":
        return cls(body)

    @property
    def converted(self) -> bool:
        """Whether the call goes to chat completions (else to ``/v1/messages``, as it is)."""
        return self.chat_body is not None

    def request(self) -> dict:
        """The chat completions body to send, with the capture fields."""
        return with_capture(self.chat_body, CHAT)

    # the chat capture's state, read by the instrumentor
    @property
    def fed(self) -> int:
        return self.chat.fed

    @property
    def readable(self) -> bool:
        return self.chat.readable

    @readable.setter
    def readable(self, value: bool) -> None:
        self.chat.readable = value

    @property
    def temperature(self):
        return self.chat.temperature

    @property
    def model(self):
        """The model vLLM's chat answer names (the request's model: with several policies, its name)."""
        return self.chat.model

    def add(self, payload, *, hide: bool = False) -> None:
        """An answer of ``/v1/messages`` itself (a request sent as it is): nothing to read there."""

    def add_json(self, payload: dict, hide: bool = False) -> None:
        """(As :meth:`add`.)"""

    def message(self, completion: dict) -> dict:
        """The Anthropic message of vLLM's chat completion (its ids read first)."""
        self.chat.add_json(completion)
        message = to_message(completion)
        self.stop_reason, self.done = message.get("stop_reason"), True
        return message

    def events(self, chunk: dict) -> list[tuple[str, dict]]:
        """The Anthropic events of one chat completion chunk (its ids read first)."""
        choices = chunk.get("choices")
        if type(choices) is list and len(choices) == 1 and self.stream.block == "text":
            # the usual chunk, one text token in an open text block: read and converted in one pass
            choice = choices[0]
            delta = choice.get("delta") if type(choice) is dict else None
            text = delta.get("content") if type(delta) is dict else None
            if (text and type(text) is str and not delta.get("reasoning") and not delta.get("tool_calls")
                    and choice.get("finish_reason") is None and not choice.get("index")
                    and chunk.get("prompt_token_ids") is None and self.chat.add_token(choice)):
                return self.stream.text(text)
        self.chat.add_json(chunk)
        out = self.stream.feed(chunk)
        for name, data in out:
            if name == "message_delta":
                self.stop_reason = data["delta"].get("stop_reason")
        return out

    def end(self) -> list[tuple[str, dict]]:
        """The events at the chat stream's ``[DONE]``."""
        self.done = True
        return self.stream.done()

    def status(self) -> str:
        return "unsupported_request" if self.unsupported else self.chat.status()

    def attributes(self, model_version: int | None = None) -> dict:
        if self.unsupported:
            return {semconv.CAPTURE_STATUS: "unsupported_request",
                    semconv.CAPTURE_REASON: f"not captured: the request has {self.unsupported}, which lightspan "
                                            "does not convert to a chat completion as vLLM does; it went to "
                                            "/v1/messages, which returns no token ids"}
        return self.chat.attributes(model_version)

    def genai_attributes(self) -> dict:
        attrs = self.chat.genai_attributes()
        if self.stop_reason:
            attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = (self.stop_reason,)
        return attrs
