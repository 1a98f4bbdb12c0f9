"""What ``lightspan train --algo sft`` trains on: captured calls, selected by SQL and re-tokenised with
the policy's chat template (trainer/sft.py trains on them).

A call to a hosted model carries its messages (``gen_ai.input.messages``, ``gen_ai.output.messages``,
and, where the instrumentation records them, ``gen_ai.system_instructions`` and the tool definitions,
``gen_ai.tool.definitions`` or traceloop's ``llm.request.functions.*``) but no token ids. Each selected call becomes one :class:`Example`:

1. Selection is SQL: a predicate over the ``sft_calls`` view (:func:`connect`), every column of
   ``llm_calls`` plus the call's rewards: ``call_reward`` (the sum of the rewards the store's
   attribution rule, store/attribution.py, gives this call; null when none), ``final_reward`` and
   ``rollout_status`` (the ``rollouts`` view's), ``human_reward`` and ``judge_reward`` (the latest
   whole-rollout reward each source gave). Oldest first.
2. Messages in either shape, the OTel GenAI one (``role`` + ``parts``) lightspan writes or the OpenAI
   one (``role`` + ``content`` + ``tool_calls``) other instrumentations write, become the chat
   template's input: ``content`` text, ``tool_calls`` (``function.arguments`` as captured: a JSON
   object when it was one), ``tool`` messages with ``tool_call_id``. The reply is the output's first
   assistant message (choice 0).
3. Rendering: the prompt is the template over the input messages with the generation prompt; the
   completion is what the template adds for the reply, ending at the template's end-of-turn token
   (the separator after it is never sampled). Prompt and completion are tokenised apart, as vLLM
   tokenises a prompt and samples after it, so the completion ids are exactly what the policy would
   have to generate. Earlier assistant turns are in the prompt: context, not trained.
4. A call that cannot be rendered is counted by its first reason (:data:`REASONS`), never skipped
   silently; identical rendered conversations train once (the oldest), and a training call that
   renders like a held-out one is left out of training.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np

from lightspan import store
from lightspan.core.config import ConfigError
from lightspan.store.attribution import rewards_per_call

log = logging.getLogger(__name__)

REASONS = {
    "no_content": "the call has no captured messages or a message part without its content (content capture "
                  "off: turn it on in the instrumentation, e.g. OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT)",
    "not_json": "gen_ai.input.messages / gen_ai.output.messages (or the tool definitions) are not a JSON list",
    "no_reply": "the output has no assistant message with text or a tool call",
    "no_tool_definitions": "the conversation has tool calls or tool results but the call's tool definitions were not "
                           "captured (gen_ai.tool.definitions, or traceloop's llm.request.functions.*): trained "
                           "without them, the prompt would differ from the one the agent sends",
    "unsupported_part": "a message part the chat template cannot take (image, file, reasoning, ...)",
    "template_error": "the chat template raised on the conversation (a role or an order it refuses)",
    "template_drops_tools": "the call offered tools and the policy's chat template does not render them",
    "template_drops_content": "the rendered reply lacks the reply's text or a tool call's name",
    "not_prefix": "the template renders the conversation with the reply so that it does not start with the "
                  "prompt's rendering (it rewrites earlier turns)",
    "too_long": "prompt + reply is longer than sft_max_length tokens",
}
"""Why a call cannot be trained, in the order they are checked: ``train/sft/unrenderable/<reason>``."""

SELECT_SQL = """
SELECT trace_id, span_id, input_messages, output_messages,
       attributes['gen_ai.tool.definitions'] AS tools, attributes['gen_ai.system_instructions'] AS system,
       list_filter(map_entries(attributes), lambda e: starts_with(e.key, 'llm.request.functions.')) AS functions
