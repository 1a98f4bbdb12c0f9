"""Build the SQL agent's database and write its tasks (train and held-out val JSONL).

    python examples/sql_agent/make_tasks.py            # -> examples/sql_agent/data/{concert_singer.sqlite,train,val}.jsonl

Questions come from templates over the database's values (``spider_db.TEMPLATES``); the split
is by question: every template appears in both splits, a question (template + value) in one.
Questions whose gold result is empty are left out.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spider_db import build_db, execute, questions

DB_NAME = "concert_singer.sqlite"


def make_splits(db: Path, seed: int, val_share: float) -> tuple[list[dict], list[dict]]:
    # a question whose gold result is empty is left out: any query that returns nothing would match it
    qs = [q for q in questions(seed) if execute(db, q["gold"])]
    random.Random(seed).shuffle(qs)
    n_val = round(len(qs) * val_share)
    def task(split, i, q):
        return {"id": f"{split}-{i:04d}", "db": DB_NAME, **q, "max_tokens": 48}
    val = [task("val", i, q) for i, q in enumerate(qs[:n_val])]
    train = [task("train", i, q) for i, q in enumerate(qs[n_val:])]
    return train, val


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "data"))
    parser.add_argument("--val-share", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    db = build_db(out / DB_NAME, args.seed)
    train, val = make_splits(db, args.seed, args.val_share)
    for name, rows in (("train", train), ("val", val)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {db}, {len(train)} train and {len(val)} val tasks to {out}")


if __name__ == "__main__":
    main()
