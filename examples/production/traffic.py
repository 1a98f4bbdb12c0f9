"""Users of the order assistant over simulated hours, and their late, partial feedback.

    python examples/production/traffic.py --hours 8 --requests-per-hour 30 --feedback-share 0.3 \\
      --service-url http://127.0.0.1:8200 --collector-url http://127.0.0.1:8321 --out traffic.jsonl

The clock is simulated: the script advances it, request by request (``requests_per_hour`` evenly
spread over each hour), so eight "hours" of a shop take as long as the service needs to answer
(``--seconds-per-hour`` makes each simulated hour last at least that long in real time, so that a
trainer on a real schedule, ``lightspan train --mode every``, sees the traffic arrive over time).

Each request is one user with one question (``orders.make_order``); the right total stays here, never
sent to the service. A ``feedback_share`` of users give feedback, and late: each one a delay drawn
from ``[feedback_delay_min_h, feedback_delay_max_h]`` simulated hours after the answer, posted when
the clock passes it, to the collector's ``POST /v1/rewards`` as ``{"rollout_id": request_id, "value":
1 or 0, "name": "feedback", "source": "human"}`` (1 when the answer's total is right). Feedback still
due when the last hour ends is posted then (``--drain``, on) or never. Who gives feedback and when is
drawn from ``seed`` alone (:func:`plan`), so a seed replays the same users against any model.

Printed per simulated hour (one JSON line each, and every request and feedback in ``--out``):
``reward``, the share of the hour's requests answered right (from the kept totals, every request, not
only those with feedback: a failed request counts 0), ``feedback`` posted in that hour and ``errors``.
Each record has ``t``, the wall-clock time (Unix seconds) it happened at, to line the simulated clock
up with what the store records (a canary's decision, a trained version).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests

try:
    from orders import Order, make_order
except ImportError:  # imported as examples.production.traffic
    from examples.production.orders import Order, make_order


@dataclass(frozen=True)
class TrafficConfig:
    """The users' side; each field is a ``--flag`` of the same name."""

    service_url: str = "http://127.0.0.1:8200"     # the agent service (POST /ask)
    collector_url: str = "http://127.0.0.1:8321"   # the lightspan collector's API (POST /v1/rewards)
    collector_token: str = ""                      # the collector's reward_token, when it has one
    hours: int = 8                                 # simulated hours
    requests_per_hour: int = 30
    feedback_share: float = 0.3                    # share of requests whose user gives feedback
    feedback_delay_min_h: float = 0.5              # feedback comes this many simulated hours after the answer...
    feedback_delay_max_h: float = 3.0              # ...at most this many (uniform between)
    seconds_per_hour: float = 0.0                  # real seconds a simulated hour lasts at least
    concurrency: int = 4                           # users asking at once
    seed: int = 0
    reward_name: str = "feedback"
    drain: bool = True                             # post the feedback still due once the last hour ends
    out: str = ""                                  # JSONL: every request, feedback and hour

    def __post_init__(self):
        def bad(field, problem, fix):
            raise ValueError(f"traffic config field {field}: {problem}; {fix}")
        if not 0.0 <= self.feedback_share <= 1.0:
            bad("feedback_share", f"{self.feedback_share} is not a share of requests",
                "pass --feedback-share between 0 and 1 (0.3: three users in ten give feedback)")
        if self.hours < 1 or self.requests_per_hour < 1:
            bad("hours" if self.hours < 1 else "requests_per_hour", "must be at least 1", "pass a positive count")
        if not 0.0 <= self.feedback_delay_min_h <= self.feedback_delay_max_h:
            bad("feedback_delay_min_h", f"[{self.feedback_delay_min_h}, {self.feedback_delay_max_h}] h is not a "
                "range of delays", "pass 0 <= --feedback-delay-min-h <= --feedback-delay-max-h")
        if self.concurrency < 1:
            bad("concurrency", f"{self.concurrency}", "pass 1 or more")
        if self.seconds_per_hour < 0:
            bad("seconds_per_hour", f"{self.seconds_per_hour} is negative", "pass 0 (as fast as answers come) or more")


@dataclass(frozen=True)
class Visit:
    """One user's request: when (simulated hours), what, and when their feedback comes (None: never)."""

    index: int
    at_h: float
    order: Order
    feedback_at_h: float | None


def plan(cfg: TrafficConfig) -> list[Visit]:
    """Every request of the run, in time order; a function of the config (its seed) alone."""
    rng = random.Random(cfg.seed)
    visits = []
    for i in range(cfg.hours * cfg.requests_per_hour):
        at = i / cfg.requests_per_hour
        order = make_order(rng)
        gives, delay = rng.random() < cfg.feedback_share, rng.uniform(cfg.feedback_delay_min_h, cfg.feedback_delay_max_h)
        visits.append(Visit(i, at, order, at + delay if gives else None))
    return visits


