"""The trainer's Prometheus metrics: ``GET /metrics`` in the Prometheus text format (0.0.4).

A hand-written exposition (a dozen metrics; with several policies each series is labelled
``policy``, :class:`PolicyMetrics`) rather than a dependency: the trainer
updates :class:`TrainerMetrics` after each step and each weight sync, and
:class:`MetricsServer` serves it from a daemon thread. The names are a contract with the
Grafana dashboards (dashboards/grafana/); each is explained in its HELP line, which is its
documentation. A gauge is absent from the page until its first value (no step yet: no
``loss``), so a dashboard shows "no data" rather than a made-up 0.
"""

from __future__ import annotations

import logging
import math
import threading

from lightspan.core import web

log = logging.getLogger(__name__)

PREFIX = "lightspan_trainer_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name (without PREFIX) -> (HELP, the key of the train_steps row it comes from)
GAUGES: dict[str, tuple[str, str]] = {
    "step": ("Optimizer steps taken in this run's lineage (equals the policy version).", "step"),
    "policy_version": ("The policy version the trainer last published (0: the initial model).", "policy_version"),
    "reward_mean": ("Mean reward over the rollouts of the last step's fresh transitions.", "reward_mean"),
    "advantage_std": ("Standard deviation of the advantages of the last step's trained transitions.",
                      "advantage_std"),
    "loss": ("Policy loss of the last step (mean over its passes).", "loss"),
    "kl": ("Mean per-token k3 KL to the reference model in the last step (0 when beta is 0).", "kl"),
    "clip_ratio": ("Share of the last step's tokens whose ratio (or CISPO weight) was clipped.", "clip_ratio"),
    "entropy": ("Mean per-token entropy of the policy over the last step's completion tokens (nats).", "entropy"),
    "entropy_floor": ("The configured entropy_floor (nats): a step whose entropy falls below it is warned of.",
                      "entropy_floor"),
    "grad_norm": (("Total L2 norm of the last step's gradient before clipping to max_grad_norm "
                   "(of its last pass)."), "grad_norm"),
    "is_ratio_mean": (("Mean importance-sampling weight pi_old / pi_vllm after truncation or masking, "
                       "last step."), "is_ratio_mean"),
    "tokens_per_second": (("Trained completion tokens per second of the last optimisation step "
                           "(forward, backward, optimizer; not the sync)."), "tokens_per_second"),
    "staleness_mean": (("Mean policy versions between the trainer and the policy that sampled the last "
                        "step's transitions."), "staleness_mean"),
    "micro_batch_tokens": (("Padded tokens one forward/backward pass of the last step could hold: micro_batch_tokens, "
                            "or the budget derived from max_memory_gb and the model's size."), "micro_batch_tokens"),
    "micro_batches": ("Forward/backward passes (micro-batches) of the last step on this rank.", "micro_batches"),
}
# name (without PREFIX, with _total) -> (HELP, the row key added per step, or None)
COUNTERS: dict[str, tuple[str, str | None]] = {
    "transitions_trained_total": ("Transitions trained on.", "num_transitions"),
    "transitions_skipped_stale_total": (("Transitions skipped as more than max_staleness versions old "
                                         "(or of unknown version)."), "skipped_stale"),
    "transitions_masked_total": (("Transitions left out with loss weight 0 (the rows of a rollout the builder "
                                  "masked: in its group's baseline, not in the loss)."), "masked"),
    "sync_failures_total": ("Weight syncs that failed (SyncError).", None),
    "rounds_held_total": (("Rounds that trained nothing because the trainer's latest version is a canary not "
                           "decided yet (hold_while_canary)."), None),
    "entropy_below_floor_total": ("Steps whose mean per-token entropy fell below entropy_floor (exploration "
                                  "collapsing).", "entropy_below_floor"),
}
HISTOGRAM = "sync_seconds"
HISTOGRAM_HELP = "Wall time of a weight sync into vLLM (save excluded, verification excluded), seconds."
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, math.inf)


