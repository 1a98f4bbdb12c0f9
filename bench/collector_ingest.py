"""Acknowledged spans/s of the lightspan collector (WAL + fsync on) vs a receiver without durability.

Usage (from the repository root; < 60 s with the defaults)::

    .venv/bin/python bench/collector_ingest.py [--seconds 8] [--senders 4] [--batch 512]
    .venv/bin/python bench/collector_ingest.py --transport http --compare-tree /work/main --targets lightspan,tree

``--transport http`` sends the same requests as OTLP/HTTP protobuf (a ``requests.Session`` per
sender, keep-alive; a 503/429 is retried after its ``Retry-After``). ``--compare-tree DIR`` adds the
target ``tree``: the same collector imported from another checkout of lightspan (e.g. the main
branch), run side by side in the same invocation, to compare two versions of the server.

Load (bench/otlp_load.py): pre-serialized OTLP ``ExportTraceServiceRequest``s of ``--batch`` GenAI
spans each (the attributes traceloop's OpenAI instrumentation writes, JSON messages, plus
lightspan's token ids and logprobs as little-endian bytes: ≈ 2.4 KB a span), sent over raw gRPC
stubs by ``--senders`` threads, one channel each. A refusal (UNAVAILABLE + RetryInfo) is retried
after the delay in the ``google.rpc.retryinfo-bin`` trailer, as the Python OTLP exporter does; its
time counts.

Targets, one after the other, each in its own process (the load generator keeps its own GIL):

1. ``baseline``: a minimal OTLP/gRPC receiver with the same gRPC settings that parses each
   request and acknowledges it. No WAL, no fsync, no Parquet: the ceiling of a Python receiver.
2. ``lightspan``: ``lightspan.collector.server.Collector`` with its defaults: every request is
   parsed, its spans checked, written to the WAL and fsynced (group commit) before the ack;
   flattening to Arrow, deduplication and Parquet happen every second off the request path. After the run the collector stops (the
   final flush) and the script checks that Parquet holds every acknowledged span.
3. ``lightspan-nofsync`` (unless ``--targets`` leaves it out): the same collector with the WAL's
   fsync replaced by a no-op in its process, to separate the price of durability from the price
   of flattening. Not a configuration anyone should run.
4. ``lightspan-forward`` (with ``--forward``): the same collector forwarding everything it
   acknowledges (``[collector.forward]``, collector/forward.py) to a second lightspan collector,
   ``lightspan collector`` in a process of its own on the same cores; printed beside ``lightspan``
   with what the forwarder sent, retried and dropped, and what the second collector stored.
5. ``bucket`` (only when named in ``--targets``): the same collector writing its Parquet to an
   S3-compatible bucket (``s3://bench/…``, WAL on local disk) served by moto's S3 server
   (tests/s3server.py), which this script starts on loopback: a Python server on the same cores,
   so the numbers are a floor for a real object store elsewhere.

Printed: spans/s and MB/s acknowledged, p50/p99 export latency, refusals, and the ratios to the
baseline. The targets share the machine with the senders, as in a one-box deployment.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from otlp_load import GRPC_OPTIONS, MARK, TRACE_SERVICE, genai_request, send  # noqa: E402  (bench/ is not a package)


# --- targets (run in a child process) ------------------------------------------------------------

def _baseline(conn) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                          ExportTraceServiceResponse)
    empty = ExportTraceServiceResponse().SerializeToString()
    received = [0]

    def handle(request: bytes, context) -> bytes:
        received[0] += sum(len(ss.spans) for rs in ExportTraceServiceRequest.FromString(request).resource_spans
                           for ss in rs.scope_spans)
        return empty

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS, maximum_concurrent_rpcs=64,
                         handlers=[grpc.method_handlers_generic_handler(
                             TRACE_SERVICE, {"Export": grpc.unary_unary_rpc_method_handler(handle)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    conn.send(port)
    conn.recv()
    server.stop(5).wait()
    conn.send({"spans_received": received[0]})


def _use_tree(tree: str) -> None:
    """Import ``lightspan`` from the checkout ``tree`` in this process, with the distribution's
    package-dir mapping (``lightspan.collector`` is ``tree/collector``, ``lightspan.core.config`` is
    ``tree/core/config.py``), ahead of the installed (editable) one."""
    import importlib.abc
    import importlib.machinery
    import importlib.util

    root = Path(tree).resolve()
    parts = {"store", "collector", "tracing", "rollout", "lightningrl", "trainer", "dashboards"}

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "lightspan":
                return importlib.machinery.PathFinder.find_spec(name, [str(root)])
            if not name.startswith("lightspan."):
                return None
            pieces = name.split(".")
            if len(pieces) == 2 and pieces[1] in parts:
                folder = root / pieces[1]
                return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                              submodule_search_locations=[str(folder)])
            parent = sys.modules[name.rsplit(".", 1)[0]]
            return importlib.machinery.PathFinder.find_spec(name, list(parent.__path__))

    sys.meta_path.insert(0, Finder())


def _lightspan(conn, data_dir: str, fsync: bool = True, tree: str | None = None, transport: str = "grpc",
               bucket: str | None = None, forward: str | None = None) -> None:
    if tree:
        _use_tree(tree)
    from lightspan import store
    from lightspan.collector.config import CollectorConfig
    from lightspan.collector.server import Collector
    from lightspan.collector.wal import WAL

    if not fsync:
        WAL._fsync = lambda self, fd: None           # this process only: measures what durability costs

    where = {"data_dir": bucket, "wal_dir": str(Path(data_dir) / "wal"), "collector_id": "bench"} if bucket \
        else {"data_dir": data_dir}
    if forward:
        where["forward"] = {"endpoint": forward, "drain_s": 60.0}
    collector = Collector(CollectorConfig(**where, grpc_port=0, http_port=0, api_port=0)).start()
    if tree:
        import lightspan.collector.server as module
        assert str(Path(module.__file__).resolve()).startswith(str(Path(tree).resolve())), module.__file__
    conn.send(collector.http_port if transport == "http" else collector.grpc_port)
    conn.recv()
    start = time.monotonic()
    collector.stop()                                 # the final flush: everything acknowledged → Parquet
    stop_s = time.monotonic() - start
    snap = collector.metrics.snapshot()
    if bucket:
        con = store.connect(bucket)
        rows = con.execute("SELECT count(*) FROM spans").fetchone()[0]
    else:
        files = [str(p) for p in Path(data_dir, "spans").rglob("*.parquet")]
        con = store.connect(data_dir)
        rows = con.execute(f"SELECT count(*) FROM read_parquet({files})").fetchone()[0] if files else 0
    con.close()
    conn.send({"spans_accepted": snap["spans_accepted_total"], "spans_in_parquet": rows,
               "fsyncs": snap_fsyncs(collector), "stop_s": stop_s,
               "refused": snap["requests_refused_total"],
               **({k: snap[f"forward_{k}_total"] for k in ("queued", "sent", "dropped", "retries")} if forward else {})})


def _second_collector(data_dir: str):
    """``lightspan collector`` in a process of its own: the forward target. Returns (process, OTLP/HTTP URL)."""
    import subprocess
    import urllib.request

    from lightspan.runs import free_ports

    ports = free_ports(3)
    proc = subprocess.Popen([sys.executable, "-m", "lightspan.cli", "collector", "--data-dir", data_dir,
                             "--grpc-port", str(ports[0]), "--http-port", str(ports[1]), "--api-port", str(ports[2]),
                             "--log-format", "text"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{ports[2]}/healthz", timeout=1)
            return proc, f"http://127.0.0.1:{ports[1]}"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the forward target did not start")


def _median_run(runs: list[dict]) -> dict:
    """The run whose spans/s is the median (the lower middle one of an even count), with every
    run's spans/s beside it."""
    ordered = sorted(runs, key=lambda r: r["spans_per_s"])
    median = dict(ordered[(len(ordered) - 1) // 2])
    median["runs_spans_per_s"] = [round(r["spans_per_s"]) for r in runs]
    return median


def snap_fsyncs(collector) -> int:
    return collector.health().get("fsync_seconds_count", 0)


def run_target(name: str, args, payloads: list[tuple[bytes, bytes]]) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    second = None
    with tempfile.TemporaryDirectory(prefix="lightspan-bench-", dir=args.data_dir) as data_dir:
        if name == "baseline":
            if args.transport != "grpc":
                raise SystemExit("the baseline receiver speaks gRPC only: leave it out of --targets with --transport http")
            target = (_baseline, (child,))
        else:
            tree = args.compare_tree if name == "tree" else None
            bucket = f"s3://bench/run-{os.urandom(4).hex()}" if name == "bucket" else None
            if name == "lightspan-forward":
                second = _second_collector(str(Path(data_dir) / "second"))
            target = (_lightspan, (child, data_dir, name != "lightspan-nofsync", tree, args.transport, bucket,
                                   second[1] if second else None))
        process = ctx.Process(target=target[0], args=target[1], daemon=True)
        process.start()
        try:
            if not parent.poll(60):
                raise RuntimeError(f"{name} did not start")
            port = parent.recv()
            result = send(port, payloads, args.batch, args.senders, args.warmup, args.seconds, args.transport)
            parent.send("stop")
            if not parent.poll(120):
                raise RuntimeError(f"{name} did not stop")
            result["server"] = parent.recv()
        finally:
            process.join(30)
            if process.is_alive():
                process.kill()
            if second is not None:
                second[0].terminate()                    # it flushes on SIGTERM
                second[0].wait(60)
        if second is not None:
            from lightspan import store

            con = store.connect(str(Path(data_dir) / "second"))
            result["server"]["second_collector_spans"] = con.execute("SELECT count(*) FROM spans").fetchone()[0]
            con.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="measured seconds per target")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds sent before measuring, per target")
    parser.add_argument("--senders", type=int, default=4, help="concurrent exporters (threads, one channel each)")
    parser.add_argument("--batch", type=int, default=512, help="spans per export request")
    parser.add_argument("--payloads", type=int, default=6, help="distinct pre-built requests, sent round-robin")
    parser.add_argument("--targets", default="baseline,lightspan,lightspan-nofsync",
                        help="comma-separated, from baseline, lightspan, lightspan-nofsync, tree, bucket (lightspan needed)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per target, alternating their order; the median run is reported")
    parser.add_argument("--transport", default="grpc", choices=["grpc", "http"], help="OTLP/gRPC or OTLP/HTTP protobuf")
    parser.add_argument("--compare-tree", default=None,
                        help="another checkout of lightspan: the target `tree` runs its collector")
    parser.add_argument("--data-dir", default=None,
                        help="where the collector's WAL and Parquet go (a temporary directory inside it; default: "
                             "the system's temp dir). Put it on the disk you mean to deploy on: fsync cost varies")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--forward", action="store_true",
                        help="add the target lightspan-forward: the collector forwarding all it acknowledges to a "
                             "second lightspan collector, side by side with lightspan (forwarding off)")
    args = parser.parse_args(argv)

    rng = random.Random(0)
    started = time.monotonic()
    payloads = []
    for _ in range(args.payloads):
        mark = rng.randbytes(MARK)
        payload = genai_request(args.batch, rng, mark)
        assert payload.count(mark) == 2 * args.batch     # the mark occurs only in the ids
        payloads.append((payload, mark))
    span_bytes = sum(len(p) for p, _ in payloads) / (len(payloads) * args.batch)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if args.forward and "lightspan-forward" not in targets:
        targets.append("lightspan-forward")
    unknown = set(targets) - {"baseline", "lightspan", "lightspan-nofsync", "tree", "bucket", "lightspan-forward"}
    if unknown or "lightspan" not in targets or ("tree" in targets) != bool(args.compare_tree):
        parser.error(f"--targets: need lightspan, may add baseline, lightspan-nofsync, and tree with --compare-tree; "
                     f"got {targets}")
    s3 = None
    if "bucket" in targets:          # a real S3-API server on loopback; the spawned collector inherits its env
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.s3server import S3Server

        s3 = S3Server(Path(tempfile.gettempdir()) / "lightspan-bench-s3.log").start()
        os.environ.update(s3.env)
        s3.create_bucket("bench")
    runs: dict[str, list[dict]] = {name: [] for name in targets}
    try:
        for r in range(args.repeat):   # alternating order, so neither target always runs on a warmer machine
            for name in (targets if r % 2 == 0 else targets[::-1]):
                runs[name].append(run_target(name, args, payloads))
    finally:
        if s3 is not None:
            s3.stop()
    results = {name: _median_run(rs) for name, rs in runs.items()}
    reference = "baseline" if "baseline" in results else "tree" if "tree" in results else "lightspan"
    ratio = results["lightspan"]["spans_per_s"] / results[reference]["spans_per_s"]
    server = results["lightspan"]["server"]
    complete = server["spans_in_parquet"] >= server["spans_accepted"]
    for name, r in results.items():
        server_side = r["server"]
        if "spans_in_parquet" in server_side and server_side["spans_in_parquet"] < server_side["spans_accepted"]:
            complete = False
    if args.json:
        print(json.dumps({"args": vars(args), "span_bytes": span_bytes, "results": results, "ratio": ratio}))
    else:
        print(f"{args.transport}: {args.repeat} run(s) per target, median shown; {args.senders} senders x {args.batch}-span GenAI batches ({span_bytes / 1000:.2f} KB/span, "
              f"{len(payloads[0][0]) / 1e6:.2f} MB/request), {args.seconds:g} s measured after {args.warmup:g} s, "
              f"{os.cpu_count()} CPUs")
        print(f"{'target':<18} {'spans/s':>9} {'MB/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'refused':>8} {'errors':>7}")
        for name, r in results.items():
            print(f"{name:<18} {r['spans_per_s']:>9.0f} {r['mb_per_s']:>7.1f} {r['p50_ms']:>8.1f} "
                  f"{r['p99_ms']:>8.1f} {r['refused']:>8} {r['errors']:>7}")
        if args.repeat > 1:
            for name, r in results.items():
                print(f"{name}: spans/s of each run {r['runs_spans_per_s']}")
            if reference != "lightspan":
                pairs = [a / b for a, b in zip(results["lightspan"]["runs_spans_per_s"],
                                               results[reference]["runs_spans_per_s"])]
                print(f"median of the paired ratios lightspan / {reference}: {statistics.median(pairs):.3f}")
        for name in results:
            if name != reference:
                print(f"{name} / {reference} = {results[name]['spans_per_s'] / results[reference]['spans_per_s']:.3f}")
        if "lightspan-forward" in results:
            fw = results["lightspan-forward"]["server"]
            pairs = [a / b for a, b in zip(results["lightspan-forward"]["runs_spans_per_s"],
                                           results["lightspan"]["runs_spans_per_s"])]
            print(f"forwarding on / off (median of paired runs): {statistics.median(pairs):.3f}; forwarded "
                  f"{fw['sent']} of {fw['queued']} requests queued ({fw['dropped']} dropped, {fw['retries']} "
                  f"retries), the second collector stored {fw['second_collector_spans']} of "
                  f"{fw['spans_accepted']} spans")
        if "lightspan-nofsync" in results:
            print(f"lightspan / lightspan-nofsync = "
                  f"{results['lightspan']['spans_per_s'] / results['lightspan-nofsync']['spans_per_s']:.2f}")
        for name in [n for n in ("lightspan", "bucket") if n in results]:
            server = results[name]["server"]
            print(f"{name}: {server['spans_accepted']} spans acknowledged, {server['spans_in_parquet']} in Parquet "
                  f"after stop ({'nothing lost' if server['spans_in_parquet'] >= server['spans_accepted'] else 'MISSING SPANS'}), "
                  f"{server['fsyncs']} fsyncs, final flush {server['stop_s']:.1f} s")
        print(f"total {time.monotonic() - started:.0f} s")
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
