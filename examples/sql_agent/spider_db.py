"""A small Spider-like database (the ``concert_singer`` schema) and text-to-SQL questions with gold queries.

Everything is generated offline and deterministically: the rows from a seeded RNG, the questions
from templates over the values in the database. ``build_db`` writes the SQLite file atomically
(agents running at once may all ask for it); ``execute`` runs a query read-only with a time limit;
``same_result`` compares result sets the way Spider's execution accuracy does (as multisets, in
order when the gold query has ORDER BY).
"""

from __future__ import annotations

import os
import random
import re
import sqlite3
import tempfile
from collections import Counter
from pathlib import Path

SCHEMA = """CREATE TABLE stadium (stadium_id INTEGER PRIMARY KEY, name TEXT, location TEXT, capacity INTEGER);
CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT, country TEXT, age INTEGER);
CREATE TABLE concert (concert_id INTEGER PRIMARY KEY, name TEXT, year INTEGER,
                      stadium_id INTEGER REFERENCES stadium(stadium_id));
CREATE TABLE singer_in_concert (concert_id INTEGER REFERENCES concert(concert_id),
                                singer_id INTEGER REFERENCES singer(singer_id));"""

# the schema as the prompt shows it: short (the test model's context is 512 bytes)
SCHEMA_PROMPT = ("stadium(stadium_id, name, location, capacity)\n"
                 "singer(singer_id, name, country, age)\n"
                 "concert(concert_id, name, year, stadium_id)\n"
                 "singer_in_concert(concert_id, singer_id)")

COUNTRIES = ["France", "Japan", "Brazil", "Canada", "Italy", "Kenya"]
LOCATIONS = ["Lyon", "Osaka", "Recife", "Quebec", "Turin"]
FIRST = ["Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Gina", "Hugo", "Ines", "Jun", "Kofi", "Lea",
         "Mario", "Nina", "Omar", "Paula", "Quinn", "Rosa", "Sami", "Tara", "Uma", "Victor", "Wen", "Yara"]
LAST = ["Silva", "Tanaka", "Martin", "Rossi", "Otieno", "Roy", "Costa", "Mori"]
STADIUMS = ["Arena Nord", "Blue Dome", "Central Park", "Delta Field", "East Bowl", "Fox Hall",
            "Grand Oval", "Harbor Stage"]
CONCERTS = ["Spring Fest", "Summer Nights", "Autumn Jam", "Winter Live", "Rock On", "Jazz Hour",
            "Pop Parade", "Folk Days", "Soul Train", "Beat Street"]


def rows(seed: int = 0) -> dict[str, list[tuple]]:
    rng = random.Random(seed)
    stadium = [(i + 1, n, rng.choice(LOCATIONS), rng.randrange(5_000, 80_000, 500)) for i, n in enumerate(STADIUMS)]
    names = rng.sample([f"{f} {l}" for f in FIRST for l in LAST], 30)
    singer = [(i + 1, n, rng.choice(COUNTRIES), rng.randint(18, 60)) for i, n in enumerate(names)]
    concert = [(i + 1, f"{CONCERTS[i % len(CONCERTS)]} {2014 + i // len(CONCERTS) * 3 + rng.randint(0, 2)}",
                2014 + rng.randint(0, 6), rng.randint(1, len(stadium))) for i in range(20)]
    pairs = sorted({(rng.randint(1, len(concert)), rng.randint(1, len(singer))) for _ in range(60)})
    return {"stadium": stadium, "singer": singer, "concert": concert, "singer_in_concert": pairs}


