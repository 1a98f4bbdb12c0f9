"""``lightspan status``: what is in the data directory, what the inference server serves, and how
the latest training run went — one screen, or JSON with ``--format json``.

Reads the store through its DuckDB views (like ``lightspan sql``) and policy.json; asks the vLLM
server only its public ``/health`` and ``/v1/models``. Never writes anything.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import requests

from lightspan import store
from lightspan.store import deployments
from lightspan.core.config import ConfigError, option
from lightspan.store.layout import DATA_DIR_ENV, DEFAULT_DATA_DIR

SECTION = "status"
_DIRS = ("spans", "logs", "wal", "transitions", "train_steps", "deployments", "checkpoints", "rollout-logs")
_DECISIONS = 5
"""The latest deployment decisions shown."""


@dataclass(frozen=True)
class StatusConfig:
    data_dir: str = option(DEFAULT_DATA_DIR, "Data directory to summarise.", env=DATA_DIR_ENV)
    vllm_url: str = option("", "Base URL of the vLLM server to check (/health, /v1/models); empty = the "
                               "trainer's configured LIGHTSPAN_TRAINER_VLLM_URL if set, else no check.",
                           env="LIGHTSPAN_TRAINER_VLLM_URL")
    timeout_s: float = option(3.0, "Seconds to wait for each inference-server request.")
    format: str = option("text", "Output: 'text' (for people) or 'json' (for scripts).", choices=("text", "json"))

    def __post_init__(self):
        if self.format not in ("text", "json"):
            raise ConfigError(SECTION, "format", f"{self.format!r} is not allowed", "use text or json")
        if not self.timeout_s > 0:
            raise ConfigError(SECTION, "timeout_s", f"must be > 0, got {self.timeout_s}", "pass e.g. --timeout-s 3")
        if self.vllm_url and not self.vllm_url.startswith(("http://", "https://")):
            raise ConfigError(SECTION, "vllm_url", f"{self.vllm_url!r} is not an http(s) URL",
                              "pass e.g. --vllm-url http://127.0.0.1:8000")


def disk_usage(location) -> dict[str, int]:
    """Bytes under each known name of a data location (a directory, or an ``s3://`` prefix: the bytes
    of its objects) and in total (files only, links not followed)."""
    sizes = dict.fromkeys(_DIRS, 0)
    total = 0
    for entry in store.Location.of(location).list():
        total += entry.size
        top = entry.key.split("/", 1)[0]
        if top in sizes:
            sizes[top] += entry.size
    return {**sizes, "total": total}


def data_summary(root: Path | str) -> dict:
    """Counts from the store's views, the published policy and the disk use of ``root`` (a
    directory, or an ``s3://`` location: the bytes of its objects)."""
    def read():
        con = store.connect(root)
        try:
            spans, llm_calls = con.execute("SELECT (SELECT count(*) FROM spans), (SELECT count(*) FROM llm_calls)").fetchone()
            splits = {split or "(none)": [n, reward] for split, n, reward in con.execute(
                "SELECT split, count(*), avg(final_reward) FROM rollouts GROUP BY split ORDER BY split").fetchall()}
            transitions, built = con.execute("SELECT count(*), count(DISTINCT build_id) FROM transitions").fetchone()
            steps, runs = con.execute("SELECT count(*), count(DISTINCT run_id) FROM train_steps").fetchone()
            last = con.execute("SELECT max(end_time_unix_nano) FROM spans").fetchone()[0]
            # the latest step of each policy (one row, policy null, without policies)
            latest = con.execute("""
                SELECT run_id, count(*) OVER (PARTITION BY run_id), step, policy_version, time_unix_nano, reward_mean,
                       loss, kl, entropy, clip_ratio, is_ratio_mean, staleness_mean, sync_seconds, policy
                FROM train_steps QUALIFY row_number() OVER (PARTITION BY policy ORDER BY time_unix_nano DESC) = 1
                ORDER BY time_unix_nano DESC""").fetchall()
            deployed = deployments.summary(con, _DECISIONS)
        finally:
            con.close()
        return spans, llm_calls, splits, transitions, built, steps, runs, last, latest, deployed

    spans, llm_calls, splits, transitions, builds, steps, runs, last, latest, deployed = store.retry_vanished(read)
    published = store.policy.read_all(root)
    policy = {"version": published[""].version, "path": published[""].path} if "" in published else None
    policies = [{"name": name, "version": p.version, "path": p.path} for name, p in sorted(published.items()) if name]
    names = ("run_id", "steps", "step", "policy_version", "time_unix_nano", "reward_mean", "loss", "kl",
             "entropy", "clip_ratio", "is_ratio_mean", "staleness_mean", "sync_seconds", "policy")
    by_policy = [dict(zip(names, row)) for row in latest]
    run = by_policy[0] if by_policy else None
    where = store.Location.of(root).resolved()
    exists = where.exists()
    return {"data_dir": str(where), "exists": exists,
            "spans": spans, "llm_calls": llm_calls,
            "rollouts": sum(n for n, _ in splits.values()),
            "rollouts_by_split": {k: {"rollouts": n, "reward_mean": r} for k, (n, r) in splits.items()},
            "last_span_unix_nano": last, "transitions": transitions, "transition_builds": builds,
            "train_steps": steps, "training_runs": runs, "policy": policy, "policies": policies,
            "latest_run": run, "latest_by_policy": {r["policy"]: r for r in by_policy if r["policy"]},
            "deployments": deployed,
            "disk_bytes": disk_usage(where) if exists else {}}


