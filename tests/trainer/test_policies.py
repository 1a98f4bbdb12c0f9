"""Two policies over the tiny model in one real vLLM (trainer/policies.py, store/policy.py, the
builder's per-policy passes, the runner's and the instrumentor's policy versions, the gateway's
routing by agent).

This module starts its own vLLM with ``--enable-lora`` and the policies file (``lightspan vllm
--policies``): the base is served as ``policy-base``, the adapters as ``writer`` and ``checker``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import requests
import torch

from lightspan import store
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.policies import PolicyTrainers
from lightspan.trainer.sync import prompt_logprobs, verify
from tests.conftest import collector_process, free_port, running_vllm

torch.set_num_threads(1)
log = logging.getLogger(__name__)

POLICIES = """
[[policies]]
name = "writer"
agents = ["writer"]

[[policies]]
name = "checker"
agents = ["checker"]
lora_r = 4
learning_rate = 0.1
"""
PROMPT = [60, 61, 62, 63, 64]
GOOD = [[65, 66, 67, 68], [66, 67, 68, 65], [67, 68], [68, 65, 66]]
BAD = [[100, 101, 102, 103], [101, 102, 103], [102, 103, 100, 101], [103, 100]]
AGENT = Path(__file__).resolve().parents[1] / "agents" / "two_policy_agent.py"


@pytest.fixture(scope="module")
def policies_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("policies") / "policies.toml"
    path.write_text(POLICIES)
    return path


@pytest.fixture(scope="module")
def lora_vllm(tiny_model, policies_file):
    from lightspan import inference

    cfg = inference.VLLMConfig(model=str(tiny_model), port=free_port(), max_model_len=512, lora_rank=8,
                               policies=str(policies_file))
    command = inference.command(cfg)
    assert command[command.index("--max-loras") + 1] == "5"      # 2 names per policy + 1 during a swap
    with running_vllm(cfg, "vllm-policies-test.log"):
        yield cfg


def served_names(url):
    return {m["id"] for m in requests.get(f"{url}/v1/models", timeout=10).json()["data"]}


def make_config(tmp_path, tiny_model, url, policies_file, **kwargs):
    return TrainerConfig(**{"model": str(tiny_model), "data_dir": str(tmp_path / "data"), "vllm_url": url,
                            "sync": "lora", "lora_r": 8, "lora_alpha": 16.0, "learning_rate": 5e-2,
                            "torch_threads": 1, "metrics_port": 0, "policies": str(policies_file), **kwargs})


def write_batch(data_dir, policy, version, created, good=GOOD, bad=BAD):
    rows = [{"transition_id": f"{policy}-{created}-{kind}-{i}", "rollout_id": f"r-{policy}-{created}-{kind}-{i}",
             "task_id": "t0", "prompt_token_ids": PROMPT, "completion_token_ids": c,
             "completion_logprobs": [-5.5] * len(c), "model_version": version, "reward": float(adv > 0),
             "advantage": adv, "created_unix_nano": created, "policy": policy, "agent_name": policy}
            for kind, adv, completions in (("good", 1.0, good), ("bad", -1.0, bad)) for i, c in enumerate(completions)]
    store.write_table(data_dir, "transitions", pa.Table.from_pylist(rows, schema=store.TRANSITION_SCHEMA))


def max_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


def test_two_adapters_train_and_sync_side_by_side(lora_vllm, tiny_model, tmp_path, policies_file):
    url = lora_vllm.url
    cfg = make_config(tmp_path, tiny_model, url, policies_file)
    trainers = PolicyTrainers(cfg)
    trainers.load_or_init()
    writer, checker = trainers.trainers
    assert (writer.policy, checker.policy) == ("writer", "checker")
    assert checker.config.lora_r == 4 and checker.optimizer.param_groups[0]["lr"] == 0.1     # its own fields
    assert writer.config.lora_r == 8 and writer.optimizer.param_groups[0]["lr"] == 5e-2
    trainers.start()                                    # version 0 of each: B = 0, the base model
    assert {"writer", "writer-v0", "checker", "checker-v0", "policy-base"} <= served_names(url)
    ids = writer.verify_sequence()[0]

    def check_served(versions):
        for t in (writer, checker):
            assert t.version == versions[t.policy]
            diff = verify(url, t.policy, ids, t.verify_sequence()[1])
            log.warning("%s v%d: max |logprob(vLLM) - logprob(trainer)| = %.3g", t.policy, t.version, diff)
            assert diff < 1e-4
        return {name: prompt_logprobs(url, name, ids) for name in ("writer", "checker")}

    served = [check_served({"writer": 0, "checker": 0})]

    # a step of the writer alone moves its served logprobs and leaves the checker's as they were
    write_batch(cfg.data_dir, "writer", 0, created=1)
    rows = trainers.train_round()
    assert [(r["policy"], r["policy_version"]) for r in rows] == [("writer", 1)]
    assert rows[0]["sync_max_abs_logprob_diff"] < 1e-4 and 0 < rows[0]["sync_seconds"] < 10
    served.append(check_served({"writer": 1, "checker": 0}))
    assert max_diff(served[-2]["writer"], served[-1]["writer"]) > 1e-3
    assert max_diff(served[-2]["checker"], served[-1]["checker"]) < 1e-6
    assert {"writer-v1", "checker-v0"} <= served_names(url) and "writer-v0" not in served_names(url)

    # the checker alone, with the opposite preference: the writer's served logprobs do not move
    write_batch(cfg.data_dir, "checker", 0, created=2, good=BAD, bad=GOOD)
    rows = trainers.train_round()
    assert [(r["policy"], r["policy_version"]) for r in rows] == [("checker", 1)]
    served.append(check_served({"writer": 1, "checker": 1}))
    assert max_diff(served[-2]["checker"], served[-1]["checker"]) > 1e-3
    assert max_diff(served[-2]["writer"], served[-1]["writer"]) < 1e-6

    # both in one round, each synced and verified
    write_batch(cfg.data_dir, "writer", 1, created=3)
    write_batch(cfg.data_dir, "checker", 1, created=3, good=BAD, bad=GOOD)
    rows = trainers.train_round()
    assert [(r["policy"], r["policy_version"]) for r in rows] == [("writer", 2), ("checker", 2)]
    assert all(r["sync_max_abs_logprob_diff"] < 1e-4 for r in rows)
    check_served({"writer": 2, "checker": 2})
    assert verify(url, "policy-base", ids, served[0]["writer"]) < 1e-4      # the base is untouched

    published = store.policy.read_all(cfg.data_dir)
    assert {n: p.version for n, p in published.items()} == {"writer": 2, "checker": 2}
    assert Path(published["checker"].path).parent == Path(cfg.data_dir) / "checkpoints" / "checker"
    assert store.policy.read(cfg.data_dir) is None      # no unnamed policy: ask by name
    steps = store.connect(cfg.data_dir).execute(
        "SELECT policy, policy_version, num_transitions FROM train_steps ORDER BY time_unix_nano").fetchall()
    assert steps == [("writer", 1, 8), ("checker", 1, 8), ("writer", 2, 8), ("checker", 2, 8)]
    page = trainers.metrics.render()
    assert 'lightspan_trainer_policy_version{policy="writer"} 2.0' in page
    assert 'lightspan_trainer_policy_version{policy="checker"} 2.0' in page

    # a restart resumes each policy: its version, its cursor (nothing left to train), its adapter
    expected = {t.policy: t.verify_sequence()[1] for t in (writer, checker)}
    again = PolicyTrainers(cfg)
    again.load_or_init()
    assert [(t.policy, t.version) for t in again.trainers] == [("writer", 2), ("checker", 2)]
    for t in again.trainers:
        assert max_diff(t.verify_sequence()[1], expected[t.policy]) < 1e-6
    assert again.train_round() == []


def lightspan(*args, **kwargs) -> str:
    return subprocess.run([sys.executable, "-m", "lightspan.cli", *args], check=True, text=True,
                          stdout=subprocess.PIPE, **kwargs).stdout


@pytest.mark.e2e
def test_a_rollout_with_both_agents_trains_both_policies(lora_vllm, tiny_model, tmp_path, policies_file):
    """Real agents under ``lightspan rollout``: each call records the policy and version that served
    it; the build gives each policy its agent's calls, grouped by task; one run steps both."""
    data = tmp_path / "data"
    data.mkdir()
    train = ["train", "--mode", "once", "--data-dir", str(data), "--model", str(tiny_model),
             "--vllm-url", lora_vllm.url, "--sync", "lora", "--lora-r", "8", "--lora-alpha", "16",
             "--learning-rate", "5e-2", "--metrics-port", "0", "--policies", str(policies_file)]
    lightspan(*train)                   # nothing to train yet: publishes version 0 of each policy
    assert store.policy.served_versions(data) == {"writer": 0, "checker": 0}
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "prompt": "Say something:", "max_tokens": 6}) + "\n"
                             for i in range(2)))
    with collector_process(data, tmp_path / "collector.log") as (_, ports):
        api = f"http://127.0.0.1:{ports['api']}"
        out = json.loads(lightspan(
            "rollout", "--tasks", str(tasks), "--samples", "2", "--concurrency", "2", "--data-dir", str(data),
            "--otlp-endpoint", f"http://127.0.0.1:{ports['http']}", "--openai-base-url", f"{lora_vllm.url}/v1",
            "--timeout-s", "120", "--", sys.executable, str(AGENT),
            env={**os.environ, "WRITER_MODEL": "writer", "CHECKER_MODEL": "checker"}).strip().splitlines()[-1])
        assert out["ok"] == 4, out
        requests.post(f"{api}/v1/flush", timeout=60).raise_for_status()
        con = store.connect(data)
        calls = con.execute("""
            SELECT request_model, policy, model_version, count(*) FROM llm_calls
            WHERE len(completion_token_ids) > 0 GROUP BY ALL ORDER BY 1""").fetchall()
        assert calls == [("checker", "checker", 0, 4), ("writer", "writer", 0, 4)], calls
        firsts = dict(con.execute("SELECT task_id, min(rollout_key) FROM rollouts WHERE task_id IS NOT NULL "
                                  "GROUP BY 1").fetchall())
        for key in firsts.values():     # a grader's late reward: each group has a nonzero advantage
            requests.post(f"{api}/v1/rewards", json={"rollout_id": key, "value": 1.0, "name": "grader"},
                          timeout=30).raise_for_status()
        requests.post(f"{api}/v1/flush", timeout=60).raise_for_status()

    built = json.loads(lightspan("transitions", "build", "--data-dir", str(data), "--grace-s", "0",
                                 "--policies", str(policies_file)).strip().splitlines()[-1])
    for name in ("writer", "checker"):
        assert built[f"transitions/policies/{name}/calls"] == 4, built
        assert built[f"transitions/policies/{name}/groups"] == 2, built
    rows = store.connect(data).execute("""
        SELECT policy, agent_name, task_id, count(*), count(DISTINCT rollout_id) FROM transitions
        GROUP BY ALL ORDER BY ALL""").fetchall()
    assert rows == [("checker", "checker", "t0", 2, 2), ("checker", "checker", "t1", 2, 2),
                    ("writer", "writer", "t0", 2, 2), ("writer", "writer", "t1", 2, 2)], rows

    lightspan(*train)                   # one round: both policies step, each synced
    steps = store.connect(data).execute(
        "SELECT policy, policy_version, num_transitions, sync_max_abs_logprob_diff FROM train_steps "
        "ORDER BY policy").fetchall()
    assert [s[:3] for s in steps] == [("checker", 1, 4), ("writer", 1, 4)], steps
    assert all(s[3] < 1e-4 for s in steps), steps
    assert store.policy.served_versions(data) == {"writer": 1, "checker": 1}


