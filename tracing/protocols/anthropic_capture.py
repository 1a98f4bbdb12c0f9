"""The capture of an Anthropic Messages call sent to vLLM as a chat completion (the general path;
:mod:`.anthropic_common` has the common request's fewer steps): :class:`AnthropicCapture` holds the
converted request (:func:`~.anthropic_convert.to_chat`) and a chat-completions
:class:`~.chat.Capture` of vLLM's answer; it reads the answer's ids and logprobs, and turns the
answer into what the caller asked for (:meth:`~AnthropicCapture.message` for a response,
:meth:`~AnthropicCapture.events` for each stream chunk). Pure."""

from __future__ import annotations

from itertools import islice

import orjson

from lightspan.tracing import semconv
from lightspan.tracing.protocols.anthropic_convert import MessageStream, Unsupported, to_chat, to_message
from lightspan.tracing.protocols.base import OverChat, loads, temperature
from lightspan.tracing.protocols.chat import CHAT, Capture, _chat_logprobs, with_capture


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

    def batch(self, datas: list, i: int, make, out: list) -> int:
        """A converted stream's decoder (``streams.ConvertedDecoder``) reading ``datas`` (the data of
        the events of one read, chat chunks) from ``i``: each chunk's events made (``make(name,
        data)``) and appended to ``out``, as :meth:`events` and :meth:`end` give them; up to the
        first ``[DONE]`` (its events appended: the caller records the call), the index after it, or
        to the end. The usual chunk, one text token in an open text block, in one step of this loop
        (``Capture.text_token`` and ``MessageStream.text``, written out with what they look up kept
        between chunks: this runs per token; tests/tracing/test_anthropic_fast.py holds it equal to
        them); any other goes to :meth:`events`."""
        stream, chat = self.stream, self.chat
        fed = 0
        fast, ids_add, lp_add, delta_add, index, c = self._batch_state()
        try:
            for data in islice(datas, i, None):
                i += 1
                if not data.startswith("{"):
                    if data.startswith("[DONE]"):
                        out += [make(name, event) for name, event in self.end()]
                        return i
                    continue
                try:
                    chunk = orjson.loads(data)
                except orjson.JSONDecodeError:
                    chunk = loads(data)
                if type(chunk) is not dict:
                    continue
                if fast:
                    try:   # (text_token's subscripts and tests, in its order)
                        (choice,) = chunk["choices"]
                        delta = choice["delta"]
                        text = delta["content"]
                    except (KeyError, TypeError, ValueError):
                        text = None
                    if (type(text) is str and text and choice.get("finish_reason") is None and not choice.get("index")
                            and (len(delta) == 1 or (delta.get("reasoning") is None and not delta.get("tool_calls")))
                            and ("prompt_token_ids" not in chunk or chunk["prompt_token_ids"] is None)):
                        fed += 1
                        ids = choice.get("token_ids")
                        if ids is not None:
                            ids_add(ids)
                        lp = choice.get("logprobs")
                        if lp is not None:
                            try:
                                (entry,) = lp["content"]
                                lp_add(entry["logprob"])
                            except (KeyError, TypeError, ValueError):
                                _chat_logprobs(c, lp)
                        delta = {"type": "text_delta", "text": text}
                        delta_add(delta)
                        out.append(make("content_block_delta", {"type": "content_block_delta", "delta": delta,
                                                                "index": index}))
                        continue
                chat.fed += fed
                fed = 0
                out += [make(name, event) for name, event in self.events(chunk)]
                fast, ids_add, lp_add, delta_add, index, c = self._batch_state()
            return i
        finally:
            chat.fed += fed

    def _batch_state(self) -> tuple:
        """(whether :meth:`batch` can read the usual chunk now: a text block open, choice 0 read, and
        what it adds to: the choice's ids and logprobs, the block's deltas, its index, the choice)."""
        stream, chat = self.stream, self.chat
        c = chat.choices.get(0)
        if stream.block != "text" or not chat._chat or c is None:
            return False, None, None, None, None, None
        return True, c.ids.extend, c.logprobs.append, stream.blocks[-1][1].append, stream.index, c

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