def build_db(path: str | os.PathLike, seed: int = 0) -> Path:
    """Write the database to ``path`` (atomically: a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        con = sqlite3.connect(tmp)
        con.executescript(SCHEMA)
        for table, values in rows(seed).items():
            con.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * len(values[0]))})", values)
        con.commit()
        con.close()
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def ensure_db(path: str | os.PathLike, seed: int = 0) -> Path:
    return Path(path) if Path(path).is_file() else build_db(path, seed)


def execute(db: str | os.PathLike, sql: str, *, max_steps: int = 2_000_000) -> list[tuple]:
    """Run ``sql`` read-only; a query still running after ``max_steps`` VM steps is aborted.
    Raises ``sqlite3.Error`` for any failure (syntax, unknown column, a write, the limit)."""
    con = sqlite3.connect(f"file:{Path(db).resolve()}?mode=ro", uri=True)
    steps = [0]

    def progress():
        steps[0] += 1
        return 1 if steps[0] * 1000 > max_steps else 0  # non-zero aborts the query
    con.set_progress_handler(progress, 1000)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def _norm(row: tuple) -> tuple:
    return tuple(round(v, 4) if isinstance(v, float) else v for v in row)


def same_result(predicted: list[tuple], gold: list[tuple], ordered: bool) -> bool:
    """Spider-style execution match: equal rows, as multisets (as lists when ``ordered``)."""
    p, g = [_norm(r) for r in predicted], [_norm(r) for r in gold]
    return p == g if ordered else Counter(p) == Counter(g)


def extract_sql(text: str) -> str | None:
    """The first ``SELECT …`` statement in a model's reply (code fences and a trailing ';' removed)."""
    m = re.search(r"\bselect\b", text or "", flags=re.IGNORECASE)
    if not m:
        return None
    sql = re.split(r";|```|\n\s*\n", text[m.start():])[0]
    return " ".join(sql.split()) or None


# (question template, gold SQL template, which values fill {v})
TEMPLATES = [
    ("How many singers are from {v}?", "SELECT count(*) FROM singer WHERE country = '{v}'", "country"),
    ("What are the names of the singers from {v}?", "SELECT name FROM singer WHERE country = '{v}'", "country"),
    ("What is the average age of singers from {v}?", "SELECT avg(age) FROM singer WHERE country = '{v}'", "country"),
    ("How many singers are older than {v}?", "SELECT count(*) FROM singer WHERE age > {v}", "age"),
    ("List the names of singers younger than {v}.", "SELECT name FROM singer WHERE age < {v}", "age"),
    ("What is the capacity of the stadium {v}?", "SELECT capacity FROM stadium WHERE name = '{v}'", "stadium"),
    ("Which stadiums are in {v}?", "SELECT name FROM stadium WHERE location = '{v}'", "location"),
    ("How many stadiums are in {v}?", "SELECT count(*) FROM stadium WHERE location = '{v}'", "location"),
    ("How many concerts were held in {v}?", "SELECT count(*) FROM concert WHERE year = {v}", "year"),
    ("What are the names of the concerts held in {v}?", "SELECT name FROM concert WHERE year = {v}", "year"),
    ("How old is {v}?", "SELECT age FROM singer WHERE name = '{v}'", "singer"),
    ("Which country is {v} from?", "SELECT country FROM singer WHERE name = '{v}'", "singer"),
    ("How many concerts were held at {v}?",
     "SELECT count(*) FROM concert AS c JOIN stadium AS s ON c.stadium_id = s.stadium_id WHERE s.name = '{v}'",
     "stadium"),
]


def values(seed: int = 0) -> dict[str, list]:
    data = rows(seed)
    return {"country": COUNTRIES, "location": LOCATIONS, "stadium": STADIUMS,
            "age": list(range(20, 56, 5)), "year": list(range(2014, 2021)),
            "singer": [r[1] for r in data["singer"]]}


def questions(seed: int = 0) -> list[dict]:
    """Every (template, value) question with its gold SQL."""
    vals = values(seed)
    out = []
    for t, (question, gold, kind) in enumerate(TEMPLATES):
        for v in vals[kind]:
            out.append({"template": t, "question": question.format(v=v), "gold": gold.format(v=v),
                        "ordered": "order by" in gold.lower()})
    return out
