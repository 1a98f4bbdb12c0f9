"""The trainer's Prometheus endpoint (trainer/metrics.py), scraped over HTTP while a trainer runs."""

import logging
import threading
import time

import pyarrow as pa
import pytest
import requests
import torch

from lightspan import store
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.driver import run
from lightspan.trainer.loop import Trainer
from lightspan.trainer.metrics import COUNTERS, GAUGES, PREFIX, MetricsServer, TrainerMetrics, entropy_warning
from lightspan.trainer.sync import SyncError

torch.set_num_threads(1)

PROMPT = [60, 61, 62, 63, 64]


def transitions(created, prefix, version=0):
    rows = []
    for i, (completion, adv) in enumerate([([65, 66, 67], 1.0), ([66, 67], 0.5), ([100, 101], -1.5),
                                           ([101, 102, 103, 104], 0.0)]):
        rows.append({"transition_id": f"{prefix}-{i}", "rollout_id": f"r-{prefix}-{i}", "task_id": "t0",
                     "split": "train", "prompt_token_ids": PROMPT, "completion_token_ids": completion,
                     "completion_logprobs": [-5.5] * len(completion), "model_version": version,
                     "reward": float(i), "advantage": adv, "created_unix_nano": created})
    return rows


def write(data_dir, rows):
    store.write_table(data_dir, "transitions", pa.Table.from_pylist(rows, schema=store.TRANSITION_SCHEMA))