class Users:
    """Plays the plan against the service and posts the feedback as the simulated clock passes it."""

    def __init__(self, cfg: TrafficConfig, emit=None):
        self.cfg, self.http = cfg, requests.Session()     # the feedback's (one thread); users ask on their own
        self.answers: dict[int, dict] = {}
        self.drained = 0                                 # feedback posted after the last hour (--drain)
        self.pending: list[tuple[float, int]] = []       # (feedback due, visit index), a heap
        self.hours = [{"hour": h, "requests": 0, "right": 0, "errors": 0, "feedback": 0, "feedback_right": 0}
                      for h in range(cfg.hours)]
        self.emit = emit or (lambda record: None)

    def ask(self, visit: Visit) -> dict:
        try:
            r = requests.post(f"{self.cfg.service_url}/ask", json={"question": visit.order.question}, timeout=300)
            doc = r.json() if r.status_code == 200 else {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
        except requests.RequestException as e:
            doc = {"error": f"{type(e).__name__}: {e}"}
        right = doc.get("total") is not None and abs(doc["total"] - visit.order.total) < 1e-9
        return {"kind": "request", "index": visit.index, "at_h": visit.at_h, "question": visit.order.question,
                "truth": visit.order.total, "total": doc.get("total"), "right": right,
                "request_id": doc.get("request_id"), "error": doc.get("error"), "t": round(time.time(), 3)}

    def post_feedback(self, until_h: float) -> None:
        """Post every feedback due before ``until_h`` (the clock's new time)."""
        headers = {"Authorization": f"Bearer {self.cfg.collector_token}"} if self.cfg.collector_token else {}
        while self.pending and self.pending[0][0] < until_h:
            due, index = heapq.heappop(self.pending)
            answer = self.answers[index]
            value = 1.0 if answer["right"] else 0.0
            r = self.http.post(f"{self.cfg.collector_url}/v1/rewards", headers=headers, timeout=60,
                               json={"rollout_id": answer["request_id"], "value": value,
                                     "name": self.cfg.reward_name, "source": "human"})
            r.raise_for_status()     # a 409 (another value already stored) is a bug here: stop, say so
            if due < self.cfg.hours:       # counted in the hour the clock passed it; drained ones apart
                self.hours[int(due)]["feedback"] += 1
                self.hours[int(due)]["feedback_right"] += int(value)
            else:
                self.drained += 1
            self.emit({"kind": "feedback", "index": index, "request_id": answer["request_id"], "value": value,
                       "at_h": answer["at_h"], "due_h": due, "posted_at_h": until_h if until_h != float("inf") else due,
                       "t": round(time.time(), 3)})

    def run(self) -> list[dict]:
        visits = plan(self.cfg)
        with ThreadPoolExecutor(self.cfg.concurrency) as pool:
            for h, hour in enumerate(self.hours):
                started = time.monotonic()
                todays = [v for v in visits if int(v.at_h) == h]
                for k in range(0, len(todays), self.cfg.concurrency):
                    batch = todays[k:k + self.cfg.concurrency]
                    self.post_feedback(batch[0].at_h)
                    for visit, answer in zip(batch, pool.map(self.ask, batch)):
                        self.answers[visit.index] = answer
                        self.emit(answer)
                        hour["requests"] += 1
                        hour["right"] += int(answer["right"])
                        hour["errors"] += int(answer["error"] is not None)
                        if visit.feedback_at_h is not None and answer["request_id"]:
                            heapq.heappush(self.pending, (visit.feedback_at_h, visit.index))
                self.post_feedback(h + 1)
                hour["reward"] = round(hour["right"] / hour["requests"], 4)
                self.emit({"kind": "hour", **hour, "t": round(time.time(), 3)})
                time.sleep(max(0.0, self.cfg.seconds_per_hour - (time.monotonic() - started)))
        if self.cfg.drain:
            self.post_feedback(float("inf"))
        return self.hours


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(TrafficConfig):
        kind = {bool: lambda s: s.lower() in ("1", "true", "yes", "on")}.get(type(f.default), type(f.default))
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default, metavar=f.name.upper())
    args = parser.parse_args(argv)
    try:
        cfg = TrafficConfig(**vars(args))
    except ValueError as e:
        print(f"traffic.py: {e}", file=sys.stderr)
        return 2
    out = open(cfg.out, "w") if cfg.out else None

    def emit(record):
        if out:
            out.write(json.dumps(record) + "\n")
            out.flush()
        if record["kind"] == "hour":
            print(json.dumps(record), flush=True)

    try:
        users = Users(cfg, emit)
        hours = users.run()
    finally:
        if out:
            out.close()
    requests_total = sum(h["requests"] for h in hours)
    print(json.dumps({"requests": requests_total, "reward": round(sum(h["right"] for h in hours) / requests_total, 4),
                      "feedback": sum(h["feedback"] for h in hours) + users.drained,
                      "feedback_after_last_hour": users.drained, "errors": sum(h["errors"] for h in hours)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
