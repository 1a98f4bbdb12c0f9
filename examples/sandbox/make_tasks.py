"""Write the sandbox agent's tasks: small computations a 135M model cannot do in its head but can write
a one-line program for, with their answers, as JSONL.

    python examples/sandbox/make_tasks.py --out examples/sandbox/data

Eight families: sums of ranges and of squares, counting multiples, digit sums, products of 3-digit
numbers, and string work on made-up words (count a letter, reverse, length). ``train.jsonl`` and
``val.jsonl`` draw from the same families with disjoint questions (a held-out split), round-robin over
the families, deterministically from ``--seed``. Each task: ``id``, ``family``, ``question``, ``answer``
(a string: the program's printed output, stripped).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYLLABLES = ["ba", "ke", "lo", "mi", "nu", "ra", "se", "ti", "vo", "za", "pe", "do", "fi", "gu", "ha", "ju"]


def word(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(lo, hi)))


def range_sum(rng):
    a, b = rng.randint(10, 99), rng.randint(100, 999)
    return f"What is the sum of all integers from {a} to {b}?", sum(range(a, b + 1))


def squares(rng):
    n = rng.randint(10, 99)
    return f"What is the sum of the squares of the integers from 1 to {n}?", sum(i * i for i in range(1, n + 1))


def multiples(rng):
    a, b, k = rng.randint(1, 99), rng.randint(200, 999), rng.randint(3, 13)
    return (f"How many integers from {a} to {b} are divisible by {k}?",
            sum(1 for n in range(a, b + 1) if n % k == 0))


def digit_sum(rng):
    n = rng.randint(10**9, 10**12)
    return f"What is the sum of the digits of {n}?", sum(int(d) for d in str(n))


def product(rng):
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return f"What is {a} multiplied by {b}?", a * b


def count_letter(rng):
    w = word(rng, 5, 8)
    c = rng.choice(sorted(ch for ch in set(w) if w.count(ch) > 1) or sorted(w))   # a count of 1 is a guess
    return f"How many times does the letter '{c}' appear in '{w}'?", w.count(c)


def reverse(rng):
    w = word(rng, 4, 6)
    return f"What is the word '{w}' spelled backwards?", w[::-1]


def length(rng):
    w = word(rng, 6, 12)
    return f"How many letters does the word '{w}' have?", len(w)


FAMILIES = [range_sum, count_letter, multiples, reverse, squares, digit_sum, product, length]


def make_task(rng: random.Random, split: str, i: int) -> dict:
    family = FAMILIES[i % len(FAMILIES)]
    question, answer = family(rng)
    return {"id": f"{split}-{i:04d}", "family": family.__name__, "question": question, "answer": str(answer)}


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
    parser.add_argument("--val", type=int, default=64)
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
