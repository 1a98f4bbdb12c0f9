"""How long a small OTLP/JSON export waits while other clients send big ones (issue 28, section 4).

Usage (from the repository root; ≈ 30 s a target)::

    .venv/bin/python bench/collector_json_mix.py [--seconds 12] [--big-senders 2] [--big-mb 7.5]
    .venv/bin/python bench/collector_json_mix.py --compare-tree /tmp/main-wt4     # this tree, then that one

Load: ``--big-senders`` clients loop OTLP/JSON exports of ``--big-mb`` MB each (GenAI chat spans,
``≈ 2.4 KB`` a span as ``bench/collector_ingest.py`` builds them, written as OTLP/JSON), while one
client sends a small export (two spans, ≈ 5 KB) every 50 ms. All go over HTTP keep-alive to the
collector's OTLP/HTTP port (``application/json``); a 503/429 is retried after its ``Retry-After``.
The collector runs in its own process (the load keeps its own GIL); ``--compare-tree DIR`` runs the
same load against the collector of another checkout (e.g. ``git worktree add /tmp/main-wt4 HEAD``),
one after the other.

Printed per target: the small exports' latency (p50, p90, max) and count, the big exports
acknowledged per second, and refusals.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collector_ingest import _use_tree  # noqa: E402  (bench/ is not a package)

_ATTRS = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "policy", "gen_ai.system": "openai",
          "gen_ai.input.messages": json.dumps([{"role": "user", "content": "What is 12 + 30? " * 40}]),
          "gen_ai.output.messages": json.dumps([{"role": "assistant", "content": "42. " * 100}]),
          "lightspan.rollout.id": "bench-rollout", "lightspan.task.id": "bench-task"}


def export(spans: int, mark: int) -> bytes:
    """An OTLP/JSON trace export of ``spans`` chat spans whose ids carry ``mark`` (never repeated)."""
    attributes = [{"key": k, "value": {"stringValue": v}} for k, v in _ATTRS.items()]
    doc = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "bench"}}]},
                              "scopeSpans": [{"scope": {"name": "bench"}, "spans": [
                                  {"traceId": f"{mark:016x}{i:016x}", "spanId": f"{i + 1:016x}", "name": "chat policy",
                                   "kind": 3, "startTimeUnixNano": "1700000000000000000",
                                   "endTimeUnixNano": "1700000000100000000", "attributes": attributes}
                                  for i in range(spans)]}]}]}
    return json.dumps(doc).encode()


def _collector(conn, data_dir: str, tree: str | None) -> None:
    if tree:
        _use_tree(tree)
    from lightspan.collector.config import CollectorConfig
    from lightspan.collector.server import Collector

    collector = Collector(CollectorConfig(data_dir=data_dir, grpc_port=0, http_port=0, api_port=0)).start()
    import lightspan.collector.server as module
    conn.send((collector.http_port, module.__file__))
    conn.recv()
    collector.stop()
    conn.send(sum(collector.metrics.snapshot().get("requests_refused_total", {}).values()))


def _send(session: requests.Session, url: str, body: bytes) -> tuple[float, int]:
    """(seconds until acknowledged, refusals retried)."""
    start, refused = time.monotonic(), 0
    while True:
        answer = session.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=120)
        if answer.status_code == 200:
            return time.monotonic() - start, refused
        if answer.status_code not in (429, 503):
            raise RuntimeError(f"export answered {answer.status_code}: {answer.text[:200]}")
        refused += 1
        time.sleep(float(answer.headers.get("Retry-After", "1")))


def run(args, tree: str | None) -> dict:
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    with tempfile.TemporaryDirectory() as data_dir:
        process = context.Process(target=_collector, args=(child, data_dir, tree))
        process.start()
        port, where = parent.recv()
        url = f"http://127.0.0.1:{port}/v1/traces"
        big_spans = max(1, int(args.big_mb * 1e6 * 100 / len(export(100, 0))))
        bigs = [export(big_spans, 1000 + n) for n in range(args.big_senders)]
        stop = threading.Event()
        big_done, small, refusals = [0], [], [0]

        def big(n: int) -> None:
            session = requests.Session()
            while not stop.is_set():
                _, refused = _send(session, url, bigs[n])
                big_done[0] += 1
                refusals[0] += refused

        def small_sender() -> None:
            session = requests.Session()
            mark = 1
            while not stop.is_set():
                took, refused = _send(session, url, export(2, mark))
                small.append(took)
                refusals[0] += refused
                mark += 1
                stop.wait(0.05)

        threads = [threading.Thread(target=big, args=(n,), daemon=True) for n in range(args.big_senders)]
        for thread in threads:
            thread.start()
        time.sleep(2.0)                            # the big senders are under way
        small_thread = threading.Thread(target=small_sender, daemon=True)
        start = time.monotonic()
        small_thread.start()
        stop.wait(args.seconds)
        stop.set()
        small_thread.join(120)
        for thread in threads:
            thread.join(120)
        elapsed = time.monotonic() - start
        parent.send("stop")
        refused_total = parent.recv()
        process.join(60)
    ordered = sorted(small)
    return {"collector": where, "big_body_mb": round(len(bigs[0]) / 1e6, 2), "big_senders": args.big_senders,
            "big_exports_per_s": round(big_done[0] / elapsed, 2), "small_exports": len(small),
            "small_p50_s": round(statistics.median(ordered), 3) if ordered else None,
            "small_p90_s": round(ordered[int(0.9 * (len(ordered) - 1))], 3) if ordered else None,
            "small_max_s": round(ordered[-1], 3) if ordered else None,
            "retried_refusals": refusals[0], "collector_refusals": refused_total}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=12.0, help="measured seconds per target")
    parser.add_argument("--big-senders", type=int, default=2, help="clients looping big exports")
    parser.add_argument("--big-mb", type=float, default=7.5, help="size of one big export, MB of JSON")
    parser.add_argument("--compare-tree", default=None, help="another checkout: its collector runs the same load")
    args = parser.parse_args()
    results = {"this tree": run(args, None)}
    if args.compare_tree:
        results[args.compare_tree] = run(args, args.compare_tree)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
