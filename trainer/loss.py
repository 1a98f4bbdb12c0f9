"""The GRPO family of clipped policy losses and CISPO, with importance sampling against vLLM.

Papers:
- GRPO: Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), §4.1 eq. 3: the PPO clipped
  surrogate with a group-relative advantage, averaged over each sequence's tokens, then over
  the sequences; KL to a reference with the k3 estimator (eq. 4).
- DAPO: Yu et al. 2025 (arXiv:2503.14476): clip-higher, a larger upper clip range
  epsilon_high (§3.1), and the token-level loss, every token of the batch weighted equally (§3.3).
- Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training" (arXiv:2503.20783), §3.1:
  no per-sequence length normalisation; the sum is divided by a constant.
- CISPO: MiniMax 2025, "MiniMax-M1" (arXiv:2506.13585), §3.1 eq. 4-5: clip the importance
  sampling weight, not the update; the clipped weight carries no gradient and multiplies
  A log pi_theta, so every token keeps a gradient (clipping only bounds its size).
- Truncated importance sampling (TIS): Yao et al. 2025, "Your Efficient RL Framework Secretly
  Brings You Off-Policy RL Training": the sampler's (vLLM's) probabilities differ from the
  trainer's, so each token's loss is weighted by min(pi_old / pi_vllm, C).
- Masked importance sampling (MIS) and its sequence-level forms: Liu, Li et al. 2025, "When
  Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch": drop
  (weight 0) rather than truncate tokens or whole sequences whose ratio leaves [C_min, C];
  the sequence ratio is the product of its tokens' ratios. TRL calls these
  ``vllm_importance_sampling_mode`` ``token_truncate``/``token_mask``/``sequence_*``.

For token t of completion i, with A_i the transition's advantage::

    r_it  = pi_theta(o_it | q_i, o_i<t) / pi_old(o_it | q_i, o_i<t)
    w_it  = min(pi_old(o_it) / pi_vllm(o_it), C)                 (token_truncate, no gradient)
    l_it  = -min(r_it A_i, clip(r_it, 1 - eps, 1 + eps_high) A_i) w_it + beta KL_it
    KL_it = pi_ref / pi_theta - log(pi_ref / pi_theta) - 1                 (k3)

CISPO replaces the clipped surrogate (``loss_type = "cispo"``, token-level aggregation)::

    l_it  = -sg(min(r_it, 1 + eps_high)) A_i log pi_theta(o_it) w_it + beta KL_it

and the loss aggregates l_it per loss type (``AGGREGATIONS``). The IS weight w_it
(``is_correction``) is, with rho_it = pi_old(o_it) / pi_vllm(o_it) and rho_i = prod_t rho_it:
``token_truncate`` clip(rho_it, C_min, C); ``token_mask`` rho_it if C_min <= rho_it <= C else 0;
``sequence_truncate`` clip(rho_i, C_min, C) on every token of i; ``sequence_mask`` rho_i if
C_min <= rho_i <= C else 0; ``none`` 1. C is ``is_cap``, C_min ``is_floor`` (0: no lower bound).

Deviations from the papers:
1. Advantages arrive precomputed, one scalar per transition (rollout-level GRPO in the
   transition builder, ``lightningrl``); nothing here groups or normalises rewards.
2. pi_old is the trainer's own policy at the start of the step. With one pass per batch
   (the default) r_it = 1 and the clip never binds; staleness and the vLLM/trainer mismatch
   are corrected by w_it instead, as TRL does with ``vllm_importance_sampling_correction``.
3. Dr. GRPO's constant is num_sequences x the longest completion of the step, not a
   generation budget: the trainer does not generate, so it has none.
4. Every normaliser counts the whole step's batch (``BatchTotals``), not one micro-batch's,
   so the micro-batch losses sum to the full-batch loss and gradient accumulation is exact.
   The step's zero-advantage sequences carry no gradient and skip the forward pass; whether they
   count in the normaliser is ``zero_advantage``: ``exclude`` (the default, as DAPO's dynamic
   sampling drops such groups: a step moves as far whatever the share of groups with signal) or
   ``count`` (``Batch.zero_totals``, GRPO's 1/G as TRL counts it: a step with one informative
   group in four moves a quarter as far).
5. The clip range is the same for every loss type; epsilon_high = epsilon gives GRPO's
   symmetric clip.
6. The KL reference is the initial model, fixed for the whole run (with LoRA: the base
   model, adapters disabled).
7. The policy optimised is the one that sampled: logits divided by the call's sampling
   temperature, as TRL does. vLLM's processed logprobs also reflect top-k/top-p and penalties,
   which are not reproduced: keep them off in RL rollouts (docs/architecture.md, "Trainer").
8. CISPO's IS-weight clip has no lower bound (MiniMax-M1 §3.1 sets eps_low^IS large and tunes
   only eps_high^IS); its upper bound is 1 + ``epsilon_high``, the same option as the other
   losses' clip (TRL's ``cispo`` instead reads ``epsilon_high`` as the bound itself). Its
   loss value is -A log pi weighted, so it is not comparable with the other losses' values.
   With one pass per batch (r = 1) its gradient equals DAPO's.
9. What a "sequence" is, is a setting (``loss_normalisation``): the transition (each row, as
   the papers have it, one completion each) or the rollout (all its rows in the step's batch
   together). A multi-turn rollout the builder could not merge into one row (compaction,
   re-tokenisation) then weighs as if it were one row: GRPO's per-sequence mean runs over the
   rollout's tokens and the mean over sequences counts rollouts; Dr. GRPO's constant is
   rollouts x the longest rollout (the sum of its rows' completion lengths); DAPO and CISPO,
   token-level, are the same either way. Agent Lightning's ``per_rollout_mean`` divides by rows
   (its issues #593/#594), which makes a split rollout weigh k times. Rows carry a ``loss_weight``
   (the builder's: 0 for a masked rollout's rows); a row of weight 0 is out of every normaliser
   and the loss, as if it were not in the batch (:func:`sequence_totals`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from trl.trainer.utils import entropy_from_logits, selective_log_softmax

from lightspan.trainer.prefix import shared_prefix_logits

Tensor = torch.Tensor


class BatchTotals(NamedTuple):
    """The sizes of a whole step's batch, which every normaliser divides by (deviation 4)."""

    num_sequences: int
    num_tokens: int
    max_completion_length: int

    @classmethod
    def of(cls, completion_mask: Tensor) -> "BatchTotals":
        lengths = completion_mask.sum(-1)
        return cls(int(completion_mask.size(0)), int(lengths.sum()), int(lengths.max()) if lengths.numel() else 0)


