"""Canaries at the gateway: a new policy version serves a share of rollouts until a rule decides.

With ``[canary] enabled = true`` the gateway (rollout/gateway.py) stops sending every call to the
name vLLM serves the newest version under. For each policy it knows the serving version and at most
one candidate, from the ``deployments`` table (lightspan.store.deployments), and:

1. **routing** — a call to the policy's model name (a named policy's name, or ``model`` for the
   unnamed one) goes to ``<name>-v<N>``, the versioned name LoRA weight sync loads each version
   under: N is the candidate for a ``share`` of rollouts, chosen by a hash of the rollout id and the
   candidate's version (:func:`in_canary`; sticky: every call of a rollout lands on the same
   version, and a new candidate draws a new sample), else the serving version. The call's span
   records the version that served it. A call that names a rolled-back version itself is refused;
2. **planning** — every ``refresh_s`` the table and policy.json are read again: the first time a
   policy is seen its published version is recorded as serving (``serve``); a newer version that
   training published and nobody decided on becomes the candidate (``canary``, replacing an
   undecided older one);
3. **deciding** — every ``check_every_s`` each candidate's rewards are compared with the serving
   version's since the canary began (rollout/canary_rule.py) and a ``promote`` or ``rollback`` is
   written with its evidence. Every decision is a row in the store before it takes effect, so a
   gateway restarted mid-canary routes as before and never serves a rolled-back version; a person's
   decision (``lightspan deploy``) reaches a running gateway within ``refresh_s``.

vLLM must serve both arms' versioned names: LoRA weight sync (``trainer.sync = "lora"``) loads each
new version as ``<name>-v<N>`` and unloads the previous one unless it is an arm (trainer/deployed.py,
which also keeps the arms' checkpoints from pruning), and with ``load_adapters`` the gateway loads
the arms' adapters that a replica's ``/v1/models`` lacks (a restarted vLLM), from the checkpoints
the table records. A checkpoint reloaded in place (``sync = "reload"``) serves one version per server: no canary.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import requests

from lightspan import store
from lightspan.core import web
from lightspan.core.config import ConfigError, option
from lightspan.rollout.canary_rule import WAIT, Evidence, decide
from lightspan.store import deployments as dep
from lightspan.store.policy import Policy

log = logging.getLogger(__name__)
SECTION = "canary"
_VERSIONED = re.compile(r"(.+)-v(\d+)")


@dataclass(frozen=True)
class CanaryConfig:
    """``[canary]``: how the gateway rolls out new policy versions (rollout/canary.py). Off by default."""

    enabled: bool = option(False, "Serve each new policy version to a share of rollouts first, then promote or roll "
                                  "it back by the rule (docs/deployment.md, \"Canaries\"). Needs LoRA weight sync.")
    share: float = option(0.1, "Share of rollouts (by a hash of the rollout id) the candidate version serves.")
    min_rollouts: int = option(30, "Rewarded rollouts each arm needs before the rule decides anything.")
    window: int = option(500, "The latest rewarded rollouts of each arm the rule compares (equal versions need "
                              "about 2 var (1.645 / margin)^2 each to be promoted: 135 for 0/1 rewards near 0.5).")
    confidence: float = option(0.95, "Confidence of the one-sided Welch test: promote when p < 1 - confidence, "
                                     "roll back when p > confidence.")
    margin: float = option(0.1, "The loss of mean reward (in the reward's units) a candidate may have and still "
                                 "be promoted; 0: it must be better.")
    check_every_s: float = option(30.0, "Seconds between evaluations of the running canaries.")
    refresh_s: float = option(2.0, "Seconds between reads of the decisions (deployments) and policy.json.")
    model: str = option("policy", "The model name agents call the unnamed policy by (trainer.served_model_name); "
                                  "a named policy's is its name.")
    load_adapters: bool = option(True, "Load the arms' LoRA adapters into each vLLM replica that lacks them.")

    def __post_init__(self):
        def bad(name, problem, fix):
            raise ConfigError(SECTION, name, problem, fix)

        if not (math.isfinite(self.share) and 0.0 < self.share < 1.0):
            bad("share", f"{self.share} is not a share strictly between 0 and 1", "pass e.g. share = 0.1")
        if not (0.5 < self.confidence < 1.0):
            bad("confidence", f"{self.confidence} is not between 0.5 and 1 (exclusive)", "pass e.g. 0.95")
        if not (math.isfinite(self.margin) and self.margin >= 0.0):
            bad("margin", f"{self.margin} is not a reward difference >= 0", "pass e.g. 0.05 (0: must be better)")
        if self.min_rollouts < 2:
            bad("min_rollouts", "a variance needs at least 2 rollouts per arm", "pass e.g. 30")
        if self.window < self.min_rollouts:
            bad("window", f"{self.window} is below min_rollouts ({self.min_rollouts}): no decision could be made",
                "pass a window of at least min_rollouts")
        for name in ("check_every_s", "refresh_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                bad(name, "must be a positive number of seconds", "pass e.g. 30")
        if not self.model:
            bad("model", "is empty", "pass the name agents call the policy by (trainer.served_model_name)")


def in_canary(key: str, candidate: int, share: float) -> bool:
    """Whether rollout ``key`` is in the candidate's share: blake2b(candidate, key) as a number in
    [0, 1) below ``share`` (uniform over keys; the same key, the same answer)."""
    digest = hashlib.blake2b(f"{candidate}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64 < share


def plan(state: dict[str, dep.Deployment], published: dict[str, Policy], share: float) -> list[dict]:
    """The rows that follow from what training published: a policy seen for the first time serves
    its published version; a newer undecided version becomes the candidate."""
    rows = []
    for name, p in sorted(published.items()):
        d = state.get(name)
        if d is None:
            rows.append(dep.row(name, p.version, dep.SERVE, checkpoint=p.path,
                                reason="published when canaries began"))
        elif (d.serving is not None and p.version > d.serving and p.version != d.candidate
              and not d.decided(p.version)):
            more = f"; supersedes undecided v{d.candidate}" if d.candidate is not None else ""
            rows.append(dep.row(name, p.version, dep.CANARY, share=share, serving_version=d.serving,
                                checkpoint=p.path, reason=f"published by training{more}"))
    return rows


def verdict(d: dep.Deployment, evidence: Evidence) -> dict | None:
    """The row of an automatic decision on ``d``'s candidate, None while the rule waits."""
    if evidence.action == WAIT:
        return None
    return dep.row(d.policy, d.candidate, evidence.action, share=d.share, serving_version=d.serving,
                   checkpoint=d.candidate_checkpoint, reason=evidence.reason, **evidence.columns())


