"""Write the calculator agent's tasks: Calc-X-style word problems with their answers, as JSONL.

    python examples/calc_agent/make_tasks.py --out examples/calc_agent/data

Each problem comes from a template with one or two operations over 2- and 3-digit numbers, so
that mental arithmetic fails where the calculator does not. ``train.jsonl`` and ``val.jsonl``
use the same templates with disjoint numbers (a held-out split, as GSM8K-style Calc-X data is
split by problem), deterministically from ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# (template, answer as a function of the numbers, numbers' ranges)
TEMPLATES = [
    ("A farmer plants {a} rows of {b} trees. How many trees does he plant?", lambda a, b: a * b, (12, 99), (12, 99)),
    ("A library has {a} books and buys {b} more. How many books does it have now?", lambda a, b: a + b, (120, 999), (120, 999)),
    ("Sam had {a} stickers and gave away {b}. How many stickers are left?", lambda a, b: a - b, (500, 999), (100, 499)),
    ("A ticket costs {a} dollars. How much do {b} tickets cost?", lambda a, b: a * b, (11, 99), (11, 49)),
    ("{b} boxes hold {a} pencils in total, the same number in each. How many pencils are in one box?",
     lambda a, b: a // b, None, (11, 49)),
    ("Ann has {a} coins. She finds {b} more and then spends {c}. How many coins does she have?",
     lambda a, b, c: a + b - c, (100, 999), (100, 999), (10, 99)),
]


def make_task(rng: random.Random, split: str, i: int) -> dict:
    text, fn, *ranges = TEMPLATES[i % len(TEMPLATES)]
    if ranges[0] is None:  # division: make it exact
        b = rng.randint(*ranges[1])
        a = b * rng.randint(11, 99)
        numbers = {"a": a, "b": b}
    else:
        numbers = {k: rng.randint(*r) for k, r in zip("abc", ranges)}
    return {"id": f"{split}-{i:04d}", "question": text.format(**numbers), "answer": fn(*numbers.values()),
            "max_tokens": 24}


def make_splits(seed: int, n_train: int, n_val: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    seen: set[str] = set()

    def draw(split: str, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            task = make_task(rng, split, len(out))
            if task["question"] not in seen:  # disjoint splits: no question in both
                seen.add(task["question"])
                out.append(task)
        return out

    val = draw("val", n_val)
    return draw("train", n_train), val


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "data"))
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--val", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, val = make_splits(args.seed, args.train, args.val)
    for name, rows in (("train", train), ("val", val)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(train)} train and {len(val)} val tasks to {out}")


if __name__ == "__main__":
    main()
