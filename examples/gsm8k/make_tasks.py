"""Write GSM8K-style word problems of 1 to 4 steps, with a held-out split, as JSONL.

    python examples/gsm8k/make_tasks.py            # data/train.jsonl (400), data/val.jsonl (100)

This is not GSM8K: it is data made here in GSM8K's form. Each task has GSM8K's two fields,
``question`` and ``answer``, where ``answer`` is a worked solution with calculator annotations
(``<<48-5=43>>``) and the final number after ``####``, as in GSM8K; plus ``id``, ``steps`` (how many
arithmetic steps the solution takes) and ``result`` (the final number, for convenience).

A problem is a scenario told sentence by sentence: its first ``steps`` facts, then the question that
follows the last of them, so a 3-step problem is a 2-step one with one more fact. The numbers are
drawn so that every intermediate result is a positive whole number (divisions are exact). The splits
use the same scenarios with disjoint problems, and the held-out split has the same number of problems
of each step count; both are deterministic in ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# (name, pronoun)
NAMES = [("Ava", "She"), ("Ben", "He"), ("Carla", "She"), ("Dev", "He"), ("Elif", "She"), ("Farid", "He"),
         ("Grace", "She"), ("Hugo", "He"), ("Ines", "She"), ("Jonas", "He"), ("Kemi", "She"), ("Luca", "He"),
         ("Maya", "She"), ("Nils", "He"), ("Omar", "He"), ("Priya", "She"), ("Quinn", "He"), ("Rosa", "She"),
         ("Sami", "He"), ("Tara", "She")]

# A scenario: facts, each (sentence, operation, range of its number), and after fact k the question
# of a (k+1)-step problem. The first fact's operation combines its two numbers; each later fact applies
# its operation to the running result. Sentences name the numbers {a}, {b}, ... in order.
SCENARIOS = [
    {"facts": [("{name} bakes {a} trays of muffins with {b} muffins on each tray.", "*", (3, 12), (4, 15)),
               ("{pronoun} sells {c} of the muffins at the market.", "-", (2, 20)),
               ("{pronoun} packs the rest into boxes of {d}.", "/", (2, 6)),
               ("Each box sells for {e} dollars.", "*", (3, 12))],
     "questions": ["How many muffins does {name} bake?", "How many muffins are left?",
                   "How many boxes does {name} fill?", "How many dollars does {name} get for the boxes?"]},
    {"facts": [("A school has {a} classes of {b} students each.", "*", (4, 15), (12, 30)),
               ("{c} students are away on a trip.", "-", (5, 40)),
               ("The students who stay are put into teams of {d}.", "/", (2, 8)),
               ("Each team gets {e} balls.", "*", (2, 6))],
     "questions": ["How many students does the school have?", "How many students stay at school?",
                   "How many teams are there?", "How many balls are needed?"]},
    {"facts": [("{name} earns {a} dollars a day for {b} days.", "*", (20, 90), (3, 9)),
               ("{pronoun} spends {c} dollars on a bike.", "-", (30, 150)),
               ("{pronoun} splits what is left equally among {d} savings jars.", "/", (2, 5)),
               ("Later {pronoun_lower} adds {e} dollars to one jar.", "+", (5, 60))],
     "questions": ["How many dollars does {name} earn?", "How many dollars does {name} have left?",
                   "How many dollars go into each jar?", "How many dollars are in that jar now?"]},
    {"facts": [("A farm has {a} chickens and buys {b} more.", "+", (40, 300), (20, 200)),
               ("Each chicken lays {c} eggs a week.", "*", (2, 6)),
               ("The farm keeps {d} eggs a week and sells the rest.", "-", (10, 90)),
               ("The eggs sold are packed in cartons of {e}.", "/", (6, 12))],
     "questions": ["How many chickens does the farm have now?", "How many eggs are laid in a week?",
                   "How many eggs are sold in a week?", "How many cartons are packed in a week?"]},
    {"facts": [("A library has {a} books and gives away {b} old ones.", "-", (200, 900), (20, 150)),
               ("The remaining books are shared equally among {c} rooms.", "/", (2, 6)),
               ("Each room then gets {d} new books.", "+", (10, 80)),
               ("Each book in a room needs {e} labels.", "*", (2, 4))],
     "questions": ["How many books are left?", "How many books are in each room?",
                   "How many books does each room have now?", "How many labels does one room need?"]},
    {"facts": [("A train carries {a} passengers. At the first stop {b} more get on.", "+", (80, 400), (10, 120)),
               ("At the second stop {c} passengers get off.", "-", (10, 90)),
               ("The passengers left sit equally in {d} cars.", "/", (2, 8)),
               ("Each passenger pays {e} dollars.", "*", (2, 9))],
     "questions": ["How many passengers are on the train after the first stop?",
                   "How many passengers are on the train after the second stop?",
                   "How many passengers sit in each car?", "How many dollars do the passengers of one car pay?"]},
]
OPS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}


def make_problem(rng: random.Random, scenario: int, steps: int) -> dict | None:
    """One problem of ``steps`` steps from SCENARIOS[scenario], or None when the draw does not work
    out (a result not positive, or a division with a remainder: the caller draws again)."""
    spec = SCENARIOS[scenario]
    name, he = rng.choice(NAMES)
    first, *rest = spec["facts"][:steps]
    sentence, op, *ranges = first
    numbers = [rng.randint(*r) for r in ranges]
    value = OPS[op](*numbers)
    lines = [f"{numbers[0]}{op}{numbers[1]}={value}"]
    for sentence_k, op_k, range_k in rest:
        if op_k == "/":
            # pick a divisor of the running result within range, if there is one
            divisors = [d for d in range(range_k[0], range_k[1] + 1) if value % d == 0]
            if not divisors:
                return None
            n = rng.choice(divisors)
            new = value // n
        else:
            n = rng.randint(*range_k)
            new = OPS[op_k](value, n)
        if new <= 0:
            return None
        lines.append(f"{value}{op_k}{n}={new}")
        numbers.append(n)
        value = new
    fields = {"name": name, "pronoun": he, "pronoun_lower": he.lower(), **dict(zip("abcde", numbers))}
    facts = " ".join(s.format(**fields) for s, *_ in spec["facts"][:steps])
    question = f"{facts} {spec['questions'][steps - 1].format(**fields)}"
    # GSM8K's answer form: one line per step with its calculator annotation, then #### and the number
    solution = "\n".join(f"{line.split('=')[0]} = <<{line}>>{line.split('=')[1]}" for line in lines)
    return {"question": question, "answer": f"{solution}\n#### {value}", "steps": steps, "result": value,
            "scenario": scenario}


def make_splits(seed: int = 0, n_train: int = 400, n_val: int = 100) -> tuple[list[dict], list[dict]]:
    """(train, val): disjoint questions; each split cycles through step counts 1-4 and scenarios,
    so val has n_val / 4 problems of each step count."""
    rng = random.Random(seed)
    seen: set[str] = set()

    def draw(split: str, n: int) -> list[dict]:
        out: list[dict] = []
        while len(out) < n:
            i = len(out)
            steps, scenario = i % 4 + 1, (i // 4) % len(SCENARIOS)
            task = make_problem(rng, scenario, steps)
            if task is None or task["question"] in seen:
                continue
            seen.add(task["question"])
            out.append({"id": f"{split}-{i:04d}", **task})
        return out

    val = draw("val", n_val)        # held out first: training never sees these questions
    return draw("train", n_train), val


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "data"))
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--val", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, val = make_splits(args.seed, args.train, args.val)
    for name, rows in (("train", train), ("val", val)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(train)} train and {len(val)} val GSM8K-style problems to {out}")


if __name__ == "__main__":
    main()
