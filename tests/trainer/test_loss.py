"""The loss functions on tiny hand-computed tensors (trainer/loss.py)."""

import math

import pytest
import torch

from lightspan.trainer.loss import AGGREGATIONS, BatchTotals, is_weight, k3_kl, policy_loss, token_logprobs

torch.set_num_threads(1)

EPS, EPS_HIGH = 0.2, 0.28
# two completions: 2 tokens (third is padding) and 3 tokens
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
ADV = torch.tensor([1.0, -2.0])
# ratios r = pi / pi_old; the padded position gets a wild ratio that must not count
RATIO = torch.tensor([[1.1, 1.5, 5.0], [0.5, 1.0, 1.3]])
# per-token -min(r A, clip(r, 0.8, 1.28) A):
#   A = +1: r 1.1 -> -1.1;  r 1.5 -> -1.28 (clipped high)
#   A = -2: r 0.5 -> 2 * 0.8 = 1.6 (clipped low);  r 1.0 -> 2.0;  r 1.3 -> 2 * 1.3 = 2.6 (upper clip
#           does not bind on a negative advantage)
EXPECTED = {
    "grpo": ((-1.1 - 1.28) / 2 + (1.6 + 2.0 + 2.6) / 3) / 2,   # per-sequence means, then mean
    "dapo": (-1.1 - 1.28 + 1.6 + 2.0 + 2.6) / 5,                # all tokens equal
    "dr_grpo": (-1.1 - 1.28 + 1.6 + 2.0 + 2.6) / (2 * 3),       # sequences x longest completion
}


def _loss(loss_type, ratio=RATIO, **kwargs):
    old = torch.log(torch.tensor([[0.3, 0.2, 0.1], [0.4, 0.25, 0.5]]))
    logprobs = (old + torch.log(ratio)).requires_grad_()
    loss, metrics = policy_loss(logprobs, old, ADV, MASK, loss_type=loss_type, epsilon=EPS,
                                epsilon_high=EPS_HIGH, **kwargs)
    return loss, metrics, logprobs


@pytest.mark.parametrize("loss_type", sorted(EXPECTED))
def test_loss_value_per_loss_type(loss_type):
    loss, metrics, _ = _loss(loss_type, is_correction="none")
    assert loss.item() == pytest.approx(EXPECTED[loss_type], abs=1e-6)
    assert metrics["clip_ratio"] == pytest.approx(2 / 5)        # one high, one low, of 5 tokens
    assert metrics["clip_ratio_high"] == pytest.approx(1 / 5)
    assert metrics["clip_ratio_low"] == pytest.approx(1 / 5)
    assert metrics["num_tokens"] == 5


def test_clipped_tokens_get_no_gradient():
    # d loss / d logprob = d loss / d r * r; dapo: -A r / T where unclipped, 0 where clipped
    loss, _, logprobs = _loss("dapo", is_correction="none")
    loss.backward()
    expected = torch.tensor([[-1.1 / 5, 0.0, 0.0], [0.0, 2.0 * 1.0 / 5, 2.0 * 1.3 / 5]])
    assert torch.allclose(logprobs.grad, expected, atol=1e-6)


def test_positive_advantage_below_the_lower_clip_still_learns():
    # r = 0.5 < 1 - eps with A > 0: min picks r A (unclipped), so the gradient pushes it up
    ratio = torch.tensor([[0.5, 1.0, 1.0], [1.0, 1.0, 1.0]])
    loss, metrics, logprobs = _loss("dapo", ratio=ratio, is_correction="none")
    loss.backward()
    assert logprobs.grad[0, 0].item() == pytest.approx(-1.0 * 0.5 / 5)
    assert metrics["clip_ratio"] == 0


