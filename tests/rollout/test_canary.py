"""Canaries (rollout/canary.py, rollout/canary_rule.py, store/deployments.py): the decision rule on
injected reward streams, the canary's share and stickiness per rollout, the fold of decisions, the
gateway routing by them and a gateway restarted mid-canary, and ``lightspan deploy`` by hand.

The gateway tests run against a stand-in upstream (an HTTP server that answers every chat call and
records the model it was asked for): what is under test is the gateway's routing, not vLLM."""

from __future__ import annotations

import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import duckdb
import pytest
import requests
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightspan import store
from lightspan.core.config import ConfigError, resolve
from lightspan.rollout.canary import Canary, CanaryConfig, by_hand, in_canary, plan
from lightspan.rollout.canary_rule import PROMOTE, ROLLBACK, WAIT, decide, t_sf
from lightspan.rollout.gateway import Gateway, GatewayConfig
from lightspan.store import deployments as dep
from lightspan.tracing import semconv
from tests.rollout.chat_stub import ChatStub

RULE = {"min_rollouts": 30, "confidence": 0.95, "margin": 0.1}


def _bernoulli(p: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [1.0 if rng.random() < p else 0.0 for _ in range(n)]


# --- the rule --------------------------------------------------------------------------------------

def test_student_t_tail_matches_the_tables():
    # two-sided 5% critical values: df 1 -> 12.706, df 10 -> 2.228, df 30 -> 2.042
    for t, df in ((12.706, 1), (2.228, 10), (2.042, 30)):
        assert t_sf(t, df) == pytest.approx(0.025, abs=2e-4)
        assert t_sf(-t, df) == pytest.approx(0.975, abs=2e-4)
    assert t_sf(0.0, 7) == pytest.approx(0.5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_rule_promotes_a_clearly_better_candidate_and_rolls_back_a_clearly_worse_one(seed):
    good, base, bad = _bernoulli(0.8, 60, seed), _bernoulli(0.5, 60, seed + 100), _bernoulli(0.1, 60, seed + 200)
    better = decide(good, base, **RULE)
    assert better.action == PROMOTE and better.p_value < 0.05 and better.candidate_rollouts == 60
    worse = decide(bad, base, **RULE)
    assert worse.action == ROLLBACK and worse.p_value > 0.95
    assert worse.candidate_reward_mean < worse.serving_reward_mean


def test_the_rule_waits_for_enough_rollouts_on_both_arms():
    evidence = decide([1.0] * 29, [0.0] * 100, **RULE)       # clearly better, but one short
    assert evidence.action == WAIT and evidence.t_statistic is None and "30" in evidence.reason
    assert decide([1.0] * 30, [0.0] * 100, **RULE).action == PROMOTE
    assert decide([0.0] * 100, [1.0] * 5, **RULE).action == WAIT


def test_equal_rewards_promote_within_the_margin_and_wait_without_one():
    same = [0.0, 1.0] * 70                                               # 140 per arm: 2 * 0.25 * (1.645 / 0.1)^2
    assert decide(same, list(same), **RULE).action == PROMOTE            # not worse by 0.1
    assert decide(same[:100], same[:100], **RULE).action == WAIT        # too few to tell
    equal = decide(same, list(same), **{**RULE, "margin": 0.0})          # must be better: undecided
    assert equal.action == WAIT and equal.p_value == pytest.approx(0.5)
    assert decide([1.0] * 40, [1.0] * 40, **RULE).action == PROMOTE      # no variance: the sign decides
    assert decide([0.5] * 40, [0.65] * 40, **RULE).action == ROLLBACK


def test_a_small_loss_inside_the_margin_is_promoted_a_large_one_rolled_back():
    rng = random.Random(5)
    base = [rng.gauss(0.6, 0.1) for _ in range(200)]
    slightly = [rng.gauss(0.55, 0.1) for _ in range(200)]
    much = [rng.gauss(0.4, 0.1) for _ in range(200)]
    assert decide(slightly, base, **{**RULE, "min_rollouts": 30}).action == PROMOTE
    assert decide(much, base, **RULE).action == ROLLBACK


# --- routing ---------------------------------------------------------------------------------------

def test_the_canary_share_is_the_configured_one_and_sticky_per_rollout():
    keys = [f"rollout-{i}" for i in range(20000)]
    for share in (0.05, 0.2, 0.5):
        chosen = [k for k in keys if in_canary(k, 7, share)]
        assert abs(len(chosen) / len(keys) - share) < 0.015
        assert chosen == [k for k in keys if in_canary(k, 7, share)]          # the same key, the same arm
    first = {k for k in keys if in_canary(k, 7, 0.2)}
    second = {k for k in keys if in_canary(k, 8, 0.2)}                        # a new candidate, a new sample
    assert abs(len(first & second) / len(keys) - 0.04) < 0.01


# --- the fold of decisions -------------------------------------------------------------------------

def _rows(*specs):
    return [dep.row(policy, version, action, time_unix_nano=t, checkpoint=f"/ck/v{version}", share=0.2)
            for t, (policy, version, action) in enumerate(specs, 1)]


def test_the_fold_serves_promotes_and_never_serves_a_rolled_back_version():
    d = dep.fold(_rows(("", 1, "serve"), ("", 2, "canary")))[""]
    assert (d.serving, d.candidate, d.share, d.serving_checkpoint) == (1, 2, 0.2, "/ck/v1")
    d = dep.fold(_rows(("", 1, "serve"), ("", 2, "canary"), ("", 2, "rollback"), ("", 2, "canary")))[""]
    assert (d.serving, d.candidate, d.rolled_back) == (1, None, {2})            # a rolled-back canary stays out
    d = dep.fold(_rows(("", 1, "serve"), ("", 2, "canary"), ("", 2, "promote"), ("", 3, "canary"),
                       ("", 2, "rollback")))[""]
    assert (d.serving, d.candidate, d.rolled_back) == (1, 3, {2})               # the one before serves again
    d = dep.fold(_rows(("", 1, "serve"), ("", 2, "canary"), ("", 2, "rollback"), ("", 2, "promote")))[""]
    assert (d.serving, d.rolled_back, d.serving_checkpoint) == (2, set(), "/ck/v2")   # by hand: serves again
    both = dep.fold(_rows(("writer", 4, "serve"), ("", 1, "serve"), ("writer", 5, "canary")))
    assert (both["writer"].candidate, both[""].candidate) == (5, None)


def test_plan_records_the_serving_version_then_each_new_undecided_one_as_candidate():
    published = {"": store.policy.Policy(1, "/ck/v1", 0)}
    first = plan({}, published, 0.1)
    assert [(r["action"], r["version"]) for r in first] == [("serve", 1)]
    state = dep.fold(first)
    assert plan(state, published, 0.1) == []
    published = {"": store.policy.Policy(2, "/ck/v2", 0)}
    second = plan(state, published, 0.1)
    assert [(r["action"], r["version"], r["share"], r["serving_version"]) for r in second] == [("canary", 2, 0.1, 1)]
    state = dep.fold(first + second)
    assert plan(state, published, 0.1) == []                                      # already the candidate
    rolled = dep.fold(first + second + [dep.row("", 2, "rollback", time_unix_nano=second[0]["time_unix_nano"] + 1)])
    assert plan(rolled, published, 0.1) == []                                     # never a canary again


def test_the_deployments_view_and_an_empty_store(tmp_path):
    assert store.connect(tmp_path).execute("SELECT count(*) FROM deployments").fetchone() == (0,)
    dep.record(tmp_path, _rows(("", 1, "serve"), ("", 2, "canary")))
    rows = store.connect(tmp_path).execute("SELECT action, version, share FROM deployments ORDER BY time_unix_nano").fetchall()
    assert rows == [("serve", 1, 0.2), ("canary", 2, 0.2)]


def test_check_decides_from_the_rewards_of_each_arm_since_the_canary_began(tmp_path):
    """The rule over the store's SQL, with reward streams injected as a ``rollouts`` table."""
    dep.record(tmp_path, [dep.row("", 1, "serve", time_unix_nano=100), dep.row("", 2, "canary", time_unix_nano=1000,
                                                                               share=0.5, checkpoint="/ck/v2")])
    canary = Canary(CanaryConfig(enabled=True, min_rollouts=20, load_adapters=False), str(tmp_path),
                    lambda: {"": store.policy.Policy(2, "/ck/v2", 0)})
    canary.refresh()
    con = duckdb.connect()
    con.execute("CREATE TABLE rollouts (model_version BIGINT, final_reward DOUBLE, start_time_unix_nano BIGINT, "
                "policies VARCHAR[])")
    # before the canary began, v1's rollouts scored 0: they must not count
    con.executemany("INSERT INTO rollouts VALUES (1, 0.0, ?, [])", [(t,) for t in range(500, 520)])
    assert canary.check(con) == [] and canary.evidence[""].action == WAIT
    rows = [(1, r, 2000 + i, []) for i, r in enumerate(_bernoulli(0.7, 40, 1))]
    rows += [(2, r, 2000 + i, []) for i, r in enumerate(_bernoulli(0.1, 40, 2))]
    con.executemany("INSERT INTO rollouts VALUES (?, ?, ?, ?)", rows)
    decided = canary.check(con)
    assert [(r["action"], r["version"], r["serving_version"], r["candidate_rollouts"]) for r in decided] == \
        [("rollback", 2, 1, 40)]
    again = dep.state(tmp_path)[""]                      # stored: a new reader sees the decision
    assert again.serving == 1 and again.candidate is None and again.rolled_back == {2}
    stored = store.connect(tmp_path).execute(
        "SELECT actor, p_value > 0.95, serving_reward_mean > candidate_reward_mean FROM deployments "
        "WHERE action = 'rollback'").fetchall()
    assert stored == [("auto", True, True)]


# --- the gateway -----------------------------------------------------------------------------------

@pytest.fixture
def upstream():
    up = ChatStub()
    yield up
    up.server.shutdown()


def _gateway(data_dir, upstream, exporter=None):
    provider = TracerProvider()
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    cfg = CanaryConfig(enabled=True, share=0.3, load_adapters=False, refresh_s=3600)   # refreshed by the test
    return Gateway(GatewayConfig(upstream=upstream.url, port=0, data_dir=str(data_dir)), provider, cfg)


def _calls(url, upstream, rollouts: int, turns: int = 3) -> dict[str, set[str]]:
    """The models each rollout's calls went to."""
    served: dict[str, set[str]] = {}
    for i in range(rollouts):
        for turn in range(turns):
            before = len(upstream.models)
            response = requests.post(f"{url}/v1/chat/completions", timeout=30,
                                     headers={"X-Lightspan-Rollout-Id": f"r{i}"},
                                     json={"model": "policy", "messages": [{"role": "user", "content": str(turn)}]})
            assert response.status_code == 200, response.text
            assert len(upstream.models) == before + 1
            served.setdefault(f"r{i}", set()).add(upstream.models[-1])
    return served


def test_the_gateway_sends_the_canary_its_share_keeps_rollouts_on_one_version_and_survives_a_restart(
        tmp_path, upstream):
    store.policy.write(tmp_path, 1, tmp_path / "v1")
    exporter = InMemorySpanExporter()
    gw = _gateway(tmp_path, upstream, exporter)
    url = gw.start()
    try:
        assert set().union(*_calls(url, upstream, 5).values()) == {"policy-v1"}      # no candidate yet
        store.policy.write(tmp_path, 2, tmp_path / "v2")                            # training published v2
        gw.canary.refresh()
        exporter.clear()
        served = _calls(url, upstream, 200)
        assert all(len(models) == 1 for models in served.values())                 # one rollout, one version
        canaries = [r for r, models in served.items() if models == {"policy-v2"}]
        assert 0.2 < len(canaries) / len(served) < 0.4                              # share 0.3
        assert {r for r in served if in_canary(r, 2, 0.3)} == set(canaries)
        versions = {(s.attributes[semconv.ROLLOUT_ID], s.attributes[semconv.MODEL_VERSION])
                    for s in exporter.get_finished_spans() if s.attributes.get(semconv.ROLLOUT_ID) in served}
        assert versions == {(r, 2 if r in canaries else 1) for r in served}           # the span says who served
        assert gw.status()["canary"][0] | {"evidence": None} == {
            "policy": "", "serving": 1, "candidate": 2, "share": 0.3, "rolled_back": [], "evidence": None}
    finally:
        gw.stop()
    # a restarted gateway reads the canary back: the same rollouts on the same versions
    gw = _gateway(tmp_path, upstream)
    url = gw.start()
    try:
        assert _calls(url, upstream, 200, turns=1) == {r: models for r, models in served.items()}
        by_hand(tmp_path, "rollback", 2, reason="test")
        gw.canary.refresh()
        assert set().union(*_calls(url, upstream, 50, turns=1).values()) == {"policy-v1"}
        pinned = requests.post(f"{url}/v1/chat/completions", timeout=30,
                               json={"model": "policy-v2", "messages": [{"role": "user", "content": "x"}]})
        assert pinned.status_code == 404 and "rolled back" in pinned.text
    finally:
        gw.stop()
    # restarted after the rollback, while policy.json still says v2: v2 never serves
    gw = _gateway(tmp_path, upstream)
    url = gw.start()
    try:
        assert set().union(*_calls(url, upstream, 50, turns=1).values()) == {"policy-v1"}
    finally:
        gw.stop()


def test_without_canaries_the_gateway_routes_as_before(tmp_path, upstream):
    store.policy.write(tmp_path, 1, tmp_path / "v1")
    gw = Gateway(GatewayConfig(upstream=upstream.url, port=0, data_dir=str(tmp_path)), TracerProvider())
    url = gw.start()
    try:
        assert set().union(*_calls(url, upstream, 3).values()) == {"policy"}
        assert gw.canary is None and "canary" not in gw.status()
        assert not (tmp_path / dep.TABLE).exists()
    finally:
        gw.stop()


# --- config and the command line -------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("share", 1.0), ("share", 0.0), ("confidence", 0.4), ("margin", -0.1),
                                          ("min_rollouts", 1), ("window", 5), ("refresh_s", 0.0)])
