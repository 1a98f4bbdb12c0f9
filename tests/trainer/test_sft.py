"""SFT on captured calls (trainer/sft.py, sft_data.py): re-tokenisation against the chat template, the
loss mask, unrenderable calls counted by reason, selection by SQL with rewards, one run on the tiny
model, and its checkpoint resumed by GRPO and synced into the suite's shared vLLM.

The captured messages are made by the capture's own conversion (tracing/protocols/chat.py: what the
instrumentor and the gateway store for a chat completion), stored as span rows in the store's schema.
"""

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from lightspan import store
from lightspan.core.config import ConfigError
from lightspan.models import CHATML_TEMPLATE, build_tokenizer
from lightspan.store.schema import REWARD_SCOPE
from lightspan.tracing.messages import dumps
from lightspan.tracing.protocols.chat_messages import ChatOutput, chat_input
from lightspan.trainer import sft, sft_data
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.batches import Cursor
from lightspan.trainer.loop import Trainer
from lightspan.trainer.sync import ReloadSync

torch.set_num_threads(1)

T0 = 1_800_000_000 * 10**9
DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"

# A ChatML template that renders tools (in the system turn), assistant tool calls and tool turns, and
# refuses any other role: what many models' templates do.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n"
    "{% endif %}Tools:{% for t in tools %}\n{{ t['function'] | tojson }}{% endfor %}<|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m['role'] == 'system' %}"
    "{%- elif m['role'] in ('user', 'tool') %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{%- elif m['role'] == 'assistant' %}<|im_start|>assistant\n{{ m['content'] or '' }}"
    "{%- for c in m['tool_calls'] or [] %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}{{ raise_exception('unknown role ' + m['role']) }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "name": "weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def tokenizer(template=TOOLS_TEMPLATE):
    tok = build_tokenizer()
    tok.chat_template = template
    return tok


def captured(messages, reply, *, tool_calls=None):
    """(gen_ai.input.messages, gen_ai.output.messages) as the capture writes them for a chat request
    with ``messages`` answered by ``reply`` (text) and/or ``tool_calls``."""
    out = ChatOutput()
    message = {"role": "assistant", "content": reply}
    if tool_calls:
        message["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                                  "function": {"name": name, "arguments": json.dumps(args)}}
                                 for i, (name, args) in enumerate(tool_calls)]
    out.add({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})
    return dumps(chat_input({"messages": messages})), dumps(out.messages())


def tools_attribute(*tools):
    return json.dumps(json.dumps(list(tools)))      # the store's attribute map holds JSON-encoded values


def masked_in(example):
    """The ids the loss covers, read back from the padded batch's mask (targets of logits[:, t])."""
    ids, _, mask = sft.pad([example], 0, "cpu")
    return [int(i) for i, m in zip(ids[0, 1:], mask[0]) if m]


# ---- re-tokenisation against the chat template --------------------------------------------------
def test_plain_chat_trains_exactly_the_reply_tokens():
    tok = tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    inputs, outputs = captured(messages, "2 + 2 = 4.")

    example = sft_data.render(tok, *sft_data.conversation(inputs, outputs), max_length=1024)

    assert list(example.prompt_ids) == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                               return_dict=True)["input_ids"]
    assert masked_in(example) == list(example.completion_ids)
    assert tok.decode(masked_in(example)) == "2 + 2 = 4.<|im_end|>"           # the reply and the end of turn
    assert tok.decode(masked_in(example), skip_special_tokens=True) == json.loads(outputs)[0]["parts"][0]["content"]
    full = tok.apply_chat_template(messages + [{"role": "assistant", "content": "2 + 2 = 4."}], tokenize=False)
    assert tok.decode(example.prompt_ids + example.completion_ids) == full.rstrip("\n")