NORMALISATIONS = ("transition", "rollout")


def sequence_totals(lengths, trained, rollouts, weights, *, normalisation: str) -> tuple[BatchTotals, list[int]]:
    """The step's :class:`BatchTotals` and each row's sequence size, per ``normalisation`` (deviation 9).

    Per row of the whole batch: ``lengths`` its completion length, ``trained`` the tokens its loss
    trains (its mask's ones), ``rollouts`` its rollout's key, ``weights`` its loss weight (0: out of
    the batch). The sequence size of a row is the trained tokens of its sequence: its own under
    ``transition``, its rollout's rows' together under ``rollout`` (GRPO's per-sequence divisor).
    """
    if normalisation not in NORMALISATIONS:
        raise ValueError(f"unknown loss normalisation {normalisation!r}")
    live = [i for i, w in enumerate(weights) if w != 0]
    num_tokens = sum(trained[i] for i in live)
    if normalisation == "transition":
        sizes = [int(t) for t in trained]
        return BatchTotals(len(live), int(num_tokens), max((int(lengths[i]) for i in live), default=0)), sizes
    tokens: dict = {}
    length: dict = {}
    for i in live:
        tokens[rollouts[i]] = tokens.get(rollouts[i], 0) + int(trained[i])
        length[rollouts[i]] = length.get(rollouts[i], 0) + int(lengths[i])
    sizes = [tokens.get(r, 0) for r in rollouts]
    return BatchTotals(len(tokens), int(num_tokens), max(length.values(), default=0)), sizes


