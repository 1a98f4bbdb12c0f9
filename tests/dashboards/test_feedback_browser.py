"""Human feedback in headless Chromium, end to end: a person works through the annotation queue
(skips one rollout, scores another with a thumb, a comment and a better answer), scores one LLM
call on a rollout's page, behind the collector's bearer token; the scores are stored as rewards
with source ``human`` through the collector's POST /v1/rewards, and the next transition build
trains on them (before them it dropped both rollouts as unrewarded)."""

from __future__ import annotations

import json
import time

import pytest

from lightspan import store
from lightspan.collector.server import Collector
from lightspan.dashboards import web
from lightspan.lightningrl.builder import build_transitions
from lightspan.lightningrl.config import TransitionsConfig
from tests.collector.helpers import config, query
from tests.conftest import ARTIFACTS
from tests.dashboards.browser import Browser
from tests.dashboards.conftest import REASON, Rollout, send

TOKEN = "s3cret-token"
# q0 has the agent's reward and qf failed: neither waits for a person; q2 is the newest
ROLLOUTS = [Rollout("q0", "task-q", "train", "planner", 1.0, 1, "ok"),
            Rollout("qf", "task-q", "train", "planner", None, 1, "failed"),
            Rollout("q1", "task-q", "train", "planner", None, 1, "ok"),
            Rollout("q2", "task-q", "train", "planner", None, 1, "ok")]
SHOTS = ARTIFACTS / "dashboards"


@pytest.fixture()
def collector(tmp_path):
    collector = Collector(routes=web.routes(), config=config(tmp_path / "data", auth_token=TOKEN)).start()
    try:
        yield collector, send(collector, ROLLOUTS, token=TOKEN)
    finally:
        collector.stop()


def build(data_dir, **overrides):
    """The transitions a build would write now (complete rollouts: no grace period left)."""
    con = store.connect(data_dir)
    try:
        table, metrics = build_transitions(con, TransitionsConfig(data_dir=str(data_dir), **overrides),
                                           now_unix_nano=time.time_ns() + 3600 * 10**9)
    finally:
        con.close()
    return table.to_pylist(), metrics


def ready(browser: Browser, condition: str, what: str):
    return browser.wait_for(f"document.getElementById('main').dataset.state === 'ready' && ({condition})", what)


def fill(browser: Browser, selector: str, value: str) -> None:
    browser.evaluate(f"(() => {{ const f = document.querySelector({json.dumps(selector)}); "
                     f"f.value = {json.dumps(value)}; f.dispatchEvent(new Event('input')); }})()")


def click(browser: Browser, selector: str) -> None:
    browser.evaluate(f"document.querySelector({json.dumps(selector)}).click()")