def test_tool_calls_and_tool_definitions_render_and_only_the_call_is_trained():
    tok = tokenizer()
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    inputs, outputs = captured(messages, None, tool_calls=[("weather", {"city": "Paris"})])

    call = sft_data.conversation(inputs, outputs, tools_attribute(WEATHER))
    example = sft_data.render(tok, *call, max_length=1024)

    prompt = tok.decode(example.prompt_ids)
    assert "The weather in a city." in prompt and prompt.endswith("<|im_start|>assistant\n")
    captured_call = json.loads(outputs)[0]["parts"][0]
    assert captured_call["type"] == "tool_call"
    expected = "<tool_call>" + json.dumps({"name": "weather", "arguments": captured_call["arguments"]}) + "</tool_call>"
    assert tok.decode(masked_in(example), skip_special_tokens=True) == expected

    # the same tools as traceloop's instrumentation records them (llm.request.functions.<i>.*)
    functions = [{"key": f"llm.request.functions.0.{k}", "value": json.dumps(json.dumps(WEATHER[k]) if k == "parameters"
                                                                             else WEATHER[k])}
                 for k in ("name", "description", "parameters")]
    assert sft_data.conversation(inputs, outputs, None, None, functions) == call

    # a template that drops tools cannot train this call: counted, not trained
    plain = tokenizer(CHATML_TEMPLATE)
    with pytest.raises(sft_data.Unrenderable) as err:
        sft_data.render(plain, *call, max_length=1024)
    assert err.value.reason == "template_drops_tools"


def test_multi_turn_calls_train_the_last_reply_only_earlier_turns_are_context():
    tok = tokenizer()
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
                {"role": "assistant", "content": "Sunny and 21 C."},
                {"role": "user", "content": "And tomorrow?"}]
    inputs, outputs = captured(messages, "I can only see today's weather.")

    example = sft_data.render(tok, *sft_data.conversation(inputs, outputs, tools_attribute(WEATHER)), max_length=1024)

    prompt = tok.decode(example.prompt_ids)
    assert "Sunny and 21 C.<|im_end|>" in prompt and '<tool_call>{"name": "weather"' in prompt
    assert "<|im_start|>tool\nsunny, 21 C" in prompt
    assert tok.decode(masked_in(example), skip_special_tokens=True) == "I can only see today's weather."
    # the same call as another instrumentation writes it (OpenAI-shaped messages) renders the same
    openai_shaped = sft_data.conversation(json.dumps(messages), json.dumps(
        [{"role": "assistant", "content": "I can only see today's weather."}]), tools_attribute(WEATHER))
    assert sft_data.render(tok, *openai_shaped, max_length=1024) == example


def row(inputs, outputs, tools=None, *, span="s"):
    return ("t", span, inputs, outputs, tools, None)


def test_unrenderable_calls_are_counted_by_reason_and_duplicates_once():
    tok = tokenizer()
    good = captured([{"role": "user", "content": "hi"}], "hello")
    image = json.dumps([{"role": "user", "parts": [{"type": "image", "content": "..."}]}])
    no_text = json.dumps([{"role": "user", "parts": [{"type": "text"}]}])
    critic = captured([{"role": "critic", "content": "hm"}], "ok")
    rows = [row(*good, span="a"), row(*good, span="b"),                            # one duplicate
            row(None, good[1]),                                                    # content capture off
            row(no_text, good[1]),                                                 # a part without its content
            row(image, good[1]),
            row(*critic),                                                          # the template raises
            row(good[0], json.dumps([{"role": "user", "parts": [{"type": "text", "content": "x"}]}])),
            row("{not json", good[1]),
            row(good[0], json.dumps([{"role": "assistant", "parts": [], "finish_reason": "length"}])),
            row(*captured([{"role": "user", "content": "x" * 300}], "long")),
            row(*captured([{"role": "user", "content": "Weather?"}], None, tool_calls=[("weather", {})])),
            row(*captured([{"role": "user", "content": "Weather?"}], None, tool_calls=[("weather", {})]),
                tools_attribute(WEATHER)),
            ]

    found, counts = sft_data.examples(rows, tok, max_length=280)
    _, plain_counts = sft_data.examples(rows[-1:], tokenizer(CHATML_TEMPLATE), max_length=280)

    assert [e.key for e in found] == [("t", "a"), ("t", "s")]
    assert dict(counts) == {"duplicates": 1, "unrenderable/no_content": 2, "unrenderable/unsupported_part": 1,
                            "unrenderable/template_error": 1, "unrenderable/no_reply": 2,
                            "unrenderable/not_json": 1, "unrenderable/too_long": 1,
                            "unrenderable/no_tool_definitions": 1}
    assert dict(plain_counts) == {"unrenderable/template_drops_tools": 1}
    assert set(k.split("/", 1)[1] for k in counts if "/" in k) <= set(sft_data.REASONS)


