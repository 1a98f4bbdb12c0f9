"""The common Anthropic request's fewer steps (``anthropic_messages.SimpleCapture``) store what the
general path stores: the same input through both paths, the same chat request, caller's answer
and span attributes; requests of any other shape take the general path.

Random requests and answers (seeded), and the instrumentor end to end on a mocked transport."""

from __future__ import annotations

import random

import httpx2
import orjson
import pytest

from lightspan.tracing import semconv, straight
from lightspan.tracing.protocols import anthropic_common as common
from lightspan.tracing.protocols import anthropic_messages as am
from lightspan.tracing.protocols.anthropic_convert import to_chat
from tests.tracing.otel import _instrumented

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

WORDS = ["hi", "", "x-anthropic-billing-header: 1", "é ü", "two words", "{\"a\": 1}"]


def _common(rng: random.Random) -> dict:
    """A random request of the common shape."""
    body = {"model": rng.choice(["policy", "m/x"]), "max_tokens": rng.randint(1, 64),
            "messages": [{"role": rng.choice(["user", "assistant"]), "content": rng.choice(WORDS)}
                         for _ in range(rng.randint(1, 4))]}
    for key, values in (("system", WORDS), ("temperature", [0.0, 0.7, 1, None]), ("top_p", [0.9, None]),
                        ("top_k", [5, None]), ("stop_sequences", [["\n"], []]), ("stream", [True, False, None])):
        if rng.random() < 0.5:
            body[key] = rng.choice(values)
    return body


def _answer(rng: random.Random, prompt: int = 5) -> dict:
    """A random chat completion: the usual text answer, or one with what the general path reads."""
    n = rng.randint(1, 4)
    message = {"role": "assistant", "content": rng.choice(["hello", "", None]), "reasoning": None, "tool_calls": []}
    choice = {"index": 0, "message": message, "finish_reason": rng.choice(["length", "stop", "abort", None]),
              "stop_reason": rng.choice([None, "\n"]), "token_ids": [rng.randrange(100) for _ in range(n)],
              "logprobs": {"content": [{"token": "t", "logprob": -rng.random()} for _ in range(n)]}}
    answer = {"id": "chatcmpl-1", "object": "chat.completion", "model": "policy", "choices": [choice],
              "prompt_token_ids": list(range(prompt)),
              "usage": {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}}
    kind = rng.randrange(8)
    if kind == 0:
        message["reasoning"] = "hm"
    elif kind == 1:
        message["tool_calls"] = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    elif kind == 2:
        answer["choices"].append({**choice, "index": 1})
    elif kind == 3:
        choice["token_ids"] = None
    elif kind == 4:
        choice["logprobs"]["content"].pop()
    elif kind == 5:
        answer["prompt_token_ids"] = None
    return answer


def _read(cap, answer: dict) -> tuple:
    """(the caller's message, lightspan attributes, GenAI attributes, output messages) of ``answer``."""
    out = am.output(cap, False)
    if out is not None:
        out.add(answer)
    message = cap.message(answer)
    return message, cap.attributes(3), cap.genai_attributes(), am.outputs(cap, out)


def test_the_common_request_converts_as_the_general_path_does():
    rng = random.Random(13)
    for _ in range(500):
        body = _common(rng)
        assert am.common_chat(body) == to_chat(body)
        assert type(am.PROTOCOL.capture(body)) is am.SimpleCapture


@pytest.fixture()
def fixed_signatures(monkeypatch):
    """A thinking block's signature is a fresh uuid each time: the same one for both paths."""
    import uuid

    from lightspan.tracing.protocols import anthropic_convert
    monkeypatch.setattr(anthropic_convert.uuid, "uuid4", lambda: uuid.UUID(int=1))


def test_both_paths_give_the_caller_and_the_span_the_same(fixed_signatures):
    rng = random.Random(14)
    for _ in range(500):
        body = {**_common(rng), "stream": False}
        answer = _answer(rng)
        simple, general = am.PROTOCOL.capture(body), am.AnthropicCapture(body)
        assert type(simple) is am.SimpleCapture
        assert simple.request() == general.request()
        # (each reads its own copy: the general path leaves the answer as it found it, and so must this one)
        assert _read(simple, orjson.loads(orjson.dumps(answer))) == _read(general, orjson.loads(orjson.dumps(answer)))