def test_a_bad_canary_setting_is_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=f"canary.{field}"):
        CanaryConfig(**{field: value})


def test_canaries_are_off_by_default_and_read_from_the_canary_table(tmp_path):
    assert CanaryConfig().enabled is False
    file = tmp_path / "gateway.toml"
    file.write_text("[gateway]\nport = 9\n[canary]\nenabled = true\nshare = 0.25\n")
    cfg = resolve(CanaryConfig, section="canary", file=file, environ={"LIGHTSPAN_CANARY_MARGIN": "0"})
    assert (cfg.enabled, cfg.share, cfg.margin) == (True, 0.25, 0.0)


def test_lightspan_deploy_promotes_and_rolls_back_by_hand(tmp_path, capsys):
    from lightspan import cli

    store.policy.write(tmp_path, 3, tmp_path / "v3")
    dep.record(tmp_path, [dep.row("", 2, "serve", time_unix_nano=1, checkpoint="/ck/v2"),
                          dep.row("", 3, "canary", time_unix_nano=2, share=0.1, checkpoint="/ck/v3")])
    d = str(tmp_path)
    assert cli.main(["deploy", "rollback", "3", "--data-dir", d, "--reason", "looks wrong"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["action"], out["actor"], out["version"], out["reason"]) == ("rollback", "manual", 3, "looks wrong")
    assert dep.state(tmp_path)[""].rolled_back == {3}
    assert cli.main(["deploy", "promote", "3", "--data-dir", d]) == 0                # by hand: serves again
    capsys.readouterr()
    state = dep.state(tmp_path)[""]
    assert (state.serving, state.serving_checkpoint, state.rolled_back) == (3, "/ck/v3", set())
    assert cli.main(["deploy", "list", "--data-dir", d]) == 0
    assert json.loads(capsys.readouterr().out)[0]["serving"] == 3
    assert cli.main(["deploy", "promote", "9", "--data-dir", d]) == 2               # never published
    assert cli.main(["deploy", "rollback", "--data-dir", d]) == 2                   # which version?
    assert store.connect(tmp_path).execute("SELECT count(*) FROM deployments WHERE actor = 'manual'").fetchone() == (2,)


def test_a_trainer_restarted_mid_canary_changes_no_decision(tmp_path):
    """The trainer republishes on every start (LoRA sync): the same version again neither restarts the
    canary nor revives a rolled-back version; the next new version becomes the candidate."""
    store.policy.write(tmp_path, 1, tmp_path / "v1")
    canary = Canary(CanaryConfig(enabled=True, load_adapters=False), str(tmp_path),
                    lambda: store.policy.read_all(tmp_path))
    canary.refresh()
    store.policy.write(tmp_path, 2, tmp_path / "v2")
    canary.refresh()
    since = canary.state[""].since_unix_nano
    store.policy.write(tmp_path, 2, tmp_path / "v2")                   # the trainer restarted
    canary.refresh()
    assert (canary.state[""].candidate, canary.state[""].since_unix_nano) == (2, since)
    by_hand(tmp_path, "rollback", 2)
    store.policy.write(tmp_path, 2, tmp_path / "v2")                   # restarted again, from v2
    restarted = Canary(CanaryConfig(enabled=True, load_adapters=False), str(tmp_path),
                       lambda: store.policy.read_all(tmp_path))
    restarted.refresh()
    assert (restarted.state[""].serving, restarted.state[""].candidate) == (1, None)
    assert restarted.route("policy", "any-rollout") == ("policy-v1", 1)
    store.policy.write(tmp_path, 3, tmp_path / "v3")
    restarted.refresh()
    assert restarted.state[""].candidate == 3
    actions = [r["action"] for r in sorted(dep.Reader(tmp_path).rows(), key=lambda r: r["time_unix_nano"])]
    assert actions == ["serve", "canary", "rollback", "canary"]


def test_the_arms_adapters_are_loaded_where_a_replica_lacks_them(tmp_path):
    """Against a stand-in for vLLM's /v1/models and /v1/load_lora_adapter."""
    loaded = {"policy-v1"}
    posts = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, doc):
            data = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._answer({"data": [{"id": name} for name in sorted(loaded)]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            posts.append((self.path, body))
            loaded.add(body["lora_name"])
            self._answer({})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        dep.record(tmp_path, [dep.row("", 1, "serve", time_unix_nano=1, checkpoint="/ck/v1"),
                              dep.row("", 2, "canary", time_unix_nano=2, share=0.1, checkpoint="/ck/v2")])
        canary = Canary(CanaryConfig(enabled=True), str(tmp_path), lambda: {}, lambda: [url + "/v1"])
        canary.refresh()
        assert posts == [("/v1/load_lora_adapter", {"lora_name": "policy-v2", "lora_path": "/ck/v2"})]
        canary.refresh()
        assert len(posts) == 1                                           # listed now: not loaded again
        # no canary running, a vLLM restarted without the serving version's adapter: loaded too
        # (calls go to policy-v<serving>; before, only a running canary loaded the arms)
        loaded.clear()
        dep.record(tmp_path, [dep.row("", 2, "rollback", time_unix_nano=3, checkpoint="/ck/v2")])
        canary.refresh()
        assert posts[1:] == [("/v1/load_lora_adapter", {"lora_name": "policy-v1", "lora_path": "/ck/v1"})]
    finally:
        server.shutdown()


def test_a_named_policys_calls_are_routed_by_its_own_canary(tmp_path):
    published = {"writer": store.policy.Policy(5, "/ck/w5", 0, "writer"), "": store.policy.Policy(1, "/ck/v1", 0)}
    dep.record(tmp_path, [dep.row("writer", 4, "serve", time_unix_nano=1, checkpoint="/ck/w4"),
                          dep.row("writer", 5, "canary", time_unix_nano=2, share=0.5, checkpoint="/ck/w5"),
                          dep.row("", 1, "serve", time_unix_nano=3)])
    canary = Canary(CanaryConfig(enabled=True, load_adapters=False), str(tmp_path), lambda: published)
    canary.refresh()
    keys = [f"r{i}" for i in range(400)]
    routed = {k: canary.route("writer", k) for k in keys}
    assert {v for v in routed.values()} == {("writer-v5", 5), ("writer-v4", 4)}
    assert all(routed[k] == (("writer-v5", 5) if in_canary(k, 5, 0.5) else ("writer-v4", 4)) for k in keys)
    assert canary.route("policy", "r1") == ("policy-v1", 1)                # the unnamed policy: no canary
    assert canary.route("writer-v4", "r1") == ("writer-v4", 4)              # pinned by the caller
    assert canary.route("other-model", "r1") == ("other-model", None)      # not a policy: untouched


def test_deploy_list_exits_cleanly_every_time(tmp_path):
    """Arrow's reader threads left running abort the interpreter at exit now and then
    (apache/arrow#34314): one run in four of `lightspan deploy list` did, before it read on one thread."""
    import subprocess
    import sys

    for i in range(3):       # a file per decision, as the gateway writes them
        dep.record(tmp_path, [dep.row("", i + 1, "serve" if i == 0 else "canary", time_unix_nano=i + 1,
                                      checkpoint=f"/ck/v{i + 1}")])
    codes = []
    for _ in range(12):
        run = subprocess.run([sys.executable, "-m", "lightspan.cli", "deploy", "list", "--data-dir", str(tmp_path)],
                             capture_output=True, text=True, timeout=120)
        codes.append(run.returncode)
        assert json.loads(run.stdout)[0]["candidate"] == 3
    assert codes == [0] * 12, codes