def token_logprobs(model, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor,
                   temperatures: Tensor | None = None, prefix_len: int = 0) -> tuple[Tensor, Tensor]:
    """log pi(o_t | q, o_<t) and the entropy of pi(. | q, o_<t) at each completion token.

    ``temperatures`` (B,), when given, tempers each sequence's logits (z / T) first: the policy
    that sampled, and whose logprobs vLLM recorded (``--logprobs-mode processed_logprobs``), is
    the tempered one (deviation 7).

    ``input_ids`` (B, L) is prompt then completion, prompts left-padded and completions
    right-padded, so the completions fill the last C = ``completion_mask.size(1)`` positions.
    Returns two (B, C) tensors, zero where ``completion_mask`` is 0; the entropy has no gradient.
    ``prefix_len`` > 0: every row's prompt starts with the same that many tokens, computed once
    (trainer/prefix.py).
    """
    c = completion_mask.size(1)
    if prefix_len:
        logits = shared_prefix_logits(model, input_ids, attention_mask, completion_mask, prefix_len)
    else:
        # explicit positions: left padding must not shift the rotary positions vLLM used (0, 1, ...)
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       logits_to_keep=c + 1).logits
        logits = logits[:, :-1, :]             # (B, C, V): position t-1 predicts token t
    if temperatures is not None:
        logits = logits / temperatures.to(logits.dtype).view(-1, 1, 1)
    targets = input_ids[:, -c:]                # (B, C)
    mask = completion_mask.to(logits.dtype)
    logprobs = selective_log_softmax(logits, targets) * mask
    with torch.no_grad():
        entropy = entropy_from_logits(logits) * mask
    return logprobs, entropy


def clipped_surrogate(ratio: Tensor, advantages: Tensor, epsilon: float, epsilon_high: float) -> Tensor:
    """-min(r A, clip(r, 1 - eps, 1 + eps_high) A) per token; ``advantages`` (B, 1) broadcasts."""
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    return -torch.min(ratio * advantages, clipped * advantages)


def cispo_surrogate(ratio: Tensor, logprobs: Tensor, advantages: Tensor, epsilon_high: float) -> Tensor:
    """-sg(min(r, 1 + eps_high)) A log pi per token (MiniMax-M1 eq. 4); ``advantages`` (B, 1)."""
    weight = torch.clamp(ratio, max=1 + epsilon_high).detach()
    return -weight * advantages * logprobs


def is_weight(old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, *, mode: str, cap: float,
              floor: float = 0.0) -> tuple[Tensor, Tensor]:
    """(w, rho): the IS weight of each token (B, C) per ``mode`` (module docstring) and the raw
    ratio it came from, per token or, for ``sequence_*``, per sequence broadcast over its tokens.
    No gradient. Tokens outside ``mask`` count neither in a sequence's ratio nor anywhere else: their
    rho is 1 whatever was recorded there (``torch.where``, not a product: NaN x 0 is NaN)."""
    log_rho = torch.where(mask.bool(), old_logprobs.detach() - behaviour_logprobs, 0.0)
    if mode.startswith("sequence_"):
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    rho = torch.exp(log_rho)
    if mode.endswith("_truncate"):
        return torch.clamp(rho, min=floor, max=cap), rho
    if mode.endswith("_mask"):
        return rho.masked_fill((rho > cap) | (rho < floor), 0.0), rho
    raise ValueError(f"unknown importance sampling mode {mode!r}")


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """KL(pi_theta || pi_ref) per token, the k3 estimator of GRPO eq. 4 (always >= 0)."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` on the tokens of ``mask``, 0 elsewhere, even where ``x`` is NaN (a product would keep it)."""
    return torch.where(mask.bool(), x, 0.0)


def grpo_aggregate(per_token: Tensor, mask: Tensor, totals: BatchTotals, sizes: Tensor | None = None) -> Tensor:
    """GRPO: mean over each sequence's own tokens, then mean over the step's sequences. ``sizes`` (B,):
    the tokens of each row's sequence (deviation 9); default the row's own."""
    sizes = mask.sum(-1) if sizes is None else sizes.to(per_token.dtype)
    per_sequence = _masked(per_token, mask).sum(-1) / sizes.clamp(min=1)
    return per_sequence.sum() / max(totals.num_sequences, 1)


def dapo_aggregate(per_token: Tensor, mask: Tensor, totals: BatchTotals, sizes: Tensor | None = None) -> Tensor:
    """DAPO token-level loss: sum over all tokens / the step's number of tokens."""
    return _masked(per_token, mask).sum() / max(totals.num_tokens, 1)


