"""The trainer's batches: which transitions a step trains on, and how they become tensors.

- :func:`next_batch` chooses the transitions after the data cursor, oldest first, in DuckDB: it
  skips (and counts) the stale, the malformed and the zero-advantage ones, and takes at most
  ``batch_size`` (the loop's module docstring, choices 1-3).
- :func:`collate` pads a list of transition rows into one :class:`MicroBatch`.
- :func:`shard_groups` splits a batch between data-parallel ranks, whole groups each
  (the loop's module docstring, choice 5); :func:`micro_batches` cuts one rank's share.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lightspan import store
from lightspan.trainer.config import TrainerConfig


@dataclass(frozen=True, order=True)
class Cursor:
    """The last transition consumed, in (created_unix_nano, transition_id) order."""

    created_unix_nano: int = -1
    transition_id: str = ""


@dataclass
class Batch:
    rows: list[dict]                  # transitions to train on, oldest first
    cursor: Cursor                    # where the cursor goes once they are trained
    skipped_stale: int = 0            # model_version < version - max_staleness, or unknown
    skipped_malformed: int = 0        # no tokens, logprobs misaligned or not finite, ids outside the vocab, too long
    zero_advantage: int = 0           # no gradient: left out of the forward pass
    reward_mean: float | None = None  # over the rollouts of the fresh transitions consumed
    staleness_mean: float = 0.0       # version - model_version over the trained rows


@dataclass
class MicroBatch:
    input_ids: torch.Tensor           # (B, P + C): prompts left-padded, completions right-padded
    attention_mask: torch.Tensor      # (B, P + C)
    completion_mask: torch.Tensor     # (B, C): 1 on the tokens the loss trains
    behaviour_logprobs: torch.Tensor  # (B, C): vLLM's logprobs at sampling time
    advantages: torch.Tensor          # (B,)
    temperatures: torch.Tensor        # (B,): the sampling temperature vLLM's logprobs were taken at


def collate(rows: list[dict], pad_id: int, device: torch.device | str = "cpu") -> MicroBatch:
    """Left-pad the prompts and right-pad the completions, so completions end the sequence.

    A row's ``completion_mask`` (per-rollout transitions) is 0 on completion tokens the model did
    not sample (tool output, user turns): they stay in the attention, out of the loss. Without
    one (null) every completion token is trained.
    """
    from trl.trainer.utils import pad

    def ints(key):
        return [torch.tensor(r[key], dtype=torch.long) for r in rows]

    prompts, completions = ints("prompt_token_ids"), ints("completion_token_ids")
    ones = lambda ts: [torch.ones_like(t) for t in ts]  # noqa: E731
    trained = [torch.tensor(r["completion_mask"], dtype=torch.long) if r.get("completion_mask") is not None
               else torch.ones_like(c) for r, c in zip(rows, completions)]
    input_ids = torch.cat([pad(prompts, pad_id, "left"), pad(completions, pad_id, "right")], dim=1)
    completion_mask = pad(trained, 0, "right")
    attention_mask = torch.cat([pad(ones(prompts), 0, "left"), pad(ones(completions), 0, "right")], dim=1)
    behaviour = pad([torch.tensor(r["completion_logprobs"], dtype=torch.float32) for r in rows], 0.0, "right")
    advantages = torch.tensor([float(r["advantage"]) for r in rows], dtype=torch.float32)
    # vLLM's processed logprobs are of the tempered distribution softmax(z / T); no temperature
    # recorded, or greedy (0), means the untempered one
    temperatures = torch.tensor([float(r.get("temperature") or 1.0) for r in rows], dtype=torch.float32)
    return MicroBatch(*(t.to(device) for t in (input_ids, attention_mask, completion_mask, behaviour, advantages,
                                                temperatures)))


def shard_groups(rows: list[dict], num_shards: int) -> list[list[int]]:
    """Split a batch between ranks: row indices per shard, each shard in batch order.

    A group (the transitions of one task, else of one rollout) stays on one rank. Groups go,
    largest first, to the shard with the fewest tokens so far (ties: the lower shard), so every
    rank computes the same split. A shard may be empty when there are fewer groups than ranks.
    """
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(r.get("task_id") or r.get("rollout_id") or r["transition_id"], []).append(i)

    def tokens(indices: list[int]) -> int:
        return sum(len(rows[i]["prompt_token_ids"]) + len(rows[i]["completion_token_ids"]) for i in indices)

    shards: list[list[int]] = [[] for _ in range(num_shards)]
    load = [0] * num_shards
    for indices in sorted(groups.values(), key=lambda g: (-tokens(g), g[0])):
        k = min(range(num_shards), key=lambda j: (load[j], j))
        shards[k] += indices
        load[k] += tokens(indices)
    return [sorted(s) for s in shards]


def micro_batches(rows: list[dict], *, rank: int, num_ranks: int, size: int, pad_id: int,
                  device) -> tuple[list[MicroBatch], int]:
    """Rank ``rank``'s micro-batches of ``rows`` and how many of them are real: the others repeat
    one row and are trained with weight 0, so that every rank runs as many passes as the busiest one."""
    shards = shard_groups(rows, num_ranks) if num_ranks > 1 else [list(range(len(rows)))]
    mine = [rows[i] for i in shards[rank]]
    chunks = [mine[i:i + size] for i in range(0, len(mine), size)]
    live = len(chunks)
    chunks += [rows[:1]] * (max(-(-len(s) // size) for s in shards) - live)
    return [collate(c, pad_id, device) for c in chunks], live


# The new transitions after the cursor, classified once. Only light columns: the token lists
# of the rows chosen are read afterwards, by key. A temp table keeps one snapshot: files that
# land while a batch is chosen wait for the next one instead of being skipped by the cursor.
# A recorded logprob that is missing (null) or not finite (NaN, +-inf) makes a row malformed:
# its importance weight would turn the whole loss NaN. list_sum adds in DOUBLE, which no float32
# list overflows, so it is NaN or infinite exactly when an element is.
_NEW_SQL = """
CREATE OR REPLACE TEMP TABLE new AS
SELECT transition_id, created_unix_nano, rollout_id, reward, model_version,
       coalesce(model_version >= $min_version, false) AS fresh,
       coalesce(len(completion_token_ids) > 0
                AND len(completion_logprobs) = len(completion_token_ids)
                AND len(prompt_token_ids) > 0
                AND list_min(prompt_token_ids) >= 0 AND list_max(prompt_token_ids) < $vocab
                AND list_min(completion_token_ids) >= 0 AND list_max(completion_token_ids) < $vocab
                AND len(prompt_token_ids) + len(completion_token_ids) <= $max_len
                AND (completion_mask IS NULL OR len(completion_mask) = len(completion_token_ids))
                AND list_count(completion_logprobs) = len(completion_logprobs)
                AND isfinite(list_sum(completion_logprobs))
                AND isfinite(coalesce(advantage, 0)), false) AS wellformed,
       coalesce(advantage, 0) <> 0 AS nonzero