def test_feedback_given_in_the_ui_is_stored_as_human_rewards_and_trained_on(collector, browser):
    collector, calls = collector
    data = collector.data_dir
    rows, metrics = build(data)
    assert rows == []                       # q0 alone is a group of one
    # qf failed without a reward: a failure trains with its real reward, and it has none (never a 0)
    assert metrics["transitions/dropped_rollouts/no_reward"] == 3 and metrics["transitions/dropped_rollouts/failed"] == 0

    base = f"http://127.0.0.1:{collector.api_port}/ui/"
    browser.errors.clear()
    browser.goto(f"{base}#/queue")
    # the collector asks for its token: the page says so and offers the form
    browser.wait_for("!document.getElementById('token-form').hidden", "the token form")
    assert browser.evaluate("document.getElementById('main').dataset.state") == "error"
    assert all("401" in e for e in browser.errors)
    browser.errors.clear()
    fill(browser, "#token", TOKEN)
    click(browser, "#token-form button[type=submit]")
    ready(browser, "document.getElementById('queue-key')", "the first rollout of the queue")
    assert browser.evaluate("document.getElementById('queue-key').textContent") == "q2"      # newest first
    assert browser.evaluate("document.getElementById('queue-count').textContent").startswith("2 rollout(s) without")

    click(browser, "#queue-skip")                                                          # skip q2
    ready(browser, "document.getElementById('queue-key')?.textContent === 'q1'", "q1 after the skip")
    click(browser, "form.feedback[data-scope=rollout] .thumb-up")
    fill(browser, "form.feedback[data-scope=rollout] .fb-comment", "right answer, one tool call")
    fill(browser, "form.feedback[data-scope=rollout] .fb-correction", "4, after one search")
    browser.screenshot(SHOTS / "queue.png")
    click(browser, "form.feedback[data-scope=rollout] .fb-submit")
    # scored: the queue moves past it, and q2 was skipped: nothing further this round
    ready(browser, "document.getElementById('queue-empty')", "the end of the queue")
    assert browser.errors == []

    # a single call: the first LLM call of q2, on the rollout's page
    browser.goto(f"{base}#/rollout/q2")
    ready(browser, "document.querySelector('[data-call-index=\"0\"] form.feedback')", "q2's page")
    form = "[data-call-index=\"0\"] form.feedback[data-scope=call]"
    browser.evaluate(f"document.querySelector({json.dumps(form)}).closest('details').open = true")
    click(browser, f"{form} .fb-submit")                                                  # no score yet: refused here
    assert browser.evaluate(f"document.querySelector({json.dumps(form + ' .fb-note')}).textContent").startswith("give a score")
    fill(browser, f"{form} .fb-value", "0.25")
    fill(browser, f"{form} .fb-comment", "the search was not needed")
    click(browser, f"{form} .fb-submit")
    browser.wait_for(f"document.querySelector({json.dumps(form)}).dataset.state === 'stored'", "the call's score stored")
    assert browser.errors == []

    collector.flush()
    stored = query(data, "SELECT rollout_key, reward_name, reward, source, comment, correction, call_span_id "
                         "FROM rewards WHERE source = 'human' ORDER BY rollout_key")
    assert stored == [("q1", "human", 1.0, "human", "right answer, one tool call", "4, after one search", None),
                      ("q2", "human", 0.25, "human", "the search was not needed", None, calls["q2"][0])]
    # the rollout's page now shows the person's score and why
    browser.goto(f"{base}#/rollout/q1")
    ready(browser, "document.querySelector('#rewards .source-human')", "q1's human reward")
    assert browser.evaluate("document.querySelector('#rewards .source-human .comment').textContent") == \
        "right answer, one tool call"
    assert browser.evaluate("document.getElementById('final-reward').textContent") == "1.000"
    browser.goto(f"{base}#/queue")
    ready(browser, "document.getElementById('queue-empty')", "an empty queue")
    assert browser.evaluate("document.getElementById('queue-count').textContent").startswith("0 rollout(s)")
    assert browser.errors == []

    # the next build trains on them: q1 with the person's 1.0, q2 with 0.25 (its only reward, on
    # call 0), in one group with q0 (the agent's 1.0)
    rows, metrics = build(data)
    by = {(r["rollout_id"], r["call_index"]): r for r in rows}
    assert {k[0] for k in by} == {"q0", "q1", "q2"} and metrics["transitions/dropped_rollouts/no_reward"] == 1   # qf
    assert by[("q1", 0)]["reward"] == by[("q1", 1)]["reward"] == 1.0
    assert by[("q2", 0)]["reward"] == by[("q2", 1)]["reward"] == 0.25
    assert by[("q1", 0)]["advantage"] > 0 > by[("q2", 0)]["advantage"]
    # the call's score is that call's: with return-to-go it credits call 0, not the call after it
    rows, _ = build(data, credit="discounted", gamma=1.0)
    credit = {(r["rollout_id"], r["call_index"]): r["credit"] for r in rows}
    assert (credit[("q2", 0)], credit[("q2", 1)]) == (0.25, 0.0)


def test_the_pages_show_status_capture_quality_agreement_and_the_entropy_floor(quality_store, browser):
    base = f"{quality_store}/ui/"
    browser.errors.clear()
    browser.goto(f"{base}#/rollouts")
    ready(browser, "document.querySelectorAll('tr.rollout-row').length === 5", "the rollouts")
    status = dict(browser.evaluate("[...document.querySelectorAll('tr.rollout-row')].map("
                                   "r => [r.dataset.key, r.querySelector('td.status').textContent])"))
    assert status["f-fail"] == "failed (exit 3) " and status["f-ok1"].startswith("rewarded")
    assert status["f-new2"].startswith("unrewarded") and "1 uncaptured: no_token_ids" in status["f-new2"]
    browser.goto(f"{base}#/rollout/f-new2")
    ready(browser, "document.getElementById('capture-reason')", "the capture reason")
    assert REASON in browser.evaluate("document.getElementById('capture-reason').textContent")
    browser.goto(f"{base}#/rollout/f-fail")
    ready(browser, "document.getElementById('outcome-note')", "the failure")
    assert "failed (exit code 3)" in browser.evaluate("document.getElementById('outcome-note').textContent")

    browser.goto(f"{base}#/quality?k=2")
    ready(browser, "document.getElementById('agreement-count')", "the quality page")
    assert browser.evaluate("[...document.querySelectorAll('#pass-by-task td')].map(t => t.textContent)") == \
        ["task-f", "1", "train", "3", "1", "0.667", "0.000"]
    assert browser.evaluate("document.getElementById('chart-pass-k').dataset.points") == "2"   # pass@2, pass^2 at v1
    assert browser.evaluate("document.getElementById('agreement-count').textContent") == "2"
    assert browser.evaluate("document.getElementById('agreement-mae').textContent") == "0.500"
    assert browser.evaluate("document.getElementById('agreement-success').textContent") == "50%"
    assert browser.evaluate("document.getElementById('chart-judge-drift').dataset.points") == "1"
    browser.screenshot(SHOTS / "quality.png")

    browser.goto(f"{base}#/training")
    ready(browser, "document.getElementById('entropy-warning')", "the entropy warning")
    warning = browser.evaluate("document.getElementById('entropy-warning').textContent")
    assert warning.startswith("Entropy below the floor at 1 step(s), last at step 2: 0.250 < 0.500 nats/token")
    assert browser.evaluate("document.getElementById('chart-entropy').dataset.points") == str(3 + 2)  # + the floor
    assert browser.evaluate("document.getElementById('chart-reward-source').dataset.points") == "3"
    browser.screenshot(SHOTS / "training-floor.png")
    assert browser.errors == []
