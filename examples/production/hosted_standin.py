"""A stand-in for a hosted chat model, written here: an OpenAI-compatible server that answers the
shop's order-total questions well, and, like a hosted API, returns no token ids and no logprobs.

    python examples/production/hosted_standin.py --port 8300

**It is not a language model.** It plays the part of the hosted model (a provider's API) the team
started with, so that the example runs on one machine without a network: ``POST
/v1/chat/completions`` reads the last user message, adds up the dollar amounts written in it
(``orders.prices``) and replies with the total as text; a question without two amounts gets "I can't
tell from that message." A ``--mistake-share`` of questions (chosen by a hash of the question, so the
same question gets the same answer) is answered 10 dollars off, as a good model is sometimes wrong: the
user feedback then has something to tell apart, and ``--select`` in the SFT stage something to leave
out. ``GET /v1/models`` lists the one model name.

What a hosted API gives a tracer is what this gives: the reply's text and usage counts (words here,
not tokens), ``logprobs: null`` and no ``prompt_token_ids`` / ``token_ids``, whatever the request asks
for (vLLM's ``return_token_ids``, ``logprobs``); so lightspan can store these calls' messages but has
no ids to train RL on, which is why the SFT stage re-tokenises them. Streaming is not offered: the
agent service does not stream (400, OpenAI's error shape).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import time
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

try:
    from orders import prices
except ImportError:  # imported as examples.production.hosted_standin
    from examples.production.orders import prices

CANNOT_TELL = "I can't tell from that message."
MAX_BODY = 1 << 20


@dataclass(frozen=True)
class StandinConfig:
    """The stand-in's settings (``--help`` shows them)."""

    model: str = "hosted-model"        # the one model name it serves
    mistake_share: float = 0.1         # share of questions answered 10 dollars off, by a hash of the question

    def __post_init__(self):
        if not 0.0 <= self.mistake_share <= 1.0:
            raise ValueError(f"mistake_share: {self.mistake_share} is not a share; pass a number in [0, 1]")


def answer(question: str, mistake_share: float) -> str:
    """The reply to one question: the sum of its dollar amounts, sometimes 10 off (deterministic)."""
    amounts = prices(question)
    if len(amounts) < 2:
        return CANNOT_TELL
    draw = int.from_bytes(hashlib.blake2b(question.encode(), digest_size=8).digest(), "big") / 2 ** 64
    total = sum(amounts) + (10 if draw < mistake_share else 0)
    return f"{' + '.join(map(str, amounts))} = {total}"


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": None}}, status_code=status)


def make_app(cfg: StandinConfig) -> Starlette:
    ids = itertools.count(1)

    async def chat(request: Request) -> JSONResponse:
        body = await request.body()
        if len(body) > MAX_BODY:
            return _error(413, f"request body over {MAX_BODY} bytes")
        try:
            doc = json.loads(body)
        except ValueError:
            return _error(400, "the body is not JSON")
        messages = doc.get("messages") if isinstance(doc, dict) else None
        if not isinstance(messages, list) or not messages:
            return _error(400, "'messages' must be a non-empty list", "messages")
        if doc.get("stream"):
            return _error(400, "this stand-in does not stream; send stream: false", "stream")
        users = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        question = users[-1] if users and isinstance(users[-1], str) else ""
        reply = answer(question, cfg.mistake_share)
        prompt_words = sum(len(str(m.get("content", "")).split()) for m in messages if isinstance(m, dict))
        return JSONResponse({
            "id": f"chatcmpl-standin-{next(ids)}", "object": "chat.completion", "created": int(time.time()),
            "model": cfg.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                         "logprobs": None, "finish_reason": "stop"}],
            # counted in words: a stand-in has no tokenizer (a hosted API counts its own tokens)
            "usage": {"prompt_tokens": prompt_words, "completion_tokens": len(reply.split()),
                      "total_tokens": prompt_words + len(reply.split())}})

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": cfg.model, "object": "model", "created": 0,
                                                         "owned_by": "stand-in"}]})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/models", models, methods=["GET"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--model", default=StandinConfig.model, help="the model name it serves")
    parser.add_argument("--mistake-share", type=float, default=StandinConfig.mistake_share,
                        help="share of questions answered 10 dollars off (by a hash of the question)")
    args = parser.parse_args()
    try:
        cfg = StandinConfig(model=args.model, mistake_share=args.mistake_share)
    except ValueError as e:
        parser.error(str(e))
    uvicorn.run(make_app(cfg), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
