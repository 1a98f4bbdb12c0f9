"""The shop's order assistant: the agent service users call. No lightspan code in it.

    OPENAI_BASE_URL=http://127.0.0.1:8300/v1 OPENAI_API_KEY=x AGENT_MODEL=hosted-model \\
    OTEL_SERVICE_NAME=order-assistant OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 \\
    OTEL_RESOURCE_ATTRIBUTES=lightspan.task.id=order_total LIGHTSPAN_CAPTURE_URLS=none \\
      opentelemetry-instrument python examples/production/service.py --port 8200

    POST /ask  {"question": "How much is a desk lamp for $47 plus a mug for $38?"}
    200        {"answer": "Your order total is $85.", "total": 85, "request_id": "4bf9...", "calls": 1}

A small Starlette app, as a team's service would be: one route that asks a chat model, through the
plain ``openai`` client (``AsyncOpenAI``, base URL and key from the environment as the client reads
them), for the order's total, reads the last number of the reply (the sum its working ends in), and
answers the user. A reply with no number is asked again once, with a reminder
(``AGENT_MAX_ATTEMPTS``, 2): one request, one or two chat calls. What it serves is configuration: the
hosted model first, later the team's own model behind lightspan's gateway
(``OPENAI_BASE_URL=http://GATEWAY/v1``), the same code.

Traces reach lightspan by configuration alone: ``opentelemetry-instrument`` loads the OpenAI
instrumentation and lightspan's instrumentor, and exports to ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the
lightspan collector, or the team's own OTel collector that the lightspan collector forwards to, or
the other way round). One request is one rollout: each request runs inside one span, opened with the
OpenTelemetry API (what ``opentelemetry-instrumentation-starlette``'s server span does where that
package is installed), so its chat calls share its trace, and lightspan keys a rollout without a
``lightspan.rollout.id`` by its trace id (docs/architecture.md, "Attributes"). The same trace id
goes to the gateway in the ``traceparent`` header lightspan's instrumentor adds in gateway mode
(``LIGHTSPAN_CAPTURE_URLS=none``), so a canary keeps all calls of one request on one policy version.
The request's trace id is its ``request_id``: the key the user's feedback is posted under
(``POST /v1/rewards`` ``{"rollout_id": request_id, ...}``). ``lightspan.task.id`` (from
``OTEL_RESOURCE_ATTRIBUTES``) names the route's kind of request: a task, in RL's sense, whose
rollouts are compared with each other.

Settings (environment): ``AGENT_MODEL`` (the model name to ask for, "policy"), ``AGENT_TEMPERATURE``
(0.7: RL learns from what is sampled), ``AGENT_MAX_TOKENS`` (8), ``AGENT_MAX_ATTEMPTS`` (2).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import uuid
from dataclasses import dataclass

import uvicorn
from openai import AsyncOpenAI
from opentelemetry import trace
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

SYSTEM = "You are the order assistant of an online shop. Add up the prices and reply with the sum."
# one worked exchange as earlier turns: a 135M model copies a dialogue's form far better than it
# follows an instruction (examples/gsm8k/README.md)
SHOT = [{"role": "user", "content": "What's the total for one scarf ($23) and one candle ($14)?"},
        {"role": "assistant", "content": "23 + 14 = 37"}]
REMINDER = "Reply with the sum of the prices, for example 23 + 14 = 37."
MAX_QUESTION = 2000          # characters
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
tracer = trace.get_tracer("order-assistant")


@dataclass(frozen=True)
class ServiceConfig:
    """The service's settings, from the environment (:meth:`from_env`)."""

    model: str = "policy"
    temperature: float = 0.7
    max_tokens: int = 24
    max_attempts: int = 2

    def __post_init__(self):
        if self.max_attempts < 1:
            raise ValueError(f"AGENT_MAX_ATTEMPTS: {self.max_attempts} asks nothing; set it to 1 or more")
        if self.max_tokens < 1:
            raise ValueError(f"AGENT_MAX_TOKENS: {self.max_tokens}; set it to 1 or more")

    @classmethod
    def from_env(cls, env=os.environ) -> ServiceConfig:
        return cls(model=env.get("AGENT_MODEL", cls.model),
                   temperature=float(env.get("AGENT_TEMPERATURE", cls.temperature)),
                   max_tokens=int(env.get("AGENT_MAX_TOKENS", cls.max_tokens)),
                   max_attempts=int(env.get("AGENT_MAX_ATTEMPTS", cls.max_attempts)))


def last_number(reply: str | None) -> float | None:
    """The last number in a reply, the result of its working (``23 + 14 = $37.`` reads as 37; thousands
    commas dropped)."""
    numbers = _NUMBER.findall((reply or "").replace(",", ""))
    return float(numbers[-1]) if numbers else None


def _dollars(value: float) -> str:
    return str(int(value)) if value.is_integer() else f"{value:.2f}"


async def answer(client: AsyncOpenAI, cfg: ServiceConfig, question: str) -> tuple[float | None, int]:
    """(the total the model gave, or None; the number of chat calls made)."""
    messages = [{"role": "system", "content": SYSTEM}, *SHOT, {"role": "user", "content": question}]
    for attempt in range(1, cfg.max_attempts + 1):
        response = await client.chat.completions.create(model=cfg.model, messages=messages,
                                                        temperature=cfg.temperature, max_tokens=cfg.max_tokens)
        reply = response.choices[0].message.content or ""
        total = last_number(reply)
        if total is not None:
            return total, attempt
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": REMINDER}]
    return None, cfg.max_attempts


def make_app(cfg: ServiceConfig, client: AsyncOpenAI | None = None) -> Starlette:
    client = client or AsyncOpenAI()   # OPENAI_BASE_URL and OPENAI_API_KEY from the environment

    async def ask(request: Request) -> JSONResponse:
        try:
            doc = json.loads(await request.body())
        except ValueError:
            return JSONResponse({"error": "send JSON: {\"question\": \"...\"}"}, status_code=400)
        question = doc.get("question") if isinstance(doc, dict) else None
        if not isinstance(question, str) or not question.strip() or len(question) > MAX_QUESTION:
            return JSONResponse({"error": f"'question' must be text of 1 to {MAX_QUESTION} characters"},
                                status_code=400)
        with tracer.start_as_current_span("POST /ask", kind=trace.SpanKind.SERVER) as span:
            context = span.get_span_context()
            # the trace id is the rollout's key in lightspan; untraced (no SDK), any unique id will do
            request_id = format(context.trace_id, "032x") if context.is_valid else uuid.uuid4().hex
            total, calls = await answer(client, cfg, question)
        text = (f"Your order total is ${_dollars(total)}." if total is not None
                else "Sorry, I could not work out the total.")
        return JSONResponse({"answer": text, "total": total, "request_id": request_id, "calls": calls})

    async def healthz(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "model": cfg.model})

    return Starlette(routes=[Route("/ask", ask, methods=["POST"]), Route("/healthz", healthz, methods=["GET"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200)
    args = parser.parse_args()
    try:
        cfg = ServiceConfig.from_env()
    except ValueError as e:
        parser.error(str(e))
    uvicorn.run(make_app(cfg), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