FROM transitions
WHERE coalesce(split, 'train') = 'train'
  AND ($policy::VARCHAR IS NULL OR policy = $policy::VARCHAR)
  AND (created_unix_nano > $created OR (created_unix_nano = $created AND transition_id > $tid))
QUALIFY row_number() OVER (PARTITION BY transition_id ORDER BY created_unix_nano DESC) = 1
"""
_UPTO = "(created_unix_nano < $created OR (created_unix_nano = $created AND transition_id <= $tid))"


def next_batch(data_dir: str | os.PathLike, config: TrainerConfig, *, version: int, cursor: Cursor, vocab_size: int,
               max_len: int, policy: str | None = None) -> Batch | None:
    """The next batch after ``cursor`` for a trainer at ``version``, or None if fewer than
    ``config.min_transitions`` are trainable. ``vocab_size`` and ``max_len`` are the model's:
    a row with a token id outside the vocabulary or longer than the model's positions is malformed.
    ``policy``: only that named policy's transitions (None: every transition, the unnamed policy's)."""
    con = store.connect(data_dir)
    try:
        con.execute(_NEW_SQL, {
            "min_version": version - config.max_staleness, "vocab": vocab_size, "max_len": max_len, "policy": policy,
            "created": cursor.created_unix_nano, "tid": cursor.transition_id})
        con.execute("CREATE TEMP TABLE chosen AS SELECT created_unix_nano, transition_id FROM new "
                    "WHERE fresh AND wellformed AND nonzero ORDER BY 1, 2 LIMIT $n",
                    {"n": config.batch_size or 2**62})
        keys = con.execute("SELECT * FROM chosen ORDER BY 1, 2").fetchall()
        if len(keys) < config.min_transitions:
            return None
        if config.batch_size and len(keys) == config.batch_size:
            cutoff = Cursor(*keys[-1])              # full batch: later rows wait for the next step
        else:
            cutoff = Cursor(*con.execute("SELECT created_unix_nano, transition_id FROM new "
                                         "ORDER BY 1 DESC, 2 DESC LIMIT 1").fetchone())
        upto = {"created": cutoff.created_unix_nano, "tid": cutoff.transition_id}
        stale, malformed, zero = con.execute(f"""
            SELECT count(*) FILTER (WHERE NOT fresh),
                   count(*) FILTER (WHERE fresh AND NOT wellformed),
                   count(*) FILTER (WHERE fresh AND wellformed AND NOT nonzero)
            FROM new WHERE {_UPTO}""", upto).fetchone()
        reward_mean = con.execute(f"""
            SELECT avg(reward) FROM (SELECT any_value(reward) AS reward FROM new
                                     WHERE fresh AND {_UPTO} GROUP BY rollout_id)""", upto).fetchone()[0]
        # the range filter lets DuckDB skip row groups by their min/max statistics
        cur = con.execute("""
            SELECT t.transition_id, t.rollout_id, t.task_id, t.prompt_token_ids, t.completion_token_ids,
                   t.completion_logprobs, t.completion_mask, t.model_version, t.temperature, t.reward, t.advantage,
                   t.created_unix_nano
            FROM transitions t JOIN chosen c USING (created_unix_nano, transition_id)
            WHERE t.created_unix_nano BETWEEN $first AND $last
            ORDER BY t.created_unix_nano, t.transition_id""",
            {"first": keys[0][0], "last": keys[-1][0]})
        names = [d[0] for d in cur.description]
        rows = [dict(zip(names, values)) for values in cur.fetchall()]
    finally:
        con.close()
    rows = list({r["transition_id"]: r for r in rows}.values())   # a file listed twice reads twice
    staleness = [version - r["model_version"] for r in rows]
    return Batch(rows=rows, cursor=cutoff, skipped_stale=stale, skipped_malformed=malformed,
                 zero_advantage=zero, reward_mean=reward_mean,
                 staleness_mean=sum(staleness) / len(staleness))
