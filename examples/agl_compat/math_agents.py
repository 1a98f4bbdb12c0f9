"""Two word-problem agents in Agent Lightning's class shape: a class with an async ``run()`` and no
``__main__``, configured by environment variables only, that scores itself and posts the score as a
reward event. They import nothing of lightspan; ``lightspan rollout`` runs them as Agent Lightning's
local runner would (``python -m lightspan.rollout.agent_class MODULE.CLASS``), see README.md here.

- :class:`ChatAgent` asks the chat completions API;
- :class:`CompletionAgent` sends the prompt as token ids to the completions API and decodes the
  completion's token ids (``choice.token_ids``) with the same tokenizer, so the text it scores is the
  token sequence the trainer sees. It never asks for the ids: Agent Lightning's proxy adds them to
  every call, and lightspan's instrumentor returns them to a caller of ``AGL_OPENAI_BASE_URL`` too.

What each reads: ``QUESTION`` and ``ANSWER`` (the task, through ``--env-map``),
``AGL_OPENAI_BASE_URL`` and ``AGL_KEY`` (the policy's endpoint and key), ``AGL_EVENT_URL`` (where
the reward event goes); the completion agent also ``TOKENIZER``, the policy's model directory.
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from fractions import Fraction

from openai import AsyncOpenAI

MODEL = "auto"          # the name the agents ask for; serve the policy under it (lightspan vllm --aliases auto)
INSTRUCTIONS = "Work the problem out step by step, then write the result on a last line as 'Answer: <number>'."


def final_answer(text: str) -> str:
    """What follows the last ``Answer:``; without one, the last number in ``text``."""
    marked = re.findall(r"answer\s*:\s*([^\n]+)", text, flags=re.IGNORECASE)
    if marked:
        return marked[-1].strip()
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return numbers[-1] if numbers else text.strip()


def score(reply: str, expected: str) -> float:
    """1.0 when the reply's final answer is the expected number (commas, ``$`` and a trailing period
    ignored), else 0.0."""
    def number(text: str) -> Fraction | None:
        try:
            return Fraction(text.replace(",", "").replace("$", "").strip().rstrip("."))
        except ValueError:
            return None
    got, want = number(final_answer(reply)), number(expected)
    return float(got is not None and got == want)


def post_reward(value: float) -> None:
    """Send the reward event of this rollout to ``AGL_EVENT_URL``, with ``AGL_KEY`` as the bearer token."""
    body = json.dumps({"event_type": "reward", "data": {"value": value}}).encode()
    request = urllib.request.Request(os.environ["AGL_EVENT_URL"], data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {os.environ['AGL_KEY']}"})
    with urllib.request.urlopen(request, timeout=30):
        pass


def _client() -> AsyncOpenAI:
    return AsyncOpenAI(base_url=os.environ["AGL_OPENAI_BASE_URL"], api_key=os.environ["AGL_KEY"], timeout=300)


class ChatAgent:
    async def run(self) -> None:
        response = await _client().chat.completions.create(
            model=MODEL, max_tokens=512, temperature=1.0,
            messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": os.environ["QUESTION"]}])
        reply = response.choices[0].message.content or ""
        print(reply)
        post_reward(score(reply, os.environ["ANSWER"]))


class CompletionAgent:
    async def run(self) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(os.environ["TOKENIZER"])
        prompt = f"Problem: {os.environ['QUESTION']}\n{INSTRUCTIONS}\nSolution:"
        response = await _client().completions.create(
            model=MODEL, prompt=tokenizer.encode(prompt, add_special_tokens=False), max_tokens=512, temperature=1.0)
        choice = response.choices[0]
        token_ids = getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids")
        if token_ids is None:
            raise RuntimeError(f"{os.environ['AGL_OPENAI_BASE_URL']} returned no token ids with the completion")
        reply = tokenizer.decode(token_ids, skip_special_tokens=True)
        print(reply)
        post_reward(score(reply, os.environ["ANSWER"]))
