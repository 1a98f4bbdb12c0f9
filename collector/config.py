"""The collector's configuration: one frozen dataclass, resolved by :mod:`lightspan.core.config`.

Build it with ``resolve(CollectorConfig, section="collector", file=..., cli=...)``; every field
is also ``LIGHTSPAN_COLLECTOR_<FIELD>`` in the environment (``data_dir`` also answers to
``LIGHTSPAN_DATA_DIR``, the variable every lightspan component reads).

:func:`writable` is the start-up check of a directory the configuration names: one that cannot be
written is a ConfigError naming it and the field that chose it (:func:`not_writable`).
"""

from __future__ import annotations

import math
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from lightspan.collector.jsonlog import FORMATS
from lightspan.core.config import ConfigError, is_loopback, option
from lightspan.store.layout import DATA_DIR_ENV, DEFAULT_DATA_DIR, WAL_DIR
from lightspan.store.location import NOT_WRITABLE, Location

SECTION = "collector"
MiB = 1 << 20


@dataclass(frozen=True)
class CollectorConfig:
    data_dir: str = option(
        DEFAULT_DATA_DIR,
        "Data location: a directory (spans/ as Parquet hive-partitioned by date, and wal/), or an "
        "S3-compatible bucket s3://BUCKET/PREFIX (credentials and endpoint from the standard AWS variables "
        "and ~/.aws files; the WAL then lives in wal_dir).",
        env=DATA_DIR_ENV)
    wal_dir: str = option(
        "",
        "Local directory of the write-ahead log; empty = DATA_DIR/wal. Required when data_dir is a bucket: "
        "an export is acknowledged once it is fsynced here, and its segments are deleted only after the "
        "objects holding its rows are written.")
    collector_id: str = option(
        "",
        "This collector's name in a bucket shared by several: it writes, compacts and expires only "
        "TABLE/collector=<id>/date=…/ (letters, digits, '.', '_', '-'). Empty = the host name (a "
        "StatefulSet pod's is stable). Unused for a directory, which one collector owns.")
    host: str = option(
        "127.0.0.1",
        "Address the receivers and the API bind to. 0.0.0.0 exposes them to the network (then auth_token is "
        "required, unless allow_no_token).")
    grpc_port: int = option(4317, "OTLP/gRPC port (the OTLP default is 4317; 0 = any free port).")
    http_port: int = option(4318, "OTLP/HTTP port, protobuf and JSON (the OTLP default is 4318; 0 = any free port).")
    api_port: int = option(
        8321, "Port of the API: /healthz, /metrics, POST /v1/flush, POST /v1/rewards, /v1/sql (0 = any free port).")
    flush_interval_s: float = option(
        1.0,
        "Seconds between Parquet flushes. Each flush writes one file per date partition, so a "
        "longer interval means fewer, larger files and more data waiting in the WAL.")
    max_queue_bytes: int = option(
        256 * MiB,
        "Bytes of accepted exports waiting for Parquet (a trace request's protobuf size: the writer "
        "flattens it; a log request's Arrow size). Past it, exports are refused "
        "with a retryable status (gRPC UNAVAILABLE + RetryInfo, HTTP 503 + Retry-After).")
    grpc_max_receive_bytes: int = option(
        64 * MiB,
        "Largest gRPC request accepted. gRPC's own default (4 MiB) is smaller than a 512-span "
        "batch with token ids.")
    max_http_body_bytes: int = option(
        64 * MiB,
        "Largest OTLP/HTTP body, checked before and after gunzip; larger bodies get 413.")
    retry_after_s: int = option(
        1,
        "Seconds a refused client is told to wait (HTTP Retry-After, gRPC RetryInfo).")
    auth_token: str = option(
        "",
        "Bearer token required on ingest (gRPC metadata and HTTP header `authorization: Bearer "
        "<token>`) and on the API, /healthz excepted; empty = no authentication (loopback only, unless allow_no_token). Agents send it "
        "with OTEL_EXPORTER_OTLP_HEADERS (authorization=Bearer <token>, the space URL-encoded). "
        "Without TLS it crosses the network in clear text; prefer the environment variable to "
        "--auth-token, which shows in the process list.")
    reward_token: str = option(
        "",
        "Bearer token that a POST /v1/rewards needs to record a reward from a person, the judge or another "
        "tool (source human, judge or api); with auth_token alone (what agents hold: lightspan rollout gives "
        "them only that) a posted reward must be the agent's own (source agent), so the policy under "
        "training cannot post a score as a person or the judge. It also opens everything auth_token opens "
        "on the API (the web UI and the judge carry it). Empty = any client that may use the API may post "
        "any source (set it wherever agents can reach the API).")
    tls_cert_file: str = option(
        "",
        "PEM certificate (chain) served on the gRPC, HTTP and API ports; set with tls_key_file. "
        "Empty = plain text.")
    tls_key_file: str = option("", "PEM private key of tls_cert_file.")
    allow_no_token: bool = option(
        False,
        "Let the collector bind a non-loopback host without auth_token: anyone who reaches its ports can then "
        "write spans and rewards and read every span over SQL. Without it such a start fails.")
    allowed_hosts: tuple[str, ...] = option(
        (),
        "Host names the HTTP ports and the API answer to besides IP addresses and localhost, comma-separated "
        "(e.g. the service's DNS name): a request naming another host is refused with 403, so a web page that "
        "rebinds its own name to this machine cannot use the API. \"*\" answers any name.")
    max_connections: int = option(
        256,
        "Open connections per HTTP port; past it a new connection is answered 503 + Retry-After and closed.")
    max_inflight_bytes: int = option(
        256 * MiB,
        "Request bytes held at once by the receivers and the API (both HTTP ports and gRPC together, while "
        "they are read and handled); past it requests are refused with 503 + Retry-After (gRPC UNAVAILABLE).")
    read_timeout_s: float = option(
        30.0,
        "Time a request's head and body have to arrive on the HTTP ports, from its first byte; past it the "
        "request is answered 408 and its connection closed (a client that stalls holds nothing for long).")
    max_json_bytes: int = option(
        8 * MiB,
        "Largest OTLP/JSON body (after gunzip) and API JSON body; larger ones get 413. Decoding JSON holds "
        "several times its size in memory, so at most this many bytes of OTLP/JSON bodies are decoded at once "
        "(smaller bodies beside a big one; past it they wait, then 503 + Retry-After).")
    sql_timeout_s: float = option(
        10.0, "Time limit of one query on the API's read-only SQL endpoint (/v1/sql); past it the query is interrupted.")
    sql_max_rows: int = option(
        10_000, "Most rows one /v1/sql answer returns; the answer says `truncated: true` when there were more.")
    sql_max_result_bytes: int = option(
        16 * MiB, "Most bytes of rows (as JSON) one /v1/sql answer returns; past it, `truncated: true` too.")
    sql_memory_limit_bytes: int = option(
        512 * MiB,
        "Memory one /v1/sql query may use. Queries run in worker processes capped at this much (DuckDB's "
        "memory_limit and the process's address space), so a query that needs more fails alone.")
    sql_max_concurrent: int = option(
        2, "Queries run at once (/v1/sql and the web UI's); more wait briefly, then get 429 + Retry-After.")
    compact_min_files: int = option(
        16,
        "Compact a date partition (merge its small Parquet files into one, sorted by rollout and time) "
        "once it holds more than this many small files; the writer checks after each flush. 0 = only "
        "when Collector.compact() is called.")
    log_format: str = option(
        "json",
        "Log lines of the collector service on stderr: \"json\" (one object per line: ts, level, logger, "
        "msg, then the event's fields; for log shippers) or \"text\" (for a terminal).",
        choices=FORMATS)
    log_refusals_every_s: float = option(
        10.0,
        "Refused exports (bad data, queue full, disk) are logged as warnings at most once per reason "
        "this often, with the number left out since the last line; every refusal is counted in /metrics.")
    dedup_window_s: float = option(
        600.0,
        "The writer remembers the (trace_id, span_id) of the spans it wrote (and the ids of log records) "
        "at least this long and drops a copy received again (an exporter's retry): the store is "
        "deduplicated at write time, and its views read the files without a deduplicating window. "
        "Longer than any exporter's retry horizon (the OpenTelemetry Collector's is 300 s).")
    dedup_max_keys: int = option(
        1_000_000,
        "Most keys the writer remembers for dedup_window_s (≈ 90 bytes each); past max_keys / 2 keys in the "
        "window it remembers at least the last max_keys / 2.")
    retention_days: int = option(
        0,
        "Delete whole date partitions of spans and logs whose day ended this many days ago or more "
        "(checked after each flush). 0 = keep everything.")
    evaluation_label_values: dict[str, float] | None = option(
        None,
        "Values of the labels of gen_ai.evaluation.result events that carry a label and no score, so they "
        "train: a table {LABEL = value} or {\"NAME/LABEL\" = value} for one evaluation's label (the "
        "environment takes it as JSON). An evaluation with a label it does not map is stored and not trained "
        "on.")
    forward: dict | None = option(
        None,
        "Forward what the collector acknowledges to another OTLP/HTTP endpoint: a [collector.forward] table "
        "(endpoint, headers, queue_bytes, timeout_s, backoff_s, backoff_max_s, max_elapsed_s, drain_s; "
        "collector/forward.py), or the same as JSON in the environment. A bounded queue and retries with backoff; "
        "it never holds up an acknowledgement, and what it drops is counted.")
    evaluation_wait_s: float = option(
        60.0,
        "How long an evaluation event that arrives before the span it evaluates waits for that span (its "
        "rollout is the span's); past it, it is stored keyed by the evaluated trace. At most dedup_window_s (a "
        "restart reads the waiting ones back, and the store drops a copy written within that window).")

    def __post_init__(self) -> None:
        def fail(name: str, problem: str, fix: str) -> None:
            raise ConfigError(SECTION, name, problem, fix)

        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not isinstance(self.data_dir, str) or not self.data_dir.strip():
            fail("data_dir", f"{self.data_dir!r} is not a directory path", "give a writable directory")
        if Location(self.data_dir).local(WAL_DIR) is None:     # a bucket: the WAL is on a local disk all the same
            if not self.wal_dir:
                fail("wal_dir", f"data_dir {self.data_dir!r} is a bucket, and the WAL must be on a local disk",
                     "set collector.wal_dir (LIGHTSPAN_COLLECTOR_WAL_DIR) to a local directory, e.g. /var/lib/lightspan/wal")
            if Location(self.wal_dir).local() is None:
                fail("wal_dir", f"{self.wal_dir!r} is a bucket; the WAL is fsynced on every export",
                     "give a local directory")
        if self.collector_id and not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", self.collector_id):
            fail("collector_id", f"{self.collector_id!r} is not a name for a prefix",
                 "use letters, digits, '.', '_' and '-' (e.g. the pod name)")
        if not isinstance(self.host, str) or not self.host.strip():
            fail("host", f"{self.host!r} is not a host address", "use 127.0.0.1, or 0.0.0.0 to listen on every interface")
        for name in ("grpc_port", "http_port", "api_port"):
            value = getattr(self, name)
            if not is_int(value) or not 0 <= value <= 65535:
                fail(name, f"{value!r} is not a port", "use 0..65535 (0 picks a free port)")
        ports = [getattr(self, n) for n in ("grpc_port", "http_port", "api_port")]
        nonzero = [p for p in ports if p]
        if len(set(nonzero)) != len(nonzero):
            fail("api_port", f"grpc_port, http_port and api_port share a port ({ports})", "give each a different port")
        if (not isinstance(self.flush_interval_s, (int, float)) or isinstance(self.flush_interval_s, bool)
                or not math.isfinite(self.flush_interval_s) or self.flush_interval_s <= 0):
            fail("flush_interval_s", f"{self.flush_interval_s!r} is not a positive number of seconds",
                 "use a value such as 1.0")
        if not is_loopback(self.host) and not self.auth_token and not self.allow_no_token:
            fail("auth_token", f"host {self.host!r} exposes the receivers and the API (SQL over every span, "
                 "rewards) beyond this machine without a token",
                 "set collector.auth_token (LIGHTSPAN_COLLECTOR_AUTH_TOKEN), bind 127.0.0.1, or set "
                 "collector.allow_no_token = true to run without one on purpose")
        for name in ("max_queue_bytes", "grpc_max_receive_bytes", "max_http_body_bytes", "max_inflight_bytes",
                     "max_json_bytes", "sql_max_result_bytes", "sql_memory_limit_bytes"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                fail(name, f"{value!r} is not a positive number of bytes", f"use e.g. {64 * MiB} (64 MiB)")
        if self.grpc_max_receive_bytes >= 1 << 31:
            fail("grpc_max_receive_bytes", f"{self.grpc_max_receive_bytes} does not fit gRPC's int32 limit",
                 "use less than 2 GiB")
        if not is_int(self.retry_after_s) or self.retry_after_s <= 0:
            fail("retry_after_s", f"{self.retry_after_s!r} is not a positive whole number of seconds",
                 "use 1 or more (HTTP Retry-After takes whole seconds)")
        if not isinstance(self.auth_token, str) or any(c.isspace() or not c.isprintable() for c in self.auth_token):
            fail("auth_token", "the token holds whitespace or control characters (it travels in an HTTP header)",
                 "use a printable token without spaces, e.g. from `openssl rand -hex 32`")
        if not isinstance(self.reward_token, str) or any(c.isspace() or not c.isprintable()
                                                         for c in self.reward_token):
            fail("reward_token", "the token holds whitespace or control characters (it travels in an HTTP header)",
                 "use a printable token without spaces, e.g. from `openssl rand -hex 32`")
        if self.reward_token and self.reward_token == self.auth_token:
            fail("reward_token", "it equals auth_token, which agents hold, so an agent could post a person's score",
                 "give the reward token a value of its own")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            missing = "tls_key_file" if self.tls_cert_file else "tls_cert_file"
            fail(missing, "TLS needs both a certificate and its key", "set tls_cert_file and tls_key_file together")
        for name in ("tls_cert_file", "tls_key_file"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                fail(name, f"{path!r} is not a file", "give the path of a PEM file")
        if (not isinstance(self.sql_timeout_s, (int, float)) or isinstance(self.sql_timeout_s, bool)
                or not math.isfinite(self.sql_timeout_s) or self.sql_timeout_s <= 0):
            fail("sql_timeout_s", f"{self.sql_timeout_s!r} is not a positive number of seconds", "use e.g. 10")
        for name in ("max_connections", "sql_max_concurrent"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                fail(name, f"{getattr(self, name)!r} is not a whole number >= 1", "use e.g. 2")
        if (not isinstance(self.read_timeout_s, (int, float)) or isinstance(self.read_timeout_s, bool)
                or not math.isfinite(self.read_timeout_s) or self.read_timeout_s <= 0):
            fail("read_timeout_s", f"{self.read_timeout_s!r} is not a positive number of seconds", "use e.g. 30")
        if not all(isinstance(h, str) and h.strip() and not any(c.isspace() for c in h) for h in self.allowed_hosts):
            fail("allowed_hosts", f"{self.allowed_hosts!r} holds an empty name or whitespace",
                 "give host names separated by commas, e.g. lightspan-collector,lightspan-collector.lightspan")
        if not is_int(self.sql_max_rows) or self.sql_max_rows <= 0:
            fail("sql_max_rows", f"{self.sql_max_rows!r} is not a positive number of rows", "use e.g. 10000")
        if self.log_format not in FORMATS:
            fail("log_format", f"{self.log_format!r} is not a log format", 'use "json" or "text"')
        if (not isinstance(self.log_refusals_every_s, (int, float)) or isinstance(self.log_refusals_every_s, bool)
                or not math.isfinite(self.log_refusals_every_s) or self.log_refusals_every_s < 0):
            fail("log_refusals_every_s", f"{self.log_refusals_every_s!r} is not a number of seconds >= 0",
                 "use e.g. 10 (0 logs every refusal)")
        if (not isinstance(self.dedup_window_s, (int, float)) or isinstance(self.dedup_window_s, bool)
                or not math.isfinite(self.dedup_window_s) or self.dedup_window_s <= 0):
            fail("dedup_window_s", f"{self.dedup_window_s!r} is not a positive number of seconds", "use e.g. 600")
        if not is_int(self.dedup_max_keys) or self.dedup_max_keys < 2:
            fail("dedup_max_keys", f"{self.dedup_max_keys!r} is not a whole number >= 2", "use e.g. 1000000")
        if self.forward is not None:
            from lightspan.collector.forward import parse

            parse(self.forward)                 # a ConfigError naming collector.forward.<field>
        if self.evaluation_label_values is not None:
            if not isinstance(self.evaluation_label_values, dict) or not all(
                    isinstance(k, str) and k and isinstance(v, (int, float)) and not isinstance(v, bool)
                    and math.isfinite(v) for k, v in self.evaluation_label_values.items()):
                fail("evaluation_label_values", f"{self.evaluation_label_values!r} is not a table of labels to "
                     "finite numbers", 'give e.g. {pass = 1.0, fail = 0.0, "Relevance/relevant" = 1.0}')
        if (not isinstance(self.evaluation_wait_s, (int, float)) or isinstance(self.evaluation_wait_s, bool)
                or not math.isfinite(self.evaluation_wait_s) or self.evaluation_wait_s < 0):
            fail("evaluation_wait_s", f"{self.evaluation_wait_s!r} is not a number of seconds >= 0", "use e.g. 60")
        for name in ("compact_min_files", "retention_days"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                fail(name, f"{value!r} is not a whole number >= 0", "use 0 to switch it off")

    @property
    def wal_path(self) -> str:
        """Where the WAL lives: wal_dir, else DATA_DIR/wal."""
        return self.wal_dir or os.path.join(self.data_dir, WAL_DIR)

    @property
    def writer_id(self) -> str:
        """The collector's prefix name in a bucket: collector_id, else the host name."""
        name = self.collector_id or re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()) or "collector"
        return name[:128]


def not_writable(directory, field: str, exc: OSError) -> ConfigError:
    """The ConfigError of a directory (``collector.<field>``) that the collector cannot write to."""
    env = f"LIGHTSPAN_COLLECTOR_{field.upper()}"
    return ConfigError("collector", field, f"the collector cannot write to {directory} ({exc.strerror or exc})",
                       f"make {directory} writable for the collector's user (chown/chmod, or mount it read-write), "
                       f"or set collector.{field} ({env}, --{field.replace('_', '-')}) to a writable directory")


def writable(directory: Path, field: str) -> None:
    """Make ``directory`` if need be and write (then remove) a file in it: at start-up, before
    anything is written, a directory the collector cannot write to is one ConfigError naming it and
    ``collector.<field>``, not a traceback from the first write. Other errors (a full disk) pass:
    they are answered where they happen (503)."""
    try:
        Location.of(directory).check()
    except OSError as exc:
        if exc.errno not in NOT_WRITABLE:
            raise
        raise not_writable(directory, field, exc) from None
