"""Per-rollout output: multi-turn prefix merging, loss masks, mismatch kinds, and the trainer
honouring the masks (lightningrl/sequences.py, the per_rollout path of assignment.py, trainer collate)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightspan import store
from lightspan.lightningrl import assignment, sequences
from lightspan.lightningrl.config import OUTPUTS
from lightspan.lightningrl.sequences import classify_mismatch, merge
from lightspan.trainer.batches import collate
from lightspan.trainer.loss import policy_loss, token_logprobs
from tests.lightningrl.helpers import EPS, build, call, reward, runner, write

EOS, NL = 99, 98       # <|im_end|> and "\n" of a made-up chat template


# --- mismatch kinds, by hand ------------------------------------------------------------------

P = [1, 2, 3]
C = [10, 11, 12, 13, 14, 15, EOS]


@pytest.mark.parametrize("name, next_prompt, kind", [
    ("trailing im_end missing", P + C[:-1] + [NL, 50, 51], "chat_template"),
    ("im_end re-rendered as another token", P + C[:-1] + [97, NL, 50], "chat_template"),
    ("template tokens inserted before the turn", P + [40, 41] + C + [50], "chat_template"),
    ("reasoning block stripped", P + C[4:] + [NL, 50, 51], "chat_template"),
    ("space dropped at the end", P + C[:-2] + [EOS, NL, 50], "chat_template"),
    ("two tokens merged inside", P + [10, 11, 77, 14, 15, EOS, NL, 50], "retokenization"),
    ("one token split inside", P + [10, 11, 12, 70, 71, 14, 15, EOS, 50], "retokenization"),
    ("history rewritten", [1, 9, 3] + C + [50], "compaction"),
    ("history truncated", [2, 3] + C + [50], "compaction"),
    ("history summarised: shorter than before", [1, 80, 50], "compaction"),
    ("a middle part dropped", [1, 3] + C + [50], "compaction"),
    ("completion replaced", P + [60, 61, 62, 63, 64, 65, 66, 67], "tool_text"),
    ("tool call re-rendered as the harness's own text", P + [70, 71, 72, 73, 10, 74, 75, 76], "tool_text"),
])
def test_classify_mismatch(name, next_prompt, kind):
    assert classify_mismatch(np.array(P), np.array(C), np.array(next_prompt)) == kind, name


def test_doubled_im_end_in_the_completion_is_the_template():
    completion = [10, 11, 12, 13, EOS, EOS]                  # the template renders one im_end
    assert classify_mismatch(np.array(P), np.array(completion), np.array(P + completion[:-1] + [NL, 50])) \
        == "chat_template"


# a rendered chat: system, user, then the generation prompt <|im_start|> assistant \n (5 6 7)
GEN = [5, 6, 7]
CHAT = [1, 20, 21, 4, NL, 5, 30, 31, 32, 4, NL] + GEN


@pytest.mark.parametrize("name, next_prompt, kind", [
    # mini-swe-agent: the reply could not be parsed, so it is left out and a user turn follows
    ("reply left out, a user turn after", CHAT[:-len(GEN)] + [5, 33, 40, 41, 4, NL] + GEN, "reply_dropped"),
    ("reply left out, the same generation prompt only", CHAT[:-len(GEN)] + [5, 30, 42, 4, NL] + GEN, "reply_dropped"),
    ("the user turn before the reply rewritten", CHAT[:6] + [39, 31, 32, 4, NL] + GEN + C + [NL] + GEN, "compaction"),
    ("history truncated before the reply", CHAT[5:] + C + [NL] + GEN, "compaction"),
    ("ends differently: no generation prompt in common", CHAT[:-len(GEN)] + [5, 33, 40], "compaction"),
])
def test_a_reply_left_out_of_the_history_is_told_from_compaction(name, next_prompt, kind):
    assert classify_mismatch(np.array(CHAT), np.array(C), np.array(next_prompt)) == kind, name


def test_mismatch_kinds_and_output_modes_are_closed_sets():
    assert sequences.MISMATCH_KINDS == ("compaction", "chat_template", "retokenization", "tool_text", "reply_dropped")
    assert tuple(assignment.OUTPUTS) == OUTPUTS == ("per_call", "per_rollout")


# --- merged sequences end to end, by hand ------------------------------------------------------

def _multi_turn_rollouts():
    """a: three turns that extend each other; b, c, d: call 1 breaks the prefix (template,
    retokenisation, history rewritten). Rewards a 1, b 0, c 0.5, d 0.5: one group."""
    a = [call("a", 0, 10, prompt=P, completion=[10, 11, EOS], logprobs=[-0.1, -0.2, -0.3], version=5),
         call("a", 20, 30, prompt=P + [10, 11, EOS, 50, 51], completion=[12, EOS], logprobs=[-0.4, -0.5],
              version=3),
         call("a", 40, 50, prompt=P + [10, 11, EOS, 50, 51, 12, EOS, 60], completion=[13], logprobs=[-0.6],
              version=4),
         reward("a", 60, 1.0), runner("a", 70)]
    b = [call("b", 0, 10, prompt=P, completion=[20, 21, 22, EOS]),
         call("b", 20, 30, prompt=P + [20, 21, 22, 50, 51], completion=[23, EOS]),   # im_end missing
         reward("b", 60, 0.0), runner("b", 70)]
    c = [call("c", 0, 10, prompt=P, completion=[30, 31, 32, 33, 34, 35, EOS]),
         call("c", 20, 30, prompt=P + [30, 31, 77, 34, 35, EOS, 50], completion=[36]),   # 32 33 -> 77
         reward("c", 60, 0.5), runner("c", 70)]
    d = [call("d", 0, 10, prompt=P, completion=[40, EOS]),
         call("d", 20, 30, prompt=[1, 9, 3, 40, EOS, 50], completion=[41]),            # history changed
         reward("d", 60, 0.5), runner("d", 70)]
    return a + b + c + d


def test_per_rollout_merges_matching_turns_by_hand(tmp_path):
    write(tmp_path, _multi_turn_rollouts())
    table, m = build(tmp_path, output="per_rollout")
    assert table.schema == store.TRANSITION_SCHEMA
    rows = sorted(table.to_pylist(), key=lambda r: (r["rollout_id"], r["call_index"]))
    got = [(r["rollout_id"], r["call_index"], r["num_calls"], r["prompt_token_ids"], r["completion_token_ids"],
            r["completion_mask"]) for r in rows]
    assert got == [
        ("a", 0, 3, P, [10, 11, EOS, 50, 51, 12, EOS, 60, 13], [1, 1, 1, 0, 0, 1, 1, 0, 1]),
        ("b", 0, 2, P, [20, 21, 22, EOS], [1, 1, 1, 1]),
        ("b", 1, 2, P + [20, 21, 22, 50, 51], [23, EOS], [1, 1]),
        ("c", 0, 2, P, [30, 31, 32, 33, 34, 35, EOS], [1] * 7),
        ("c", 1, 2, P + [30, 31, 77, 34, 35, EOS, 50], [36], [1]),
        ("d", 0, 2, P, [40, EOS], [1, 1]),
        ("d", 1, 2, [1, 9, 3, 40, EOS, 50], [41], [1]),
    ]
    a = rows[0]
    assert a["completion_logprobs"] == pytest.approx([-0.1, -0.2, -0.3, 0, 0, -0.4, -0.5, 0, -0.6])
    assert a["model_version"] == 3                       # the oldest policy that wrote it
    assert a["transition_id"] == "a/" + a["transition_id"].split("/")[1]
    # identical credit, GRPO over [1, 0, 0.5, 0.5]: mean 0.5, population std sqrt(1/8)
    s = np.sqrt(1 / 8)
    adv = {r["rollout_id"]: r["advantage"] for r in rows}
    assert adv == pytest.approx({"a": 0.5 / (s + EPS), "b": -0.5 / (s + EPS), "c": 0.0, "d": 0.0})
    assert all(r["credit"] == r["reward"] for r in rows)
    assert m["transitions/sequences"] == 7 and m["transitions/calls"] == 9 and m["transitions/rollouts"] == 4
    assert {k.rsplit("/", 1)[1]: v for k, v in m.items() if "prefix_mismatch" in k} == {
        "compaction": 1, "chat_template": 1, "retokenization": 1, "tool_text": 0, "reply_dropped": 0}
    # each row's segment of its rollout and the mismatch that started it
    assert [(r["rollout_id"], r["segment"], r["segment_cause"], r["rollout_rows"]) for r in rows] == [
        ("a", 0, None, 1), ("b", 0, None, 2), ("b", 1, "chat_template", 2), ("c", 0, None, 2),
        ("c", 1, "retokenization", 2), ("d", 0, None, 2), ("d", 1, "compaction", 2)]
    assert m["transitions/rows_per_rollout_mean"] == pytest.approx(7 / 4)
    assert m["transitions/rows_per_rollout_max"] == 2 and m["transitions/merge_rate"] == pytest.approx(1 / 4)
    assert m["transitions/masked_tokens"] == 3
    assert m["transitions/completion_tokens"] == sum(sum(r["completion_mask"]) for r in rows)


def test_per_call_output_has_no_mask(tmp_path):
    write(tmp_path, _multi_turn_rollouts())
    table, m = build(tmp_path)
    assert table.num_rows == m["transitions/sequences"] == m["transitions/calls"] == 9
    assert table.column("completion_mask").null_count == 9
    assert all(v == 0 for k, v in m.items() if "prefix_mismatch" in k)


def test_each_agent_gets_its_own_sequence(tmp_path):
    # planner and coder take turns over one shared conversation; each merges with its own last call
    rows = [call("a", 0, 10, agent="planner", prompt=[1, 2], completion=[5, EOS]),
            call("a", 20, 30, agent="coder", prompt=[1, 2, 5, EOS, 7], completion=[8, EOS]),
            call("a", 40, 50, agent="planner", prompt=[1, 2, 5, EOS, 7, 8, EOS, 9], completion=[6, EOS]),
            call("a", 60, 70, agent="coder", prompt=[1, 2, 5, EOS, 7, 8, EOS, 9, 6, EOS, 4], completion=[3]),
            reward("a", 80, 1.0), runner("a", 90)]
    rows += [call("b", 0, 10, agent="coder", prompt=[1, 2], completion=[5]), reward("b", 20, 0.0), runner("b", 25)]
    write(tmp_path, rows)
    table, m = build(tmp_path, output="per_rollout")
    got = {(r["rollout_id"], r["agent_name"]): (r["prompt_token_ids"], r["completion_token_ids"], r["completion_mask"])
           for r in table.to_pylist()}
    assert got == {
        ("a", "planner"): ([1, 2], [5, EOS, 7, 8, EOS, 9, 6, EOS], [1, 1, 0, 0, 0, 0, 1, 1]),
        ("a", "coder"): ([1, 2, 5, EOS, 7], [8, EOS, 9, 6, EOS, 4, 3], [1, 1, 0, 0, 0, 0, 1]),
        ("b", "coder"): ([1, 2], [5], [1]),
    }
    coder, m = build(tmp_path, output="per_rollout", agent_match="^coder$")
    assert {(r["rollout_id"], r["agent_name"]) for r in coder.to_pylist()} == {("a", "coder"), ("b", "coder")}
    assert m["transitions/dropped_calls/agent_mismatch"] == 2 and m["transitions/calls"] == 3


def test_discounted_sequence_gets_the_return_from_its_first_call(tmp_path):
    # a: call 1 does not extend call 0 (history rewritten) -> two sequences. Rewards 0.2 after
    # call 0 and 1.0 at the end, γ = 1: G = [1.2, 1.0]; b: G_0 = 0.6. Dr. GRPO baseline 0.9.
    a = [call("a", 0, 10, prompt=[1, 2], completion=[5]), reward("a", 15, 0.2),
         call("a", 20, 30, prompt=[3, 4], completion=[6]), reward("a", 40, 1.0), runner("a", 50)]
    write(tmp_path, a + [call("b", 0, 10), reward("b", 20, 0.6), runner("b", 25)])
    table, m = build(tmp_path, output="per_rollout", credit="discounted", advantage="dr_grpo")
    got = {(r["rollout_id"], r["call_index"]): (r["credit"], r["advantage"], r["reward"]) for r in table.to_pylist()}
    assert got == {("a", 0): pytest.approx((1.2, 0.3, 1.0)), ("a", 1): pytest.approx((1.0, 0.1, 1.0)),
                   ("b", 0): pytest.approx((0.6, -0.3, 0.6))}
    assert m["transitions/prefix_mismatch/compaction"] == 1


def test_turns_read_from_different_files_still_merge(tmp_path):
    rows = _multi_turn_rollouts()
    write(tmp_path, rows[::2])
    write(tmp_path, rows[1::2])
    split_files, m = build(tmp_path, output="per_rollout")
    assert m["transitions/token_files_read"] == 2
    one = tmp_path / "one"
    write(one, rows)
    one_file, _ = build(one, output="per_rollout")
    def strip(table):
        rows = ({k: v for k, v in r.items() if k != "build_id"} for r in table.to_pylist())
        return sorted(rows, key=lambda r: (r["rollout_id"], r["call_index"]))

    assert strip(split_files) == strip(one_file)


# --- merge as a property ----------------------------------------------------------------------

chain_st = st.lists(st.tuples(st.lists(st.integers(0, 50), min_size=0, max_size=4),    # the turn before
                              st.lists(st.integers(0, 50), min_size=1, max_size=4)),   # the completion
                    min_size=1, max_size=5)


def _lists(rows, typ):
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    values = np.array([v for r in rows for v in r], dtype=typ)
    return offsets, values if len(values) else np.zeros(1, typ)


@settings(max_examples=50, deadline=None)
@given(first=st.lists(st.integers(0, 50), min_size=1, max_size=4), turns=chain_st)
def test_a_chain_of_extending_prompts_is_one_sequence(first, turns):
    prompts, completions, logprobs, sequence = [], [], [], list(first)
    for i, (turn, completion) in enumerate(turns):
        sequence += turn if i else []
        prompts.append(list(sequence))
        completions.append(completion)
        logprobs.append([-(i + 1) - j / 10 for j in range(len(completion))])
        sequence += completion
    n = len(turns)
    m = merge([_lists(prompts, np.int32)], [_lists(completions, np.int32)], [_lists(logprobs, np.float32)],
              np.array([0, n]), np.arange(n), np.zeros(n, dtype=np.int64))
    assert list(m.first) == [0] and list(m.num_calls) == [n]
    assert list(first) + m.tokens.tolist() == prompts[-1] + completions[-1]    # the whole episode
    assert int(m.mask.sum()) == sum(map(len, completions))
    np.testing.assert_allclose(m.logprobs[m.mask == 1], np.concatenate(logprobs), rtol=1e-6)
    assert np.all(m.logprobs[m.mask == 0] == 0)
    assert m.mismatches == dict.fromkeys(sequences.MISMATCH_KINDS, 0)


# --- the trainer honours the mask -------------------------------------------------------------

class _Logits(torch.nn.Module):
    """A 'model' whose logits are one parameter: its gradient shows which positions the loss uses."""

    def __init__(self, batch, length, vocab=120):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.randn(batch, length, vocab, generator=torch.Generator().manual_seed(0)))

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep):
        return SimpleNamespace(logits=self.logits[:, -logits_to_keep:, :])


def test_collate_keeps_masked_tokens_in_attention_and_out_of_the_loss():
    rows = [{"prompt_token_ids": [1, 2, 3], "completion_token_ids": [10, 11, 50, 51, 12],
             "completion_logprobs": [-1.0, -1.0, 0.0, 0.0, -1.0], "completion_mask": [1, 1, 0, 0, 1],
             "advantage": 1.0},
            {"prompt_token_ids": [4], "completion_token_ids": [13, 14], "completion_logprobs": [-1.0, -1.0],
             "completion_mask": None, "advantage": -1.0}]
    mb = collate(rows, pad_id=0)
    assert mb.completion_mask.tolist() == [[1, 1, 0, 0, 1], [1, 1, 0, 0, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0, 0, 0]]
    assert mb.input_ids[0, -5:].tolist() == [10, 11, 50, 51, 12]

    model = _Logits(*mb.input_ids.shape)
    logprobs, _ = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.completion_mask)
    loss, metrics = policy_loss(logprobs, logprobs.detach(), mb.advantages, mb.completion_mask,
                                loss_type="grpo", epsilon=0.2, epsilon_high=0.2,
                                behaviour_logprobs=mb.behaviour_logprobs)
    loss.backward()
    # completion token j is predicted at position L - C - 1 + j (C = 5, L = 8)
    grad = model.logits.grad.abs().sum(-1)[:, 2:7]
    assert grad[0].tolist()[2:4] == [0.0, 0.0]                  # tool-output tokens: no gradient
    assert all(g > 0 for g in grad[0].tolist()[:2] + grad[0].tolist()[4:])
    assert all(g > 0 for g in grad[1].tolist()[:2])             # no mask: every token trained
    assert metrics["num_tokens"] == 5


def test_trainer_reads_the_builders_masks(tmp_path):
    from lightspan.trainer.config import TrainerConfig
    from lightspan.trainer.loop import Trainer

    write(tmp_path, _multi_turn_rollouts())
    table, _ = build(tmp_path, output="per_rollout", advantage="dr_grpo")
    store.write_table(tmp_path, "transitions", table)
    trainer = Trainer(TrainerConfig(data_dir=str(tmp_path), model="unused", sync="none", max_staleness=10**6))
    trainer.model = torch.nn.Module()         # next_batch reads only the model's config
    trainer.model.config = SimpleNamespace(vocab_size=128, max_position_embeddings=4096)
    batch = trainer.next_batch()
    a = next(r for r in batch.rows if r["rollout_id"] == "a")
    assert a["completion_mask"] == [1, 1, 1, 0, 0, 1, 1, 0, 1]
    mb = collate([a], pad_id=0)
    assert mb.completion_mask[0].tolist() == a["completion_mask"]
    assert batch.skipped_malformed == 0
    assert len(batch.rows) == 3                 # c and d have advantage 0: no gradient, left out


def test_a_call_left_out_becomes_context(tmp_path):
    # call 1 ran out of tokens and drop_truncated leaves it out: call 2 extends call 0's sequence,
    # and call 1's completion is in it with mask 0, like the tool turns around it
    a = [call("a", 0, 10, prompt=[1], completion=[10, EOS]),
         call("a", 20, 30, prompt=[1, 10, EOS, 50], completion=[11, 12], finish="length"),
         call("a", 40, 50, prompt=[1, 10, EOS, 50, 11, 12, 60], completion=[13, EOS]),
         reward("a", 60, 1.0), runner("a", 70)]
    write(tmp_path, a + [call("b", 0, 10), reward("b", 20, 0.0), runner("b", 25)])
    table, m = build(tmp_path, output="per_rollout", drop_truncated=True)
    (row,) = [r for r in table.to_pylist() if r["rollout_id"] == "a"]
    assert row["completion_token_ids"] == [10, EOS, 50, 11, 12, 60, 13, EOS]
    assert row["completion_mask"] == [1, 1, 0, 0, 0, 0, 1, 1]
    assert row["num_calls"] == 2 and m["transitions/dropped_calls/truncated"] == 1