# ---- selection by SQL over the store ------------------------------------------------------------
_ids = iter(range(1, 10**6))


def span_row(trace, name, at, **cols):
    r = {f.name: None for f in store.SPAN_SCHEMA}
    r.update(trace_id=trace, span_id=f"{next(_ids):016x}", name=name, kind="CLIENT", service_name="support-bot",
             start_time_unix_nano=T0 + at, end_time_unix_nano=T0 + at + 10, status_code="UNSET",
             received_unix_nano=T0 + at + 10)
    r.update(cols)
    return r


def hosted_call(trace, question, answer, at, *, split=None, tools=None):
    """A call to a hosted model as the capture stores it: messages, no token ids, its own trace."""
    inputs, outputs = captured([{"role": "user", "content": question}], answer)
    attrs = [("gen_ai.tool.definitions", tools)] if tools else []
    return span_row(trace, "chat gpt-hosted", at, operation_name="chat", request_model="gpt-hosted",
                    input_messages=inputs, output_messages=outputs, split=split, attributes=attrs)


def human(trace, value, at):
    return span_row(trace, "lightspan.reward", at, reward=value, reward_name="human", scope_name=REWARD_SCOPE,
                    attributes=[("lightspan.reward.source", json.dumps("human"))])


ANSWERS = {"add 2 and 3": "5", "add 4 and 4": "8", "add 1 and 6": "7", "add 5 and 2": "7"}


def hosted_store(data_dir):
    """Eight rewarded calls (two of them held out), one badly rated, one with content capture off."""
    rows = []
    for i in range(2):
        for j, (q, a) in enumerate(ANSWERS.items()):
            trace = f"{i:02d}{j:02d}".ljust(32, "0")
            rows += [hosted_call(trace, f"{q} ({i})", f"The sum is {a}.", 100 * (4 * i + j), split="val" if i else None),
                     human(trace, 1.0, 100 * (4 * i + j) + 50)]
    rows += [hosted_call("b" * 32, "add 9 and 9", "The sum is 17.", 900), human("b" * 32, 0.0, 950),
             span_row("c" * 32, "chat gpt-hosted", 1000, operation_name="chat"), human("c" * 32, 1.0, 1050)]
    store.write_table(data_dir, "spans", pa.Table.from_pylist(rows, schema=store.SPAN_SCHEMA),
                      partition="date=2026-12-04")


def test_select_by_sql_with_rewards_by_the_attribution_rule(tmp_path):
    hosted_store(tmp_path)
    con = sft_data.connect(tmp_path)

    good = sft_data.select(con, "human_reward >= 1 AND coalesce(split, 'train') = 'train'", field="select")
    rewards = dict(con.execute("SELECT trace_id, call_reward FROM sft_calls").fetchall())

    assert [r[0][:4] for r in good] == ["0000", "0001", "0002", "0003", "cccc"]
    assert rewards["b" * 32] == 0.0 and rewards["c" * 32] == 1.0 and len(rewards) == 10
    with pytest.raises(ConfigError) as err:
        sft_data.select(con, "no_such_column > 1", field="select")
    assert "select" in str(err.value) and "sft_calls" in str(err.value)


# ---- one run on the tiny model --------------------------------------------------------------------
def sft_config(tmp_path, model, **kwargs):
    return TrainerConfig(**{"data_dir": str(tmp_path / "data"), "model": str(model), "sync": "none", "algo": "sft",
                            "select": "human_reward >= 1", "learning_rate": 3e-3, "sft_epochs": 3,
                            "batch_size": 2, "micro_batch_size": 2, "torch_threads": 1, **kwargs})


