"""lightspan's collector vs Arize Phoenix on the same GenAI span load, side by side in one run.

Usage (from the repository root; ≈ 2-3 min with the defaults, Phoenix's start-up included)::

    .venv/bin/python bench/collector_vs_phoenix.py [--seconds 10] [--senders 4] [--batch 64]
        [--transports grpc,http] [--phoenix-python PATH]

Phoenix runs from its own virtual environment (``--phoenix-python``, default
``~/.cache/lightspan/phoenix-venv/bin/python``; create it with ``python3.11 -m venv
~/.cache/lightspan/phoenix-venv && ~/.cache/lightspan/phoenix-venv/bin/pip install
arize-phoenix==20.26.1``). Not in the project's environment: arize-phoenix pulls in
``openinference-instrumentation-openai``, which registers a second ``openai`` OpenTelemetry
instrumentor, and ``opentelemetry-instrument`` would then make two spans per chat call in every
agent. Phoenix runs offline: telemetry off, SQLite in a temporary working directory, loopback.

Load: ``--batch``-span ``ExportTraceServiceRequest``s of GenAI chat spans (the requests of
``bench/collector_ingest.py``: traceloop-style attributes, JSON input/output messages) with ids
unique to each request (Phoenix keeps one row per span id). ``--token-ids`` picks how the 256
prompt + 64 completion token ids and 64 logprobs travel: ``none`` (left out, the default: both
store such spans as they are), ``array`` (OTel int/double arrays: lightspan keeps them as JSON
attributes, lightspan's contract is bytes, docs/architecture.md) or ``bytes`` (lightspan's little-endian encoding:
promoted to typed columns by lightspan; Phoenix acknowledges such spans and then fails to insert
them, bytes values are not JSON). Sent by ``--senders`` threads (one gRPC channel or HTTP
session each, protobuf, no compression) for ``--warmup`` + ``--seconds``, per target and
transport. A refusal with a retry delay (gRPC RetryInfo trailer, HTTP Retry-After) is retried
after it, as the OTel exporters do; any other failure is counted as an error and its spans as
not acknowledged (the exporter would drop them).

Printed per target and transport: spans/s acknowledged in the measured window, p50/p99 export
latency, refusals, errors, and **dropped**: spans acknowledged (warm-up included) that the
target did not store: for lightspan, missing from the ``spans`` view after a stop (the final
flush); for Phoenix, missing from its ``spans`` table once its insert queue has drained (the
count stops changing for 20 s); and **stored/s**: acknowledged spans in storage per second from
the first send until the last of them was stored (lightspan acknowledges only what its WAL has
fsynced, so its drain is the final Parquet flush; Phoenix acknowledges into an in-memory queue
and inserts into SQLite behind it, so a crash loses what it had not inserted). Then lightspan /
Phoenix per transport, acknowledged and stored.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from otlp_load import EXPORT_METHOD, GRPC_OPTIONS, RETRY_INFO_KEY, genai_request  # noqa: E402
from lightspan.runs import free_ports  # noqa: E402

STABLE_S = 20.0   # Phoenix has drained once its span count has not moved for this long
MARK = 6   # bytes of an id that are unique per request: trace_id = mark + 10 bytes, span_id = mark + 2


def templates(count: int, batch: int, rng: random.Random, token_ids: str = "array") -> list[tuple[bytes, bytes]]:
    """(serialized request, its mark): every id of a request starts with the mark, so one
    ``bytes.replace`` gives the request fresh ids. ``token_ids="array"`` turns the token-id and
    logprob bytes into OTel arrays of ints and doubles."""
    import numpy as np
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    out = []
    for _ in range(count):
        request = ExportTraceServiceRequest.FromString(genai_request(batch, rng))
        if token_ids == "none":
            for span in request.resource_spans[0].scope_spans[0].spans:
                kept = [kv for kv in span.attributes if kv.value.WhichOneof("value") != "bytes_value"]
                del span.attributes[:]
                span.attributes.extend(kept)
        if token_ids == "array":
            for span in request.resource_spans[0].scope_spans[0].spans:
                for kv in span.attributes:
                    if kv.value.WhichOneof("value") == "bytes_value":
                        floats = "logprobs" in kv.key
                        values = np.frombuffer(kv.value.bytes_value, "<f4" if floats else "<i4").tolist()
                        kv.value.ClearField("bytes_value")
                        array = kv.value.array_value.values
                        for v in values:
                            if floats:
                                array.add(double_value=v)
                            else:
                                array.add(int_value=v)
        mark = rng.randbytes(MARK)
        trace_id = mark + rng.randbytes(16 - MARK)
        for i, span in enumerate(request.resource_spans[0].scope_spans[0].spans):
            span.trace_id, span.span_id = trace_id, mark + i.to_bytes(8 - MARK, "big")
        payload = request.SerializeToString()
        assert payload.count(mark) == batch * 2
        out.append((payload, mark))
    return out


class Ledger:
    def __init__(self):
        self.lock = threading.Lock()
        self.acked: dict[str, int] = {}            # trace_id hex → spans acknowledged

    def add(self, trace_id: str, n: int) -> None:
        with self.lock:
            self.acked[trace_id] = n


def send(transport: str, port: int, path: str, payloads, batch: int, senders: int, warmup_s: float,
         seconds: float, ledger: Ledger, sender_base: int) -> dict:
    start = time.monotonic()
    window = (start + warmup_s, start + warmup_s + seconds)
    results = [dict(acked=0, refused=0, errors=0, latencies=[], error_kinds={}) for _ in range(senders)]

    def sender(k: int) -> None:
        out = results[k]
        if transport == "grpc":
            channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS + [
                ("grpc.use_local_subchannel_pool", 1)])
            export = channel.unary_unary(EXPORT_METHOD)
        else:
            session = requests.Session()
            url = f"http://127.0.0.1:{port}{path}"
        seq = 0
        while time.monotonic() < window[1]:
            template, mark = payloads[(k + seq) % len(payloads)]
            seq += 1
            fresh = bytes([sender_base + k]) + seq.to_bytes(MARK - 1, "big")
            payload = template.replace(mark, fresh)
            trace_id = (fresh + template[template.index(mark) + MARK:template.index(mark) + 16]).hex()
            delay = None
            while True:          # the same request until acknowledged, dropped, or the window ends
                t0 = time.monotonic()
                try:
                    if transport == "grpc":
                        export(payload, timeout=30)
                    else:
                        answer = session.post(url, data=payload, timeout=30,
                                              headers={"Content-Type": "application/x-protobuf"})
                        if answer.status_code in (429, 503) and answer.headers.get("Retry-After"):
                            raise _Retry(float(answer.headers["Retry-After"]))
                        if answer.status_code != 200:
                            raise _Failed(f"HTTP {answer.status_code}")
                except grpc.RpcError as error:
                    trailers = dict(error.trailing_metadata() or ())
                    if error.code() == grpc.StatusCode.UNAVAILABLE and RETRY_INFO_KEY in trailers:
                        from google.rpc import error_details_pb2
                        info = error_details_pb2.RetryInfo.FromString(trailers[RETRY_INFO_KEY]).retry_delay
                        delay = info.seconds + info.nanos / 1e9
                    else:
                        delay = _failed(out, f"gRPC {error.code().name}", t0, window)
                except _Retry as retry:
                    delay = retry.seconds
                except (_Failed, requests.RequestException) as exc:
                    delay = _failed(out, str(exc)[:60], t0, window)
                else:
                    t1 = time.monotonic()
                    ledger.add(trace_id, batch)
                    if window[0] <= t0 and t1 <= window[1]:
                        out["acked"] += batch
                        out["latencies"].append(t1 - t0)
                    break
                if delay is None:     # a permanent failure: the exporter drops the batch
                    break
                if window[0] <= t0:
                    out["refused"] += 1
                if time.monotonic() + delay >= window[1]:
                    break
                time.sleep(delay)
                delay = None
        if transport == "grpc":
            channel.close()
        else:
            session.close()

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(senders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    latencies = sorted(x for r in results for x in r["latencies"])
    kinds: dict[str, int] = {}
    for r in results:
        for kind, n in r["error_kinds"].items():
            kinds[kind] = kinds.get(kind, 0) + n
    return {
        "elapsed_s": time.monotonic() - start,
        "spans_per_s": sum(r["acked"] for r in results) / seconds,
        "p50_ms": 1000 * statistics.median(latencies) if latencies else float("nan"),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else float("nan"),
        "refused": sum(r["refused"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "error_kinds": kinds,
    }


class _Retry(Exception):
    def __init__(self, seconds: float):
        self.seconds = seconds


class _Failed(Exception):
    pass


def _failed(out: dict, kind: str, t0: float, window) -> None:
    if window[0] <= t0:
        out["errors"] += 1
        out["error_kinds"][kind] = out["error_kinds"].get(kind, 0) + 1
    return None


# --- lightspan, in a child process ----------------------------------------------------------------

def _lightspan(conn, data_dir: str) -> None:
    from lightspan import store
    from lightspan.collector.config import CollectorConfig
    from lightspan.collector.server import Collector

    collector = Collector(CollectorConfig(data_dir=data_dir, grpc_port=0, http_port=0, api_port=0)).start()
    conn.send((collector.grpc_port, collector.http_port))
    conn.recv()
    start = time.monotonic()
    collector.stop()                                 # the final flush
    stop_s = time.monotonic() - start
    con = store.connect(data_dir)
    stored = dict(con.execute("SELECT trace_id, count(*) FROM spans GROUP BY 1").fetchall())
    con.close()
    conn.send((stored, stop_s))


def run_lightspan(transport: str, args, payloads) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    ledger = Ledger()
    with tempfile.TemporaryDirectory(prefix="lightspan-vs-phoenix-", dir=args.data_dir) as data_dir:
        process = ctx.Process(target=_lightspan, args=(child, data_dir), daemon=True)
        process.start()
        try:
            if not parent.poll(60):
                raise RuntimeError("lightspan did not start")
            grpc_port, http_port = parent.recv()
            port = grpc_port if transport == "grpc" else http_port
            result = send(transport, port, "/v1/traces", payloads, args.batch, args.senders, args.warmup,
                          args.seconds, ledger, sender_base=1)
            parent.send("stop")
            if not parent.poll(300):
                raise RuntimeError("lightspan did not stop")
            stored, drain_s = parent.recv()
        finally:
            process.join(30)
            if process.is_alive():
                process.kill()
    return _dropped(result, ledger, stored, args.warmup + args.seconds + drain_s)


def _dropped(result: dict, ledger: Ledger, stored: dict, seconds: float) -> dict:
    """Acknowledged spans the target did not store, and the stored rate: acknowledged spans in
    storage per second from the first send until the last of them was stored."""
    acked = sum(ledger.acked.values())
    missing = sum(max(0, n - stored.get(t, 0)) for t, n in ledger.acked.items())
    return {**result, "acked_total": acked, "dropped": missing, "stored_per_s": (acked - missing) / seconds,
            "drain_s": seconds - result["elapsed_s"]}


# --- Phoenix, as its own server process --------------------------------------------------------------

class Phoenix:
    def __init__(self, python: str, workdir: str):
        self.workdir = workdir
        self.http_port, self.grpc_port = free_ports(2)
        env = {**os.environ, "PHOENIX_WORKING_DIR": workdir, "PHOENIX_HOST": "127.0.0.1",
               "PHOENIX_PORT": str(self.http_port), "PHOENIX_GRPC_PORT": str(self.grpc_port),
               "PHOENIX_TELEMETRY_ENABLED": "false", "PHOENIX_ENABLE_AUTH": "false",
               "PHOENIX_SQL_DATABASE_URL": f"sqlite:///{workdir}/phoenix.db"}
        self.log = open(Path(workdir) / "phoenix.log", "wb")
        self.proc = subprocess.Popen([python, "-m", "phoenix.server.main", "serve"], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Phoenix exited: see {workdir}/phoenix.log")
            try:
                if requests.get(f"http://127.0.0.1:{self.http_port}/healthz", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise RuntimeError("Phoenix did not start within 180 s")

    def stored(self) -> tuple[dict, float]:
        """(trace_id → spans in Phoenix's database, seconds until the last insert) once its
        insert queue has drained."""
        start = time.monotonic()
        last, stable_since, deadline = -1, start, start + 300
        while time.monotonic() < deadline:
            count = self._query("SELECT count(*) FROM spans")[0][0]
            if count != last:
                last, stable_since = count, time.monotonic()
            elif time.monotonic() - stable_since >= STABLE_S:
                break
            time.sleep(0.5)
        rows = self._query("SELECT t.trace_id, count(*) FROM spans s JOIN traces t ON s.trace_rowid = t.id GROUP BY 1")
        return dict(rows), stable_since - start

    def _query(self, sql: str):
        con = sqlite3.connect(f"file:{self.workdir}/phoenix.db?mode=ro", uri=True, timeout=30)
        try:
            return con.execute(sql).fetchall()
        finally:
            con.close()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def run_phoenix(phoenix: Phoenix, transport: str, args, payloads) -> dict:
    ledger = Ledger()
    port = phoenix.grpc_port if transport == "grpc" else phoenix.http_port
    result = send(transport, port, "/v1/traces", payloads, args.batch, args.senders, args.warmup, args.seconds,
                  ledger, sender_base=16 if transport == "grpc" else 32)
    stored, drain_s = phoenix.stored()
    return _dropped(result, ledger, stored, result["elapsed_s"] + drain_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per target and transport")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="spans per export request")
    parser.add_argument("--payloads", type=int, default=6, help="distinct request templates")
    parser.add_argument("--transports", default="grpc,http")
    parser.add_argument("--token-ids", choices=("none", "array", "bytes"), default="none",
                        help="GenAI spans without token ids (the default: both store them as they are), with token "
                             "ids and logprobs as OTel arrays (lightspan keeps arrays as JSON attributes: docs/architecture.md "
                             "says bytes), or as little-endian bytes (lightspan's encoding: Phoenix acknowledges "
                             "such spans, then fails to insert them)")
    parser.add_argument("--phoenix-python", default=str(Path.home() / ".cache/lightspan/phoenix-venv/bin/python"))
    parser.add_argument("--data-dir", default=None, help="where both targets write (temporary directories inside it)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not Path(args.phoenix_python).exists():
        parser.error(f"--phoenix-python {args.phoenix_python} does not exist: create the venv (see --help)")
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if not transports or set(transports) - {"grpc", "http"}:
        parser.error("--transports: grpc, http or both")

    started = time.monotonic()
    payloads = templates(args.payloads, args.batch, random.Random(0), args.token_ids)
    results = {}
    for transport in transports:
        results[f"lightspan/{transport}"] = run_lightspan(transport, args, payloads)
    with tempfile.TemporaryDirectory(prefix="phoenix-", dir=args.data_dir) as workdir:
        phoenix = Phoenix(args.phoenix_python, workdir)
        try:
            for transport in transports:
                results[f"phoenix/{transport}"] = run_phoenix(phoenix, transport, args, payloads)
        finally:
            phoenix.stop()
    ratios = {t: {key: (results[f"lightspan/{t}"][key] / results[f"phoenix/{t}"][key]
                        if results[f"phoenix/{t}"][key] else float("inf"))
                  for key in ("spans_per_s", "stored_per_s")} for t in transports}
    if args.json:
        print(json.dumps({"args": vars(args), "results": results, "ratios": ratios}))
    else:
        print(f"{args.senders} senders x {args.batch}-span GenAI batches, token ids as {args.token_ids} "
              f"({len(payloads[0][0]) / 1e3:.0f} KB/request), "
              f"{args.seconds:g} s measured after {args.warmup:g} s, {os.cpu_count()} CPUs")
        print(f"{'target':<16} {'acked/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'refused':>8} {'errors':>7} "
              f"{'acked':>8} {'dropped':>8} {'stored/s':>9} {'drain s':>8}")
        for name, r in results.items():
            print(f"{name:<16} {r['spans_per_s']:>9.0f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['refused']:>8} "
                  f"{r['errors']:>7} {r['acked_total']:>8} {r['dropped']:>8} {r['stored_per_s']:>9.0f} "
                  f"{r['drain_s']:>8.1f}"
                  + (f"  {r['error_kinds']}" if r["error_kinds"] else ""))
        for t, ratio in ratios.items():
            print(f"lightspan / phoenix over {t}: {ratio['spans_per_s']:.1f}x acknowledged, "
                  f"{ratio['stored_per_s']:.1f}x stored")
        print(f"total {time.monotonic() - started:.0f} s")
    lost = sum(r["dropped"] for name, r in results.items() if name.startswith("lightspan"))
    return 0 if lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