def inference_summary(url: str, timeout_s: float) -> dict:
    """``/health`` and ``/v1/models`` of an OpenAI-compatible (vLLM) server; errors are reported, not raised."""
    url = url.rstrip("/")
    out: dict = {"url": url}
    try:
        out["healthy"] = requests.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except requests.RequestException as exc:
        return {**out, "healthy": False, "error": f"unreachable: {type(exc).__name__}"}
    try:
        response = requests.get(f"{url}/v1/models", timeout=timeout_s)
        response.raise_for_status()
        out["models"] = [{"id": m.get("id"), "root": m.get("root"), "max_model_len": m.get("max_model_len")}
                         for m in response.json().get("data", [])]
    except (requests.RequestException, ValueError, AttributeError) as exc:
        out["error"] = f"/v1/models failed: {exc}"
    return out


def summary(config: StatusConfig) -> dict:
    doc = {"data": data_summary(store.data_dir(config.data_dir))}
    doc["inference"] = inference_summary(config.vllm_url, config.timeout_s) if config.vllm_url else None
    return doc


def _num(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else f"{value:,}"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def render(doc: dict) -> str:
    """The summary for people."""
    import datetime as dt

    def when(ns):
        return dt.datetime.fromtimestamp(ns / 1e9, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ") if ns else "-"

    d = doc["data"]
    lines = [f"data directory  {d['data_dir']}" + ("" if d["exists"] else "  (does not exist yet)"),
             f"  spans         {_num(d['spans'])} ({_num(d['llm_calls'])} LLM calls), "
             f"last at {when(d['last_span_unix_nano'])}",
             f"  rollouts      {_num(d['rollouts'])}"
             + "".join(f"; {k} {_num(v['rollouts'])} (mean reward {_num(v['reward_mean'], 3)})"
                       for k, v in d["rollouts_by_split"].items()),
             f"  transitions   {_num(d['transitions'])} from {_num(d['transition_builds'])} builds",
             f"  train steps   {_num(d['train_steps'])} in {_num(d['training_runs'])} runs"]
    policy = d["policy"]
    if policy or not d["policies"]:
        lines.append(f"  policy        version {policy.get('version')} at {policy.get('path')}" if policy
                     else "  policy        none published (no policy.json)")
    for p in d["policies"]:     # several policies: each served under its name
        lines.append(f"  policy        {p['name']}: version {p['version']} at {p['path']}")
    for p in d["deployments"]["policies"]:
        canary = "no canary"
        if p["candidate"] is not None:
            arms = p["arms"] or {}
            evidence = ", ".join(f"v{v}: {a['rollouts']} rewarded, mean {_num(a['reward_mean'], 3)}" for v, a in arms.items())
            canary = f"canary v{p['candidate']} on {p['share']:.0%} of rollouts since {when(p['since_unix_nano'])} ({evidence})"
        back = f"; rolled back: {', '.join(f'v{v}' for v in p['rolled_back'])}" if p["rolled_back"] else ""
        lines.append(f"  deployment    {p['policy'] + ': ' if p['policy'] else ''}serving v{p['serving']}, {canary}{back}")
    for r in d["deployments"]["decisions"]:
        lines.append(f"  decision      {when(r['time_unix_nano'])} {r['action']} v{r['version']}"
                     f"{' of ' + r['policy'] if r['policy'] else ''} ({r['actor']}): {r['reason']}")
    if d["disk_bytes"]:
        parts = ", ".join(f"{k} {_size(v)}" for k, v in d["disk_bytes"].items() if k != "total" and v)
        lines.append(f"  disk          {_size(d['disk_bytes']['total'])}" + (f" ({parts})" if parts else ""))
    inference = doc["inference"]
    if inference is None:
        lines.append("inference       not checked (pass --vllm-url)")
    else:
        state = "healthy" if inference.get("healthy") else "NOT healthy"
        problem = f" ({inference['error']})" if "error" in inference else ""
        lines.append(f"inference       {inference['url']}: {state}{problem}")
        for model in inference.get("models", []):
            lines.append(f"  model         {model['id']} (max_model_len {model['max_model_len']}, from {model['root']})")
    if d["latest_run"] is None:
        lines.append("latest run      none (lightspan train writes train_steps)")
    runs = d["latest_by_policy"] or ({"": d["latest_run"]} if d["latest_run"] else {})
    for name, run in runs.items():     # with several policies, the latest run of each
        lines.append(f"latest run      {name + ': ' if name else ''}{run['run_id']}: {run['steps']} steps, "
                     f"last step {run['step']} at {when(run['time_unix_nano'])} -> policy version {run['policy_version']}")
        lines.append(f"  last step     reward {_num(run['reward_mean'])}, loss {_num(run['loss'])}, KL {_num(run['kl'])}, "
                     f"entropy {_num(run['entropy'])}, clip {_num(run['clip_ratio'])}, IS {_num(run['is_ratio_mean'])}, "
                     f"staleness {_num(run['staleness_mean'], 2)}, sync {_num(run['sync_seconds'], 2)} s")
    return "\n".join(lines) + "\n"


def run(config: StatusConfig) -> int:
    """``lightspan status``: print the summary; exit 1 when a checked inference server is not healthy."""
    doc = summary(config)
    if config.format == "json":
        sys.stdout.write(json.dumps(doc, default=str) + "\n")
    else:
        sys.stdout.write(render(doc))
    return 1 if doc["inference"] is not None and not doc["inference"].get("healthy") else 0
