"""The capture of an Anthropic Messages call sent to vLLM as a chat completion (the general path;
:mod:`.anthropic_common` has the common request's fewer steps): :class:`AnthropicCapture` holds the
converted request (:func:`~.anthropic_convert.to_chat`) and a chat-completions
:class:`~.chat.Capture` of vLLM's answer; it reads the answer's ids and logprobs, and turns the
answer into what the caller asked for (:meth:`~AnthropicCapture.message` for a response,
:meth:`~AnthropicCapture.events` for each stream chunk). Pure."""

from __future__ import annotations

from lightspan.tracing import semconv
from lightspan.tracing.protocols.anthropic_convert import MessageStream, Unsupported, to_chat, to_message
from lightspan.tracing.protocols.base import OverChat, temperature
from lightspan.tracing.protocols.chat import CHAT, Capture, with_capture


class AnthropicCapture(OverChat):
    def __init__(self, body: dict):
        self.body = body   # the caller's request, as JSON-ready data
        self.convert(body, to_chat, Unsupported)
        # the Anthropic answer has no field for ids or logprobs: nothing of the chat answer's is shown
        self.chat = Capture(CHAT, caller_ids=False, caller_logprobs=False)
        self.chat.temperature = temperature(body)
        self.stream = MessageStream() if body.get("stream") else None
        self.stop_reason: str | None = None
        self.done = False

    @classmethod
    def for_request(cls, body: dict) -> "AnthropicCapture":
        return cls(body)

    def request(self) -> dict:
        """The chat completions body to send, with the capture fields."""
        return with_capture(self.chat_body, CHAT)

    def unconverted(self, why: str) -> AnthropicCapture:
        """This capture, of the call sent to ``/v1/messages`` as it is (a transport that cannot
        hand the caller a converted answer: ``why``)."""
        self.unsupported, self.chat_body = why, None
        return self

    def message(self, completion: dict) -> dict:
        """The Anthropic message of vLLM's chat completion (its ids read first)."""
        self.chat.add_json(completion)
        message = to_message(completion)
        self.stop_reason, self.done = message.get("stop_reason"), True
        return message

    def events(self, chunk: dict) -> list[tuple[str, dict]]:
        """The Anthropic events of one chat completion chunk (its ids read first)."""
        if self.stream.block == "text":   # the usual chunk, one text token in an open text block
            text = self.chat.text_token(chunk)
            if text is not None:
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