def dr_grpo_aggregate(per_token: Tensor, mask: Tensor, totals: BatchTotals, sizes: Tensor | None = None) -> Tensor:
    """Dr. GRPO: sum over all tokens / (sequences x longest completion), a constant per step."""
    return _masked(per_token, mask).sum() / max(totals.num_sequences * totals.max_completion_length, 1)


AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "grpo": grpo_aggregate,
    "dapo": dapo_aggregate,
    "dr_grpo": dr_grpo_aggregate,
    "cispo": dapo_aggregate,          # MiniMax-M1 eq. 4: 1 / sum_i |o_i|, token-level like DAPO
}


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    return float(_masked(x, mask).sum() / mask.sum().clamp(min=1))


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, completion_mask: Tensor, *,
                loss_type: str, epsilon: float, epsilon_high: float,
                behaviour_logprobs: Tensor | None = None, is_correction: str = "token_truncate",
                is_cap: float = 2.0, is_floor: float = 0.0, ref_logprobs: Tensor | None = None, beta: float = 0.0,
                totals: BatchTotals | None = None, sizes: Tensor | None = None,
                row_weights: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """The clipped, IS-corrected policy loss of one (micro-)batch and its metrics.

    ``logprobs``, ``old_logprobs``, ``behaviour_logprobs``, ``ref_logprobs`` and
    ``completion_mask`` are (B, C); ``advantages`` is (B,). ``totals`` are the sizes of the
    whole step's batch (default: this batch); ``sizes`` (B,) each row's sequence size and
    ``row_weights`` (B,) each row's loss weight (:func:`sequence_totals`, deviation 9; default:
    the row's own tokens, weight 1). Metrics are means over this batch's tokens.
    """
    aggregate = AGGREGATIONS[loss_type]
    mask = completion_mask.to(logprobs.dtype)
    totals = totals or BatchTotals.of(completion_mask)
    advantages = advantages.to(logprobs.dtype).unsqueeze(1)      # (B, 1), one per transition

    ratio = torch.exp(logprobs - old_logprobs.detach())
    if loss_type == "cispo":
        per_token = cispo_surrogate(ratio, logprobs, advantages, epsilon_high)
    else:
        per_token = clipped_surrogate(ratio, advantages, epsilon, epsilon_high)

    if behaviour_logprobs is not None and is_correction != "none":
        weight, is_raw = is_weight(old_logprobs, behaviour_logprobs, mask, mode=is_correction, cap=is_cap,
                                   floor=is_floor)
    else:
        weight = is_raw = torch.ones_like(per_token)
    per_token = per_token * weight

    if beta and ref_logprobs is not None:
        kl = k3_kl(logprobs, ref_logprobs)
        per_token = per_token + beta * kl
    else:
        kl = torch.zeros_like(per_token)

    if row_weights is not None:       # a masked rollout's rows: weight 0, no loss and no gradient
        per_token = per_token * row_weights.to(per_token.dtype).unsqueeze(1)
    loss = aggregate(per_token, mask, totals, sizes)

    with torch.no_grad():
        if loss_type == "cispo":      # the weight is clipped whatever the advantage's sign
            clipped_low, clipped_high = torch.zeros_like(ratio, dtype=torch.bool), ratio > 1 + epsilon_high
        else:
            clipped_low = (ratio < 1 - epsilon) & (advantages < 0)
            clipped_high = (ratio > 1 + epsilon_high) & (advantages > 0)
        masked_is = is_raw.masked_fill(mask == 0, 0.0)
        metrics = {
            "loss": float(loss),
            "num_tokens": float(mask.sum()),
            "clip_ratio": _masked_mean((clipped_low | clipped_high).to(mask.dtype), mask),
            "clip_ratio_low": _masked_mean(clipped_low.to(mask.dtype), mask),
            "clip_ratio_high": _masked_mean(clipped_high.to(mask.dtype), mask),
            "ratio_mean": _masked_mean(ratio, mask),
            "is_ratio_mean": _masked_mean(weight, mask),
            "is_ratio_max": float(masked_is.max()) if masked_is.numel() else 0.0,
            # share of tokens whose weight was truncated or masked (0 with is_correction "none")
            "is_truncated": _masked_mean((weight != is_raw).to(mask.dtype), mask),
            "kl": _masked_mean(kl, mask),
        }
    return loss, metrics
