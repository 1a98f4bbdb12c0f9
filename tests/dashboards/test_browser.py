"""The web UI in headless Chromium against a collector filled by a real short run.

The run: the letters agent (tests/agents/letters_agent.py) under ``lightspan rollout`` against
the session's real vLLM, train and val rollouts, ``lightspan transitions build``, one
``lightspan train`` step with an in-place weight reload, then val rollouts of the new policy.
Each page must load without console errors and show what SQL over the same store says.
Screenshots go to artifacts/dashboards/. ``lightspan status`` is checked on the same run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightspan import store
from lightspan.collector.server import Collector
from lightspan.dashboards import web
from tests.collector.helpers import config, query
from tests.conftest import ARTIFACTS
from tests.dashboards.browser import Browser

pytestmark = pytest.mark.e2e

AGENT = Path(__file__).resolve().parents[1] / "agents" / "letters_agent.py"
SHOTS = ARTIFACTS / "dashboards"


def lightspan(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightspan.cli", *args], check=True, text=True,
                          stdout=subprocess.PIPE, env={**os.environ, **(env or {})})


def tasks_file(path: Path, prefix: str, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"{prefix}{i}", "prompt": f"write letters #{i}", "max_tokens": 12,
                                        "temperature": 0.8}) + "\n" for i in range(n)))
    return path


@pytest.fixture(scope="module")
def real_run(vllm_server, tiny_model, tmp_path_factory):
    """A collector (real, in this process) holding one short real training run."""
    from lightspan.trainer.sync import ReloadSync

    data = tmp_path_factory.mktemp("ui-run")
    store.policy.write(data, 0, tiny_model)    # as the demo does: the first rollouts are policy version 0
    collector = Collector(routes=web.routes(), config=config(data, flush_interval_s=0.5)).start()
    ReloadSync(vllm_server.url).push(str(tiny_model), 0)    # the session's vLLM may serve other weights
    try:
        rollout = ["rollout", "--concurrency", "4", "--otlp-endpoint", f"http://127.0.0.1:{collector.http_port}",
                   "--openai-base-url", f"{vllm_server.url}/v1", "--data-dir", str(data)]
        train_tasks = tasks_file(data / "train.jsonl", "t", 2)
        val_tasks = tasks_file(data / "val.jsonl", "v", 2)
        agent = ["--", sys.executable, str(AGENT)]
        lightspan(*rollout, "--tasks", str(train_tasks), "--samples", "4", "--split", "train", *agent)
        lightspan(*rollout, "--tasks", str(val_tasks), "--samples", "1", "--split", "val", *agent)
        collector.flush()
        lightspan("transitions", "build", "--data-dir", str(data))
        lightspan("train", "--mode", "once", "--data-dir", str(data), "--model", str(tiny_model),
                  "--vllm-url", vllm_server.url, "--learning-rate", "2e-2", "--loss-type", "grpo",
                  "--sync", "reload", "--seed", "0", env={"LIGHTSPAN_TRAINER_METRICS_PORT": "0"})
        lightspan(*rollout, "--tasks", str(val_tasks), "--samples", "1", "--split", "val", *agent)
        collector.flush()
        yield collector, data
    finally:
        collector.stop()
        ReloadSync(vllm_server.url).push(str(tiny_model), 0)


def open_page(browser: Browser, collector: Collector, hash_: str, ready: str) -> None:
    browser.errors.clear()
    browser.goto(f"http://127.0.0.1:{collector.api_port}/ui/#{hash_}")
    browser.wait_for(f"document.getElementById('main').dataset.state === 'ready' && ({ready})", hash_)


def text(browser: Browser, element_id: str) -> str:
    return browser.evaluate(f"document.getElementById({element_id!r}).textContent")


def test_rollouts_page_shows_the_count_and_rewards_sql_gives(real_run, browser):
    collector, data = real_run
    total, mean = query(data, "SELECT count(*), avg(final_reward) FROM rollouts")[0]
    assert total == 8 + 2 + 2
    open_page(browser, collector, "/rollouts", "document.querySelectorAll('tr.rollout-row').length > 0")
    assert text(browser, "rollout-total") == str(total)
    assert abs(float(text(browser, "reward-mean")) - mean) <= 5e-4 + 1e-12     # shown to 3 decimals
    shown = dict(browser.evaluate("[...document.querySelectorAll('tr.rollout-row')].map("
                                  "r => [r.dataset.key, r.querySelector('td.reward').textContent])"))
    expected = dict(query(data, "SELECT rollout_key, final_reward FROM rollouts"))
    assert shown.keys() == expected.keys()
    assert all(abs(float(shown[key]) - reward) <= 5e-4 + 1e-12 for key, reward in expected.items())
    browser.screenshot(SHOTS / "rollouts.png")
    assert browser.errors == []
    # a filter in the address: the validation rollouts of the new policy
    (n_val,) = query(data, "SELECT count(*) FROM rollouts WHERE split = 'val' AND model_version = 1")[0]
    open_page(browser, collector, "/rollouts?split=val&version=1", "document.getElementById('rollout-total')")
    assert text(browser, "rollout-total") == str(n_val) == "2"
    assert browser.evaluate("document.querySelector('select[name=split]').value") == "val"
    assert browser.errors == []


def test_rollout_page_renders_the_span_tree_and_the_call(real_run, browser):
    collector, data = real_run
    key, reward = query(data, "SELECT rollout_id, any_value(reward) FROM transitions GROUP BY 1 ORDER BY 1 LIMIT 1")[0]
    spans = query(data, f"SELECT count(*) FROM spans WHERE coalesce(rollout_id, trace_id) = '{key}'")[0][0]
    ids, credit, advantage = query(data, "SELECT completion_token_ids, credit, advantage FROM transitions "
                                         f"WHERE rollout_id = '{key}'")[0]
    open_page(browser, collector, f"/rollout/{key}", "document.querySelectorAll('.span-row').length > 0")
    assert text(browser, "rollout-key") == key
    assert browser.evaluate("document.querySelectorAll('#waterfall .span-row').length") == spans
    names = browser.evaluate("[...document.querySelectorAll('.span-row .span-name')].map(n => n.textContent)")
    assert any(n.startswith("lightspan.runner") for n in names) and any(n.startswith("lightspan.reward") for n in names)
    assert abs(float(text(browser, "final-reward")) - reward) <= 5e-4 + 1e-12
    # the LLM call: its completion tokens coloured by logprob, its credit and advantage
    assert browser.evaluate("document.querySelector('[data-call-index=\"0\"] .tokens').dataset.tokens") == str(len(ids))
    assert browser.evaluate("document.querySelectorAll('[data-call-index=\"0\"] .tok').length") == len(ids)
    assert browser.evaluate("document.querySelector('.tok').title").startswith(f"token {ids[0]} · logprob")
    assert browser.evaluate("document.querySelector('[data-call-index=\"0\"] .credit').textContent").startswith(
        f"credit {credit:.3f}")
    assert browser.evaluate("document.querySelector('[data-call-index=\"0\"] .advantage').textContent").startswith(
        f"advantage {advantage:.3f}")
    assert browser.evaluate("document.querySelectorAll('.msg.role-user').length") == 1
    browser.evaluate("document.querySelector('.span-row').click()")           # a span's details open in place
    assert browser.evaluate("document.querySelectorAll('.span-detail').length") == 1
    browser.screenshot(SHOTS / "rollout.png")
    assert browser.errors == []


def test_training_page_shows_the_step_and_the_reward_per_version(real_run, browser):
    collector, data = real_run
    (version, loss) = query(data, "SELECT policy_version, loss FROM train_steps")[0]
    open_page(browser, collector, "/training", "document.getElementById('step-count')")
    assert text(browser, "step-count") == "1" and text(browser, "policy-version") == str(version) == "1"
    assert browser.evaluate("document.querySelectorAll('tr.step-row').length") == 1
    for chart in ("chart-loss", "chart-entropy", "chart-is", "chart-tps", "chart-sync", "chart-staleness"):
        assert browser.evaluate(f"document.getElementById('{chart}').dataset.points") == "1", chart
    # validation reward at versions 0 and 1, train reward at version 0
    assert browser.evaluate("document.getElementById('chart-reward-version').dataset.points") == "3"
    assert loss is not None
    browser.screenshot(SHOTS / "training.png")
    assert browser.errors == []


def test_collector_page_shows_the_collectors_metrics(real_run, browser):
    collector, _ = real_run
    accepted = collector.metrics.snapshot()["spans_accepted_total"]
    open_page(browser, collector, "/health", "document.getElementById('spans-accepted')")
    assert text(browser, "spans-accepted") == f"{accepted:,}"
    assert text(browser, "state") == "running"
    # the page polls every 2 s: the second poll gives a rate
    browser.wait_for("document.getElementById('ingest-rate') && document.getElementById('ingest-rate').textContent !== '—'",
                     "an ingest rate after two polls")
    assert float(text(browser, "ingest-rate")) >= 0
    reasons = browser.evaluate("[...document.querySelectorAll('#refusals td:first-child')].map(t => t.textContent)")
    assert "queue_full" in reasons and "disk" in reasons
    browser.screenshot(SHOTS / "collector.png")
    assert browser.errors == []


def test_status_summarises_the_run_and_the_inference_server(real_run, vllm_server):
    _, data = real_run
    doc = json.loads(lightspan("status", "--data-dir", str(data), "--vllm-url", vllm_server.url, "--format", "json").stdout)
    d = doc["data"]
    con = store.connect(data)
    assert d["spans"] == con.execute("SELECT count(*) FROM spans").fetchone()[0]
    by_split = d["rollouts_by_split"]
    assert (d["rollouts"], by_split["train"]["rollouts"], by_split["val"]["rollouts"]) == (12, 8, 4)
    assert d["transitions"] == con.execute("SELECT count(*) FROM transitions").fetchone()[0] > 0
    assert (d["train_steps"], d["training_runs"], d["policy"]["version"]) == (1, 1, 1)
    assert d["latest_run"]["policy_version"] == 1 and d["latest_run"]["steps"] == 1
    assert d["disk_bytes"]["spans"] > 0 and d["disk_bytes"]["checkpoints"] > 0
    assert d["disk_bytes"]["total"] >= sum(v for k, v in d["disk_bytes"].items() if k != "total")
    assert doc["inference"]["healthy"] is True
    assert vllm_server.model_name in [m["id"] for m in doc["inference"]["models"]]
    text_out = lightspan("status", "--data-dir", str(data), "--vllm-url", vllm_server.url).stdout
    assert "rollouts      12; train 8" in text_out and ": healthy" in text_out and "version 1 at" in text_out
