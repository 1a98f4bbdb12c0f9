"""What became of each rollout: its outcome, how its process ended, and the run's summaries of
what was captured (tracing/report.py) and what reached the collector (rollout/spool.py)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from lightspan.rollout.spool import Delivery, Shipper, runner_span
from lightspan.tracing import semconv

log = logging.getLogger("lightspan.rollout.runner")

# An agent that exits with this status says that something it needs besides the model is unavailable
# (a retrieval service, a sandbox): sysexits' EX_TEMPFAIL, "temporary failure, retry". The rollout is
# an infrastructure failure, as one killed by a signal the runner did not send: retried, recorded as
# ``infra``, never trained on and never a failure of the policy's.
INFRA_EXIT_CODE = 75


def exit_outcome(code: int) -> str:
    """The outcome of an agent process that exited with ``code`` (negative: killed by that signal)."""
    if code == 0:
        return "ok"
    return "infra" if code < 0 or code == INFRA_EXIT_CODE else "failed"


@dataclass
class Outcome:
    rollout_id: str
    task_id: str
    outcome: str          # ok | failed | timeout | infra
    exit_code: int | None
    start_ns: int
    end_ns: int
    attempt: int
    capture: dict | None = None   # the agent's capture report (tracing/report.py), if it wrote one
    delivery: Delivery | None = None   # its spans: spooled, delivered, lost (rollout/spool.py)

    @property
    def exception(self) -> str | None:
        """The type of the uncaught exception that ended the process, as its spool recorded it."""
        return self.delivery.exception if self.delivery is not None else None

    @property
    def end(self) -> tuple[str, int | None]:
        """How the process ended (:data:`semconv.ROLLOUT_END`) and the signal that ended it, if one did:
        an exit with a non-zero status that an uncaught exception caused is ``exception``."""
        if self.outcome == "timeout":
            return "timeout", -self.exit_code if self.exit_code is not None and self.exit_code < 0 else None
        if self.exit_code is None:
            return "unknown", None
        if self.exit_code < 0:
            return "signal", -self.exit_code
        return ("exception", None) if self.exit_code > 0 and self.exception else ("exit", None)


def read_report(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def capture_summary(outcomes: list[Outcome], gateway: bool = False) -> dict:
    """The rollouts' LLM calls by capture outcome; each reason a call was not captured is logged
    once, with its fix, and the rollouts none of whose calls were captured are listed."""
    total = {"calls": 0, "captured": 0, "not_captured": {}, "reasons": {}, "rollouts_without_ids": [],
             "rollouts_without_report": 0}
    for o in outcomes:
        report = o.capture
        if report is None:
            total["rollouts_without_report"] += o.outcome == "ok"
            continue
        total["calls"] += report.get("calls", 0)
        total["captured"] += report.get("captured", 0)
        for status, n in (report.get("not_captured") or {}).items():
            total["not_captured"][status] = total["not_captured"].get(status, 0) + n
        for status, reason in (report.get("reasons") or {}).items():
            total["reasons"].setdefault(status, reason)
        uncaptured = sum(n for s, n in (report.get("not_captured") or {}).items() if s != "gateway")
        if uncaptured and not report.get("captured"):
            total["rollouts_without_ids"].append(o.rollout_id)
    for status, n in sorted(total["not_captured"].items()):
        if status == "gateway":
            continue
        log.warning("%d LLM call(s) not captured (%s): %s", n, status,
                    total["reasons"].get(status, "see the rollout logs"))
    if total["rollouts_without_ids"]:
        log.warning("%d rollout(s) with LLM calls and no token ids, nothing to train on: %s",
                    len(total["rollouts_without_ids"]), ", ".join(total["rollouts_without_ids"][:10]))
    if total["rollouts_without_report"] and not gateway:
        log.warning("%d rollout(s) left no capture report: the agent did not run lightspan's instrumentor "
                    "(not a Python agent, or lightspan is not installed in its environment); send its calls "
                    "through a lightspan gateway (--gateway-url)", total["rollouts_without_report"])
    return total


def record_outcome(shipper: Shipper, split: str, o: Outcome) -> None:
    """Export the rollout's ``lightspan.runner`` span (outcome, how it ended, its spans' delivery) with
    the runner's own exporter; when the collector does not acknowledge it, it is lost too."""
    outcome = o.outcome
    end, sig = o.end
    attrs = {semconv.ROLLOUT_ID: o.rollout_id, semconv.TASK_ID: o.task_id, semconv.SPLIT: split,
             semconv.ROLLOUT_OUTCOME: outcome, semconv.ROLLOUT_EXIT_CODE: -1 if o.exit_code is None else o.exit_code,
             semconv.ROLLOUT_END: end}
    if sig is not None:
        attrs[semconv.ROLLOUT_SIGNAL] = sig
    if end == "exception":
        attrs[semconv.ROLLOUT_EXCEPTION_TYPE] = o.exception
    d = o.delivery
    if d is not None and d.spool:
        attrs.update({semconv.ROLLOUT_SPANS_SPOOLED: d.spooled, semconv.ROLLOUT_SPANS_LOST: d.lost,
                      semconv.ROLLOUT_SPANS_DAMAGED: d.damaged})
    span = runner_span(semconv.genai(attrs), o.start_ns, o.end_ns, None if outcome == "ok" else f"rollout {outcome}")
    if not shipper.export([span]):
        o.delivery = d = d or Delivery(spool=False)
        d.lost += 1


def delivery_summary(outcomes: list[Outcome], gateway: bool = False) -> dict:
    """The rollouts' spans by delivery; the rollouts that lost any are listed and logged."""
    total = {"spans": 0, "delivered": 0, "lost": 0, "damaged": 0, "rollouts_with_lost_spans": [],
             "rollouts_without_spool": 0}
    for o in outcomes:
        d = o.delivery or Delivery(spool=False)
        total["spans"] += d.spooled
        total["delivered"] += d.delivered
        total["lost"] += d.lost
        total["damaged"] += d.damaged
        total["rollouts_without_spool"] += not d.spool
        if d.lost:
            total["rollouts_with_lost_spans"].append(o.rollout_id)
    if total["lost"]:
        log.error("%d span(s) of %d rollout(s) did not reach the collector: %s", total["lost"],
                  len(total["rollouts_with_lost_spans"]), ", ".join(total["rollouts_with_lost_spans"][:10]))
    if total["rollouts_without_spool"] and not gateway:
        log.warning("%d rollout(s) wrote no span spool (the agent did not run lightspan's instrumentor): whether "
                    "their spans reached the collector is not checked", total["rollouts_without_spool"])
    return total
