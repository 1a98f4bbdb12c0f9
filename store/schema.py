"""The Parquet schemas of the store's base tables: one row per span, log record, transition, train step.

Promoted columns are what readers filter or join on (docs/architecture.md, "Storage"); everything
else of a span is in its ``attributes`` map, JSON-encoded values.
"""

from __future__ import annotations

import pyarrow as pa

_EVENT = pa.struct([("time_unix_nano", pa.int64()), ("name", pa.string()), ("attributes", pa.string())])
_LINK = pa.struct([("trace_id", pa.string()), ("span_id", pa.string()), ("attributes", pa.string())])

SPAN_SCHEMA = pa.schema([
    ("trace_id", pa.string()),               # 32 lowercase hex
    ("span_id", pa.string()),                # 16 lowercase hex
    ("parent_span_id", pa.string()),         # null for a root span
    ("name", pa.string()),
    ("kind", pa.string()),                   # INTERNAL, SERVER, CLIENT, PRODUCER, CONSUMER
    ("service_name", pa.string()),
    ("scope_name", pa.string()),
    ("start_time_unix_nano", pa.int64()),
    ("end_time_unix_nano", pa.int64()),
    ("status_code", pa.string()),            # UNSET, OK, ERROR
    ("status_message", pa.string()),
    # rollout grouping: span attribute first, else resource attribute
    ("rollout_id", pa.string()),
    ("task_id", pa.string()),
    ("split", pa.string()),
    # GenAI
    ("operation_name", pa.string()),
    ("request_model", pa.string()),
    ("response_model", pa.string()),
    ("temperature", pa.float64()),           # gen_ai.request.temperature; null = the server's default
    ("input_tokens", pa.int64()),
    ("output_tokens", pa.int64()),
    # of those: served from the provider's prompt cache, written to it, spent reasoning
    # (gen_ai.usage.cache_read.input_tokens, …: v0.1.0 names, or the older cache_read_input_tokens, …)
    ("cache_read_input_tokens", pa.int64()),
    ("cache_creation_input_tokens", pa.int64()),
    ("reasoning_output_tokens", pa.int64()),
    ("finish_reasons", pa.list_(pa.string())),
    ("agent_name", pa.string()),
    ("input_messages", pa.string()),         # JSON text as the instrumentation wrote it
    ("output_messages", pa.string()),
    # RL
    ("prompt_token_ids", pa.list_(pa.int32())),
    ("completion_token_ids", pa.list_(pa.int32())),   # choice 0
    ("completion_logprobs", pa.list_(pa.float32())),  # choice 0, sampled-token logprobs
    ("num_choices", pa.int32()),
    ("model_version", pa.int64()),
    ("policy", pa.string()),                 # lightspan.policy.name: the policy that served the call
    ("capture_status", pa.string()),
    ("reward", pa.float64()),
    ("reward_name", pa.string()),
    # everything else
    ("attributes", pa.map_(pa.string(), pa.string())),           # JSON-encoded values
    ("resource_attributes", pa.map_(pa.string(), pa.string())),  # JSON-encoded values
    ("events", pa.list_(_EVENT)),
    ("links", pa.list_(_LINK)),
    ("received_unix_nano", pa.int64()),
])
"""One row per span. Promoted columns are what readers filter or join on."""

TRANSITION_SCHEMA = pa.schema([
    ("transition_id", pa.string()),          # rollout_key/span_id: unique per LLM call
    ("rollout_id", pa.string()),             # lightspan.rollout.id, else the trace id
    ("task_id", pa.string()),
    ("split", pa.string()),
    ("agent_name", pa.string()),
    ("call_index", pa.int32()),              # 0-based position of the call in its rollout
    ("num_calls", pa.int32()),
    ("prompt_token_ids", pa.list_(pa.int32())),
    ("completion_token_ids", pa.list_(pa.int32())),
    ("completion_logprobs", pa.list_(pa.float32())),
    ("model_version", pa.int64()),
    ("temperature", pa.float64()),           # sampling temperature of the (first) call; null = 1
    ("reward", pa.float64()),                # the rollout's reward
    ("credit", pa.float64()),                # the reward this call received (credit policy)
    ("advantage", pa.float64()),
    ("credit_policy", pa.string()),
    ("advantage_estimator", pa.string()),
    ("build_id", pa.string()),
    ("created_unix_nano", pa.int64()),
    # per-rollout output: 1 where the model sampled the completion token, 0 where it did not
    # (tool output, user turn, template tokens); null = all ones (one call per transition)
    ("completion_mask", pa.list_(pa.int8())),
    # the policy that trains on it (lightspan/store/policies.py); null: the unnamed policy
    ("policy", pa.string()),
    # per-rollout output: the row's segment among its rollout and agent's rows (0: the first; a
    # new one starts where a prompt does not extend the sequence) and the prefix mismatch that
    # started it (compaction, chat_template, retokenization, tool_text; null for segment 0);
    # null with one call per transition
    ("segment", pa.int32()),
    ("segment_cause", pa.string()),
    # rows of its rollout in its build (for this policy): a loss normalised per rollout weighs
    # each row 1/rollout_rows, so a rollout split into k rows weighs as one; null = unknown (older)
    ("rollout_rows", pa.int32()),
    # the rollout's outcome as trained: ok, failed (the agent's fault, trained with its real
    # reward) or masked (in its group's baseline, no loss); null = ok (older builds)
    ("outcome", pa.string()),
    # the weight of the row's loss: 1, 0 for a masked rollout's rows; null = 1
    ("loss_weight", pa.float64()),
])