def test_the_gateway_routes_each_agents_calls_to_its_policy(lora_vllm, tiny_model, tmp_path, policies_file):
    """An agent behind the gateway names itself (x-lightspan-agent): its call goes to the model of the
    policy that owns it, whatever model it asked for, and the span records that policy and version;
    a call to a policy's name records it too; another agent's call goes where it asked, unrecorded."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from lightspan.core.config import ConfigError
    from lightspan.rollout.gateway import Gateway, GatewayConfig
    from lightspan.tracing import semconv

    data = tmp_path / "data"
    trainers = PolicyTrainers(make_config(tmp_path, tiny_model, lora_vllm.url, policies_file))
    trainers.load_or_init()
    trainers.start()                                    # publishes (and serves) version 0 of each
    store.policy.write(data, 4, store.policy.read(data, "checker").path, name="checker")   # as if trained
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    gw = Gateway(GatewayConfig(upstream=lora_vllm.url, port=0, data_dir=str(data), policies=str(policies_file)),
                 provider)
    url = gw.start()
    try:
        def call(model, agent=None):
            exporter.clear()
            resp = requests.post(f"{url}/v1/chat/completions", timeout=60,
                                 headers={"x-lightspan-agent": agent} if agent else {},
                                 json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
            assert resp.status_code == 200, resp.text
            (span,) = exporter.get_finished_spans()
            a = span.attributes
            assert a[semconv.CAPTURE_STATUS] == "ok" and a[semconv.GEN_AI_REQUEST_MODEL] == resp.json()["model"]
            return (resp.json()["model"], a.get(semconv.GEN_AI_AGENT_NAME), a.get(semconv.POLICY_NAME),
                    a.get(semconv.MODEL_VERSION))

        assert call("policy-base", "checker") == ("checker", "checker", "checker", 4)
        assert call("checker", "writer") == ("writer", "writer", "writer", 0)      # ownership decides
        assert call("writer") == ("writer", None, "writer", 0)                    # by its model name
        # an agent no policy owns: the model it asked for, and no policy or version (only named ones are served)
        assert call("policy-base", "planner") == ("policy-base", "planner", None, None)
        # the other protocols are routed alike: an Anthropic Messages call of the checker agent
        exporter.clear()
        resp = requests.post(f"{url}/v1/messages", timeout=60, headers={"x-lightspan-agent": "checker"},
                             json={"model": "policy-base", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 200 and resp.json()["type"] == "message", resp.text
        (span,) = exporter.get_finished_spans()
        assert span.attributes[semconv.CAPTURE_STATUS] == "ok"
        assert (span.attributes[semconv.GEN_AI_REQUEST_MODEL], span.attributes[semconv.POLICY_NAME],
                span.attributes[semconv.MODEL_VERSION]) == ("checker", "checker", 4)
    finally:
        gw.stop()
    with pytest.raises(ConfigError, match="policies"):
        GatewayConfig(policies=str(tmp_path / "missing.toml"))


# --- configuration: fails at start-up, naming the field ------------------------------------------

def write_policies(tmp_path, text):
    path = tmp_path / "p.toml"
    path.write_text(text)
    return str(path)


def test_each_policy_gets_its_own_trainer_config(tmp_path, tiny_model, policies_file):
    cfg = TrainerConfig(model=str(tiny_model), data_dir=str(tmp_path), sync="lora", lora_r=16,
                        policies=str(policies_file), max_staleness=3)
    (writer, w), (checker, c) = cfg.policy_configs
    assert (writer.name, w.served_model_name, w.lora_r, w.learning_rate) == ("writer", "writer", 16, 1e-5)
    assert (checker.name, c.served_model_name, c.lora_r, c.learning_rate) == ("checker", "checker", 4, 0.1)
    assert Path(c.output_dir) == tmp_path / "checkpoints" / "checker" and w.max_staleness == c.max_staleness == 3
    assert not w.policies and not w.policy_configs


@pytest.mark.parametrize("kwargs, text, field", [
    (dict(sync="reload"), POLICIES, "trainer.sync"),
    (dict(sync="lora", lora_r=0), POLICIES, "policies.writer.lora_r"),      # the checker has its own, the writer none
    (dict(sync="lora", lora_r=8), POLICIES + "weight_decay = -1.0\n", "policies.checker.weight_decay"),
    (dict(sync="lora", lora_r=8), POLICIES.replace("lora_r = 4", "lora_r = -4"), "policies.checker.lora_r"),
    # replicas.json holds one version per replica, not one per policy
    (dict(sync="lora", lora_r=8, vllm_replicas=("http://127.0.0.1:1", "http://127.0.0.1:2")), POLICIES,
     "trainer.vllm_replicas"),
])
def test_bad_policy_settings_fail_when_the_trainer_starts(tmp_path, tiny_model, kwargs, text, field):
    from lightspan.core.config import ConfigError

    with pytest.raises(ConfigError) as err:
        TrainerConfig(model=str(tiny_model), data_dir=str(tmp_path), policies=write_policies(tmp_path, text), **kwargs)
    assert err.value.field == field


def test_vllm_serves_the_policies_side_by_side(tmp_path, tiny_model):
    from lightspan import inference
    from lightspan.core.config import ConfigError

    cfg = inference.VLLMConfig(model=str(tiny_model), lora_rank=8, policies=write_policies(tmp_path, POLICIES))
    command = inference.command(cfg)
    assert command[command.index("--served-model-name") + 1] == "policy-base"
    assert command[command.index("--max-loras") + 1] == command[command.index("--max-cpu-loras") + 1] == "5"
    for kwargs, text, field in [
            (dict(lora_rank=0), POLICIES, "vllm.lora_rank"),
            (dict(lora_rank=1), POLICIES, "vllm.lora_rank"),                  # the checker's lora_r is 4
            (dict(lora_rank=8), POLICIES.replace('"checker"', '"policy-base"'), "policies.policy-base.name")]:
        with pytest.raises(ConfigError) as err:
            inference.VLLMConfig(model=str(tiny_model), policies=write_policies(tmp_path, text), **kwargs)
        assert err.value.field == field
