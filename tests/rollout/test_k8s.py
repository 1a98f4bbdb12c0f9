"""The one-Job-per-rollout template, rendered and read back as YAML."""

from __future__ import annotations

import dataclasses
import io
import json
import re
from contextlib import redirect_stdout
from urllib.parse import unquote

import pytest
import yaml

from lightspan import cli
from lightspan.core.config import ConfigError
from lightspan.rollout import k8s
from lightspan.tracing import semconv
from lightspan.rollout.runner import RolloutConfig

TRICKY = 'q: "1 + 1"\n# not a comment ${X} {a: b}'


def _cfg(tmp_path, **kw):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "Task_7/x", "question": TRICKY}) + "\n" + json.dumps({"id": "t2"}) + "\n")
    return RolloutConfig(tasks=str(tasks), data_dir=str(tmp_path), split="val", timeout_s=90.5, retries=2,
                         otlp_endpoint="http://lightspan.rl:4318", openai_base_url="http://vllm.rl:8000/v1", **kw)


def test_rendered_job_is_valid_yaml_with_the_rollout_environment(tmp_path):
    cfg = _cfg(tmp_path)
    task = {"id": "Task_7/x", "question": TRICKY}
    text = k8s.render_job(k8s.DEFAULT_TEMPLATE.read_text(), cfg, task, image="agent:1", version=3,
                          command=["python", "-c", TRICKY], rollout_id="Task_7/x-0123456789ab", namespace="rl")
    job = yaml.safe_load(text)
    assert job["kind"] == "Job" and job["metadata"]["namespace"] == "rl"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", job["metadata"]["name"])
    assert job["metadata"]["annotations"]["lightspan.dev/task-id"] == "Task_7/x"
    spec = job["spec"]
    assert spec["activeDeadlineSeconds"] == 90 and spec["backoffLimit"] == 2
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    (container,) = spec["template"]["spec"]["containers"]
    assert container["image"] == "agent:1"
    assert container["command"] == ["opentelemetry-instrument", "python", "-c", TRICKY]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert all(isinstance(v, str) for v in env.values())
    assert json.loads(env["LIGHTSPAN_TASK"]) == task
    assert env["LIGHTSPAN_MODEL_VERSION"] == "3" and env["LIGHTSPAN_ROLLOUT_ID"] == "Task_7/x-0123456789ab"
    assert env["OPENAI_BASE_URL"] == env["LIGHTSPAN_CAPTURE_URLS"] == "http://vllm.rl:8000/v1"
    assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "http://lightspan.rl:4318/v1/traces"
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    resource = dict(kv.split("=", 1) for kv in env["OTEL_RESOURCE_ATTRIBUTES"].split(","))
    assert unquote(resource[semconv.ROLLOUT_ID]) == "Task_7/x-0123456789ab"
    assert unquote(resource[semconv.TASK_ID]) == "Task_7/x" and resource[semconv.SPLIT] == "val"


def test_job_names_are_dns_labels_that_keep_the_unique_tail():
    long_id = "A" * 80 + "-0123456789ab"
    name = k8s.job_name(long_id)
    assert len(name) <= 63 and name.endswith("0123456789ab") and name == name.lower()


def test_one_manifest_per_task_sample_from_the_command_line(tmp_path):
    cfg = _cfg(tmp_path)  # writes the task file
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["jobs", "--image", "agent:1", "--tasks", cfg.tasks, "--samples", "3",
                         "--data-dir", str(tmp_path), "--", "python", "agent.py"]) == 0
    jobs = list(yaml.safe_load_all(out.getvalue()))
    assert len(jobs) == 6 and len({j["metadata"]["name"] for j in jobs}) == 6
    tasks = [j["metadata"]["annotations"]["lightspan.dev/task-id"] for j in jobs]
    assert sorted(tasks) == ["Task_7/x"] * 3 + ["t2"] * 3


def test_bad_template_or_command_names_the_fix(tmp_path):
    cfg = _cfg(tmp_path)
    with pytest.raises(ConfigError, match="rollout.template"):
        k8s.render_job("name: ${NOPE}", cfg, {"id": "t"}, image="i", command=["a"])
    with pytest.raises(ConfigError, match="rollout.command"):
        k8s.render_jobs(k8s.JobsConfig(**{**dataclasses.asdict(cfg), "image": "i"}), [])
    with pytest.raises(ConfigError, match="rollout.image"):
        k8s.JobsConfig(tasks=cfg.tasks)
