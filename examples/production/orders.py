"""The shop's order-total questions: what users ask the assistant, and the right total.

A customer names two items of their cart with their prices and asks what the order comes to; the
right answer is the sum, a two-digit addition (what lightspan's demo teaches SmolLM2-135M) told the way
a shop's customers write. The traffic generator (``traffic.py``) draws the questions and keeps each
total to itself: the agent service sees the question only, and the hosted-model stand-in
(``hosted_standin.py``) works the total out from the question's own text, as a good model would.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

ITEMS = ("desk lamp", "phone case", "notebook", "water bottle", "backpack", "coffee mug", "umbrella",
         "wall clock", "yoga mat", "USB cable", "tea kettle", "picture frame", "bike light", "plant pot")
ASKS = ("I'm ordering a {a} (${pa}) and a {b} (${pb}). What is my order total?",
        "My cart has a {a} at ${pa} and a {b} at ${pb}. How much do I pay?",
        "How much is a {a} for ${pa} plus a {b} for ${pb}?",
        "What's the total for one {a} (${pa}) and one {b} (${pb})?")
_PRICE = re.compile(r"\$(\d+)")


@dataclass(frozen=True)
class Order:
    """One customer's question and its right answer (never shown to the agent)."""

    question: str
    total: int


def make_order(rng: random.Random) -> Order:
    """A question about two different items at two-digit prices (10..89 dollars each)."""
    a, b = rng.sample(ITEMS, 2)
    pa, pb = rng.randint(10, 89), rng.randint(10, 89)
    return Order(rng.choice(ASKS).format(a=a, b=b, pa=pa, pb=pb), pa + pb)


def prices(text: str) -> list[int]:
    """The dollar amounts written in ``text`` (``$47`` → 47), in order."""
    return [int(p) for p in _PRICE.findall(text)]