def test_truncated_importance_sampling():
    old = torch.log(torch.tensor([[0.3, 0.2]]))
    # pi_old / pi_vllm = 3.0 (truncated to the cap 2.0) and 0.5
    behaviour = old - torch.log(torch.tensor([[3.0, 0.5]]))
    weight, raw = is_weight(old, behaviour, torch.ones(1, 2), mode="token_truncate", cap=2.0)   # Yao et al. 2025
    assert torch.allclose(weight, torch.tensor([[2.0, 0.5]]))
    assert torch.allclose(raw, torch.tensor([[3.0, 0.5]]))
    mask, adv = torch.ones(1, 2), torch.tensor([1.0])
    kw = dict(loss_type="dapo", epsilon=EPS, epsilon_high=EPS_HIGH, is_cap=2.0)
    loss, metrics = policy_loss(old.clone(), old, adv, mask, behaviour_logprobs=behaviour, **kw)
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2)         # ratio 1, weights 2.0 and 0.5
    assert metrics["is_ratio_mean"] == pytest.approx(1.25)
    assert metrics["is_truncated"] == pytest.approx(0.5)
    assert metrics["is_ratio_max"] == pytest.approx(3.0)
    loss, metrics = policy_loss(old.clone(), old, adv, mask, behaviour_logprobs=behaviour,
                                is_correction="none", **kw)
    assert loss.item() == pytest.approx(-1.0)
    assert metrics["is_ratio_mean"] == 1.0


def test_k3_kl_and_beta():
    logprobs = torch.log(torch.tensor([[0.25]]))
    ref = torch.log(torch.tensor([[0.5]]))                           # pi_ref / pi = 2
    assert k3_kl(logprobs, ref).item() == pytest.approx(2 - math.log(2) - 1)
    loss, metrics = policy_loss(logprobs, logprobs, torch.tensor([0.0]), torch.ones(1, 1), loss_type="dapo",
                                epsilon=EPS, epsilon_high=EPS_HIGH, ref_logprobs=ref, beta=0.1)
    assert loss.item() == pytest.approx(0.1 * (1 - math.log(2)))
    assert metrics["kl"] == pytest.approx(1 - math.log(2))


@pytest.mark.parametrize("loss_type", sorted(AGGREGATIONS))
def test_micro_batches_sum_to_the_full_batch_loss(loss_type):
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    old = -torch.rand(4, 4) * 3
    logprobs = old + 0.3 * torch.randn(4, 4)
    behaviour = old + 0.2 * torch.randn(4, 4)
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2])
    kw = dict(loss_type=loss_type, epsilon=EPS, epsilon_high=EPS_HIGH, is_cap=2.0)
    full, _ = policy_loss(logprobs, old, adv, mask, behaviour_logprobs=behaviour, **kw)
    totals = BatchTotals.of(mask)
    # a micro-batch is padded only to its own longest completion
    parts = [policy_loss(logprobs[s, :w], old[s, :w], adv[s], mask[s, :w], behaviour_logprobs=behaviour[s, :w],
                         totals=totals, **kw)[0] for s, w in ((slice(0, 2), 3), (slice(2, 4), 4))]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), abs=1e-6)


def test_token_logprobs_with_padding_match_one_sequence_at_a_time(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    seqs = [([5, 6, 7], [8, 9]), ([10], [11, 12, 13, 14])]
    input_ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 0, 0], [0, 0, 0, 0, 10, 11, 12, 13, 14]])  # 0 = padding
    attention = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    with torch.no_grad():
        logprobs, entropy = token_logprobs(model, input_ids, attention, completion_mask)
        for i, (prompt, completion) in enumerate(seqs):
            full = torch.tensor([prompt + completion])
            logits = model(full).logits[0].log_softmax(-1)
            for j, tok in enumerate(completion):
                pos = len(prompt) + j
                assert logprobs[i, j].item() == pytest.approx(logits[pos - 1, tok].item(), abs=1e-5)
                h = -(logits[pos - 1].exp() * logits[pos - 1]).sum()
                assert entropy[i, j].item() == pytest.approx(h.item(), abs=1e-5)
    assert logprobs[0, 2:].abs().sum() == 0 and entropy[0, 2:].abs().sum() == 0


def test_token_logprobs_are_those_of_the_tempered_policy():
    """vLLM's processed logprobs are log softmax(z / T): the trainer must temper the same way."""
    import torch

    from lightspan.trainer.loss import token_logprobs

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)

    class Fixed(torch.nn.Module):
        def forward(self, input_ids, attention_mask, position_ids, logits_to_keep):
            return type("Out", (), {"logits": logits[:, -logits_to_keep:]})()

    ids = torch.randint(0, 7, (2, 5))
    mask = torch.ones(2, 3, dtype=torch.long)
    temps = torch.tensor([0.5, 1.0])
    got, _ = token_logprobs(Fixed(), ids, torch.ones_like(ids), mask, temps)
    for b, t in enumerate(temps):
        expected = torch.log_softmax(logits[b, 1:4] / t, -1).gather(-1, ids[b, 2:5, None])[:, 0]
        assert torch.allclose(got[b], expected, atol=1e-6)
    untempered, _ = token_logprobs(Fixed(), ids, torch.ones_like(ids), mask)
    assert not torch.allclose(got[0], untempered[0])


