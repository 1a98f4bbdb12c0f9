"""Per-rollout output: an agent's multi-turn LLM calls merged into one sequence with a loss mask.

A chat agent's call k+1 usually re-sends everything so far: its prompt is call k's prompt, call
k's completion, then the turns that came after (tool output, user message, the template's
turn markers), rendered by the chat template. When the new prompt starts with call k's prompt
+ completion token for token, the calls are one sequence::

    prompt      = p_0                                    (the first call's prompt)
    completion  = c_0 | x_1 | c_1 | x_2 | c_2 ...        x_k = p_k[len(p_{k-1}) + len(c_{k-1}):]
    mask        = 1…1 | 0…0 | 1…1 | 0…0 | 1…1            1: sampled by the model, 0: not
    logprobs    = the sampled tokens' logprobs, 0 where the mask is 0

so the trainer scores the whole episode in one forward pass and trains only the tokens the
policy produced: the loss masking of multi-turn agent RL (e.g. the retrieved-token masking of
Search-R1, Jin et al. 2025, arXiv 2503.09516).

When the prefix does not match, the calls start a new sequence, a *segment* of the same
rollout (never a mis-merge: the rows are separate samples, each credited as its first call is),
and the mismatch is classified (:func:`classify_mismatch`), so a run can tell an agent that
compacts its history (summarised, truncated, rewritten) from a chat template that re-renders the
assistant turn, a tokenizer that re-tokenises text differently from how it was sampled, and a
harness that re-writes the assistant turn as its own tool-call text. Each sequence records its
segment index within its rollout and agent and the kind of mismatch that started it.

Deviations and heuristics:

1. Matching is on token ids only, with no tokenizer: the classification of a mismatch is a
   heuristic over the token-level diff (see :func:`classify_mismatch`), good for counting, not
   proof.
2. Only call k (the previous call of the same agent that has token ids) is compared, not
   earlier ones: a sequence never resumes after a mismatch.
3. A call that is not trained (no token ids; truncated under ``drop_truncated``) is skipped:
   the next call is compared with the last trained one, and what the skipped call produced
   becomes context with mask 0. Other agents' turns are context with mask 0 too.
"""

from __future__ import annotations

import difflib
from typing import NamedTuple

import numpy as np

MISMATCH_KINDS = ("compaction", "chat_template", "retokenization", "tool_text", "reply_dropped")
EDGE = 2
"""Tokens at each end of a completion where a difference is the template's (stop token, spaces)."""
GENERATION_PROMPT = 8
"""At most this many tokens end every prompt the same way (the template's generation prompt,
``<|im_start|>assistant\n``): a next prompt that departs from the prompt only there dropped the reply."""


def classify_mismatch(prompt, completion, next_prompt) -> str:
    """Why ``next_prompt`` does not start with ``prompt + completion`` (three 1-D int arrays).

    - ``compaction``: ``next_prompt`` does not even start with ``prompt``: the history before
      the completion changed (summarised, truncated, a middle part dropped, another system
      prompt), whether the new prompt is shorter or not.
    - ``chat_template``: the completion's tokens reappear except at its edges: tokens differ,
      are missing or are added within its first or last ``EDGE`` tokens (a trailing
      ``<|im_end|>`` missing or doubled, whitespace around the turn), or a block at its start
      or end was dropped (a template that strips reasoning from earlier turns).
    - ``retokenization``: at least half of the completion's tokens reappear in order, but a
      stretch inside it was replaced by other tokens (the same text tokenised differently).
    - ``tool_text``: ``prompt`` is kept but less than half of the completion reappears where it
      should: the harness re-wrote the assistant turn (e.g. parsed its tool call and rendered it
      as its own tool-call text) or put something else there.
    - ``reply_dropped``: ``next_prompt`` keeps ``prompt`` up to the generation prompt both end
      with (their common suffix, at most ``GENERATION_PROMPT`` tokens) and departs from it only
      there: the harness left the reply out of its history and went on (mini-swe-agent drops a
      reply it could not parse and sends its format-error message instead).
    """
    prompt, completion, next_prompt = (np.asarray(a) for a in (prompt, completion, next_prompt))
    n, start = len(completion), len(prompt)
    if len(next_prompt) < start or not np.array_equal(next_prompt[:start], prompt):
        return "reply_dropped" if _departs_at_generation_prompt(prompt, next_prompt) else "compaction"
    window = next_prompt[start:start + n + EDGE].tolist()
    ops = difflib.SequenceMatcher(None, completion.tolist(), window, autojunk=False).get_opcodes()
    template = True
    for tag, i1, i2, _, _ in ops:
        if tag == "equal":
            continue
        at_edge = i2 <= EDGE or i1 >= n - EDGE
        block_dropped = tag == "delete" and (i1 == 0 or i2 == n)
        template = template and (at_edge or block_dropped)
    if template:
        return "chat_template"
    kept = sum(i2 - i1 for tag, i1, i2, _, _ in ops if tag == "equal")
    return "retokenization" if 2 * kept >= n else "tool_text"


def _departs_at_generation_prompt(prompt: np.ndarray, next_prompt: np.ndarray) -> bool:
    """Whether ``next_prompt`` keeps all of ``prompt`` before their common ending (the generation
    prompt: the last tokens both share, at most ``GENERATION_PROMPT``) and departs within it."""
    g = 0
    while g < min(GENERATION_PROMPT, len(prompt) - 1, len(next_prompt)) and prompt[-1 - g] == next_prompt[-1 - g]:
        g += 1
    keep = len(prompt) - g
    return g > 0 and len(next_prompt) > keep and np.array_equal(next_prompt[:keep], prompt[:keep])