class Canary:
    """The gateway's canary: :meth:`route` per call; :meth:`refresh` and :meth:`check` in a thread."""

    def __init__(self, cfg: CanaryConfig, data_dir, published: Callable[[], dict[str, Policy]],
                 replicas: Callable[[], list[str]] = list):
        self.cfg, self.data_dir, self._published, self._replicas = cfg, data_dir, published, replicas
        self.reader = dep.Reader(data_dir)
        self.state: dict[str, dep.Deployment] = {}
        self.evidence: dict[str, Evidence] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- per call ------------------------------------------------------------------------------
    def route(self, model: str | None, key: str) -> tuple[str | None, int | None]:
        """The model name a call to ``model`` of rollout ``key`` goes to and the version it serves
        (None: not a policy under canary, unchanged). A rolled-back version: web.HTTPError 404."""
        if not model:
            return model, None
        named = set(self._published()) - {""}
        m = _VERSIONED.fullmatch(model)
        base, pinned = (m.group(1), int(m.group(2))) if m else (model, None)
        policy = base if base in named else "" if base == self.cfg.model else None
        d = self.state.get(policy) if policy is not None else None
        if d is None:
            return model, pinned
        if pinned is not None:
            if pinned in d.rolled_back:
                raise web.HTTPError(404, f"version {pinned} of {base!r} was rolled back; `lightspan deploy promote "
                                         f"{pinned}` serves it again")
            return model, pinned
        if d.serving is None:
            raise web.HTTPError(503, f"no version of {base!r} may serve (every one was rolled back); promote one "
                                     "with `lightspan deploy promote VERSION`", {"Retry-After": "30"})
        arm = d.candidate if d.candidate is not None and in_canary(key or uuid.uuid4().hex, d.candidate, d.share) \
            else d.serving
        return f"{base}-v{arm}", arm

    # --- in the background ---------------------------------------------------------------------
    def refresh(self) -> None:
        """Read the decisions and policy.json, record what follows (:func:`plan`), adopt the result."""
        state = self.reader.state()
        rows = plan(state, self._published(), self.cfg.share)
        if rows:
            dep.record(self.data_dir, rows)          # durable before any call is routed by it
            for r in rows:
                log.info("canary: %s v%d of policy %r (%s)", r["action"], r["version"], r["policy"] or "",
                         r["reason"])
            state = self.reader.state()
        self.state = state
        # every arm, the serving one too: calls go to its versioned name even with no canary running,
        # and a vLLM restarted since has none of them (the users' calls would get 404 until training
        # published again)
        if self.cfg.load_adapters and any(d.serving is not None or d.candidate is not None for d in state.values()):
            self._load_adapters()

    def check(self, con=None) -> list[dict]:
        """Apply the rule to each running canary; record and return its decisions."""
        running = [d for d in self.state.values() if d.candidate is not None and d.serving is not None]
        if not running:
            return []
        own = con is None
        con = store.connect(self.data_dir) if own else con
        try:
            rows = []
            for d in running:
                rewards = store.retry_vanished(lambda: dep.arm_rewards(
                    con, d.policy, (d.candidate, d.serving), d.since_unix_nano, self.cfg.window))
                evidence = decide(rewards[d.candidate], rewards[d.serving], min_rollouts=self.cfg.min_rollouts,
                                  confidence=self.cfg.confidence, margin=self.cfg.margin)
                self.evidence[d.policy] = evidence
                decision = verdict(d, evidence)
                if decision is not None:
                    log.info("canary: %s v%d of policy %r: %s", decision["action"], d.candidate, d.policy,
                             evidence.reason)
                    rows.append(decision)
        finally:
            if own:
                con.close()
        dep.record(self.data_dir, rows)
        if rows:
            self.state = self.reader.state()
        return rows

    def _load_adapters(self) -> None:
        """Each arm's ``<name>-v<N>`` on every replica that does not list it (``POST /v1/load_lora_adapter``)."""
        wanted = {}
        for d in self.state.values():
            base = d.policy or self.cfg.model
            for version, path in ((d.serving, d.serving_checkpoint), (d.candidate, d.candidate_checkpoint)):
                if version is not None and path:
                    wanted[f"{base}-v{version}"] = path
        for url in self._replicas():
            url = url.rstrip("/").removesuffix("/v1")
            try:
                have = {m.get("id") for m in requests.get(f"{url}/v1/models", timeout=5).json().get("data", [])}
                for name, path in wanted.items():
                    if name not in have:
                        requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                                      timeout=120).raise_for_status()
                        log.info("canary: loaded %s from %s into %s", name, path, url)
            except (requests.RequestException, ValueError, AttributeError) as e:
                log.warning("canary: could not check or load the arms' adapters at %s: %s", url, e)

    def start(self) -> None:
        """Read the decisions now (a restarted gateway routes as before from its first call), then
        keep refreshing and checking in a thread."""
        self.refresh()
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="lightspan-canary", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        last_check = time.monotonic()
        while not self._stop.wait(self.cfg.refresh_s):
            try:
                self.refresh()
                if time.monotonic() - last_check >= self.cfg.check_every_s:
                    last_check = time.monotonic()
                    self.check()
            except Exception:        # the store unreadable for a moment: route by what was read last
                log.warning("canary: refresh failed; routing by the last decisions read", exc_info=True)

    def status(self) -> list[dict]:
        """Each policy's versions, the canary's share and the rule's latest evidence."""
        out = []
        for name, d in sorted(self.state.items()):
            e = self.evidence.get(name)
            out.append({"policy": name, "serving": d.serving, "candidate": d.candidate, "share": d.share,
                        "rolled_back": sorted(d.rolled_back),
                        "evidence": None if e is None or d.candidate is None else {**e.columns(), "action": e.action,
                                                                                   "reason": e.reason}})
        return out



