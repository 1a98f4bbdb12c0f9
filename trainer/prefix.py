"""Shared prompt prefixes: the forward pass over a prompt prefix that a micro-batch's rows all share
is computed once, not once per row.

A GRPO group is ``samples`` rollouts of one task: their first calls have the same prompt, and an
agent's later calls extend it (or the system prompt and worked examples every call starts with).
The trainer's plain pass (trainer/loss.py's ``token_logprobs``) runs every row's whole prompt; here
the micro-batch's longest common prompt prefix (``L`` tokens) runs once, with its key/value cache
kept, and each row runs only what follows it (the rest of its prompt, then its completion) against
that cache, expanded to the batch as a view. Autograd sums each row's gradient into the one prefix
pass, so the logprobs and gradients are the plain pass's (to float rounding: tests/trainer/
test_prefix.py), at a cost of ``L + B x (rest + C)`` tokens instead of ``B x (L + rest + C)``.

:func:`pack` orders a batch's rows by their prompt tokens (rows that share a prefix side by side)
and cuts micro-batches by that cost; :func:`common_prefix` is the prefix a micro-batch shares.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor
from transformers import DynamicCache


def common_prefix(prompts: Sequence[np.ndarray], min_tokens: int) -> int:
    """How many leading tokens every prompt in ``prompts`` shares, if at least ``min_tokens`` (and
    there are two prompts or more); else 0 (the plain pass)."""
    if len(prompts) < 2 or not min_tokens:
        return 0
    first, n = prompts[0], min(len(p) for p in prompts)
    for other in prompts[1:]:
        differs = np.flatnonzero(first[:n] != other[:n])
        n = int(differs[0]) if len(differs) else n
        if n < min_tokens:
            return 0
    return n


def pack(prompts: Sequence[np.ndarray], completion_len: Sequence[int], *, max_rows: int, max_tokens: int,
         min_tokens: int) -> list[list[int]]:
    """Row indices per micro-batch, rows in the order of their prompt tokens (a shared prefix keeps
    rows together): at most ``max_rows`` rows and, with ``max_tokens``, at most that many tokens by
    the shared pass's count (the prefix once, each row its rest and its completion, padded); a row
    over the budget alone is a micro-batch of its own."""
    order = sorted(range(len(prompts)), key=lambda i: (prompts[i].tolist(), i))
    chunks: list[list[int]] = []
    current: list[int] = []
    for i in order:
        trial = current + [i]
        if current and (len(trial) > max_rows or (max_tokens and _cost(prompts, completion_len, trial, min_tokens)
                                                  > max_tokens)):
            chunks.append(sorted(current))
            trial = [i]
        current = trial
    if current:
        chunks.append(sorted(current))
    return chunks


def _cost(prompts: Sequence[np.ndarray], completion_len: Sequence[int], rows: list[int], min_tokens: int) -> int:
    """Tokens a pass over ``rows`` holds: the shared prefix once and, per row, the longest rest and
    the longest completion (rows sorted by prompt share a prefix with the first and the last)."""
    shared = common_prefix([prompts[rows[0]], prompts[rows[-1]]], min_tokens) if len(rows) > 1 else 0
    rest = max(len(prompts[i]) for i in rows) - shared
    return shared + len(rows) * (rest + max(completion_len[i] for i in rows))


def shared_prefix_logits(model, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor,
                           prefix_len: int) -> Tensor:
    """The logits that predict each completion token, (B, C, V), as trainer/loss.py's plain pass
    gives them, computing the ``prefix_len`` prompt tokens every row starts with once.

    ``input_ids`` is laid out as the plain pass takes it (prompts left-padded to P, completions
    right-padded to C), and every row's prompt starts with the same ``prefix_len`` tokens."""
    c = completion_mask.size(1)
    p = input_ids.size(1) - c
    prompt_len = attention_mask[:, :p].sum(-1)                                  # (B,)
    rest = prompt_len - prefix_len                                              # each row's prompt after the prefix
    width = int(rest.max())
    start = p - int(prompt_len[0])
    out = model(input_ids=input_ids[:1, start:start + prefix_len], use_cache=True, logits_to_keep=1)
    last = out.logits[:, -1:, :]                                                # predicts the token after the prefix
    b = input_ids.size(0)
    cache = DynamicCache()
    for i, layer in enumerate(out.cache.layers):
        cache.update(layer.keys.expand(b, -1, -1, -1), layer.values.expand(b, -1, -1, -1), i)
    ids = input_ids[:, p - width:]                                              # (B, width + C): rest, completion
    mask = attention_mask[:, p - width:].clone()
    mask[:, :width] *= (torch.arange(width, device=mask.device)[None, :] >= width - rest[:, None]).to(mask.dtype)
    positions = prefix_len + (mask.long().cumsum(-1) - 1).clamp(min=0)
    full_mask = torch.cat([mask.new_ones(b, prefix_len), mask], dim=1)
    logits = model(input_ids=ids, attention_mask=full_mask, position_ids=positions, cache=cache,
                   use_cache=True, logits_to_keep=c + (1 if width else 0)).logits
    if not width:                   # every prompt is the prefix: the first token's logit is the prefix's last
        return torch.cat([last.expand(b, -1, -1), logits[:, :-1, :]], dim=1)
    logits = logits[:, :-1, :]      # position t-1 predicts token t
    no_rest = (rest == 0).view(-1, 1, 1)
    first = torch.where(no_rest, last.expand(b, -1, -1), logits[:, :1, :])     # a row with no rest: the prefix's
    return torch.cat([first, logits[:, 1:, :]], dim=1)