def test_a_run_lowers_the_loss_counts_what_it_skips_and_grpo_resumes_from_it(tmp_path, tiny_model):
    from tests.trainer.test_loop import good_and_bad, write

    cfg = sft_config(tmp_path, tiny_model)
    hosted_store(cfg.data_dir)

    summary = sft.run(cfg)

    assert summary["train/sft/calls_selected"] == 9 and summary["train/sft/examples"] == 4
    assert summary["train/sft/held_out_overlap"] == 4
    assert summary["train/sft/unrenderable/no_content"] == 1 and summary["train/sft/val/examples"] == 4
    assert summary["train/sft/optimizer_steps"] == 6 and summary["train/sft/policy_version"] == 1
    assert summary["train/sft/loss_last_epoch"] < summary["train/sft/loss_first_epoch"]
    assert summary["train/sft/val/loss_after"] < summary["train/sft/val/loss_before"] - 0.1, summary
    assert summary["train/sft/val/token_accuracy_after"] > summary["train/sft/val/token_accuracy_before"]
    checkpoint = Path(cfg.data_dir) / "checkpoints" / "v000001"
    assert json.loads((checkpoint / sft.SUMMARY_FILE).read_text()) == summary
    assert store.policy.read(cfg.data_dir).version == 1
    steps = store.connect(cfg.data_dir).execute("SELECT policy_version, num_transitions, loss FROM train_steps").fetchall()
    assert steps == [(1, 4, pytest.approx(summary["train/sft/loss_last_epoch"]))]

    # GRPO continues from the SFT checkpoint: its weights, version 1, the untouched data cursor
    grpo = Trainer(TrainerConfig(data_dir=cfg.data_dir, model=str(tiny_model), sync="none", torch_threads=1,
                                 learning_rate=1e-3))
    grpo.load_or_init()
    assert grpo.version == 1 and grpo.cursor == Cursor()
    sft_weights = Trainer(sft_config(tmp_path, checkpoint, output_dir=str(tmp_path / "other")))
    sft_weights.load_or_init()
    for (name, a), (_, b) in zip(grpo.model.named_parameters(), sft_weights.model.named_parameters()):
        assert torch.equal(a, b), name
    write(cfg.data_dir, good_and_bad(created=10))
    row = grpo.train_once()
    assert row["policy_version"] == 2 and store.policy.read(cfg.data_dir).version == 2


def test_a_lora_run_writes_an_adapter_grpo_resumes(tmp_path, tiny_model):
    cfg = sft_config(tmp_path, tiny_model, lora_r=8, learning_rate=1e-2, sft_epochs=1)
    hosted_store(cfg.data_dir)

    summary = sft.run(cfg)

    assert summary["train/sft/policy_version"] == 1
    checkpoint = Path(cfg.data_dir) / "checkpoints" / "v000001"
    assert (checkpoint / "adapter_config.json").is_file() and not (checkpoint / "model.safetensors").exists()
    grpo = Trainer(TrainerConfig(data_dir=cfg.data_dir, model=str(tiny_model), sync="none", lora_r=8,
                                 torch_threads=1))
    grpo.load_or_init()
    assert grpo.version == 1


def test_nothing_trainable_says_why_and_makes_no_version(tmp_path, tiny_model):
    cfg = sft_config(tmp_path, tiny_model, select="human_reward >= 1 AND input_messages IS NULL")
    hosted_store(cfg.data_dir)

    summary = sft.run(cfg)

    assert summary["train/sft/examples"] == 0 and summary["train/sft/unrenderable/no_content"] == 1
    assert summary["train/sft/policy_version"] == 0
    assert not (Path(cfg.data_dir) / "checkpoints" / "v000001").exists()


def test_config_errors_name_the_field(tmp_path, tiny_model):
    with pytest.raises(ConfigError, match="mode"):
        sft_config(tmp_path, tiny_model, mode="continuous")
    with pytest.raises(ConfigError, match="sft_epochs"):
        sft_config(tmp_path, tiny_model, sft_epochs=0)
    with pytest.raises(ConfigError, match="algo"):
        sft_config(tmp_path, tiny_model, algo="dpo")
    assert TrainerConfig(model=str(tiny_model)).algo == "grpo"


def test_every_sft_metric_is_explained(tmp_path, tiny_model):
    from tests.lightningrl.test_metrics_doc import explained

    cfg = sft_config(tmp_path, tiny_model, sft_epochs=1)
    hosted_store(cfg.data_dir)
    summary = sft.run(cfg)
    doc = DOC.read_text().split("## SFT metrics", 1)[1].split("\n## ", 1)[0]
    missing = sorted(k for k in summary if not explained(k, doc))
    assert not missing, f"docs/metrics.md does not explain {missing}"


