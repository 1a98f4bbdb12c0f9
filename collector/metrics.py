"""The collector measures itself: counters and summaries in the Prometheus text format.

Every metric is named ``lightspan_collector_<name>`` and explained once, in its HELP line below.
"""

from __future__ import annotations

import threading

from lightspan.collector.outcomes import Outcome

_PREFIX = "lightspan_collector_"
COUNTERS = {
    "spans_received_total": "Spans in parsed export requests (a refused request retried counts again).",
    "spans_accepted_total": "Spans acknowledged: durable in the WAL, on their way to Parquet.",
    "spans_rejected_total": "Malformed spans dropped from otherwise valid requests (partial_success).",
    "spans_written_total": "Spans written to Parquet, WAL replay included.",
    "spans_replayed_total": "Spans recovered from the WAL at start-up.",
    "spans_deduplicated_total": "Spans not written because the store holds them already (an exporter's retry, a WAL replay).",
    "log_records_received_total": "Log records in parsed OTLP logs requests.",
    "log_records_accepted_total": "Log records acknowledged: durable in the WAL, on their way to Parquet.",
    "log_records_rejected_total": "Malformed log records dropped from otherwise valid requests (partial_success).",
    "log_records_written_total": "Log records written to Parquet, WAL replay included.",
    "log_records_deduplicated_total": "Log records not written because the store holds them already.",
    "rewards_accepted_total": "Late rewards stored through POST /v1/rewards or POST /v1/rollouts/ID/events "
                              "(a re-post of a stored reward is not counted).",
    "events_ignored_total": "Agent Lightning events acknowledged but not stored (an event_type other than reward).",
    "reward_forgeries_total": "OTLP spans rejected because they claimed the reward scope only the API writes "
                              "(lightspan.collector.rewards).",
    "reward_source_refusals_total": "POST /v1/rewards refused (403) because a reward's source was not the agent's "
                                    "and the request did not carry reward_token.",
    "reward_claims_total": "OTLP spans whose lightspan.reward.source claim was set aside: stored as the agent's.",
    "evaluations_received_total": "gen_ai.evaluation.result events read (log records and span events), WAL replay "
                                  "included.",
    "evaluations_stored_total": "Evaluation events stored as reward spans (collector/evaluations.py).",
    "evaluations_unvalued_total": "Of those, evaluations with a label and no score that evaluation_label_values does "
                                  "not map: stored, not trained on.",
    "evaluations_unmatched_total": "Evaluations stored without their evaluated span's rollout (it had not arrived "
                                   "within evaluation_wait_s, or the event named no span or response): keyed by "
                                   "the evaluated trace.",
    "evaluations_invalid_total": "Evaluation events that are no evaluation: no gen_ai.evaluation.name, or error.type "
                                 "set (the evaluation failed). The log record is stored; no reward.",
    "evaluations_conflicting_total": "Evaluation log records rejected because their key (evaluator, name, evaluated "
                                     "span) holds another value already (partial_success).",
    "forward_queued_total": "Acknowledged requests queued to be forwarded to [collector.forward]'s endpoint.",
    "forward_sent_total": "Requests the forward endpoint accepted.",
    "forward_dropped_total": "Requests not forwarded: the queue was full, the endpoint refused them (not "
                             "retryable), retries ran past max_elapsed_s, or the collector stopped first.",
    "forward_retries_total": "Retried tries of the forward endpoint (connection errors, 408/429/502/503/504).",
    "flush_errors_total": "Flushes that failed to write Parquet; their data stays queued and in the WAL.",
    "compactions_total": "Date partitions whose small Parquet files were merged into one.",
    "files_compacted_total": "Small Parquet files removed by compaction (replaced by merged files).",
    "partitions_expired_total": "Date partitions deleted by the retention limit (retention_days).",
    "maintenance_errors_total": "Compaction or retention runs that failed; they are retried on the next interval.",
    "sql_queries_total": "Queries answered by the SQL endpoint.",
    "sql_errors_total": "Queries refused by the SQL endpoint (bad SQL, not read-only, time limit, external access).",
}


class Metrics:
    """Counters and summaries of one collector, rendered in the Prometheus text format."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._refused = {o.value: 0 for o in Outcome if o is not Outcome.OK}
        self._flush_sum = 0.0
        self._flush_count = 0

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def refused(self, outcome: Outcome) -> None:
        with self._lock:
            self._refused[outcome.value] += 1

    def observe_flush(self, seconds: float) -> None:
        with self._lock:
            self._flush_sum += seconds
            self._flush_count += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {**self._counters, "requests_refused_total": dict(self._refused),
                    "flush_seconds_sum": self._flush_sum, "flush_seconds_count": self._flush_count}

    @staticmethod
    def render(snap: dict) -> str:
        """The Prometheus text of ``Collector.health()``'s numbers (a :meth:`snapshot` plus the
        queue, WAL and fsync figures)."""
        lines = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP {_PREFIX}{name} {help_}")
            lines.append(f"# TYPE {_PREFIX}{name} {kind}")
            lines.extend(f"{_PREFIX}{sample} {value}" for sample, value in samples)

        for name, help_ in COUNTERS.items():
            metric(name, "counter", help_, [(name, snap[name])])
        metric("requests_refused_total", "counter",
               "Requests answered with an error, by reason (disk: the WAL could not be written).",
               [(f'requests_refused_total{{reason="{r}"}}', n) for r, n in snap["requests_refused_total"].items()])
        metric("queue_bytes", "gauge", "Bytes accepted but not yet in Parquet (trace requests as received, log records as Arrow; bounded by max_queue_bytes).",
               [("queue_bytes", snap["queue_bytes"])])
        metric("wal_bytes", "gauge", "Bytes in WAL segment files.", [("wal_bytes", snap["wal_bytes"])])
        metric("inflight_bytes", "gauge", "Request bytes held by the receivers and the API now (bounded by max_inflight_bytes).",
               [("inflight_bytes", snap["inflight_bytes"])])
        metric("connections", "gauge", "Open connections on the OTLP/HTTP and API ports.",
               [("connections", snap["connections"])])
        metric("connections_refused_total", "counter",
               "Connections refused on the HTTP ports because max_connections were open.",
               [("connections_refused_total", snap["connections_refused_total"])])
        metric("flush_seconds", "summary", "Time to write queued rows to Parquet, per flush with data.",
               [("flush_seconds_sum", snap["flush_seconds_sum"]), ("flush_seconds_count", snap["flush_seconds_count"])])
        metric("fsync_seconds", "summary", "Time in WAL fsync (one fsync may cover several exports).",
               [("fsync_seconds_sum", snap["fsync_seconds_sum"]), ("fsync_seconds_count", snap["fsync_seconds_count"])])
        return "\n".join(lines) + "\n"
