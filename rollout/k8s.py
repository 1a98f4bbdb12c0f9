"""One Kubernetes Job per rollout: ``rollout-job.yaml`` (beside this module, in the package)
rendered for each task sample.

The Jobs carry the environment ``lightspan rollout`` gives a local agent process
(:func:`lightspan.rollout.runner.rollout_env`), so spans are grouped the same way. Usage::

    lightspan jobs --tasks tasks.jsonl --samples 4 --image my-agent:1 \\
        --openai-base-url http://vllm.rl:8000/v1 --otlp-endpoint http://lightspan.rl:4318 \\
        -- python my_agent.py | kubectl apply -f -
"""

from __future__ import annotations

import json
import re
import string
import uuid
from dataclasses import dataclass
from pathlib import Path

from lightspan import store
from lightspan.core.config import ConfigError, option
from lightspan.rollout.runner import RolloutConfig, load_tasks, rollout_env

DEFAULT_TEMPLATE = Path(__file__).resolve().parent / "rollout-job.yaml"  # package data: in the wheel too


@dataclass(frozen=True)
class JobsConfig(RolloutConfig):
    """``lightspan jobs``: the rollout's settings (the ``[rollout]`` table) and where the Jobs run."""

    image: str = option("", "Container image with the agent and lightspan's agent side installed.")
    namespace: str = option("default", "Kubernetes namespace of the Jobs.")
    template: str = option("", "Job template (placeholders ${JOB_NAME}, ${IMAGE}, ...); empty: lightspan's own, "
                                   "rollout-job.yaml in the installed package.")
    auth_secret: str = option("lightspan-auth", "Secret (key `token`) holding the collector's bearer token, which "
                                                "the agents' exporter sends; empty: the agents send none.")

    def __post_init__(self):
        super().__post_init__()
        if not self.image:
            raise ConfigError("rollout", "image", "no container image given", "pass --image REGISTRY/my-agent:TAG")


def job_name(rollout_id: str) -> str:
    """A DNS-1123 label (≤ 63 characters, a Job's pods carry it) that keeps the id's unique tail."""
    slug = re.sub(r"[^a-z0-9-]+", "-", rollout_id.lower()).strip("-") or "x"
    name = "rollout-" + slug
    if len(name) > 63:
        name = "rollout-" + slug[-55:].lstrip("-")
    return name


def _token_env(secret: str) -> list[dict]:
    """The collector's token from ``secret``, sent by the agents' OTLP exporter (the space URL-encoded)."""
    if not secret:
        return []
    return [{"name": "COLLECTOR_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": "token"}}},
            {"name": "OTEL_EXPORTER_OTLP_HEADERS", "value": "authorization=Bearer%20$(COLLECTOR_AUTH_TOKEN)"}]


def render_job(template: str, cfg: RolloutConfig, task: dict, *, image: str, command: list[str],
               rollout_id: str | None = None, version: int | None = None, namespace: str = "default") -> str:
    """One Job manifest (YAML text). Values go in JSON-encoded: JSON is valid YAML, so a task id or
    a command with quotes, colons or newlines cannot change the manifest's structure."""
    rollout_id = rollout_id or f"{task['id']}-{uuid.uuid4().hex[:12]}"
    env = rollout_env(cfg, task, rollout_id, version)
    values = {
        "JOB_NAME": job_name(rollout_id), "NAMESPACE": namespace, "SPLIT": cfg.split,
        "ROLLOUT_ID": rollout_id, "TASK_ID": task["id"], "RETRIES": cfg.retries,
        "TIMEOUT_S": max(1, round(cfg.timeout_s)), "IMAGE": image,
        "COMMAND": ["opentelemetry-instrument", *command],
        "ENV": [{"name": k, "value": v} for k, v in env.items()] + _token_env(getattr(cfg, "auth_secret", "")),
    }
    try:
        return string.Template(template).substitute({k: json.dumps(v) for k, v in values.items()})
    except (KeyError, ValueError) as e:
        names = ", ".join("${%s}" % k for k in values)
        raise ConfigError("rollout", "template", f"unknown or malformed placeholder {e}",
                          f"use only {names}; write a literal dollar sign as $$") from None


def render_jobs(cfg: JobsConfig, command: list[str]) -> list[str]:
    """One manifest per task sample, as ``lightspan rollout`` would run them."""
    if not command:
        raise ConfigError("rollout", "command", "no agent command given", "append: -- python my_agent.py")
    path = Path(cfg.template or DEFAULT_TEMPLATE)
    if not path.is_file():
        raise ConfigError("rollout", "template", f"{path} not found",
                          f"pass --template with a Job template (lightspan's own: {DEFAULT_TEMPLATE})")
    template, version = path.read_text(), store.policy.served_version(cfg.data_dir)
    return [render_job(template, cfg, task, image=cfg.image, command=command, version=version,
                       namespace=cfg.namespace)
            for task in load_tasks(cfg.tasks) for _ in range(cfg.samples)]