# ---- the suite's shared vLLM ----------------------------------------------------------------------
@pytest.fixture
def restore_weights(vllm_server, tmp_path):
    """Give the session's vLLM server its original weights back, from a new directory."""
    yield
    ReloadSync(vllm_server.url).push(shutil.copytree(vllm_server.model_dir, tmp_path / "restore-v0"), 0)


def test_the_sft_checkpoint_syncs_into_vllm_with_a_new_policy_version(vllm_server, tmp_path, restore_weights):
    cfg = sft_config(tmp_path, vllm_server.model_dir, sync="reload", vllm_url=vllm_server.url,
                     served_model_name=vllm_server.model_name, sft_epochs=1)
    hosted_store(cfg.data_dir)

    summary = sft.run(cfg)

    assert summary["train/sft/policy_version"] == 1 and summary["train/sft/sync_seconds"] > 0
    (diff,) = store.connect(cfg.data_dir).execute("SELECT sync_max_abs_logprob_diff FROM train_steps").fetchone()
    assert diff < 1e-4
    published = store.policy.read(cfg.data_dir)
    assert published.version == 1 and Path(published.path).name == "v000001"


def test_the_command_prints_its_summary_and_fails_when_nothing_is_trainable(tmp_path, tiny_model):
    import subprocess
    import sys

    hosted_store(tmp_path / "data")
    base = [sys.executable, "-m", "lightspan.cli", "train", "--algo", "sft", "--data-dir", str(tmp_path / "data"),
            "--model", str(tiny_model), "--sync", "none", "--metrics-port", "0", "--torch-threads", "1"]

    done = subprocess.run(base + ["--select", "human_reward >= 1"], capture_output=True, text=True, timeout=600)
    nothing = subprocess.run(base + ["--select", "human_reward < 0"], capture_output=True, text=True, timeout=600)
    bad = subprocess.run(base + ["--mode", "continuous"], capture_output=True, text=True, timeout=600)

    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["train/sft/examples"] == 4 and summary["train/sft/policy_version"] == 1
    assert nothing.returncode == 1 and json.loads(nothing.stdout)["train/sft/calls_selected"] == 0
    assert bad.returncode == 2 and "trainer.mode" in bad.stderr


def test_calls_render_with_the_template_vllm_serves(tmp_path, tiny_model, capsys):
    from lightspan.cli import main

    # a model whose own template drops tools: lightspan vllm serves it wrapped to render them
    model = shutil.copytree(tiny_model, tmp_path / "plain-model")
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML_TEMPLATE}))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    data = tmp_path / "data"
    inputs, outputs = captured([{"role": "user", "content": "Weather in Oslo?"}], None,
                               tool_calls=[("weather", {"city": "Oslo"})])
    rows = [span_row("d" * 32, "chat gpt-hosted", 0, operation_name="chat", input_messages=inputs,
                     output_messages=outputs, attributes=[("gen_ai.tool.definitions", json.dumps(json.dumps([WEATHER])))])]
    store.write_table(data, "spans", pa.Table.from_pylist(rows, schema=store.SPAN_SCHEMA), partition="date=2026-12-04")
    template_file = tmp_path / "served.jinja"
    template_file.write_text(TOOLS_TEMPLATE)
    args = dict(select="true", val_select="", sft_epochs=1)

    own = sft.run(sft_config(tmp_path, model, output_dir=str(tmp_path / "a"), **args))
    given = sft.run(sft_config(tmp_path, model, output_dir=str(tmp_path / "b"), chat_template=str(template_file), **args))
    code = main(["train", "--algo", "sft", "--data-dir", str(data), "--model", str(model), "--sync", "none",
                 "--select", "true", "--val-select", "", "--output-dir", str(tmp_path / "c"), "--metrics-port", "0"])

    assert own["train/sft/unrenderable/template_drops_tools"] == 1 and own["train/sft/examples"] == 0
    assert given["train/sft/examples"] == 1
    assert code == 0 and json.loads(capsys.readouterr().out.splitlines()[-1])["train/sft/examples"] == 1
