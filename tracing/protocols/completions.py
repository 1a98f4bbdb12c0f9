"""Completions (``POST /v1/completions``): the chat completions module's pieces, in completions' shape.

vLLM answers a completions request with ``return_token_ids`` and ``logprobs`` as it answers a
chat one, but for where the fields are (:mod:`.chat`'s docstring has both): each choice names its
prompt's ids (``choices[i].prompt_token_ids``; a request with several prompts cannot be one span:
``multiple_prompts``), the logprobs are ``logprobs.token_logprobs``, and ``logprobs`` in the
request is a number (``0``: the sampled token's alone), not a boolean. :class:`~.chat.Capture`
reads both shapes (its ``operation``); the prompt is the span's one input message, the completion
text its output.
"""

from __future__ import annotations

from lightspan.tracing.protocols import chat, chat_messages
from lightspan.tracing.protocols.base import COMMON_FIELDS, Protocol, as_sent, openai_error
from lightspan.tracing.protocols.chat import TEXT_COMPLETION, Capture

FIELDS = {**COMMON_FIELDS, "logprobs": (int, "an integer"), "return_token_ids": (bool, "a boolean")}

PROTOCOL = Protocol(
    name=TEXT_COMPLETION, client="openai", path="/completions", operation="text_completion", provider="openai",
    capture=lambda body: Capture.for_request(body, TEXT_COMPLETION), request=chat.request, inputs=chat_messages.chat_input,
    output=chat_messages.output, outputs=chat_messages.outputs, frames=chat.frames, end=chat.end, error=openai_error,
    upstream_error=as_sent, fields=FIELDS)
