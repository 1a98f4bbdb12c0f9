"""The protocols lightspan captures, one module each, behind one table.

- ``chat``: :mod:`.chat`, the ``openai`` client, ``…/chat/completions``;
- ``text_completion``: :mod:`.completions`, ``openai``, ``…/completions``;
- ``responses``: :mod:`.responses`, ``openai``, ``…/responses``;
- ``messages``: :mod:`.anthropic_messages`, ``anthropic``, ``…/messages``

(the gateway serves ``/v1`` + each path).

A protocol module holds everything that differs between protocols (its row, a
:class:`~.base.Protocol`, names each piece): the operation and provider names; the capture
of a call (its request rewrite: the capture fields, or the chat completion it converts to; its
answer read into token ids and logprobs, and turned back into what the caller asked for); the
call's messages in the GenAI shape (input and output); the gateway's relay of its own event stream;
its error shape; the request fields the gateway reads. The two transports look a call's protocol
up here and call through its row, with no branch of their own on which protocol it is: the
instrumentor (:mod:`lightspan.tracing.calls`, :mod:`lightspan.tracing.streams`) and the gateway
(:mod:`lightspan.rollout.exchanges`, whose endpoints are this table's paths).

A fifth protocol is a module that ends with its ``PROTOCOL`` row and one entry in
:data:`PROTOCOLS` (tests/tracing/test_protocol_table.py checks every row has every piece); a new
client library, a row in :data:`lightspan.tracing.clients.CLIENTS`.
"""

from __future__ import annotations

import functools

from lightspan.tracing.protocols import anthropic_messages, chat, completions, responses
from lightspan.tracing.protocols.base import Protocol

PROTOCOLS: dict[str, Protocol] = {p.name: p for p in (
    chat.PROTOCOL,
    completions.PROTOCOL,   # after chat: a path that ends in /chat/completions ends in /completions too
    responses.PROTOCOL,
    anthropic_messages.PROTOCOL,
)}
"""The protocols by name, in the order a request path is matched against them."""


@functools.lru_cache(maxsize=256)
def of(path: str, client: str = "openai") -> Protocol | None:
    """The protocol a request path of ``client`` (``openai`` or ``anthropic``) calls, else None.

    openai: ``…/chat/completions``, ``…/completions``, ``…/responses`` (not ``/responses/{id}``);
    anthropic: ``…/messages`` (not ``/messages/count_tokens`` or batches). The Assistants API's
    ``/threads/{id}/messages`` is an openai path, hence the client. (Cached: a client calls a few
    paths many times.)"""
    path = "/" + str(path).split("?", 1)[0].strip("/")
    for protocol in PROTOCOLS.values():
        if protocol.client == client and path.endswith(protocol.path):
            return protocol
    return None


__all__ = ["PROTOCOLS", "Protocol", "of"]