TRAIN_STEP_SCHEMA = pa.schema([
    ("run_id", pa.string()),
    ("policy", pa.string()),                 # the policy the step trained; null: the unnamed policy
    ("step", pa.int64()),
    ("policy_version", pa.int64()),          # the version the step produced
    ("time_unix_nano", pa.int64()),
    ("num_transitions", pa.int64()),
    ("num_tokens", pa.int64()),
    ("reward_mean", pa.float64()),
    ("advantage_abs_mean", pa.float64()),
    ("loss", pa.float64()),
    ("clip_ratio", pa.float64()),
    ("is_ratio_mean", pa.float64()),
    ("entropy", pa.float64()),
    ("entropy_floor", pa.float64()),         # the trainer's entropy_floor when the step ran (null: none)
    ("kl", pa.float64()),
    ("grad_norm", pa.float64()),             # the gradient's L2 norm before clipping (the last pass's)
    ("staleness_mean", pa.float64()),
    ("skipped_stale", pa.int64()),
    ("step_seconds", pa.float64()),
    ("sync_seconds", pa.float64()),
    ("sync_max_abs_logprob_diff", pa.float64()),
])

LOG_SCHEMA = pa.schema([
    ("time_unix_nano", pa.int64()),          # the record's time, else its observed time, else receipt
    ("observed_time_unix_nano", pa.int64()),
    ("severity_number", pa.int32()),         # 0 unspecified, 1-4 TRACE ... 21-24 FATAL
    ("severity_text", pa.string()),
    ("body", pa.string()),                   # the body AnyValue as JSON text ("\"text\"", {...}, ...)
    ("event_name", pa.string()),             # LogRecord.event_name, else the event.name attribute
    ("trace_id", pa.string()),               # 32 lowercase hex, null when the record has none
    ("span_id", pa.string()),
    ("service_name", pa.string()),
    ("scope_name", pa.string()),
    # rollout grouping: record attribute first, else resource attribute (as for spans)
    ("rollout_id", pa.string()),
    ("task_id", pa.string()),
    ("split", pa.string()),
    ("attributes", pa.map_(pa.string(), pa.string())),           # JSON-encoded values
    ("resource_attributes", pa.map_(pa.string(), pa.string())),  # JSON-encoded values
    ("record_id", pa.string()),              # hash of resource + scope + record: the dedup key
    ("received_unix_nano", pa.int64()),
])
"""One row per OTLP log record. Logs have no ids, so a content hash deduplicates re-sent ones."""

DEPLOYMENT_SCHEMA = pa.schema([
    ("time_unix_nano", pa.int64()),          # when the decision was made (its row's order)
    ("policy", pa.string()),                 # the named policy; null: the unnamed policy
    ("version", pa.int64()),                 # the policy version the decision is about
    ("action", pa.string()),                 # serve, canary, promote, rollback (store/deployments.py)
    ("actor", pa.string()),                  # auto (the gateway's rule) or manual (lightspan deploy)
    ("share", pa.float64()),                 # canary: the share of rollouts the version gets
    ("serving_version", pa.int64()),         # the version it was compared with (serving then)
    ("checkpoint", pa.string()),             # the version's checkpoint (policy.json's path), if known
    # the evidence of an automatic decision: rewarded rollouts and mean reward per arm, the
    # one-sided Welch statistic of (candidate - serving + margin), its degrees of freedom and p-value
    ("candidate_rollouts", pa.int64()),
    ("serving_rollouts", pa.int64()),
    ("candidate_reward_mean", pa.float64()),
    ("serving_reward_mean", pa.float64()),
    ("t_statistic", pa.float64()),
    ("df", pa.float64()),
    ("p_value", pa.float64()),
    ("reason", pa.string()),
])
"""One row per deployment decision about a policy version: the canary state is their fold."""

SCHEMAS = {"spans": SPAN_SCHEMA, "transitions": TRANSITION_SCHEMA, "train_steps": TRAIN_STEP_SCHEMA,
           "logs": LOG_SCHEMA, "deployments": DEPLOYMENT_SCHEMA}
TABLES = tuple(SCHEMAS)
"""The base tables: one directory each under the data directory."""

REWARD_SCOPE = "lightspan.collector.rewards"
"""The instrumentation scope of the rewards the collector's API writes (``POST /v1/rewards``). Only
the API writes spans in it (the collector rejects an OTLP span that claims it), so the views take a
reward's source from it: any other reward span is the agent's, whatever it claims."""

# tables written by the collector: hive-partitioned by date, deduplicated on these keys when
# written (at-least-once delivery: the first copy received wins; see collector/dedup.py)
PARTITIONED = {"spans": ("trace_id", "span_id"), "logs": ("record_id",)}