def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient():
    # MiniMax-M1 eq. 4: -sg(min(r, 1 + eps_high)) A log pi, token-level (/ 5 tokens), no lower bound
    loss, metrics, logprobs = _loss("cispo", is_correction="none")
    # log pi = log(pi_old r): 0.3 x 1.1, 0.2 x 1.5, 0.4 x 0.5, 0.25 x 1.0, 0.5 x 1.3
    # weights min(r, 1.28): 1.1, 1.28, 0.5, 1.0, 1.28
    expected = -(1.1 * 1 * math.log(0.33) + 1.28 * 1 * math.log(0.3) + 0.5 * -2 * math.log(0.2)
                 + 1.0 * -2 * math.log(0.25) + 1.28 * -2 * math.log(0.65)) / 5
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    # d loss / d log pi = -w A / 5: the clipped tokens (r 1.5 and 1.3) keep a gradient, unlike PPO's clip
    grad = torch.tensor([[-1.1 / 5, -1.28 / 5, 0.0], [0.5 * 2 / 5, 1.0 * 2 / 5, 1.28 * 2 / 5]])
    assert torch.allclose(logprobs.grad, grad, atol=1e-6)
    assert metrics["clip_ratio"] == pytest.approx(2 / 5) and metrics["clip_ratio_high"] == pytest.approx(2 / 5)
    assert metrics["clip_ratio_low"] == 0


def test_cispo_with_one_pass_has_dapos_gradient():
    old = torch.log(torch.tensor([[0.3, 0.2, 0.1], [0.4, 0.25, 0.5]]))
    grads = {}
    for loss_type in ("cispo", "dapo"):
        logprobs = old.clone().requires_grad_()
        loss, _ = policy_loss(logprobs, old, ADV, MASK, loss_type=loss_type, epsilon=EPS, epsilon_high=EPS_HIGH,
                              is_correction="none")
        loss.backward()
        grads[loss_type] = logprobs.grad
    assert torch.allclose(grads["cispo"], grads["dapo"]) and grads["cispo"].abs().sum() > 0


# pi_old / pi_vllm per token: 3.0 and 0.5 on the trained tokens; the padded third token's
# behaviour logprob is wild and must count nowhere (not even in the sequence's product)
IS_OLD = torch.log(torch.tensor([[0.3, 0.2, 0.5]]))
IS_BEHAVIOUR = IS_OLD - torch.log(torch.tensor([[3.0, 0.5, 100.0]]))
IS_MASK = torch.tensor([[1.0, 1.0, 0.0]])


@pytest.mark.parametrize("mode, cap, floor, expected", [
    ("token_truncate", 2.0, 0.0, [2.0, 0.5]),       # min(rho, C)
    ("token_truncate", 2.0, 0.6, [2.0, 0.6]),       # and raised to C_min
    ("token_mask", 2.0, 0.0, [0.0, 0.5]),           # 3.0 > C: dropped
    ("token_mask", 2.0, 0.6, [0.0, 0.0]),           # 0.5 < C_min: dropped too
    ("sequence_truncate", 2.0, 0.0, [1.5, 1.5]),    # rho = 3.0 x 0.5 = 1.5 on every token
    ("sequence_truncate", 1.2, 0.0, [1.2, 1.2]),
    ("sequence_mask", 2.0, 0.0, [1.5, 1.5]),
    ("sequence_mask", 1.2, 0.0, [0.0, 0.0]),        # the whole sequence dropped
])
def test_importance_sampling_modes(mode, cap, floor, expected):
    weight, raw = is_weight(IS_OLD, IS_BEHAVIOUR, IS_MASK, mode=mode, cap=cap, floor=floor)
    assert torch.allclose(weight[0, :2], torch.tensor(expected), atol=1e-6)
    assert torch.allclose(raw[0, :2], torch.tensor([1.5, 1.5] if mode.startswith("sequence") else [3.0, 0.5]))
    # through the loss: ratio 1 and A = 1, so the dapo loss is -mean(w) over the 2 trained tokens
    loss, metrics = policy_loss(IS_OLD.clone(), IS_OLD, torch.tensor([1.0]), IS_MASK, loss_type="dapo",
                                epsilon=EPS, epsilon_high=EPS_HIGH, behaviour_logprobs=IS_BEHAVIOUR,
                                is_correction=mode, is_cap=cap, is_floor=floor)
    assert loss.item() == pytest.approx(-sum(expected) / 2, abs=1e-6)
    assert metrics["is_ratio_mean"] == pytest.approx(sum(expected) / 2, abs=1e-6)
    changed = [w != r for w, r in zip(expected, raw[0, :2].tolist())]
    assert metrics["is_truncated"] == pytest.approx(sum(changed) / 2)


