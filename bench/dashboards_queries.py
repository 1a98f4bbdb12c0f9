"""Benchmark: the web UI's queries on a large store, side by side with plain queries over the views.

    .venv/bin/python bench/dashboards_queries.py [--rollouts 100000] [--repeat 3] [--dir DIR]

1. Generates ``--rollouts`` rollouts of 10 spans with token ids (bench/lightningrl_build.py's
   generator: 4 chat calls of ~500 prompt tokens each, tools, a reward, the runner's span).
   Not timed; kept in ``--dir`` when given, and reused if it already holds spans.
2. Times, each ``--repeat`` times on a fresh read-only connection (``store.sql.sql_connection``,
   what the UI uses), the functions behind ``/api/ui/rollouts`` (a page of 100, unfiltered and
   filtered by task), ``/api/ui/facets`` and ``/api/ui/rollouts/<id>``, and the baseline: the
   same answers written the obvious way, one query over the views each (``rollouts`` joined with
   ``llm_calls`` for the agents; ``spans WHERE coalesce(rollout_id, trace_id) = key``), which
   the views' deduplication keeps from filtering before every span's token lists are read.

Prints one line per query and a JSON line (the numbers recorded in bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lightningrl_build import generate  # noqa: E402  (the 1M-span generator of the builder's benchmark)

from lightspan.store.sql import sql_connection  # noqa: E402
from lightspan.dashboards import ui  # noqa: E402

_BASE_ROLLOUTS = """
SELECT r.*, a.agents FROM rollouts r
LEFT JOIN (SELECT rollout_key, list(DISTINCT coalesce(agent_name, service_name)) AS agents
           FROM llm_calls GROUP BY 1) a USING (rollout_key)
"""


def baseline_rollouts(con, task=None):
    where, params = ("WHERE task_id = $task", {"task": task}) if task else ("", {})
    con.execute(f"SELECT count(*), avg(final_reward) FROM ({_BASE_ROLLOUTS}) {where}", params).fetchall()
    return con.execute(f"SELECT * FROM ({_BASE_ROLLOUTS}) {where} ORDER BY start_time_unix_nano DESC LIMIT 100",
                       params).fetchall()


def baseline_facets(con):
    return [con.execute(sql).fetchall() for sql in (
        "SELECT DISTINCT task_id FROM rollouts", "SELECT DISTINCT split FROM rollouts",
        "SELECT DISTINCT coalesce(agent_name, service_name) FROM llm_calls", "SELECT DISTINCT model_version FROM rollouts")]


def baseline_rollout(con, key):
    return [con.execute(sql, {"key": key}).fetchall() for sql in (
        "SELECT * FROM spans WHERE coalesce(rollout_id, trace_id) = $key",
        "SELECT span_id FROM llm_calls WHERE rollout_key = $key",
        "SELECT reward FROM rewards WHERE rollout_key = $key",
        "SELECT * FROM rollouts WHERE rollout_key = $key")]


def timed(data_dir: Path, fn, repeat: int) -> dict:
    times = []
    for _ in range(repeat):
        con = sql_connection(data_dir)
        start = time.perf_counter()
        fn(con)
        times.append(time.perf_counter() - start)
        con.close()
    return {"best_s": round(min(times), 3), "median_s": round(statistics.median(times), 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=100_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="keep (or reuse) the generated store here")
    args = p.parse_args(argv)
    data_dir = Path(args.dir or tempfile.mkdtemp(prefix="lightspan-ui-bench-"))
    if not (data_dir / "spans").is_dir():
        start = time.perf_counter()
        spans = generate(data_dir, args.rollouts)
        print(f"generated {spans:,} spans in {time.perf_counter() - start:.1f} s ({data_dir})")
    con = sql_connection(data_dir)
    spans, = con.execute("SELECT count(*) FROM spans").fetchone()
    key, task = con.execute("SELECT rollout_id, task_id FROM spans WHERE rollout_id IS NOT NULL "
                            "ORDER BY rollout_id DESC LIMIT 1").fetchone()
    con.close()
    cases = {
        "rollouts page": (lambda c: ui.rollouts(c, ui.rollout_filters({})), baseline_rollouts),
        "rollouts of one task": (lambda c: ui.rollouts(c, ui.rollout_filters({"task": [task]})),
                                 lambda c: baseline_rollouts(c, task)),
        "facets": (lambda c: ui.facets(c, {}), baseline_facets),
        "one rollout": (lambda c: ui.rollout(c, key), lambda c: baseline_rollout(c, key)),
    }
    results = {"spans": spans}
    for name, (ours, base) in cases.items():
        a, b = timed(data_dir, ours, args.repeat), timed(data_dir, base, args.repeat)
        results[name] = {"ui": a, "baseline": b, "speedup_best": round(b["best_s"] / a["best_s"], 2)}
        print(f"{name:22s} ui {a['best_s']:7.3f} s (median {a['median_s']:.3f})   baseline {b['best_s']:7.3f} s "
              f"(median {b['median_s']:.3f})   {b['best_s'] / a['best_s']:.1f}x")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