def test_both_paths_give_a_streams_events_and_attributes_alike(fixed_signatures):
    rng = random.Random(15)
    for _ in range(100):
        body = {**_common(rng), "stream": True}
        chunks = [{"id": "c", "model": "policy", "prompt_token_ids": [1, 2], "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": {"prompt_tokens": 2}}]
        for i in range(rng.randint(1, 5)):
            chunks.append({"id": "c", "model": "policy", "choices": [{"index": 0, "delta": {"content": f"t{i}"},
                           "token_ids": [i], "logprobs": {"content": [{"logprob": -0.5}]}, "finish_reason": None}]})
        chunks.append({"id": "c", "model": "policy", "choices": [], "usage": {"prompt_tokens": 2}})
        seen = []
        for cap in (am.PROTOCOL.capture(body), am.AnthropicCapture(body)):
            events = [e for chunk in orjson.loads(orjson.dumps(chunks)) for e in cap.events(chunk)] + cap.end()
            seen.append((events, cap.attributes(None), cap.genai_attributes(), am.outputs(cap, am.output(cap, True))))
        assert seen[0] == seen[1]


@pytest.mark.parametrize("body", [
    {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": []},
    {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "thinking": None},
    {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "metadata": {"user_id": "u"}},
    {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
     "system": [{"type": "text", "text": "s"}]},
    {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi", "cache_control": {}}]},
    {"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]},
    {"model": "m", "max_tokens": 5, "messages": []},
    {"model": "m", "max_tokens": True, "messages": [{"role": "user", "content": "hi"}]},
    {"model": "", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
    {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {}},
    {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "temperature": True},
    {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "top_p": "0.9"},
    {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": "\n"},
    {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": [1]},
    {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "stream": 1},
    {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "system": []},
], ids=["blocks", "tools", "thinking", "metadata", "system_blocks", "turn_field", "system_turn", "no_turns",
        "bool_max_tokens", "no_model", "vllm_field", "bool_temperature", "text_top_p", "text_stop", "int_stop",
        "int_stream", "list_system"])
def test_any_other_request_takes_the_general_path(body):
    assert am.common_chat(body) is None
    assert type(am.PROTOCOL.capture(body)) is am.AnthropicCapture
    assert am.PROTOCOL.common(body) is None


def _posted(rng: random.Random) -> tuple[dict, dict | None]:
    """A random body as the anthropic client posts it (its ``omit`` sentinels in it), and its
    ``extra_body``: mostly of the common shape, some not."""
    from anthropic import omit

    body = _common(rng)
    if rng.random() < 0.2:   # a field outside the common shape
        body[rng.choice(["metadata", "thinking", "system", "temperature"])] = rng.choice(
            [{"user_id": "u"}, [{"type": "text", "text": "s"}], True, {"type": "enabled", "budget_tokens": 9}])
    posted = {**{k: omit for k in ("metadata", "service_tier", "stop_sequences", "system", "thinking", "tools")}, **body}
    extra = rng.choice([None, {}, {"temperature": 0.5}, {"top_k": 3}, {"chat_template_kwargs": {}}, {"top_p": None}])
    return posted, extra


def test_the_instrumentors_straight_line_prepares_the_call_as_the_general_steps_do(monkeypatch, fixed_signatures):
    """``calls.prepare``'s straight line for the common shape (``Protocol.common``) sends the request,
    options and path the general steps send, with the same capture and span choice; other bodies
    take the general steps."""
    import anthropic

    from lightspan.tracing import calls
    from lightspan.tracing.clients import CLIENTS

    client = CLIENTS["anthropic"]
    instance = anthropic.Anthropic(base_url="http://127.0.0.1:9", api_key="x", max_retries=0)   # loopback: captured
    general = calls._prepare_common
    rng = random.Random(18)
    straight = 0
    with _instrumented():   # (the JSON hooks installed: the client can take a converted answer)
        _prepare_both(monkeypatch, calls, general, client, instance, rng, counted := [])
    straight = sum(counted)
    assert 100 < straight < 300


def _prepare_both(monkeypatch, calls, general, client, instance, rng, counted: list) -> None:
    for _ in range(300):
        posted, extra = _posted(rng)
        options = {"headers": {"X-Stainless-Raw-Response": rng.choice([None, "raw"])}, "timeout": 5}
        if extra is not None:
            options["extra_json"] = extra
        seen = []
        for fast in (True, False):
            monkeypatch.setattr(calls, "_prepare_common", general if fast else (lambda *a, **k: None))
            kwargs = {"body": dict(posted), "options": dict(options), "cast_to": object,
                      "stream": rng.choice([False, None]) if fast else seen[0][0]["stream"]}
            call, sent = calls.prepare(client, instance, ("/v1/messages",), kwargs)
            call.settle()
            cap = call.cap
            seen.append((kwargs, sent, call.path, call.stream, call.converted, call.content, call.name, call.owned,
                         call.adopted, cap.body, cap.request() if cap.converted else None, cap.temperature,
                         cap.unsupported, cap.stream is None, call.output is None))
            counted.append(fast and type(cap) is am.SimpleCapture and cap.chat_body is sent["body"])
        assert seen[0][1:] == seen[1][1:]


# --- end to end: the instrumentor, the anthropic client, a mocked vLLM ------------------------------

def _client(answer: dict, stream_chunks=None):
    import anthropic

    def handler(request):
        assert request.url.path == "/v1/chat/completions"
        if stream_chunks is not None:
            body = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in stream_chunks) + b"data: [DONE]\n\n"
            return httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})
        return httpx2.Response(200, json=answer)

    return anthropic.Anthropic(base_url="http://127.0.0.1:9", api_key="x", max_retries=0,
                               http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))


def _spans_of(exporter) -> list:
    spans = [s for s in exporter.get_finished_spans() if s.attributes.get(semconv.CAPTURE_STATUS) not in (None, "duplicate")]
    # (less the anthropic SDK's one clock reading, its stream's time to the first chunk)
    return [{k: v for k, v in s.attributes.items() if k != "gen_ai.response.time_to_first_chunk"}
            for s in sorted(spans, key=lambda s: s.start_time)]


@pytest.mark.parametrize("stream", [False, True], ids=["response", "stream"])
def test_the_stored_span_is_the_same_through_both_paths(monkeypatch, fixed_signatures, stream):
    rng = random.Random(16)
    cases = []
    for _ in range(12):
        kwargs = {"model": "policy", "max_tokens": 8, "system": rng.choice(["Be brief.", ""]),
                  "messages": [{"role": "user", "content": rng.choice(WORDS)},
                               {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}][
                                   :rng.choice([1, 3])],
                  "extra_body": {"temperature": rng.choice([0.0, 0.7])}}
        cases.append((kwargs, _answer(rng)))
    chunks = [{"id": "c", "model": "policy", "prompt_token_ids": [1, 2], "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": {"prompt_tokens": 2}},
        {"id": "c", "model": "policy", "choices": [{"index": 0, "delta": {"content": "yo"}, "token_ids": [7],
                                                    "logprobs": {"content": [{"logprob": -0.25}]}, "finish_reason": "length"}]},
        {"id": "c", "model": "policy", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1}}]
    stored, taken = [], []
    original = common.common_chat
    for fast in (True, False):   # (both the instrumentor's straight line and SimpleCapture, or neither)
        monkeypatch.setattr(common, "common_chat", original if fast else (lambda body, capture=False: None))
        monkeypatch.setattr(straight, "ON", [fast])
        if fast:   # (the straight line's plain answers, SimpleCapture's others)
            monkeypatch.setattr(am.SimpleCapture, "message", _noting(taken, am.SimpleCapture.message))
            monkeypatch.setattr(straight.Straight, "answer", _noting(taken, straight.Straight.answer, answered=True))
        with _instrumented() as exporter:
            for kwargs, answer in cases:
                client = _client(answer, chunks if stream else None)
                if stream:
                    list(client.messages.create(**kwargs, stream=True))
                else:
                    client.messages.create(**kwargs)
            stored.append(_spans_of(exporter))
    assert len(stored[0]) == len(cases)
    assert stored[0] == stored[1]
    assert all(s[semconv.CAPTURE_STATUS] for s in stored[0])
    if not stream:   # the fast path took every call when on, none when off
        assert len(taken) == len(cases)


def _noting(taken: list, method, answered: bool = False):
    def message(self, completion):
        out = method(self, completion)
        if out is not None or not answered:
            taken.append(completion)
        return out
    return message


def test_the_hook_check_follows_the_hooks_installed():
    """``hooks.hooked`` is cached per class: installing or removing the hooks is seen at once."""
    from lightspan.tracing import hooks

    class Response:
        def json(self, **kwargs):
            return {}

    fake = type("httpx2", (), {"Response": Response})
    import sys
    saved = hooks._JSON_HOOKS[:]
    hooks._JSON_HOOKS.clear()
    hooks.hooked.cache_clear()
    real = sys.modules.get("httpx2"), sys.modules.get("httpx")
    try:
        sys.modules["httpx2"], sys.modules["httpx"] = fake, None
        assert not hooks.hooked(Response)
        hooks.install_json_hooks(lambda original: original)
        assert hooks.hooked(Response)
        hooks.remove_json_hooks()
        assert not hooks.hooked(Response)
    finally:
        for name, module in zip(("httpx2", "httpx"), real):
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        hooks._JSON_HOOKS[:] = saved
        hooks.hooked.cache_clear()


def test_a_plain_answer_is_read_in_one_pass(fixed_signatures):
    """The plain answer's message and output messages are made as it is read (no ``ChatOutput``),
    other answers the general way; both as the general path gives them."""
    body = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    rng = random.Random(17)
    plain = 0
    for _ in range(200):
        answer = _answer(rng)
        cap = am.PROTOCOL.capture(body)
        message = cap.message(orjson.loads(orjson.dumps(answer)))
        plain += cap.out is not None
        assert (cap.out is not None) == (am._plain(answer) is not None)
        general = am.AnthropicCapture(body)
        assert message == general.message(orjson.loads(orjson.dumps(answer)))
        out = am.ChatOutput()
        out.add(answer)
        assert cap.output_messages() == out.messages(general.stop_reason)
    assert 0 < plain < 200


def _stream_datas(rng: random.Random) -> list:
    """A chat stream's data strings: the usual tokens, with now and then a chunk of another shape (a
    reasoning or tool-call delta, a finish reason, another index, prompt ids, logprobs of another
    shape, a delta of several fields), data that is not a chunk, and a ``[DONE]`` (not always last)."""
    out = [orjson.dumps({"id": "c", "model": "policy", "prompt_token_ids": [1, 2], "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": {"prompt_tokens": 2}}).decode()]
    for i in range(rng.randint(0, 12)):
        choice = {"index": 0, "delta": {"content": rng.choice([f"t{i}", "é", "", None])}, "token_ids": [i],
                  "logprobs": {"content": [{"logprob": -0.5}]}, "finish_reason": None}
        chunk = {"id": "c", "model": "policy", "choices": [choice]}
        odd = rng.random()
        if odd < 0.05:
            choice["delta"] = {"reasoning": "hm"}
        elif odd < 0.1:
            choice["delta"]["tool_calls"] = [{"index": 0, "id": f"t{i}", "function": {"name": "f", "arguments": "{}"}}]
        elif odd < 0.13:
            choice["finish_reason"] = rng.choice(["length", "stop"])
        elif odd < 0.16:
            choice["index"] = 1
        elif odd < 0.19:
            chunk["prompt_token_ids"] = [3]
        elif odd < 0.22:
            choice["logprobs"] = rng.choice([None, {"content": []}, {"content": [{"logprob": -1}, {"logprob": -2}]},
                                             {"content": [{"token": "x"}]}, {}])
        elif odd < 0.25:
            del choice["token_ids"]
        elif odd < 0.28:
            choice["delta"]["role"] = "assistant"
        elif odd < 0.3:
            choice["delta"]["reasoning"] = None
        elif odd < 0.32:
            chunk["choices"] = [choice, dict(choice, index=1)]
        elif odd < 0.34:
            chunk["usage"] = {"prompt_tokens": 2, "completion_tokens": i}
        out.append(orjson.dumps(chunk).decode())
        if rng.random() < 0.05:
            out.append(rng.choice(["[1, 2]", "\"text\"", ": x", " {\"a\": 1}", "null"]))
    out.append(orjson.dumps({"id": "c", "model": "policy", "choices": [], "usage": {"prompt_tokens": 2}}).decode())
    out.insert(rng.randint(len(out) - 1, len(out)), "[DONE]")
    if rng.random() < 0.2:
        out.append(out[1] if len(out) > 2 else "[DONE]")
    return out


def _or_raised(fn, *args):
    try:
        return fn(*args)
    except Exception as e:   # (a logprob that is not a number: both ways alike)
        return type(e).__name__


def test_a_streams_batch_reads_as_its_chunks_one_by_one(fixed_signatures):
    """``AnthropicCapture.batch`` (the converted stream's decoder's loop) gives the events, ids,
    logprobs, counts and attributes that ``events`` and ``end`` give chunk by chunk, the data cut
    into reads anywhere, and stops after a ``[DONE]``."""
    def make(name, data):
        return (name, data)

    rng = random.Random(16)
    for _ in range(400):
        body = {**_common(rng), "stream": True}
        datas = _stream_datas(rng)
        seen = []
        for how in ("one by one", "batch"):
            cap, events, done = am.PROTOCOL.capture(body), [], []
            if how == "one by one":
                for data in datas:
                    if data.startswith("{"):
                        chunk = orjson.loads(data)
                        if type(chunk) is dict:
                            events += cap.events(chunk)
                    elif data.startswith("[DONE]"):
                        events += cap.end()
                        done.append(len(events))
            else:
                cuts = sorted(rng.sample(range(len(datas) + 1), rng.randint(0, 3)))
                for start, stop in zip([0, *cuts], [*cuts, len(datas)]):
                    part, i = datas[start:stop], 0
                    while i < len(part):
                        i = cap.batch(part, i, make, events)
                        if part[i - 1].startswith("[DONE]"):
                            done.append(len(events))
            c = cap.chat.choices.get(0)
            seen.append((events, done, cap.chat.fed, c and (c.ids, c.logprobs), _or_raised(cap.attributes, 3),
                         cap.genai_attributes(), am.outputs(cap, am.output(cap, True))))
        assert seen[0] == seen[1], datas