def entropy_warning(entropy: float | None, floor: float | None) -> str | None:
    """The warning for a step whose entropy (nats per token) fell below ``floor``; None when it did
    not, or when there is no floor (0 or None) or no entropy."""
    if not floor or entropy is None or not entropy < floor:
        return None
    return (f"policy entropy {entropy:.3f} nats/token is below entropy_floor={floor:g}: exploration is "
            "collapsing (the policy samples nearly the same tokens every time); consider a lower learning_rate, "
            "a KL penalty (beta), a higher sampling temperature, or stopping at an earlier checkpoint")


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class TrainerMetrics:
    """Current values of the trainer's metrics; thread-safe (the server reads, the loop writes)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.gauges: dict[str, float] = {}
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
        self.bucket_counts = [0] * len(BUCKETS)
        self.sync_sum = 0.0
        self.sync_count = 0

    def set_version(self, version: int) -> None:
        with self._lock:
            self.gauges["step"] = self.gauges["policy_version"] = float(version)

    def observe_step(self, row: dict) -> None:
        """Take a train_steps row (``Trainer.publish``'s): set the gauges, add to the counters."""
        with self._lock:
            for name, (_, key) in GAUGES.items():
                if row.get(key) is not None:
                    self.gauges[name] = float(row[key])
            for name, (_, key) in COUNTERS.items():
                if key is not None and row.get(key) is not None:
                    self.counters[name] += float(row[key])

    def observe_sync(self, seconds: float) -> None:
        with self._lock:
            self.sync_sum += seconds
            self.sync_count += 1
            for i, bound in enumerate(BUCKETS):
                if seconds <= bound:
                    self.bucket_counts[i] += 1

    def sync_failed(self) -> None:
        with self._lock:
            self.counters["sync_failures_total"] += 1

    def round_held(self) -> None:
        with self._lock:
            self.counters["rounds_held_total"] += 1

    def render(self) -> str:
        """The exposition page."""
        return render([("", self)])


class PolicyMetrics:
    """Several policies' :class:`TrainerMetrics` on one page (trainer/policies.py): every series
    carries the label ``policy="<name>"``."""

    def __init__(self, by_policy: dict[str, TrainerMetrics]):
        self.by_policy = by_policy

    def render(self) -> str:
        return render([(f'policy="{name}"', m) for name, m in self.by_policy.items()])


def render(parts: list[tuple[str, TrainerMetrics]]) -> str:
    """The exposition page of ``parts``, (label set, metrics) pairs: one HELP and TYPE per metric,
    one sample per part ('' for no labels)."""
    def sample(name: str, labels: str, value) -> str:
        return f"{name}{{{labels}}} {value}" if labels else f"{name} {value}"

    out: list[str] = []
    for _, m in parts:
        m._lock.acquire()
    try:
        for name, (help_, _) in GAUGES.items():
            out += [f"# HELP {PREFIX}{name} {help_}", f"# TYPE {PREFIX}{name} gauge"]
            out += [sample(PREFIX + name, labels, _number(m.gauges[name])) for labels, m in parts if name in m.gauges]
        for name, (help_, _) in COUNTERS.items():
            out += [f"# HELP {PREFIX}{name} {help_}", f"# TYPE {PREFIX}{name} counter"]
            out += [sample(PREFIX + name, labels, _number(m.counters[name])) for labels, m in parts]
        h = PREFIX + HISTOGRAM
        out += [f"# HELP {h} {HISTOGRAM_HELP}", f"# TYPE {h} histogram"]
        for labels, m in parts:
            for bound, count in zip(BUCKETS, m.bucket_counts):     # counts are cumulative already
                out.append(sample(f"{h}_bucket", ",".join(filter(None, [f'le="{_number(bound)}"', labels])), count))
            out += [sample(f"{h}_sum", labels, _number(m.sync_sum)), sample(f"{h}_count", labels, m.sync_count)]
    finally:
        for _, m in parts:
            m._lock.release()
    return "\n".join(out) + "\n"


class MetricsServer:
    """``GET /metrics`` over HTTP (:mod:`lightspan.core.web`: bounded connections and read time) from a
    daemon thread; ``stop`` is idempotent. The page is read-only and Prometheus scrapes it by
    whatever name or address it was given, so any ``Host`` is answered."""

    def __init__(self, metrics: TrainerMetrics, host: str, port: int):
        def handle(request: web.Request) -> web.Response:
            if request.path != "/metrics":
                return web.Response(404, "text/plain; charset=utf-8", b"only /metrics is served here\n")
            if request.method not in ("GET", "HEAD"):
                return web.Response(405, "text/plain; charset=utf-8", b"use GET /metrics\n", {"Allow": "GET"})
            return web.Response(200, CONTENT_TYPE, metrics.render().encode())

        limits = web.Limits(max_connections=64, max_inflight_bytes=1 << 20)
        self._server = web.Server(handle, host, port, limits=limits, name="trainer-metrics")
        self.host, self.port = host, self._server.start()
        log.info("serving Prometheus metrics on http://%s:%d/metrics", host, self.port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        self._server.stop()


def start_server(metrics: TrainerMetrics, host: str, port: int) -> MetricsServer | None:
    """A running server, or None when ``port`` is 0 or cannot be bound: monitoring that fails to
    start is logged, and training goes on without it."""
    if not port:
        return None
    try:
        return MetricsServer(metrics, host, port)
    except OSError as exc:
        log.error("cannot serve Prometheus metrics on %s:%d (%s); training without them "
                  "(pass --metrics-port to pick another port, 0 to disable)", host, port, exc)
        return None
