"""examples/production's measuring tools: measure.py (a run's CPU time over its process tree) and
summarize.py (the bad version's canary from the traffic's records and the decisions)."""

from __future__ import annotations

import importlib
import json
import sys

measure = importlib.import_module("examples.production.measure")
summarize = importlib.import_module("examples.production.summarize")

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_measure_counts_the_cpu_of_grandchildren_and_keeps_the_exit_code(tmp_path):
    out = tmp_path / "cost.json"
    # a child that starts a grandchild burning 1.2 s of CPU, burns 0.3 s itself, and exits 3
    script = (f"import subprocess, sys\np = subprocess.Popen([sys.executable, '-c', {BURN.format(s=1.2)!r}])\n"
              f"{BURN.format(s=0.3)}p.wait()\nsys.exit(3)\n")
    code = measure.main(["--out", str(out), "--every-s", "0.2", "--", sys.executable, "-c", script])
    cost = json.loads(out.read_text())
    assert code == 3 and cost["exit_code"] == 3
    # both processes' CPU, the grandchild's included (each read at its last sample: at most every_s lost)
    assert (1.5 - 2 * 0.2) / 60 <= cost["cpu_min"] + 0.005 and cost["cpu_min"] <= 3.0 / 60
    assert cost["cpu_min_waited_for"] >= 1.45 / 60       # the kernel's count: both were waited for
    assert cost["processes"] >= 2 and cost["wall_min"] > 0


def test_kinds_tell_vllm_from_the_trainer_that_names_it():
    assert measure.kind(["VLLM::EngineCore"]) == "vllm"
    assert measure.kind(["python", "-m", "lightspan.cli", "vllm", "--model", "m"]) == "vllm"
    assert measure.kind(["python", "-m", "lightspan.cli", "train", "--vllm-url", "http://x"]) == "train"
    assert measure.kind(["python", "-m", "lightspan.cli", "train", "--algo", "sft", "--vllm-url", "u"]) \
        == "train --algo sft"


def _request(i, t, key, right, at_h):
    return {"kind": "request", "index": i, "t": t, "request_id": key, "right": right, "at_h": at_h}


def test_bad_canary_share_and_time_to_its_rollback():
    s = 1_000_000_000
    decisions = [{"version": 5, "action": "canary", "time_unix_nano": 100 * s},
                 {"version": 5, "action": "rollback", "time_unix_nano": 160 * s, "candidate_rollouts": 20,
                  "serving_rollouts": 21, "candidate_reward_mean": 0.0, "serving_reward_mean": 0.5,
                  "p_value": 0.99, "reason": "worse"}]
    records = [_request(0, 99.0, "a", True, 0.0),                                 # before the canary
               *[_request(i, 100.0 + 10 * i, f"k{i}", i % 2 == 0, 0.25 * i) for i in range(1, 6)],
               _request(9, 200.0, "z", False, 2.5)]                               # after the rollback
    served = {"a": 4, "k1": 5, "k2": 4, "k3": 5, "k4": 5, "k5": 4, "z": 4}
    bad = summarize.bad_canary([{"event": "bad_traffic", "t": 99.0, "version": 5}], decisions, records, served)
    assert bad["decision"] == "rollback" and bad["wall_s_to_decision"] == 60.0
    assert bad["requests_before_decision"] == 5 and bad["served_by_bad_version"] == 3
    assert bad["share_of_traffic"] == 0.6 and bad["bad_version_reward"] == round(1 / 3, 4)
    assert bad["simulated_h_to_decision"] == 1.25 and bad["decided_while_traffic_ran"]
    undecided = summarize.bad_canary([{"event": "bad_traffic", "t": 99.0, "version": 5}], decisions[:1], records,
                                     served)
    assert undecided["decision"] is None and undecided["wall_s_to_decision"] is None


def test_run_sh_trainers_fit_a_shared_cpu_and_live_traffic():
    """run.sh's trainers: the RL ones on one torch thread (two spin at OpenMP barriers on a shared 2-core
    machine while vLLM serves the users), the SFT on two (no traffic then); and the scheduled one, which
    trains beside the users' requests, without the sync check whose prompt_logprobs request kills vLLM's
    CPU engine under LoRA when batched with them."""
    from pathlib import Path

    text = (Path(summarize.__file__).parent / "run.sh").read_text()
    assert 'THREADS=(--torch-threads "${TORCH_THREADS:-1}")' in text
    assert 'SFT_THREADS=(--torch-threads "${SFT_THREADS:-2}")' in text
    train_args = text[text.index("TRAIN=("):text.index(")", text.index("TRAIN=("))]
    assert "--torch-threads" not in train_args            # each trainer says its own
    sft = text[text.index("train --algo sft"):]
    assert sft[:sft.index("\n")].count('"${SFT_THREADS[@]}"') == 1
    every = text[text.index("train --mode every"):]
    every = every[:every.index("TRAIN_PID=")]
    assert "--verify-sync false" in every and '"${THREADS[@]}"' in every
    bad = text[text.index('--learning-rate "$BAD_LR"') - 200:text.index('--learning-rate "$BAD_LR"')]
    assert '"${THREADS[@]}"' in bad
