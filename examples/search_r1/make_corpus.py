"""Write a small encyclopedia of fictional entities and its one- and two-hop questions, as JSONL.

    python examples/search_r1/make_corpus.py     # data/corpus.jsonl, data/train.jsonl, data/val.jsonl

Every name is made here from syllables (``Varnholt``, ``Orlen Vask``), so no answer can come from a
model's memory: the facts exist only in this corpus, and a question is answered by searching it.

The world: countries (each with a capital), cities (each in a country, on a river), people (each born
in a city, with a profession) and companies (each founded by a person, based in a city, making a
product). One article per entity, in the corpus format Search-R1's retrievers read: ``{"id",
"contents"}`` with ``contents`` = ``"Title"\\ntext`` (wiki-18's form).

Questions, Search-R1's fields (``question``, ``golden_answers``) plus ``id``, ``hops`` and ``kind``:

- one hop, answered by the subject's own article: "In which city was Orlen Vask born?",
  "Who founded Brightfen Mills?", "In which country is Varnholt?", "What does Brightfen Mills make?",
  "What is the capital of Quessia?";
- two hops, through a second article: "In which country was Orlen Vask born?" (person → city →
  country), "In which city was the founder of Brightfen Mills born?" (company → person → city),
  "What is the capital of the country where Tarrow lies?" (city → country → capital).

Held-out split: the questions' subjects (the entity a question is about) are split, so no held-out
question is about an entity that a training question is about; the intermediate articles of two-hop
questions may be shared. Deterministic in ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# short, pronounceable syllables: names a small model's tokenizer splits into few pieces
ONSETS = ["b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z"]
VOWELS = ["a", "e", "i", "o", "u"]
CODAS = ["", "", "n", "r", "l", "s"]
SUFFIXES = {"country": ["ia", "land", "mark", "ova"], "city": ["holt", "mar", "by", "ford", "wick", "stad"],
            "river": ["", ""], "company": [" Works", " Mills", " Labs", " Foundry", " & Sons"]}
PROFESSIONS = ["painter", "engineer", "poet", "chemist", "architect", "composer", "sailor", "botanist"]
PRODUCTS = ["glass lamps", "copper kettles", "wool blankets", "paper kites", "iron bells", "clay pipes",
            "silk maps", "oak barrels", "brass clocks", "salt soap"]


class Names:
    """Made-up names, never the same twice."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def word(self, syllables: int, suffix: str = "") -> str:
        while True:
            w = "".join(self.rng.choice(ONSETS) + self.rng.choice(VOWELS) + self.rng.choice(CODAS)
                        for _ in range(syllables)).capitalize() + suffix
            if w.lower() not in self.used and len(w) >= 4:
                self.used.add(w.lower())
                return w

    def kind(self, kind: str) -> str:
        if kind == "person":
            return f"{self.word(2)} {self.word(2)}"
        return self.word(self.rng.choice((1, 1, 2)), self.rng.choice(SUFFIXES[kind]))


def make_world(seed: int = 0, countries: int = 8, cities: int = 30, people: int = 80, companies: int = 40) -> dict:
    rng = random.Random(seed)
    names = Names(rng)
    world = {"country": [], "city": [], "person": [], "company": []}
    for _ in range(countries):
        world["country"].append({"name": names.kind("country")})
    for i in range(cities):
        # the first cities are the capitals, one per country
        country = world["country"][i] if i < countries else rng.choice(world["country"])
        city = {"name": names.kind("city"), "country": country["name"], "river": names.word(2),
                "founded": rng.randint(900, 1850)}
        if i < countries:
            country["capital"] = city["name"]
        world["city"].append(city)
    for _ in range(people):
        world["person"].append({"name": names.kind("person"), "born": rng.choice(world["city"])["name"],
                                "profession": rng.choice(PROFESSIONS)})
    for _ in range(companies):
        world["company"].append({"name": names.kind("company"), "founder": rng.choice(world["person"])["name"],
                                 "city": rng.choice(world["city"])["name"], "product": rng.choice(PRODUCTS)})
    return world


def articles(world: dict) -> list[dict]:
    """One article per entity, ``{"id", "contents"}`` with ``contents`` = ``"Title"\\ntext``."""
    out = []
    for c in world["country"]:
        out.append((c["name"], f"{c['name']} is a country. Its capital is {c['capital']}."))
    for c in world["city"]:
        out.append((c["name"], f"{c['name']} is a city in {c['country']}. It lies on the river {c['river']} "
                               f"and was founded in {c['founded']}."))
    for p in world["person"]:
        surname = p["name"].split()[-1]
        article = "an" if p["profession"][0] in "aeiou" else "a"
        out.append((p["name"], f"{p['name']} is {article} {p['profession']}. {surname} was born in {p['born']}."))
    for c in world["company"]:
        out.append((c["name"], f"{c['name']} is a company that makes {c['product']}. It was founded by "
                               f"{c['founder']} and is based in {c['city']}."))
    return [{"id": str(i), "contents": f'"{title}"\n{text}'} for i, (title, text) in enumerate(out)]


def questions(world: dict) -> list[dict]:
    """Every question the world allows, each with its subject (the entity it is about)."""
    country_of = {c["name"]: c["country"] for c in world["city"]}
    capital_of = {c["name"]: c["capital"] for c in world["country"]}
    born_in = {p["name"]: p["born"] for p in world["person"]}
    out = []

    def q(subject, kind, hops, question, answer):
        out.append({"subject": subject, "kind": kind, "hops": hops, "question": question, "golden_answers": [answer]})

    for p in world["person"]:
        q(p["name"], "born_city", 1, f"In which city was {p['name']} born?", p["born"])
        q(p["name"], "born_country", 2, f"In which country was {p['name']} born?", country_of[p["born"]])
    for c in world["company"]:
        q(c["name"], "founder", 1, f"Who founded {c['name']}?", c["founder"])
        q(c["name"], "product", 1, f"What does {c['name']} make?", c["product"])
        q(c["name"], "founder_city", 2, f"In which city was the founder of {c['name']} born?", born_in[c["founder"]])
    for c in world["city"]:
        q(c["name"], "city_country", 1, f"In which country is {c['name']}?", c["country"])
        if capital_of[c["country"]] != c["name"]:
            q(c["name"], "city_capital", 2, f"What is the capital of the country where {c['name']} lies?",
              capital_of[c["country"]])
    for c in world["country"]:
        q(c["name"], "capital", 1, f"What is the capital of {c['name']}?", c["capital"])
    return out


def make_splits(seed: int = 0, val_share: float = 0.25) -> tuple[list[dict], list[dict], list[dict]]:
    """(corpus, train, val): the questions split by subject, shuffled, one- and two-hop in both."""
    world = make_world(seed)
    rng = random.Random(seed + 1)
    subjects = sorted({e["name"] for kind in world.values() for e in kind})
    rng.shuffle(subjects)
    held_out = set(subjects[:round(len(subjects) * val_share)])
    all_q = questions(world)
    rng.shuffle(all_q)
    splits = {"train": [], "val": []}
    for item in all_q:
        split = "val" if item["subject"] in held_out else "train"
        splits[split].append({"id": f"{split}-{len(splits[split]):04d}", **item})
    return articles(world), splits["train"], splits["val"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "data"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus, train, val = make_splits(args.seed)
    for name, rows in (("corpus", corpus), ("train", train), ("val", val)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(corpus)} articles, {len(train)} train and {len(val)} val questions to {out}")


if __name__ == "__main__":
    main()
