"""The trainer's batches: which transitions a step trains on, and how they become tensors.

- :func:`next_batch` chooses the transitions after the data cursor, oldest first, in DuckDB: it
  skips (and counts) the stale, the malformed and the zero-advantage ones, and takes at most
  ``batch_size`` (the loop's module docstring, choices 1-3).
- :func:`collate` pads transition rows into one :class:`MicroBatch`.
- :func:`shard_groups` splits a batch between data-parallel ranks, whole groups each
  (the loop's module docstring, choice 5); :func:`micro_batches` cuts one rank's share, by rows
  and by a budget of padded tokens (:func:`pack`).
- :func:`step_totals` counts what the loss normalises by over the whole batch, before it is cut
  (trainer/loss.py, deviations 4 and 9): a rollout's rows may land in different micro-batches.

A batch stays an Arrow table from DuckDB to the tensors: a token list column is one flat buffer
and its offsets, padded into a tensor in one vectorised assignment, never a Python int per token.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from lightspan import store
from lightspan.trainer import prefix
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.loss import BatchTotals, sequence_totals
from lightspan.trainer.prefix import common_prefix

SIZE_COLUMN = "_sequence_size"
"""The column :func:`step_totals` adds to a batch: each row's sequence size (trainer/loss.py, deviation 9)."""


@dataclass(frozen=True, order=True)
class Cursor:
    """The last transition consumed, in (created_unix_nano, transition_id) order."""

    created_unix_nano: int = -1
    transition_id: str = ""


@dataclass
class Batch:
    table: pa.Table                   # transitions to train on, oldest first (next_batch's columns)
    cursor: Cursor                    # where the cursor goes once they are trained
    skipped_stale: int = 0            # model_version < version - max_staleness, or unknown
    skipped_malformed: int = 0        # no tokens, logprobs misaligned or not finite, ids outside the vocab, too long
    zero_advantage: int = 0           # no gradient: left out of the forward pass
    # ... but in the loss's normaliser: the zero-advantage sequences consumed with the batch, which
    # GRPO's 1/G (and DAPO's token count) include as TRL does (trainer/loss.py, deviation 4)
    zero_totals: BatchTotals = BatchTotals(0, 0, 0)
    masked: int = 0                   # loss weight 0 (a masked rollout's rows): left out of the forward pass
    reward_mean: float | None = None  # over the rollouts of the fresh transitions consumed
    staleness_mean: float = 0.0       # version - model_version over the trained rows

    @property
    def rows(self) -> list[dict]:
        """The transitions as Python dicts, to look at (tests, a debugger); the step reads ``table``."""
        return self.table.to_pylist()


@dataclass
class MicroBatch:
    input_ids: torch.Tensor           # (B, P + C): prompts left-padded, completions right-padded
    attention_mask: torch.Tensor      # (B, P + C)
    completion_mask: torch.Tensor     # (B, C): 1 on the tokens the loss trains
    behaviour_logprobs: torch.Tensor  # (B, C): vLLM's logprobs at sampling time
    advantages: torch.Tensor          # (B,)
    temperatures: torch.Tensor        # (B,): the sampling temperature vLLM's logprobs were taken at
    sizes: torch.Tensor               # (B,): trained tokens of each row's sequence (the row, or its rollout)
    row_weights: torch.Tensor         # (B,): each row's loss weight (0: a masked rollout's row)
    prefix_len: int = 0               # prompt tokens every row starts with, run once (trainer/prefix.py)


Rows = pa.Table | Sequence[dict]
"""Transitions as the store reads them (an Arrow table), or as dicts of the same columns (tests)."""


def as_table(rows: Rows) -> pa.Table:
    return rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(list(rows))