class Merged(NamedTuple):
    """Sequences built by :func:`merge`, in the order of their first call."""

    first: np.ndarray               # (S,) index into ``rows`` of each sequence's first call
    num_calls: np.ndarray           # (S,) calls merged into each sequence
    offsets: np.ndarray             # (S + 1,) int64 offsets into the three flat arrays below
    tokens: np.ndarray              # int32 completion tokens of all sequences
    mask: np.ndarray                # int8: 1 sampled by the model, 0 not
    logprobs: np.ndarray            # float32: the sampled logprob, 0 where mask is 0
    mismatches: dict[str, int]      # prefix mismatches by kind
    segment: np.ndarray             # (S,) int32 index of each sequence among its group's, from 0
    cause: np.ndarray               # (S,) int8 index into MISMATCH_KINDS of what started it; -1: the first


_PROMPT, _COMPLETION = 0, 1


def merge(prompts, completions, logprobs, base: np.ndarray, rows: np.ndarray, group: np.ndarray) -> Merged:
    """Merge the calls ``rows`` (in call order) into sequences.

    The token lists come in chunks: ``prompts``, ``completions`` and ``logprobs`` are lists of
    (offsets, values) per chunk (int32, int32, float32 values), ``base`` the row number where
    each chunk starts, and ``rows`` the calls' row numbers. Every call in ``rows`` has a
    prompt, a completion and one logprob per completion token. Calls with different
    ``group`` (another rollout or agent) never share a sequence; calls of one group are
    contiguous in ``rows``.
    """
    rows = np.asarray(rows, dtype=np.int64)
    chunk = np.searchsorted(base, rows, side="right") - 1
    local = rows - base[chunk]
    bounds = {}
    for name, lists in (("p", prompts), ("c", completions), ("l", logprobs)):
        lo, hi = np.zeros(len(rows), np.int64), np.zeros(len(rows), np.int64)
        for k, (offsets, _) in enumerate(lists):
            here = chunk == k
            lo[here], hi[here] = offsets[local[here]], offsets[local[here] + 1]
        bounds[name] = (lo.tolist(), hi.tolist())
    pv = [memoryview(values).cast("B") for _, values in prompts]      # memcmp-speed slice compares
    cv = [memoryview(values).cast("B") for _, values in completions]
    (P0, P1), (C0, C1), (L0, _) = bounds["p"], bounds["c"], bounds["l"]
    pvals, cvals, lvals = [v for _, v in prompts], [v for _, v in completions], [v for _, v in logprobs]
    zeros = np.zeros(max([0] + [len(v) for v in pvals]), dtype=np.float32)

    first, num_calls, lengths, segment, cause = [], [], [], [], []
    tokens, values, kinds, sizes = [], [], [], []     # one entry per segment, views into the chunks
    mismatches = dict.fromkeys(MISMATCH_KINDS, 0)
    kind_index = {kind: k for k, kind in enumerate(MISMATCH_KINDS)}
    prev = None                     # (group, chunk, prompt start, end, completion start, end) of call k
    for i, (g, b) in enumerate(zip(group.tolist(), chunk.tolist())):
        p0, p1, c0, c1, l0 = P0[i], P1[i], C0[i], C1[i], L0[i]
        if prev is not None and prev[0] == g:
            _, a, q0, q1, d0, d1 = prev
            lp, lc = q1 - q0, d1 - d0
            mid = p0 + lp + lc        # where call k's completion ends inside this prompt
            if (p1 - p0 >= lp + lc and pv[b][4 * p0:4 * (p0 + lp)] == pv[a][4 * q0:4 * q1]
                    and pv[b][4 * (p0 + lp):4 * mid] == cv[a][4 * d0:4 * d1]):
                # x_k: the turn after call k's completion (mask 0), then this completion (mask 1)
                tokens += [pvals[b][mid:p1], cvals[b][c0:c1]]
                values += [zeros[:p1 - mid], lvals[b][l0:l0 + c1 - c0]]
                kinds += [_PROMPT, _COMPLETION]
                sizes += [p1 - mid, c1 - c0]
                num_calls[-1] += 1
                lengths[-1] += p1 - mid + c1 - c0
                prev = (g, b, p0, p1, c0, c1)
                continue
            kind = classify_mismatch(pvals[a][q0:q1], cvals[a][d0:d1], pvals[b][p0:p1])
            mismatches[kind] += 1
            segment.append(segment[-1] + 1)      # a new segment of the same rollout and agent
            cause.append(kind_index[kind])
        else:
            segment.append(0)
            cause.append(-1)
        first.append(i)
        num_calls.append(1)
        lengths.append(c1 - c0)
        tokens.append(cvals[b][c0:c1])
        values.append(lvals[b][l0:l0 + c1 - c0])
        kinds.append(_COMPLETION)
        sizes.append(c1 - c0)
        prev = (g, b, p0, p1, c0, c1)

    offsets = np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))])
    mask = np.repeat(np.asarray(kinds, dtype=np.int8), np.asarray(sizes, dtype=np.int64))
    return Merged(np.asarray(first, dtype=np.int64), np.asarray(num_calls, dtype=np.int64), offsets,
                  np.concatenate(tokens).astype(np.int32, copy=False) if tokens else np.zeros(0, np.int32),
                  mask, np.concatenate(values).astype(np.float32, copy=False) if values else np.zeros(0, np.float32),
                  mismatches, np.asarray(segment, dtype=np.int32), np.asarray(cause, dtype=np.int8))
