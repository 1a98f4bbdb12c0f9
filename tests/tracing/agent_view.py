"""What an agent sees of one call, per protocol, as the provider's SDK gives it to the agent: the
``model_dump()`` of the parsed answer, or of each stream event. tests/tracing/test_agent_view.py
(the instrumentor) and tests/rollout/test_gateway_protocols.py (the gateway) compare it with and
without lightspan, greedily: lightspan must hand back exactly what vLLM answers the caller's own
request, the token ids and logprobs it asked for included (vLLM's ``null``)."""

from __future__ import annotations

PROTOCOLS = ["chat", "completions", "responses", "messages"]

# differs from call to call by design: ids, times
_IDS = frozenset({"id", "created", "created_at", "item_id", "call_id"})
# the prompt cache counts, which lightspan's conversions report as the chat route does (docs of
# tracing/protocols/responses_convert.py and tracing/protocols/anthropic_convert.py): vLLM's Responses route counts
# cached prompt tokens; Anthropic's API sends 0 where vLLM's Messages route leaves them out
_CACHE_COUNTS = frozenset({"cached_tokens", "cache_write_tokens", "cache_read_input_tokens",
                           "cache_creation_input_tokens"})


def aside(obj, protocol: str):
    """``obj`` without ids and times, and (for the two converted protocols) the cache counts as 0."""
    if isinstance(obj, dict):
        return {k: 0 if k in _CACHE_COUNTS and protocol in ("responses", "messages") else aside(v, protocol)
                for k, v in obj.items() if k not in _IDS}
    if isinstance(obj, list):
        return [aside(v, protocol) for v in obj]
    return obj


def _text_of(event: dict, protocol: str):
    """(the place of the text a stream event adds, its text) for events whose consecutive text joins."""
    if protocol in ("chat", "completions"):
        choices = event.get("choices") or []
        if len(choices) != 1 or choices[0].get("finish_reason") is not None or event.get("usage"):
            return None
        choice = choices[0]
        if protocol == "completions":
            return (choice, "text") if isinstance(choice.get("text"), str) and choice.get("logprobs") is None else None
        delta = choice.get("delta") or {}
        if isinstance(delta.get("content"), str) and not delta.get("tool_calls") and delta.get("role") is None:
            return delta, "content"
        return None
    if protocol == "responses":
        return (event, "delta") if event["type"].endswith(".delta") else None
    if event["type"] == "content_block_delta":
        key = {"text_delta": "text", "input_json_delta": "partial_json", "thinking_delta": "thinking"}
        return (event["delta"], key[event["delta"]["type"]]) if event["delta"]["type"] in key else None
    return None


def joined(events: list[dict], protocol: str) -> list[dict]:
    """Dumped stream events with consecutive text events joined: how many tokens one chunk holds
    depends on the engine's timing (vLLM's own answers differ from run to run), not on lightspan."""
    out: list[dict] = []
    for event in events:
        here = _text_of(event, protocol)
        last = _text_of(out[-1], protocol) if out else None
        if here and last and _shape(out[-1], protocol) == _shape(event, protocol):
            last[0][last[1]] += here[0][here[1]]
        else:
            out.append(event)
    if protocol == "responses":
        for e in out:
            e.pop("sequence_number", None)
    return out


def _shape(event: dict, protocol: str):
    """What two events must share to be joined (their kind and place), the text left out."""
    if protocol == "responses":
        return event["type"], event.get("output_index"), event.get("content_index")
    if protocol == "messages":
        return event["type"], event.get("index"), event["delta"]["type"]
    return "text"


def call(client, protocol: str, stream: bool) -> list[dict]:
    """One greedy call of ``protocol`` with ``client`` (an ``openai`` client, an ``anthropic`` one for
    messages): the answer's dump, or each event's, in a list."""
    greedy = {"extra_body": {"temperature": 0}} if protocol == "messages" else {"temperature": 0}
    if protocol == "chat":
        out = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=8, stream=stream, **greedy)
    elif protocol == "completions":
        out = client.completions.create(model="policy", prompt="Say hi.", max_tokens=8, stream=stream, **greedy)
    elif protocol == "responses":
        out = client.responses.create(model="policy", input="Say hi.", instructions="Be brief.",
                                      max_output_tokens=8, stream=stream, **greedy)
    else:
        out = client.messages.create(model="policy", max_tokens=8, system="Be brief.", stream=stream,
                                     messages=[{"role": "user", "content": "hi"}], **greedy)
    if not stream:
        return [out.model_dump()]
    return joined([event.model_dump() for event in out], protocol)
