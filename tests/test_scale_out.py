"""Scale-out end to end: two real vLLM replicas of the tiny model, a trainer reading its
transitions from an S3-compatible bucket (a real S3-API server on loopback, tests/s3server.py), one
training step synced into both replicas and verified within 1e-4 of the trainer's logprobs, a
replica that cannot be synced taken out of rotation, and the gateway keeping each rollout on one
replica while it spreads rollouts over both.

Costs a second vLLM start (~40 s on a quiet machine) besides the session's."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
import requests
import torch
from opentelemetry.sdk.trace import TracerProvider

from lightspan import store
from lightspan.rollout.gateway import Gateway, GatewayConfig
from lightspan.rollout.replicas import rendezvous
from lightspan.store import replicas as rotation
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.loop import Trainer
from lightspan.trainer.sync import ReloadSync, verify
from tests.collector.helpers import wait_for
from tests.conftest import free_port, running_vllm

torch.set_num_threads(1)
log = logging.getLogger(__name__)
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def second_replica(vllm_server):
    """A second vLLM server of the same model (the session's server is the first)."""
    from lightspan import inference

    cfg = inference.VLLMConfig(model=str(vllm_server.model_dir), port=free_port(), max_model_len=1024)
    with running_vllm(cfg, "vllm-replica-2.log") as log_path:
        yield cfg.url, log_path


def served_requests(log_path) -> int:
    """Completions a vLLM server has answered, from its access log (the tests start vLLM with
    --disable-log-stats, so its Prometheus counters stay at 0)."""
    return Path(log_path).read_text(errors="replace").count('"POST /v1/completions HTTP/1.1" 200')


def test_two_replicas_are_synced_verified_and_a_rollout_stays_on_one(vllm_server, second_replica, bucket, tmp_path):
    replicas = [vllm_server.url, second_replica[0]]
    logs = [vllm_server.log, second_replica[1]]
    dead = f"http://127.0.0.1:{free_port()}"                 # a replica that is down during the sync
    remote = f"{bucket}/lightspan"
    rows = [{"transition_id": f"t{i}", "rollout_id": f"r{i}", "task_id": "t", "prompt_token_ids": [60, 61, 62],
             "completion_token_ids": [65 + i, 66], "completion_logprobs": [-5.5, -5.5], "model_version": 0,
             "reward": float(i % 2), "advantage": 1.0 if i % 2 else -1.0, "created_unix_nano": 1} for i in range(4)]
    store.write_table(remote, "transitions", pa.Table.from_pylist(rows, schema=store.TRANSITION_SCHEMA))
    cfg = TrainerConfig(model=str(vllm_server.model_dir), data_dir=remote, output_dir=str(tmp_path / "checkpoints"),
                        vllm_replicas=(*replicas, dead), served_model_name=vllm_server.model_name, sync="reload",
                        torch_threads=1, learning_rate=1e-2)
    trainer = Trainer(cfg)
    trainer.load_or_init()
    try:
        ids, before = trainer.verify_sequence()
        row = trainer.train_once()                            # reads the bucket, steps, syncs every replica
        assert row["policy_version"] == 1
        ids, expected = trainer.verify_sequence()
        assert max(abs(a - b) for a, b in zip(before, expected)) > 1e-3     # the step changed the policy
        for url in replicas:                                  # both serve the new weights
            diff = verify(url, vllm_server.model_name, ids, expected)
            log.warning("replica %s after the sync: max |logprob(vLLM) - logprob(trainer)| = %.3g", url, diff)
            assert diff < 1e-4
        assert row["sync_max_abs_logprob_diff"] < 1e-4
        doc = rotation.read(remote)                           # in the bucket, beside policy.json
        assert doc["version"] == 1
        assert [u for u, s in doc["replicas"].items() if s["in_rotation"]] == replicas
        assert not doc["replicas"][dead]["in_rotation"] and doc["replicas"][dead]["error"]
        assert store.policy.read(remote).version == 1
        steps = store.connect(remote).execute("SELECT step, sync_max_abs_logprob_diff FROM train_steps").fetchall()
        assert steps == [(1, row["sync_max_abs_logprob_diff"])]

        gateway = Gateway(GatewayConfig(upstreams=(*replicas, dead), port=0, data_dir=remote), TracerProvider())
        url = gateway.start()
        try:
            where: dict[str, set[int]] = {}
            # rollout ids whose hashes fall on both live replicas (the ports, and so the hashes, change
            # from run to run: 8 fixed ids would all land on one replica in about 1 run in 200)
            live = gateway.replicas.candidates()                  # the dead one is out of rotation
            assert len(live) == 2, live
            ids = [f"rollout-{i}" for i in range(64)]
            chosen = [r for r in ids if rendezvous(r, live) == live[0]][:4] + \
                     [r for r in ids if rendezvous(r, live) == live[1]][:4]
            for rollout in chosen:
                for turn in range(2):
                    counts = [served_requests(log) for log in logs]
                    response = requests.post(f"{url}/v1/completions", timeout=60,
                                             headers={"X-Lightspan-Rollout-Id": rollout},
                                             json={"model": vllm_server.model_name, "prompt": [60, 61, 62 + turn],
                                                   "max_tokens": 2, "temperature": 0})
                    assert response.status_code == 200, response.text
                    # the access log line may follow the answer by a moment: wait for it
                    after = wait_for(lambda counts=counts: (now := [served_requests(log) for log in logs])
                                     and sum(now) > sum(counts) and now, timeout=30, what="vLLM's request count")
                    grew = [i for i, u in enumerate(replicas) if after[i] > counts[i]]
                    assert len(grew) == 1 and sum(after) == sum(counts) + 1
                    where.setdefault(rollout, set()).add(grew[0])
            assert all(len(r) == 1 for r in where.values())                  # one rollout, one replica
            assert {i for r in where.values() for i in r} == {0, 1}          # rollouts on both
        finally:
            gateway.stop()
    finally:
        for i, replica in enumerate(replicas):                # the session's server: its weights back
            ReloadSync(replica).push(shutil.copytree(vllm_server.model_dir, tmp_path / f"restore-{i}"), 0)