FROM sft_calls WHERE ({predicate}) ORDER BY start_time_unix_nano, trace_id, span_id
"""
_CALLS_SQL = """
SELECT rollout_key, trace_id, span_id, coalesce(end_time_unix_nano, 0) AS end_ns FROM llm_calls
ORDER BY rollout_key, start_time_unix_nano, end_time_unix_nano, span_id
"""
# a reward naming a call counts at that call's end (as in the builder and the web UI)
_REWARDS_SQL = """
SELECT w.rollout_key, coalesce(c.end_time_unix_nano, w.time_unix_nano, 0) AS time_ns, w.reward
FROM rewards w LEFT JOIN llm_calls c ON c.span_id = w.call_span_id AND c.rollout_key = w.rollout_key
WHERE isfinite(w.reward)
"""
_VIEW_SQL = """
CREATE OR REPLACE TEMP VIEW sft_calls AS
SELECT c.*, a.call_reward, r.final_reward, r.status AS rollout_status, s.human_reward, s.judge_reward
FROM llm_calls c
LEFT JOIN _sft_attributed a ON a.trace_id = c.trace_id AND a.span_id = c.span_id
LEFT JOIN rollouts r ON r.rollout_key = c.rollout_key
LEFT JOIN (SELECT rollout_key,
                  arg_max(reward, (received_unix_nano, time_unix_nano, span_id)) FILTER (WHERE source = 'human') AS human_reward,
                  arg_max(reward, (received_unix_nano, time_unix_nano, span_id)) FILTER (WHERE source = 'judge') AS judge_reward
           FROM rewards WHERE call_span_id IS NULL GROUP BY rollout_key) s ON s.rollout_key = c.rollout_key
"""


class Unrenderable(ValueError):
    """A call that cannot be trained: ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class Example:
    """One call, re-tokenised: the loss trains ``completion_ids`` given ``prompt_ids``."""

    key: tuple[str, str]              # (trace_id, span_id) of the call
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]


# --- selection (SQL over the store) ----------------------------------------------------------------

def connect(data_dir):
    """The store's views plus ``sft_calls``: ``llm_calls`` with each call's rewards (module docstring, 1)."""
    import pyarrow as pa

    con = store.connect(data_dir)
    calls = con.execute(_CALLS_SQL).fetchnumpy()
    rewards = con.execute(_REWARDS_SQL).fetchnumpy()
    value = np.full(len(calls["span_id"]), np.nan)
    if len(calls["span_id"]) and len(rewards["reward"]):
        index: dict[str, int] = {}          # rollouts numbered in the calls' order: ascending, contiguous
        call_rollout = np.array([index.setdefault(k, len(index)) for k in calls["rollout_key"]], dtype=np.int64)
        reward_rollout = np.array([index.get(k, -1) for k in rewards["rollout_key"]], dtype=np.int64)
        own = reward_rollout >= 0                   # a reward of a rollout without calls has no call to go to
        args = dict(call_rollout=call_rollout, reward_rollout=reward_rollout[own])
        ends, times = np.asarray(calls["end_ns"], dtype=np.int64), np.asarray(rewards["time_ns"], dtype=np.int64)[own]
        total = rewards_per_call(ends, times, np.asarray(rewards["reward"], dtype=np.float64)[own], **args)
        count = rewards_per_call(ends, times, np.ones(int(own.sum())), **args)
        value = np.where(count > 0, total, np.nan)
    con.register("_sft_attributed", pa.table({
        "trace_id": pa.array(calls["trace_id"], pa.string()), "span_id": pa.array(calls["span_id"], pa.string()),
        "call_reward": pa.array(value, pa.float64(), from_pandas=True)}))
    con.execute(_VIEW_SQL)
    return con


def select(con, predicate: str, *, field: str) -> list[tuple]:
    """The calls of ``sft_calls`` that ``predicate`` selects, oldest first: (trace_id, span_id,
    input_messages, output_messages, tools, system, traceloop's function attributes). A bad predicate is a ConfigError naming ``field``."""
    import duckdb

    try:
        return con.execute(SELECT_SQL.format(predicate=predicate)).fetchall()
    except duckdb.Error as exc:
        raise ConfigError("trainer", field, f"the predicate {predicate!r} fails: {exc}".replace("\n", " "),
                          "give a SQL condition over the sft_calls view (llm_calls' columns plus call_reward, "
                          "final_reward, rollout_status, human_reward, judge_reward), e.g. "
                          "\"human_reward >= 1 OR judge_reward >= 0.8\"") from None


# --- messages (pure) -------------------------------------------------------------------------------

def _json(text, what: str):
    """A JSON attribute's value; the store's attribute map JSON-encodes values once more."""
    try:
        value = json.loads(text)
        if isinstance(value, str) and what != "messages":
            value = json.loads(value)
    except (TypeError, ValueError):
        raise Unrenderable("not_json", f"{what} is not JSON") from None
    return value