def scrape(url) -> dict[str, float]:
    """The samples of a Prometheus text page: {'name' or 'name{labels}': value}."""
    response = requests.get(url, timeout=5)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def poll(fn, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError("condition not met")


def test_run_serves_the_step_metrics_while_it_trains(tmp_path, tiny_model):
    from tests.conftest import free_port

    port = free_port()
    cfg = TrainerConfig(data_dir=str(tmp_path / "data"), model=str(tiny_model), sync="none", torch_threads=1,
                        mode="continuous", poll_interval_s=0.05, max_steps=2, batch_size=0, learning_rate=1e-2,
                        max_staleness=1, metrics_port=port)
    write(cfg.data_dir, transitions(1, "a") + [{**r, "transition_id": "stale-" + r["transition_id"]}
                                                for r in transitions(1, "s", version=None)])
    url = f"http://127.0.0.1:{port}/metrics"
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", run(cfg)), daemon=True)
    thread.start()

    # one step on the 3 nonzero-advantage transitions, then the trainer waits for more data
    page = poll(lambda: (s := _try_scrape(url)) and s.get(PREFIX + "step") == 1 and s)
    rows = store.connect(cfg.data_dir).sql("SELECT * FROM train_steps").to_arrow_table().to_pylist()
    assert len(rows) == 1
    row = rows[0]
    assert page[PREFIX + "policy_version"] == 1
    for name in ("reward_mean", "loss", "kl", "clip_ratio", "entropy", "is_ratio_mean", "staleness_mean", "grad_norm"):
        assert page[PREFIX + name] == pytest.approx(row[name], rel=1e-9, abs=1e-12), name
    advantages = torch.tensor([1.0, 0.5, -1.5], dtype=torch.float64)
    assert page[PREFIX + "advantage_std"] == pytest.approx(float(advantages.std(unbiased=False)))
    assert page[PREFIX + "tokens_per_second"] == pytest.approx(7 / row["step_seconds"], rel=0.5)
    assert page[PREFIX + "transitions_trained_total"] == 3
    assert page[PREFIX + "transitions_skipped_stale_total"] == 4       # unknown version counts as stale
    assert page[PREFIX + "sync_failures_total"] == 0
    assert page[PREFIX + 'sync_seconds_bucket{le="+Inf"}'] == 0        # sync 'none' measures nothing

    write(cfg.data_dir, transitions(2, "b", version=1))
    thread.join(120)
    assert not thread.is_alive() and result["code"] == 0
    with pytest.raises(requests.ConnectionError):                      # stopped with the run
        requests.get(url, timeout=5)


def _try_scrape(url):
    try:
        return scrape(url)
    except requests.ConnectionError:
        return None


class FlakySync:
    """Fails its first push, then reports a sync time (no server: the protocol is tested elsewhere)."""

    verifies = False

    def __init__(self):
        self.calls = 0

    def push(self, checkpoint_dir, version):
        self.calls += 1
        if self.calls == 1:
            raise SyncError("http://127.0.0.1:1/collective_rpc", 503, "busy", 4)
        return {"sync_seconds": 0.3}


def test_sync_failures_and_sync_time_are_counted(tmp_path, tiny_model):
    cfg = TrainerConfig(data_dir=str(tmp_path / "data"), model=str(tiny_model), sync="none", torch_threads=1,
                        batch_size=3, metrics_port=0)
    write(cfg.data_dir, transitions(1, "a") + transitions(2, "b"))
    trainer = Trainer(cfg, sync=FlakySync())
    trainer.load_or_init()
    server = MetricsServer(trainer.metrics, "127.0.0.1", 0)
    try:
        with pytest.raises(SyncError):
            trainer.train_once()
        page = scrape(server.url)
        assert page[PREFIX + "sync_failures_total"] == 1 and PREFIX + "loss" not in page   # no step published
        trainer.publish(trainer.model_source)                     # what the next start does
        page = scrape(server.url)
        assert page[PREFIX + "policy_version"] == 1
        assert page[PREFIX + 'sync_seconds_bucket{le="0.25"}'] == 0
        assert page[PREFIX + 'sync_seconds_bucket{le="0.5"}'] == 1
        assert page[PREFIX + "sync_seconds_count"] == 1 and page[PREFIX + "sync_seconds_sum"] == 0.3
        assert requests.get(server.url.replace("/metrics", "/"), timeout=5).status_code == 404
    finally:
        server.stop()
        server.stop()                                             # idempotent


def test_the_page_declares_every_metric_once():
    text = TrainerMetrics().render()
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    expected = [PREFIX + n for n in GAUGES] + [PREFIX + n for n in COUNTERS] + [PREFIX + "sync_seconds"]
    assert names == expected
    assert all(n.endswith("_total") for n in COUNTERS)


@pytest.mark.parametrize("floor, warned", [(1e3, True), (1e-6, False), (0.0, False)])
def test_a_step_below_the_entropy_floor_is_warned_of_counted_and_stored(tmp_path, tiny_model, caplog, floor, warned):
    cfg = TrainerConfig(data_dir=str(tmp_path / "data"), model=str(tiny_model), sync="none", torch_threads=1,
                        batch_size=0, metrics_port=0, entropy_floor=floor)
    write(cfg.data_dir, transitions(1, "a"))
    trainer = Trainer(cfg)
    trainer.load_or_init()
    with caplog.at_level(logging.WARNING, logger="lightspan.trainer.loop"):
        row = trainer.train_once()
    assert 0 < row["entropy"] < 1e3                     # a real entropy, between the floors tried
    warnings = [r.getMessage() for r in caplog.records if "entropy_floor" in r.getMessage()]
    assert len(warnings) == int(warned)
    if warned:
        assert f"{row['entropy']:.3f} nats/token is below entropy_floor=1000" in warnings[0]
    page = parse_page(trainer.metrics.render())
    assert page[PREFIX + "entropy_below_floor_total"] == int(warned)
    assert page.get(PREFIX + "entropy_floor") == (floor or None)
    stored = store.connect(cfg.data_dir).sql("SELECT entropy, entropy_floor FROM train_steps").fetchall()
    assert stored == [(pytest.approx(row["entropy"]), floor or None)]


def test_entropy_warning_needs_a_floor_and_an_entropy_below_it():
    assert entropy_warning(0.05, 0.1).startswith("policy entropy 0.050 nats/token is below entropy_floor=0.1")
    assert entropy_warning(0.1, 0.1) is None and entropy_warning(0.5, 0.1) is None
    assert entropy_warning(0.05, 0.0) is None and entropy_warning(0.05, None) is None
    assert entropy_warning(None, 0.1) is None


def parse_page(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}