def _lists(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A list column as (flat values, lengths, null rows): the values of its non-null rows in row
    order, each row's length (0 when null) and which rows are null (a missing column is all null)."""
    if name not in table.column_names:
        n = table.num_rows
        return np.zeros(0), np.zeros(n, dtype=np.int64), np.ones(n, dtype=bool)
    column = table.column(name).combine_chunks()
    if pa.types.is_null(column.type):
        return np.zeros(0), np.zeros(len(column), dtype=np.int64), np.ones(len(column), dtype=bool)
    lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    return (column.flatten().to_numpy(zero_copy_only=False), lengths,
            column.is_null().to_numpy(zero_copy_only=False))


def _pad(values: np.ndarray, lengths: np.ndarray, side: str, fill, dtype: type,
         width: int | None = None) -> np.ndarray:
    """(B, width) with row i's ``lengths[i]`` values (taken in order from ``values``) at the
    ``side`` end and ``fill`` elsewhere; ``width`` defaults to the longest row. In numpy: its
    boolean-mask assignment is ~500x faster than torch's on CPU (measured, 8 x 1300 tokens)."""
    width = int(lengths.max(initial=0)) if width is None else width
    out = np.full((len(lengths), width), fill, dtype=dtype)
    columns = np.arange(width)[None, :]
    filled = columns < lengths[:, None] if side == "right" else columns >= width - lengths[:, None]
    out[filled] = values                    # row-major: the flat values in row order
    return out


def _floats(table: pa.Table, name: str, default: float) -> np.ndarray:
    """A float column with nulls, and a missing column, as ``default``."""
    if name not in table.column_names:
        return np.full(table.num_rows, default, dtype=np.float64)
    column = pc.cast(table.column(name), pa.float64())
    return pc.fill_null(column, default).to_numpy().astype(np.float64)


def row_weights(rows: Rows) -> np.ndarray:
    """Each row's loss weight: its ``loss_weight`` (null or no column: 1), and 0 where its ``outcome``
    is ``masked`` (the builder's columns; a masked rollout is in its group's baseline, not the loss)."""
    table = as_table(rows)
    weights = _floats(table, "loss_weight", 1.0)
    if "outcome" in table.column_names:
        masked = pc.fill_null(pc.equal(table.column("outcome"), "masked"), False).to_numpy(zero_copy_only=False)
        weights = np.where(masked, 0.0, weights)
    return weights


def collate(rows: Rows, pad_id: int, device: torch.device | str = "cpu", shared_prefix: int = 0) -> MicroBatch:
    """Left-pad the prompts and right-pad the completions, so completions end the sequence.

    A row's ``completion_mask`` (per-rollout transitions) is 0 on completion tokens the model did
    not sample (tool output, user turns): they stay in the attention, out of the loss. Without
    one (null) every completion token is trained. A row of loss weight 0 (:func:`row_weights`)
    trains none. Each row's sequence size is the batch's (:data:`SIZE_COLUMN`), else its own tokens.
    With ``shared_prefix``, a prompt prefix of at least that many tokens that every row starts with
    is the micro-batch's ``prefix_len``.
    """
    table = as_table(rows)
    prompt, prompt_len, _ = _lists(table, "prompt_token_ids")
    completion, completion_len, _ = _lists(table, "completion_token_ids")
    mask, mask_len, no_mask = _lists(table, "completion_mask")
    width = int(completion_len.max(initial=0))
    input_ids = np.concatenate([_pad(prompt, prompt_len, "left", pad_id, np.int64),
                                _pad(completion, completion_len, "right", pad_id, np.int64)], axis=1)
    attention_mask = np.concatenate([_pad(1, prompt_len, "left", 0, np.int64),
                                     _pad(1, completion_len, "right", 0, np.int64)], axis=1)
    completion_mask = _pad(1, completion_len, "right", 0, np.int64)
    if not no_mask.all():     # the rows with a mask: theirs (the same length as their completion)
        completion_mask[~no_mask] = _pad(mask, mask_len[~no_mask], "right", 0, np.int64, width)
    logprobs, logprob_len, _ = _lists(table, "completion_logprobs")
    behaviour = _pad(logprobs, logprob_len, "right", 0.0, np.float32)
    advantages = _floats(table, "advantage", 0.0).astype(np.float32)
    # vLLM's processed logprobs are of the tempered distribution softmax(z / T); no temperature
    # recorded, or greedy (0), means the untempered one
    temperature = _floats(table, "temperature", 1.0)
    temperatures = np.where(temperature == 0, 1.0, temperature).astype(np.float32)
    weights = row_weights(table).astype(np.float32)
    completion_mask[weights == 0] = 0
    sizes = _floats(table, SIZE_COLUMN, np.nan)
    sizes = np.where(np.isnan(sizes), completion_mask.sum(-1), sizes).astype(np.float32)
    prefix_len = common_prefix(np.split(prompt, np.cumsum(prompt_len)[:-1]), shared_prefix)
    return MicroBatch(*(torch.from_numpy(a).to(device) for a in (
        input_ids, attention_mask, completion_mask, behaviour, advantages, temperatures, sizes, weights)),
        prefix_len=prefix_len)


def token_totals(rows: Rows) -> tuple[list[int], int]:
    """Each row's completion length, and the tokens the loss trains over all rows (the mask's ones,
    else every completion token)."""
    table = as_table(rows)
    _, lengths, _ = _lists(table, "completion_token_ids")
    mask, mask_len, no_mask = _lists(table, "completion_mask")
    return lengths.tolist(), int(lengths[no_mask].sum() + mask.sum())


def rollout_keys(table: pa.Table) -> list:
    """Each row's rollout: its ``rollout_id``, or for a row without one its ``transition_id`` (or
    index), so that it is a rollout of its own."""
    rollouts = (table.column("rollout_id").to_pylist() if "rollout_id" in table.column_names
                else [None] * table.num_rows)
    ids = table.column("transition_id").to_pylist() if "transition_id" in table.column_names else range(table.num_rows)
    return [r if r else t for r, t in zip(rollouts, ids)]


def step_totals(rows: Rows, normalisation: str) -> tuple[BatchTotals, pa.Table]:
    """What the loss of the whole batch ``rows`` normalises by (trainer/loss.py's ``sequence_totals``),
    and the batch with each row's sequence size in :data:`SIZE_COLUMN`: computed here, before the
    batch is cut into micro-batches, so every micro-batch of a rollout divides by the same sizes."""
    table = as_table(rows)
    lengths, _ = token_totals(table)
    mask, mask_len, no_mask = _lists(table, "completion_mask")
    trained = np.array(lengths, dtype=np.int64)
    if not no_mask.all():            # a row with a mask trains its ones
        row_of = np.repeat(np.arange(int((~no_mask).sum())), mask_len[~no_mask])
        trained[~no_mask] = np.bincount(row_of, weights=mask.astype(np.float64),
                                        minlength=int((~no_mask).sum())).astype(np.int64)
    totals, sizes = sequence_totals(lengths, trained.tolist(), rollout_keys(table), row_weights(table).tolist(),
                                    normalisation=normalisation)
    column = pa.array(sizes, pa.float64())
    if SIZE_COLUMN in table.column_names:
        return totals, table.set_column(table.column_names.index(SIZE_COLUMN), SIZE_COLUMN, column)
    return totals, table.append_column(SIZE_COLUMN, column)


def pack(prompt_len: Sequence[int], completion_len: Sequence[int], *, max_rows: int,
         max_tokens: int = 0) -> list[list[int]]:
    """Row indices per micro-batch: at most ``max_rows`` rows and, with ``max_tokens``, at most that
    many padded tokens, rows x (longest prompt + longest completion), the (B, P + C) a forward pass
    holds. A row longer than ``max_tokens`` is a micro-batch alone: it costs time, never a refusal.
    With a budget, rows go longest first so that rows of like length share their padding;
    without one, in batch order."""
    n = len(prompt_len)
    order = sorted(range(n), key=lambda i: (-(prompt_len[i] + completion_len[i]), i)) if max_tokens else range(n)
    chunks: list[list[int]] = []
    current: list[int] = []
    longest_p = longest_c = 0
    for i in order:
        p, c = max(longest_p, prompt_len[i]), max(longest_c, completion_len[i])
        if current and (len(current) == max_rows or (max_tokens and (len(current) + 1) * (p + c) > max_tokens)):
            chunks.append(sorted(current))
            current, p, c = [], prompt_len[i], completion_len[i]
        current.append(i)
        longest_p, longest_c = p, c
    if current:
        chunks.append(sorted(current))
    return chunks


def shard_groups(rows: Rows, num_shards: int) -> list[list[int]]:
    """Split a batch between ranks: row indices per shard, each shard in batch order.

    A group (the transitions of one task, else of one rollout) stays on one rank. Groups go,
    largest first, to the shard with the fewest tokens so far (ties: the lower shard), so every
    rank computes the same split. A shard may be empty when there are fewer groups than ranks.
    """
    table = as_table(rows)
    # the first of task_id, rollout_id, transition_id that is neither null nor empty
    key = [task or rollout or tid for task, rollout, tid in zip(
        *(table.column(k).to_pylist() if k in table.column_names else [None] * table.num_rows
          for k in ("task_id", "rollout_id")), table.column("transition_id").to_pylist())]
    tokens = _lists(table, "prompt_token_ids")[1] + _lists(table, "completion_token_ids")[1]
    groups: dict[str, list[int]] = {}
    for i, k in enumerate(key):
        groups.setdefault(k, []).append(i)

    def size(indices: list[int]) -> int:
        return int(tokens[indices].sum())

    shards: list[list[int]] = [[] for _ in range(num_shards)]
    load = [0] * num_shards
    for indices in sorted(groups.values(), key=lambda g: (-size(g), g[0])):
        k = min(range(num_shards), key=lambda j: (load[j], j))
        shards[k] += indices
        load[k] += size(indices)
    return [sorted(s) for s in shards]


def micro_batches(rows: Rows, *, rank: int, num_ranks: int, size: int, pad_id: int,
                  device, max_tokens: int = 0, shared_prefix: int = 0) -> tuple[list[MicroBatch], int]:
    """Rank ``rank``'s micro-batches of ``rows`` (at most ``size`` rows and ``max_tokens`` padded
    tokens each, :func:`pack`; with ``shared_prefix``, trainer/prefix.py's ``pack``) and how many of
    them are real: the others repeat one row and are trained with weight 0, so that every rank runs
    as many passes as the busiest one."""
    table = as_table(rows)
    shards = shard_groups(table, num_ranks) if num_ranks > 1 else [list(range(table.num_rows))]
    prompt, prompt_len, _ = _lists(table, "prompt_token_ids")
    completion_len = _lists(table, "completion_token_ids")[1]
    prompts = np.split(prompt, np.cumsum(prompt_len)[:-1]) if shared_prefix else []

    def cut(shard: list[int]) -> list[list[int]]:
        if shared_prefix:
            return prefix.pack([prompts[i] for i in shard], completion_len[shard].tolist(), max_rows=size,
                               max_tokens=max_tokens, min_tokens=shared_prefix)
        return pack(prompt_len[shard].tolist(), completion_len[shard].tolist(), max_rows=size, max_tokens=max_tokens)

    cuts = [[[shard[i] for i in chunk] for chunk in cut(shard)] for shard in shards]
    chunks = [table.take(pa.array(c, pa.int64())) for c in cuts[rank]]
    live = len(chunks)
    chunks += [table.slice(0, 1)] * (max(len(c) for c in cuts) - live)
    return [collate(c, pad_id, device, shared_prefix) for c in chunks], live


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
       coalesce(advantage, 0) <> 0 AS nonzero, {masked} AS masked,
       len(completion_token_ids) AS completion_len,
       coalesce(list_sum(completion_mask), len(completion_token_ids)) AS trained_len
FROM transitions
WHERE coalesce(split, 'train') = 'train'
  AND ($policy::VARCHAR IS NULL OR policy = $policy::VARCHAR)
  AND (created_unix_nano > $created OR (created_unix_nano = $created AND transition_id > $tid))
QUALIFY row_number() OVER (PARTITION BY transition_id ORDER BY created_unix_nano DESC) = 1
"""
# the zero-advantage sequences consumed up to the cutoff (Batch.zero_totals): sequences, trained
# tokens, longest completion; a sequence is a transition or, under loss_normalisation 'rollout', a
# rollout none of whose rows is trained (a trained rollout's zero rows, which only discounted credit
# makes, are left out of its size)
_ZERO_SQL = """
WITH z AS (SELECT {key} AS seq, sum(trained_len) AS tokens, sum(completion_len) AS length FROM new
           WHERE fresh AND wellformed AND NOT nonzero AND NOT masked AND {upto} {exclude}
           GROUP BY 1)
SELECT count(*), coalesce(sum(tokens), 0)::BIGINT, coalesce(max(length), 0)::BIGINT FROM z
"""
_ROLLOUT_KEY = "coalesce(nullif(rollout_id, ''), transition_id)"    # batches' step_totals' key


def _zero_sql(normalisation: str) -> str:
    if normalisation == "transition":
        return _ZERO_SQL.format(key="transition_id", upto=_UPTO, exclude="")
    trained = f"SELECT {_ROLLOUT_KEY} FROM new WHERE fresh AND wellformed AND nonzero AND NOT masked AND {_UPTO}"
    return _ZERO_SQL.format(key=_ROLLOUT_KEY, upto=_UPTO, exclude=f"AND {_ROLLOUT_KEY} NOT IN ({trained})")


_UPTO = "(created_unix_nano < $created OR (created_unix_nano = $created AND transition_id <= $tid))"
# the builder's per-row loss weight and outcome (lightningrl: a masked rollout's rows weigh 0); a
# store whose transitions predate them has neither column, and every row is trained
_WEIGHT_COLUMNS = ("loss_weight", "outcome")
_MASKED = {"loss_weight": "coalesce(loss_weight, 1) = 0", "outcome": "coalesce(outcome = 'masked', false)"}


def next_batch(data_dir: str | os.PathLike, config: TrainerConfig, *, version: int, cursor: Cursor, vocab_size: int,
               max_len: int, policy: str | None = None) -> Batch | None:
    """The next batch after ``cursor`` for a trainer at ``version``, or None if fewer than
    ``config.min_transitions`` are trainable. ``vocab_size`` and ``max_len`` are the model's:
    a row with a token id outside the vocabulary or longer than the model's positions is malformed.
    ``policy``: only that named policy's transitions (None: every transition, the unnamed policy's)."""
    con = store.connect(data_dir)
    try:
        have = [c for c in _WEIGHT_COLUMNS
                if c in {row[0] for row in con.execute("DESCRIBE SELECT * FROM transitions").fetchall()}]
        con.execute(_NEW_SQL.format(masked=" OR ".join(_MASKED[c] for c in have) or "false"), {
            "min_version": version - config.max_staleness, "vocab": vocab_size, "max_len": max_len, "policy": policy,
            "created": cursor.created_unix_nano, "tid": cursor.transition_id})
        con.execute("CREATE TEMP TABLE chosen AS SELECT created_unix_nano, transition_id FROM new "
                    "WHERE fresh AND wellformed AND nonzero AND NOT masked ORDER BY 1, 2 LIMIT $n",
                    {"n": config.batch_size or 2**62})
        keys = con.execute("SELECT * FROM chosen ORDER BY 1, 2").fetchall()
        if len(keys) < config.min_transitions:
            return None
        if config.batch_size and len(keys) == config.batch_size:
            cutoff = Cursor(*keys[-1])              # full batch: later rows wait for the next step
        else:
            cutoff = Cursor(*con.execute("SELECT created_unix_nano, transition_id FROM new "
                                         "ORDER BY 1 DESC, 2 DESC LIMIT 1").fetchall()[0])
        upto = {"created": cutoff.created_unix_nano, "tid": cutoff.transition_id}
        stale, malformed, zero, masked = con.execute(f"""
            SELECT count(*) FILTER (WHERE NOT fresh),
                   count(*) FILTER (WHERE fresh AND NOT wellformed),
                   count(*) FILTER (WHERE fresh AND wellformed AND NOT nonzero),
                   count(*) FILTER (WHERE fresh AND wellformed AND nonzero AND masked)
            FROM new WHERE {_UPTO}""", upto).fetchall()[0]
        zero_totals = BatchTotals(*con.execute(_zero_sql(config.loss_normalisation), upto).fetchall()[0])
        reward_mean = con.execute(f"""
            SELECT avg(reward) FROM (SELECT any_value(reward) AS reward FROM new
                                     WHERE fresh AND {_UPTO} GROUP BY rollout_id)""", upto).fetchall()[0][0]
        # the range filter lets DuckDB skip row groups by their min/max statistics; read as Arrow
        # (con.sql: a result of execute() would be copied once more), every result before it fetched
        table = con.sql(f"""
            SELECT t.transition_id, t.rollout_id, t.task_id, t.prompt_token_ids, t.completion_token_ids,
                   t.completion_logprobs, t.completion_mask, t.model_version, t.temperature, t.reward, t.advantage,
                   t.created_unix_nano{"".join(f", t.{c}" for c in have)}
            FROM transitions t JOIN chosen c USING (created_unix_nano, transition_id)
            WHERE t.created_unix_nano BETWEEN $first AND $last
            ORDER BY t.created_unix_nano, t.transition_id""",
            params={"first": keys[0][0], "last": keys[-1][0]}).to_arrow_table()
    finally:
        con.close()
    # a file listed twice reads twice: each transition once, at its first row
    _, first = np.unique(table.column("transition_id").to_numpy(zero_copy_only=False), return_index=True)
    if len(first) < table.num_rows:
        table = table.take(np.sort(first))
    staleness = version - pc.cast(table.column("model_version"), pa.float64()).to_numpy()
    return Batch(table=table, cursor=cutoff, skipped_stale=stale, skipped_malformed=malformed,
                 zero_advantage=zero, zero_totals=zero_totals, masked=masked, reward_mean=reward_mean,
                 staleness_mean=float(staleness.mean()))