def test_unknown_importance_sampling_mode_fails():
    with pytest.raises(ValueError, match="importance sampling mode"):
        is_weight(IS_OLD, IS_BEHAVIOUR, IS_MASK, mode="token_clip", cap=2.0)


def test_the_trainer_passes_the_objective_options_through(tmp_path, tiny_model):
    """cispo, sequence-level masking and is_floor reach the loss from the config (trainer/loop.py)."""
    import pyarrow as pa

    from lightspan import store
    from lightspan.trainer.config import TrainerConfig
    from lightspan.trainer.loop import Trainer

    def rows(logprob):
        return [{"transition_id": f"t{i}", "rollout_id": f"r{i}", "task_id": "t", "prompt_token_ids": [60, 61, 62],
                 "completion_token_ids": [65 + i, 66, 67], "completion_logprobs": [logprob] * 3, "model_version": 0,
                 "reward": float(i % 2), "advantage": 1.0 if i % 2 else -1.0, "created_unix_nano": 1}
                for i in range(4)]

    def step(name, logprob, **kwargs):
        cfg = TrainerConfig(model=str(tiny_model), data_dir=str(tmp_path / name), sync="none", torch_threads=1,
                            learning_rate=1e-2, metrics_port=0, **kwargs)
        store.write_table(cfg.data_dir, "transitions", pa.Table.from_pylist(rows(logprob), schema=store.TRANSITION_SCHEMA))
        trainer = Trainer(cfg)
        trainer.load_or_init()
        before = [p.detach().clone() for p in trainer.model.parameters()]
        row = trainer.train_once()
        moved = any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
        return row, moved

    # the tiny model is near uniform over 260 tokens (log pi ~ -5.56): vLLM's -2.0 makes every
    # token's rho ~ e^-3.6 and each sequence's ~ e^-10.7, below the floor 0.5: all masked
    row, moved = step("masked", -2.0, loss_type="cispo", is_correction="sequence_mask", is_floor=0.5)
    assert row["is_ratio_mean"] == 0 and row["loss"] == 0 and not moved
    row, moved = step("truncated", -2.0, loss_type="cispo", is_correction="sequence_truncate", is_floor=0.5)
    assert row["is_ratio_mean"] == pytest.approx(0.5) and row["loss"] != 0 and moved


@pytest.mark.parametrize("loss_type", sorted(AGGREGATIONS))
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_recorded_logprob_at_a_masked_position_cannot_poison_the_loss(loss_type, mode, bad):
    # MASK's padded position (completion 0, token 2) holds a logprob vLLM never sampled there
    p = torch.tensor([[0.3, 0.2, 0.5], [0.1, 0.4, 0.6]])
    behaviour = torch.log(p) - 0.1                  # rho = e^0.1 a token, e^0.3 a sequence: inside [0, 2]
    poisoned = behaviour.clone()
    poisoned[0, 2] = bad
    kw = dict(loss_type=loss_type, epsilon=EPS, epsilon_high=EPS_HIGH, is_correction=mode, is_cap=2.0)
    results = []
    for recorded in (behaviour, poisoned):
        logprobs = torch.log(p).requires_grad_()
        loss, metrics = policy_loss(logprobs, logprobs.detach(), ADV, MASK, behaviour_logprobs=recorded, **kw)
        loss.backward()
        results.append((loss, metrics, logprobs.grad))
    (clean, clean_metrics, clean_grad), (loss, metrics, grad) = results
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert loss.item() == pytest.approx(clean.item()) and torch.allclose(grad, clean_grad)
    assert metrics == pytest.approx(clean_metrics)
