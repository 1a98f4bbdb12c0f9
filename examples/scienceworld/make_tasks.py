"""Write the ScienceWorld tasks of three tiers, from the game's own train / dev / test variations, as JSONL.

    python examples/scienceworld/make_tasks.py     # data/train.jsonl, data/val.jsonl, data/test.jsonl

A ScienceWorld task type has hundreds of *variations* (other rooms' contents, other animals, other
colours) that the game itself splits into train, dev and test (``get_variations_train`` and so on).
Training tasks are train variations; the held-out ones are dev variations (``val.jsonl``: what
``lightspan experiment`` evaluates before and after) and test variations (``test.jsonl``: untouched by
any choice made here). The tiers, easy to hard, by the length of the game's gold action sequence and
by what a 135M model did with them (README):

- ``easy``   ``find-non-living-thing`` (gold: 5 actions; focusing on almost anything lifeless scores 58+)
- ``medium`` ``lifespan-longest-lived`` (6; go outside, then focus on the right animal)
- ``hard``   ``chemistry-mix-paint-secondary-color`` (9; find the paints, mix two, focus on the result)

All in the game's ``easy`` simplification (doors open, teleporting allowed, no electrical actions), as
Agent Lightning's example runs them. Each line: ``id``, ``task_name``, ``variation``,
``simplification``, ``tier``, ``split``. The game is started once (Java: examples/scienceworld/setup.sh).
"""

from __future__ import annotations

import argparse
import json
from itertools import zip_longest
from pathlib import Path

TIERS = {"easy": "find-non-living-thing", "medium": "lifespan-longest-lived",
         "hard": "chemistry-mix-paint-secondary-color"}
HERE = Path(__file__).resolve().parent


def game_splits() -> dict[str, dict[str, list[int]]]:
    """Each tier's task's variations by the game's split: {task: {"train": [...], "dev": [...], "test": [...]}}."""
    from scienceworld import ScienceWorldEnv

    env = ScienceWorldEnv("")
    try:
        out = {}
        for task in TIERS.values():
            env.load(task, 0, "easy")
            out[task] = {"train": list(env.get_variations_train()), "dev": list(env.get_variations_dev()),
                         "test": list(env.get_variations_test())}
        return out
    finally:
        env.close()


def make_splits(splits: dict[str, dict[str, list[int]]], n_train: int = 20, n_held: int = 8) -> dict[str, list[dict]]:
    """The first ``n_train`` train variations of each tier, and the first ``n_held`` dev and test ones
    (fewer where the game has fewer). Training tasks alternate tiers (easy, medium, hard, easy, ...):
    ``lightspan experiment`` takes them in order, so every step of three or more sees each tier."""
    files = {"train": [], "val": [], "test": []}
    for file, split, n in (("train", "train", n_train), ("val", "dev", n_held), ("test", "test", n_held)):
        by_tier = [[{"id": f"{task}-{v}", "task_name": task, "variation": v, "simplification": "easy",
                     "tier": tier, "split": split} for v in sorted(splits[task][split])[:n]]
                   for tier, task in TIERS.items()]
        if file == "train":
            files[file] = [row for rows in zip_longest(*by_tier) for row in rows if row is not None]
        else:
            files[file] = [row for rows in by_tier for row in rows]
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=int, default=20, help="train variations per tier")
    parser.add_argument("--held-out", type=int, default=8, help="dev and test variations per tier")
    parser.add_argument("--out", type=Path, default=HERE / "data")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in make_splits(game_splits(), args.train, args.held_out).items():
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{args.out / name}.jsonl: {len(rows)} tasks")


if __name__ == "__main__":
    main()