def _text(parts: list, role: str) -> str | None:
    texts = []
    for part in parts:
        content = part.get("content") if part.get("type") == "text" else part.get("text")
        if not isinstance(content, str):
            raise Unrenderable("no_content", f"a {role} text part without its content")
        texts.append(content)
    return "\n".join(texts) if texts else None


def chat_message(message) -> list[dict]:
    """One captured message (GenAI ``parts`` or OpenAI ``content``) as chat-template messages (a GenAI
    ``tool`` message with several responses is one template message per response)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise Unrenderable("not_json", "a message is not an object with a role")
    role = message["role"]
    if "parts" not in message:                                    # the OpenAI shape
        content = message.get("content")
        if isinstance(content, list):
            bad = [p.get("type") for p in content if not isinstance(p, dict) or p.get("type") != "text"]
            if bad:
                raise Unrenderable("unsupported_part", f"{role} content of type {bad[0]}")
            content = _text(content, role)
        elif content is not None and not isinstance(content, str):
            raise Unrenderable("unsupported_part", f"{role} content is a {type(content).__name__}")
        if content is None and not message.get("tool_calls"):
            raise Unrenderable("no_content", f"a {role} message without content")
        out = {"role": role, "content": content}
        if message.get("tool_calls"):
            out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                  "function": {"name": (c.get("function") or {}).get("name"),
                                               "arguments": _arguments((c.get("function") or {}).get("arguments"))}}
                                 for c in message["tool_calls"]]
        if message.get("tool_call_id") is not None:
            out["tool_call_id"] = message["tool_call_id"]
        return [out]
    parts = message.get("parts")
    if not isinstance(parts, list) or not parts:
        raise Unrenderable("no_content", f"a {role} message without parts")
    texts, calls, responses = [], [], []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            texts.append(part)
        elif kind == "tool_call":
            calls.append({"id": part.get("id"), "type": "function",
                          "function": {"name": part.get("name"), "arguments": part.get("arguments") or {}}})
        elif kind == "tool_call_response":
            if "response" not in part:
                raise Unrenderable("no_content", "a tool response without its content")
            response = part["response"]
            responses.append({"role": role, "tool_call_id": part.get("id"),
                              "content": response if isinstance(response, str) else json.dumps(response)})
        else:
            raise Unrenderable("unsupported_part", f"a {role} part of type {kind}")
    if responses:
        if texts or calls:
            raise Unrenderable("unsupported_part", f"a {role} message mixing tool responses with text or calls")
        return responses
    out = {"role": role, "content": _text(texts, role)}
    if calls:
        out["tool_calls"] = calls
    return [out]


def _arguments(value):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _functions(entries) -> list | None:
    """traceloop's tool definitions (``llm.request.functions.<i>.name``, ``.description``, ``.parameters``;
    attribute map entries, JSON-encoded values) as chat-template tools."""
    by_index: dict[int, dict] = {}
    for entry in entries or ():
        index, _, field = entry["key"][len("llm.request.functions."):].partition(".")
        if index.isdigit() and field in ("name", "description", "parameters"):
            value = _json(entry["value"], "messages")          # decoded once: the map's encoding
            if field == "parameters" and isinstance(value, str):
                value = _json(value, "messages")               # traceloop writes the schema as JSON text
            by_index.setdefault(int(index), {})[field] = value
    return [{"type": "function", "function": f} for _, f in sorted(by_index.items())] or None


def conversation(input_messages, output_messages, tools=None, system=None,
                 functions=None) -> tuple[list, dict, list | None]:
    """(prompt messages, the reply, tools) of one call, from its captured attributes' JSON text
    (``functions``: traceloop's tool attributes, used when ``tools`` is not there)."""
    if input_messages is None or output_messages is None:
        raise Unrenderable("no_content", "gen_ai.input.messages or gen_ai.output.messages was not captured")
    inputs, outputs = _json(input_messages, "messages"), _json(output_messages, "messages")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise Unrenderable("not_json", "the messages are not a JSON list")
    messages = [m for message in inputs for m in chat_message(message)]
    if system is not None:              # gen_ai.system_instructions: a list of parts
        parts = _json(system, "system instructions")
        parts = [{"type": "text", "content": parts}] if isinstance(parts, str) else parts
        if not isinstance(parts, list):
            raise Unrenderable("not_json", "gen_ai.system_instructions is not a JSON list")
        messages.insert(0, chat_message({"role": "system", "parts": parts})[0])
    replies = [m for m in outputs if isinstance(m, dict) and m.get("role") == "assistant"]
    if not replies:
        raise Unrenderable("no_reply", "no assistant message in the output")
    if replies[0].get("parts") == [] or replies[0].get("content", 0) is None and not replies[0].get("tool_calls"):
        raise Unrenderable("no_reply", "the assistant message is empty")   # captured, and empty: not capture off
    reply = chat_message(replies[0])[0]
    if not (reply.get("content") or reply.get("tool_calls")):
        raise Unrenderable("no_reply", "the assistant message is empty")
    if tools is not None:
        tools = _json(tools, "tool definitions")
        if not isinstance(tools, list):
            raise Unrenderable("not_json", "gen_ai.tool.definitions is not a JSON list")
        # the conventions' {"type", "name", "parameters"}; templates take OpenAI's {"type", "function": {...}}
        tools = [t if "function" in t else {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                 for t in tools if isinstance(t, dict)] or None
    elif functions:
        tools = _functions(functions)
    if not tools and any(m.get("tool_calls") or m["role"] == "tool" for m in messages + [reply]):
        raise Unrenderable("no_tool_definitions", "tool calls without the tools they call")
    return messages, reply, tools


# --- rendering (the policy's chat template) --------------------------------------------------------

def _template(tokenizer, messages: list, tools: list | None, *, generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as exc:    # jinja2's TemplateError (raise_exception), or a key the template needs
        raise Unrenderable("template_error", f"{type(exc).__name__}: {exc}") from None


def render(tokenizer, messages: list, reply: dict, tools: list | None, *, max_length: int,
           key: tuple[str, str] = ("", "")) -> Example:
    """The call as the policy's chat template renders it (module docstring, 3)."""
    prompt = _template(tokenizer, messages, tools, generation_prompt=True)
    if tools and prompt == _template(tokenizer, messages, None, generation_prompt=True):
        raise Unrenderable("template_drops_tools", "the prompt renders the same with and without the tools")
    full = _template(tokenizer, messages + [reply], tools, generation_prompt=False)
    if not full.startswith(prompt):
        raise Unrenderable("not_prefix", "the rendering with the reply does not extend the prompt's")
    completion = full[len(prompt):]
    stripped = completion.rstrip()
    if any(stripped.endswith(t) for t in tokenizer.all_special_tokens):
        completion = stripped           # generation stops at the end-of-turn token; what follows is never sampled
    wanted = [reply.get("content") or ""] + [c["function"]["name"] or "" for c in reply.get("tool_calls") or ()]
    if not all(w.strip() in completion for w in wanted):
        raise Unrenderable("template_drops_content", "the rendered reply lacks its text or a tool call")
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if not completion_ids:
        raise Unrenderable("no_reply", "the reply renders to no tokens")
    if len(prompt_ids) + len(completion_ids) > max_length:
        raise Unrenderable("too_long", f"{len(prompt_ids) + len(completion_ids)} tokens > {max_length}")
    return Example(key, tuple(prompt_ids), tuple(completion_ids))


def examples(rows: list[tuple], tokenizer, *, max_length: int) -> tuple[list[Example], Counter]:
    """Selected rows (:func:`select`) -> examples, deduplicated on the rendered conversation, and the
    counts: ``unrenderable/<reason>`` and ``duplicates``."""
    out, seen, counts = [], set(), Counter()
    for trace_id, span_id, inputs, outputs, tools, system, *functions in rows:
        try:
            messages, reply, tool_list = conversation(inputs, outputs, tools, system, *functions)
            example = render(tokenizer, messages, reply, tool_list, max_length=max_length, key=(trace_id, span_id))
        except Unrenderable as exc:
            counts[f"unrenderable/{exc.reason}"] += 1
            log.debug("call %s/%s cannot be trained: %s", trace_id, span_id, exc)
            continue
        ids = (example.prompt_ids, example.completion_ids)
        if ids in seen:
            counts["duplicates"] += 1
            continue
        seen.add(ids)
        out.append(example)
    return out, counts


def split(train: list[Example], val: list[Example]) -> tuple[list[Example], int]:
    """``train`` without the calls (or rendered conversations) of ``val``, and how many were left out."""
    held = {e.key for e in val} | {(e.prompt_ids, e.completion_ids) for e in val}
    kept = [e for e in train if e.key not in held and (e.prompt_ids, e.completion_ids) not in held]
    return kept, len(train) - len(kept)
