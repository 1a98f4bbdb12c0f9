"""The rollout page shows where each segment of a trajectory begins and why, and each transition's
outcome: a real collector, rollouts sent through the SDK, the real transition builder (per_rollout),
the UI's JSON and, where Chromium is installed, the page itself."""

from __future__ import annotations

import time

import pytest
import requests

from lightspan.collector.server import Collector
from lightspan.dashboards import web
from lightspan.lightningrl import builder
from lightspan.lightningrl.config import TransitionsConfig
from tests.collector.helpers import config
from tests.dashboards.conftest import Rollout, send

# conftest.run_agent's two calls: call 1's prompt [72, 105, 11] does not extend call 0's prompt
# [72, 105, 10]: the history before call 0's reply changed, a compaction. s-f failed with a reward.
ROLLOUTS = [Rollout("s-1", "task-s", "train", "planner", 1.0, 1, "ok"),
            Rollout("s-2", "task-s", "train", "planner", 0.0, 1, "ok"),
            Rollout("s-f", "task-s", "train", "planner", 0.5, 1, "failed")]


@pytest.fixture(scope="module")
def segments_store(tmp_path_factory):
    data = tmp_path_factory.mktemp("segments-data")
    collector = Collector(routes=web.routes(), config=config(data)).start()
    try:
        send(collector, ROLLOUTS)
        metrics = builder.run(TransitionsConfig(data_dir=str(data), output="per_rollout", incremental=False),
                              now_unix_nano=time.time_ns() + 3600 * 10**9)
        assert metrics["transitions/prefix_mismatch/compaction"] == 3 and metrics["transitions/sequences"] == 6
        yield collector
    finally:
        collector.stop()


def rollout_doc(collector: Collector, key: str) -> dict:
    answer = requests.get(f"http://127.0.0.1:{collector.api_port}/api/ui/rollouts/{key}", timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_the_rollout_json_has_each_segment_its_cause_and_outcome(segments_store):
    doc = rollout_doc(segments_store, "s-1")
    assert [(t["call_index"], t["segment"], t["segment_cause"], t["outcome"], t["loss_weight"])
            for t in doc["transitions"]] == [(0, 0, None, "ok", 1.0), (1, 1, "compaction", "ok", 1.0)]
    calls = sorted((s for s in doc["spans"] if s["call_index"] is not None), key=lambda s: s["call_index"])
    assert [s["transition"]["segment"] for s in calls] == [0, 1]     # each segment starts at its call
    failed = rollout_doc(segments_store, "s-f")
    assert {t["outcome"] for t in failed["transitions"]} == {"failed"} and failed["status"] == "failed"


def test_the_rollout_page_marks_where_a_segment_begins_and_why(segments_store, browser):
    browser.errors.clear()
    browser.goto(f"http://127.0.0.1:{segments_store.api_port}/ui/#/rollout/s-1")
    browser.wait_for("document.getElementById('main').dataset.state === 'ready' && "
                     "document.querySelector('.segment-marker')", "the segment marker")
    markers = browser.evaluate("[...document.querySelectorAll('.segment-marker')].map(m => "
                               "[m.dataset.segment, m.dataset.cause, m.nextElementSibling.dataset.callIndex])")
    assert markers == [["1", "compaction", "1"]]          # just before call 1, the segment's first call
    assert "summarised, truncated or rewritten" in browser.evaluate(
        "document.querySelector('.segment-marker').textContent")
    assert browser.evaluate("[...document.querySelectorAll('#transitions td.segment')].map(t => t.textContent)") == \
        ["0", "1 (compaction)"]
    browser.goto(f"http://127.0.0.1:{segments_store.api_port}/ui/#/rollout/s-f")
    browser.wait_for("document.getElementById('main').dataset.state === 'ready' && "
                     "document.querySelector('#transitions td.outcome')", "the failed rollout's transitions")
    assert set(browser.evaluate("[...document.querySelectorAll('#transitions td.outcome')].map(t => t.textContent)")) \
        == {"failed"}
    assert browser.errors == []