def by_hand(data_dir, action: str, version: int, policy: str = "", reason: str = "") -> dict:
    """``lightspan deploy promote|rollback VERSION``: record a person's decision (a running gateway
    follows it within ``refresh_s``); the version must be one training published. Returns the row."""
    if action not in (dep.PROMOTE, dep.ROLLBACK):
        raise ValueError(f"{action!r}: by hand, promote or rollback")
    rows = dep.Reader(data_dir).rows()
    d = dep.fold(rows).get(policy)
    published = store.policy.read(data_dir, policy)
    known = {v for v, _ in (d.history if d else ())} | set(d.rolled_back if d else ()) \
        | ({d.candidate} if d and d.candidate is not None else set()) | ({published.version} if published else set())
    if version not in known:
        label = f"policy {policy!r}" if policy else "the unnamed policy (pass --policy NAME for a named one)"
        raise ConfigError("deploy", "version", f"{version} is not a version of {label} that training published "
                          f"(known: {', '.join(map(str, sorted(known))) or 'none'})", "pass one of the known versions")
    # the checkpoint a decision about the version recorded last, else policy.json's
    seen = [r["checkpoint"] for r in sorted(rows, key=lambda r: r["time_unix_nano"])
            if (r["policy"] or "") == policy and r["version"] == version and r["checkpoint"]]
    checkpoint = seen[-1] if seen else published.path if published and published.version == version else ""
    r = dep.row(policy, version, action, actor=dep.MANUAL, reason=reason or f"{action} by hand",
                serving_version=d.serving if d else None, checkpoint=checkpoint)
    dep.record(data_dir, [r])
    return r
