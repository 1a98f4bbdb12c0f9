"""Group-bys over 1M stored spans: the ``spans`` view vs the same data in SQLite.

Usage (from the repository root; ≈ 1 min with the defaults)::

    .venv/bin/python bench/collector_query.py [--spans 1000000] [--files 20] [--repeat 5]
    .venv/bin/python bench/collector_query.py --bucket      # + the same files in an S3-compatible bucket

Data: ``--spans`` GenAI-shaped span rows (100,000 rollouts of 10 spans, 10 services, 1,000
tasks, token counts, a reward on one span per rollout; no token-id lists: the group-bys do not
read them) written with ``store.write_table`` into ``--files`` Parquet files over 2 date
partitions, as the collector's flushes would. Generation is not timed.

Timed, best and median of ``--repeat`` runs, on one open ``store.connect`` connection (its
own time, the views' set-up over the files, is printed apart), on the machine's cores:

- ``spans per rollout``: ``SELECT rollout_id, count(*) ... FROM spans GROUP BY 1`` (100k groups),
- ``spans per service``: ``SELECT service_name, count(*), avg(duration) ... GROUP BY 1`` (10 groups),
- ``reward per task``: ``SELECT task_id, avg(reward) FROM rewards GROUP BY 1`` (the rewards view).

Each through the ``spans`` view (which reads the files that hold the rows, as listed when the
connection opened: the collector deduplicates on (trace_id, span_id) when it writes, so the view
needs no window; see collector/dedup.py) and straight over a glob of the Parquet files; and, as a peer run
side by side, the same queries in SQLite (what Arize Phoenix stores spans in by default) over
the same rows in one table with no index.

With ``--bucket`` the same files are also written to a bucket of moto's S3 server (tests/s3server.py),
started on loopback, and the queries run side by side over it: through the views of
``store.connect("s3://…")`` (pyarrow datasets over the objects, lightspan.store.objects) and, for the
choice those views made, through DuckDB's ``read_parquet`` of the same objects by name via fsspec's
wrapper of the same pyarrow filesystem. Requests are counted from the server's log.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightspan import store  # noqa: E402

QUERIES = {
    "spans per rollout": "SELECT rollout_id, count(*) AS n, sum(output_tokens) AS tokens FROM {spans} GROUP BY 1",
    "spans per service": ("SELECT service_name, count(*) AS n, "
                          "avg(end_time_unix_nano - start_time_unix_nano) AS duration FROM {spans} GROUP BY 1"),
    "reward per task": "SELECT task_id, avg(reward) AS reward, count(*) AS n FROM {spans} WHERE reward IS NOT NULL GROUP BY 1",
}


def make_rows(n: int, rng: np.random.Generator) -> pa.Table:
    rollouts = n // 10
    index = np.arange(n)
    rollout = index // 10
    start = 1_764_460_800_000_000_000 + index * 1_000_000      # 2025-11-30, 1 ms apart
    hexes = np.char.add("r-", np.char.zfill((rollout.astype("U8")), 8))
    columns = {
        "trace_id": pa.array([f"{r:032x}" for r in rollout]),
        "span_id": pa.array([f"{i:016x}" for i in index]),
        "name": pa.array(np.where(index % 10 < 4, "openai.chat", "tool")),
        "kind": pa.array(np.full(n, "INTERNAL")),
        "service_name": pa.array(np.char.add("agent-", (rollout % 10).astype("U2"))),
        "start_time_unix_nano": pa.array(start),
        "end_time_unix_nano": pa.array(start + rng.integers(1_000_000, 500_000_000, n)),
        "status_code": pa.array(np.full(n, "UNSET")),
        "rollout_id": pa.array(hexes),
        "task_id": pa.array(np.char.add("task-", (rollout % 1000).astype("U4"))),
        "operation_name": pa.array(np.where(index % 10 < 4, "chat", None)),
        "input_tokens": pa.array(rng.integers(100, 2000, n)),
        "output_tokens": pa.array(rng.integers(1, 300, n)),
        "reward": pa.array(np.where(index % 10 == 9, rng.random(n), np.nan), from_pandas=True),
        "received_unix_nano": pa.array(start + 5_000_000_000),
    }
    assert rollouts * 10 == n
    return pa.table({f.name: columns.get(f.name, pa.nulls(n, f.type)) for f in store.SPAN_SCHEMA}).cast(store.SPAN_SCHEMA)


def timed(fn, repeat: int) -> tuple[float, float, object]:
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times), result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=1_000_000, help="span rows (a multiple of 10)")
    parser.add_argument("--files", type=int, default=20, help="Parquet files, as from that many flushes")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the data goes (a temporary directory inside it)")
    parser.add_argument("--bucket", action="store_true", help="also over an S3-compatible bucket (moto, on loopback)")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="lightspan-query-", dir=args.dir) as root:
        start = time.perf_counter()
        table = make_rows(args.spans, rng)
        per_file = -(-args.spans // args.files)
        for k in range(args.files):
            part = table.slice(k * per_file, per_file)
            day = "2025-11-30" if k < args.files // 2 else "2025-12-01"
            store.write_table(root, "spans", part, partition=f"date={day}")
        size = sum(p.stat().st_size for p in Path(root, "spans").rglob("*.parquet"))
        print(f"{args.spans:,} spans in {args.files} Parquet files ({size / 2**20:.0f} MiB) written in "
              f"{time.perf_counter() - start:.1f} s; {os.cpu_count()} CPUs; best / median of {args.repeat}")

        raw = f"read_parquet('{root}/spans/**/*.parquet', hive_partitioning=true)"
        db = sqlite3.connect(":memory:")
        light = table.select(["trace_id", "span_id", "rollout_id", "service_name", "task_id", "start_time_unix_nano",
                              "end_time_unix_nano", "output_tokens", "reward"])
        db.execute(f"CREATE TABLE spans ({', '.join(light.column_names)})")
        db.executemany(f"INSERT INTO spans VALUES ({', '.join('?' * light.num_columns)})",
                       zip(*(c.to_pylist() for c in light.columns), strict=True))
        db.commit()

        c_best, c_med, con = timed(lambda: store.connect(root), args.repeat)
        print(f"store.connect (views over the files): {c_best * 1e3:.0f} / {c_med * 1e3:.0f} ms; queries on an open "
              f"connection:")
        print(f"{'query':<20} {'spans view':>16} {'parquet glob':>18} {'sqlite (peer)':>16} {'groups':>8}")
        ok = True
        for name, sql in QUERIES.items():
            v_best, v_med, v_rows = timed(lambda sql=sql: con.execute(sql.format(spans="spans")).fetchall(), args.repeat)
            p_best, p_med, p_rows = timed(lambda sql=sql: con.execute(sql.format(spans=raw)).fetchall(), args.repeat)
            s_best, s_med, s_rows = timed(lambda sql=sql: db.execute(sql.format(spans="spans")).fetchall(),
                                          max(1, args.repeat // 2))
            ok &= len(v_rows) == len(p_rows) == len(s_rows)
            print(f"{name:<20} {v_best * 1e3:>7.0f} / {v_med * 1e3:>4.0f} ms {p_best * 1e3:>8.0f} / {p_med * 1e3:>4.0f} ms "
                  f"{s_best * 1e3:>7.0f} / {s_med * 1e3:>4.0f} ms {len(v_rows):>8}")
        if args.bucket:
            ok &= bucket_queries(root, con, args.repeat)
        print("results agree" if ok else "RESULTS DIFFER")
    return 0 if ok else 1


def _rounded(rows) -> list:
    """Rows comparable across engines: floats summed in another order differ in the last digits."""
    return sorted(tuple(round(v, 6) if isinstance(v, float) else v for v in row) for row in rows)


def bucket_queries(root: str, local, repeat: int) -> bool:
    """The same files in a bucket: the views over it, and read_parquet by name through fsspec."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.s3server import S3Server, aws_environment

    server = S3Server(Path(root) / "s3.log").start()
    try:
        with aws_environment(server.env):
            location = server.create_bucket("bench") + "/lightspan"
            where = store.Location.of(location)
            start = time.perf_counter()
            for path in sorted(Path(root, "spans").rglob("*.parquet")):
                where.put_bytes(f"spans/{path.relative_to(Path(root, 'spans')).as_posix()}", path.read_bytes())
            print(f"uploaded in {time.perf_counter() - start:.1f} s")
            requests = lambda: len((Path(root) / "s3.log").read_text().splitlines())  # noqa: E731
            c_best, c_med, con = timed(lambda: store.connect(location), repeat)
            fsspec = store.connect(location)            # registers the filesystem for read_parquet
            listing = store.quote_list(store.table_files(location, "spans"))
            by_name = f"read_parquet({listing})"
            print(f"store.connect('s3://…'): {c_best * 1e3:.0f} / {c_med * 1e3:.0f} ms")
            print(f"{'query (bucket)':<20} {'local view':>16} {'bucket view':>18} {'read_parquet+fsspec':>22} "
                  f"{'requests':>10}")
            ok = True
            for name, sql in QUERIES.items():
                l_best, l_med, l_rows = timed(lambda sql=sql: local.execute(sql.format(spans="spans")).fetchall(), repeat)
                before = requests()
                b_best, b_med, b_rows = timed(lambda sql=sql: con.execute(sql.format(spans="spans")).fetchall(), repeat)
                view_requests = (requests() - before) / repeat
                before = requests()
                f_best, f_med, f_rows = timed(lambda sql=sql: fsspec.execute(sql.format(spans=by_name)).fetchall(), repeat)
                fs_requests = (requests() - before) / repeat
                ok &= _rounded(l_rows) == _rounded(b_rows) == _rounded(f_rows)
                print(f"{name:<20} {l_best * 1e3:>7.0f} / {l_med * 1e3:>4.0f} ms {b_best * 1e3:>8.0f} / {b_med * 1e3:>4.0f} ms "
                      f"{f_best * 1e3:>11.0f} / {f_med * 1e3:>4.0f} ms {view_requests:>4.0f} / {fs_requests:<4.0f}")
            return ok
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
