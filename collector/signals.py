"""The two signals the collector receives and stores, traces and logs, and what differs between them.

:data:`SIGNALS` is, per signal, its request parsers (``protobuf``, ``json``), its counter
(``count``), its row builder (``flatten``), the prefix of its metrics (``metric``: ``spans_…``,
``log_records_…``), its table, the column its date partitions are cut by (``time``) and the sort of
a Parquet file (``sort``): the receivers (collector/server.py) parse and count by it, the writer
(collector/writer.py) flattens, partitions and sorts by it. :data:`LOGS_TAG` marks a WAL record
of logs (collector/wal.py: trace requests are stored untagged).
"""

from __future__ import annotations

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

from lightspan.collector.otlp import count_spans, flatten
from lightspan.collector.otlp_logs import count_log_records, flatten_logs, parse_json_logs_request
from lightspan.collector.otlp_parse import parse_json_request, parse_protobuf_request

LOGS_TAG = b"\x00L"    # WAL records of logs; untagged records are trace requests (see wal.py)
# per signal: the request parsers, the row builder, the counter prefix, the partition time column
SIGNALS = {
    "traces": dict(protobuf=parse_protobuf_request, json=parse_json_request, count=count_spans,
                   flatten=flatten, metric="spans", time="start_time_unix_nano", table="spans",
                   sort=[("rollout_id", "ascending"), ("start_time_unix_nano", "ascending")]),
    "logs": dict(protobuf=lambda body: parse_protobuf_request(body, ExportLogsServiceRequest),
                 json=parse_json_logs_request, count=count_log_records, flatten=flatten_logs,
                 metric="log_records", time="time_unix_nano", table="logs",
                 sort=[("rollout_id", "ascending"), ("time_unix_nano", "ascending")]),
}
