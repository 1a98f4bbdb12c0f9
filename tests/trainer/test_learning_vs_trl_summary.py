"""bench/learning_vs_trl.py's summary on the best evaluation beside the last, per seed ratios, old JSON;
and its gsm8k task (bench/learning_tasks.py): TRL's prompt is the agent's first call, its reward the
agent's scoring, its tasks lightspan's."""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_learning_vs_trl", REPO / "bench" / "learning_vs_trl.py")
lvt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lvt)
tasks = sys.modules["learning_tasks"]      # what learning_vs_trl.py imported


def point(step, cpu_s, solved, of=48):
    return {"step": step, "cpu_s": cpu_s, "wall_s": cpu_s, "solved": solved, "of": of}


# seed 0: lightspan climbs late, TRL peaks early then falls back; seed 1: lightspan's best is its first
# evaluation (gain 0 on the best), TRL climbs to the end
RUNS = {
    "lightspan": {0: [point(0, 30, 5), point(5, 300, 20), point(10, 600, 32), point(15, 900, 30)],
                  1: [point(0, 30, 15), point(5, 300, 12), point(10, 600, 15), point(15, 900, 14)]},
    "trl": {0: [point(0, 6, 5), point(5, 300, 35), point(10, 600, 26), point(15, 900, 29)],
            1: [point(0, 6, 15), point(5, 300, 16), point(10, 600, 18), point(15, 900, 21)]},
}


def test_best_evaluation_is_the_first_to_reach_the_highest_count():
    curve = [point(0, 60, 3), point(5, 120, 9), point(10, 180, 9), point(15, 240, 7)]
    assert lvt.best_evaluation(curve) == {"step": 5, "solved": 9, "of": 48, "cpu_s": 120}
    assert lvt.best_gain_per_cpu_minute(curve) == pytest.approx((9 - 3) / 2.0)
    assert lvt.gain_per_cpu_minute(curve) == pytest.approx((7 - 3) / 4.0)     # the last's, unchanged


def test_a_seed_whose_best_is_its_first_evaluation_gains_zero():
    curve = RUNS["lightspan"][1]
    assert lvt.best_evaluation(curve)["step"] == 0
    assert lvt.best_gain_per_cpu_minute(curve) == 0.0
    assert lvt.gain_per_cpu_minute(curve) == pytest.approx(-1 / 15)


def test_summary_last_and_best_per_side_and_per_seed():
    s = lvt.summarise(RUNS)
    ls, trl = s["lightspan"], s["trl"]
    # the last evaluation, as before: (last - first) / last CPU-minutes
    assert ls["gain_per_cpu_min"] == pytest.approx([25 / 15, -1 / 15])
    assert trl["gain_per_cpu_min"] == pytest.approx([24 / 15, 6 / 15])
    assert s["ratio"] == pytest.approx((24 / 15) / (30 / 15))
    # the best: (best - first) / CPU-minutes at the best
    assert ls["best_gain_per_cpu_min"] == pytest.approx([27 / 10, 0.0])
    assert trl["best_gain_per_cpu_min"] == pytest.approx([30 / 5, 6 / 15])
    assert ls["best_mean"] == pytest.approx(1.35) and trl["best_mean"] == pytest.approx(3.2)
    assert ls["best_range"] == pytest.approx([0.0, 2.7])
    assert s["best_ratio"] == pytest.approx(1.35 / 3.2)
    assert [b["step"] for b in trl["best_evaluation"]] == [5, 15]
    assert s["per_seed"]["0"]["ratio"] == pytest.approx(25 / 24)
    assert s["per_seed"]["0"]["best_ratio"] == pytest.approx(2.7 / 6)
    assert s["per_seed"]["1"]["ratio"] == pytest.approx(-1 / 6)
    assert s["per_seed"]["1"]["best_ratio"] == 0.0
    assert s["every_seed_at_least_1x"] == {"last": False, "best": False}


def test_a_seed_where_trl_gained_nothing_has_no_ratio_and_fails_every_seed():
    runs = {"lightspan": {0: [point(0, 30, 5), point(5, 300, 10)], 1: [point(0, 30, 5), point(5, 300, 10)]},
            "trl": {0: [point(0, 6, 5), point(5, 300, 9)], 1: [point(0, 6, 5), point(5, 300, 5)]}}
    s = lvt.summarise(runs)
    assert s["per_seed"]["1"] == {"ratio": None, "best_ratio": None}
    assert s["per_seed"]["0"]["ratio"] == pytest.approx(5 / 4)
    assert s["every_seed_at_least_1x"] == {"last": False, "best": False}
    lines = lvt.report(s)
    assert "seed 1: lightspan / TRL n/a on the last evaluation, n/a on the best" in lines
    del runs["trl"][1]
    assert lvt.summarise(runs)["every_seed_at_least_1x"] == {"last": True, "best": True}


def test_report_keeps_the_old_lines_and_adds_the_best(capsys):
    lines = lvt.report(lvt.summarise(RUNS), "problems", [3.6, 2.0])
    assert lines[0] == "lightspan: held-out gain +0.80 problems per CPU-minute (seeds: +1.67, -0.07)"
    assert lines[1] == "      trl: held-out gain +1.00 problems per CPU-minute (seeds: +1.60, +0.40)"
    assert lines[2] == "ratio lightspan / TRL: 0.80x   (load 3.6 -> 2.0)"
    assert lines[3].startswith("lightspan: best held-out gain +1.35 problems per CPU-minute (seeds: +2.70 (32/48 @ 10.0)")
    assert "ratio lightspan / TRL on the best evaluation: 0.42x" in lines
    assert "seed 0: lightspan / TRL 1.04x on the last evaluation, 0.45x on the best" in lines
    assert lines[-3] == "every seed at least 1.0x: last evaluation no, best evaluation no"
    # then each side's CPU a step, start-up left out: (900 - 30) / 15 and (900 - 6) / 15
    assert lines[-2:] == ["lightspan: 58.0 CPU-s a step, median over seeds (seeds: 58.0, 58.0)",
                          "      trl: 59.6 CPU-s a step, median over seeds (seeds: 59.6, 59.6)"]


def test_cpu_per_step_leaves_start_up_out_and_needs_a_step():
    assert lvt.cpu_per_step([point(0, 40, 5), point(5, 140, 9), point(8, 200, 9)]) == pytest.approx(20.0)
    assert lvt.cpu_per_step([point(0, 40, 5)]) is None
    runs = {"lightspan": {0: [point(0, 40, 5)]}, "trl": {0: [point(0, 6, 5), point(4, 106, 7)]}}
    lines = lvt.report(lvt.summarise(runs))
    assert not any(line.startswith("lightspan:") and "CPU-s a step" in line for line in lines)
    assert "      trl: 25.0 CPU-s a step, median over seeds (seeds: 25.0)" in lines


def test_an_old_json_without_the_new_keys_still_summarises(tmp_path):
    # the shape session 6 wrote: seeds as strings, no "task", no "entropy", the summary's old keys only
    old = {"runs": json.loads(json.dumps(RUNS)), "summary": {"lightspan": {"mean": 0.8}, "ratio": 0.8},
           "load_1m": [3.6, 2.0], "argv": ["--seeds", "0,1"]}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    lines = lvt.summarise_file(str(path))
    assert lines[:3] == lvt.report(lvt.summarise(RUNS), "additions", [3.6, 2.0])[:3]
    assert "additions per CPU-minute" in lines[0]
    assert "seed 1: lightspan / TRL -0.17x on the last evaluation, 0.00x on the best" in lines


# --- gsm8k ----------------------------------------------------------------------------------------

class _Recorder:
    """An OpenAI client stand-in: records each chat call's messages and replies with ``replies``."""

    def __init__(self, *replies):
        self.calls, self.replies = [], list(replies)
        self.chat = self
        self.completions = self

    def create(self, *, messages, **_):
        self.calls.append([dict(m) for m in messages])
        content = self.replies.pop(0)
        return type("R", (), {"choices": [type("C", (), {"message": type("M", (), {"content": content})})]})


def _args(**kw):
    base = dict(seed=0, max_steps=3, tasks_per_step=4, samples=8, val_tasks=5, model="", work="/nonexistent",
                max_staleness=None, cpu_budget_s=60.0, eval_every=1)
    return argparse.Namespace(**{**base, **kw})


def test_gsm8k_trl_prompt_is_the_agents_first_call():
    agent = tasks.gsm8k_agent()
    train, val = tasks.TASKS["gsm8k"].tasks(_args())
    for task in (train[0], val[3], {**val[1], "shots": 2}):
        client = _Recorder("<answer>1</answer>")
        agent.solve(client, task["question"], shots=int(task.get("shots", 1)))
        assert tasks.TASKS["gsm8k"].prompt(task) == client.calls[0]
    assert len(tasks.TASKS["gsm8k"].prompt({**val[1], "shots": 2})) > len(tasks.TASKS["gsm8k"].prompt(val[1]))


def test_gsm8k_reward_scores_as_the_agent_does():
    reward = tasks.TASKS["gsm8k"].reward
    gold = "9*4 = <<9*4=36>>36\n#### 36"
    for completion, expected in (("<answer>36</answer>", 1.0), ("<answer>36", 1.0), ("Sure. <answer> 36 </answer>", 1.0),
                                 ("<answer>35</answer>", 0.0), ("<answer>3,6</answer>", 1.0)):
        # the agent's own episode on that reply, scored as its main() scores it
        episode = tasks.gsm8k_agent().solve(_Recorder(completion), "q")
        assert tasks.gsm8k_agent().score(episode["answer"], gold) == expected
        assert reward(completion, gold) == expected, completion
    assert reward("<calc>9 * 4</calc>", gold) == 0.0           # no calculator in one turn: no answer
    assert reward("36", gold) == 0.0                           # neither tag: the agent's invalid action
    assert reward("<answer>36</answer>", "#### 37") == 0.0


def test_gsm8k_tasks_are_lightspans_in_lightspans_order():
    from lightspan.experiment import step_tasks
    from lightspan.rollout.runner import load_tasks

    args = _args(max_steps=120, tasks_per_step=4, val_tasks=7)
    train, val = tasks.TASKS["gsm8k"].tasks(args)
    file_train = load_tasks(tasks.GSM8K / "data" / "train.jsonl")
    lightspan_order = [t for step in range(args.max_steps) for t in step_tasks(file_train, step, 4, 0.7)]
    assert [t["question"] for t in train] == [t["question"] for t in lightspan_order]    # 480: cycles past 400
    assert [t["id"] for t in val] == [f"val-{i:04d}" for i in range(7)]


def test_gsm8k_lightspan_side_is_the_documented_run_with_the_benchs_budget():
    exp = tasks.TASKS["gsm8k"].experiment(_args(seed=2, samples=2, tasks_per_step=1, val_tasks=4), Path("/tmp"))
    documented = tasks.documented_gsm8k()
    assert (documented.tasks_per_step, documented.samples, documented.lora_r, documented.learning_rate) == (4, 8, 16, 3e-4)
    assert (exp.tasks_per_step, exp.samples, exp.val_limit, exp.seed, exp.steps) == (1, 2, 4, 2, 3)
    assert (exp.cpu_budget_s, exp.val_every) == (60.0, 1)
    assert exp.agent == str(REPO / "examples" / "gsm8k" / "agent.py")
    assert exp.env_map == ("QUESTION=input.question", "ANSWER=input.answer")
    assert (exp.lora_r, exp.learning_rate, exp.rollout_timeout_s, exp.disabled_instrumentations) == (
        16, 3e-4, 1200.0, "langchain")


def test_the_benchs_defaults_are_the_gsm8k_examples_settings():
    parser = argparse.ArgumentParser()
    lvt.add_shared_options(parser)
    defaults = parser.parse_args([])
    documented = tasks.documented_gsm8k()
    assert (defaults.tasks_per_step, defaults.samples) == (documented.tasks_per_step, documented.samples)
    assert (defaults.trl_lora_r, defaults.trl_lr) == (documented.lora_r, documented.learning_rate)
    assert defaults.max_tokens == 24 == int(tasks.gsm8k_agent().solve.__kwdefaults__["max_tokens"])


@pytest.mark.parametrize("task", ["addition", "gsm8k"])
def test_zero_advantage_reaches_lightspans_side_only_when_given(task, tmp_path):
    experiment = tasks.TASKS[task].experiment
    given = experiment(_args(work=str(tmp_path), zero_advantage="count", max_staleness=0), tmp_path)
    assert (given.zero_advantage, given.max_staleness) == ("count", 0)
    left_out = experiment(_args(work=str(tmp_path)), tmp_path)        # the namespace of an older caller: no attribute
    assert left_out.zero_advantage == "exclude"                     # the experiment's default


@pytest.mark.parametrize("task", ["addition", "gsm8k"])
def test_lightspan_lr_reaches_lightspans_side_only_when_given(task, tmp_path):
    experiment = tasks.TASKS[task].experiment
    default = experiment(_args(work=str(tmp_path)), tmp_path).learning_rate
    given = experiment(_args(work=str(tmp_path), lightspan_lr=default / 2), tmp_path)
    assert given.learning_rate == default / 2
    assert experiment(_args(work=str(tmp_path), lightspan_lr=None), tmp_path).learning_rate == default


@pytest.mark.parametrize("task", ["addition", "gsm8k"])
def test_lightspan_tasks_per_step_takes_trls_tasks_in_trls_order(task, tmp_path):
    from lightspan.experiment import step_tasks
    from lightspan.rollout.runner import load_tasks

    args = _args(work=str(tmp_path), max_steps=12, tasks_per_step=2, lightspan_tasks_per_step=6)
    exp = tasks.TASKS[task].experiment(args, tmp_path)
    assert exp.tasks_per_step == 6 and exp.samples == args.samples      # TRL's side keeps --tasks-per-step
    trl_train, _ = tasks.TASKS[task].tasks(args)
    own = load_tasks(exp.train_tasks)
    lightspan = [t for step in range(4) for t in step_tasks(own, step, exp.tasks_per_step, 0.7)]
    assert [t["question"] for t in lightspan] == [t["question"] for t in trl_train[:24]]   # TRL's first 12 steps
    assert tasks.TASKS[task].experiment(_args(work=str(tmp_path)), tmp_path).tasks_per_step == 4


def _saved(tmp_path, name, runs, task="addition"):
    path = tmp_path / name
    path.write_text(json.dumps({"task": task, "runs": runs, "load_1m": [1.0, 2.0]}))
    return str(path)


def test_several_files_are_summarised_as_one_run_of_their_seeds(tmp_path):
    # seed 0 from one file, seed 1 from another (a fifth seed run later, say): the same summary as one run
    first = _saved(tmp_path, "a.json", {side: {"0": RUNS[side][0]} for side in RUNS})
    second = _saved(tmp_path, "b.json", {side: {"1": RUNS[side][1]} for side in RUNS})
    lines = lvt.summarise_file(first, second)
    assert lines == lvt.report(lvt.summarise(json.loads(json.dumps(RUNS))), "additions")
    assert "seed 1: lightspan / TRL -0.17x on the last evaluation, 0.00x on the best" in lines
    assert "(load" not in lines[2]                # a load of one file is not the merged run's


def test_the_host_is_named_and_a_reading_across_hosts_says_so(tmp_path):
    assert lvt.host() and lvt.host() != "unknown"
    one = {side: {"0": RUNS[side][0]} for side in RUNS}
    two = {side: {"1": RUNS[side][1]} for side in RUNS}
    (tmp_path / "a.json").write_text(json.dumps({"task": "addition", "runs": one, "host": "CPU A"}))
    (tmp_path / "b.json").write_text(json.dumps({"task": "addition", "runs": two, "host": "CPU A"}))
    (tmp_path / "c.json").write_text(json.dumps({"task": "addition", "runs": two, "host": "CPU B"}))
    (tmp_path / "d.json").write_text(json.dumps({"task": "addition", "runs": two}))       # before hosts were kept
    same = lvt.summarise_file(str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert same[-1] == "host: CPU A"
    mixed = lvt.summarise_file(str(tmp_path / "a.json"), str(tmp_path / "c.json"))
    assert mixed[-1].startswith("hosts differ (CPU A; CPU B): a cross-host reading")
    unknown = lvt.summarise_file(str(tmp_path / "a.json"), str(tmp_path / "d.json"))
    assert unknown[-1].startswith("hosts differ (CPU A; host not recorded)")
    assert same[:-1] == mixed[:-1] == unknown[:-1]             # the host changes no figure


def test_a_seed_in_two_files_or_two_tasks_are_refused(tmp_path):
    first = _saved(tmp_path, "a.json", {side: {"0": RUNS[side][0]} for side in RUNS})
    again = _saved(tmp_path, "b.json", {"trl": {"0": RUNS["trl"][1]}})
    with pytest.raises(SystemExit, match="seed 0 of trl is in more than one file"):
        lvt.summarise_file(first, again)
    other = _saved(tmp_path, "c.json", {side: {"1": RUNS[side][1]} for side in RUNS}, task="gsm8k")
    with pytest.raises(SystemExit, match="different tasks"):
        lvt.summarise_file(first, other)


@pytest.mark.parametrize("task", ["addition", "gsm8k"])
def test_lora_targets_reach_both_sides(task, tmp_path):
    parser = argparse.ArgumentParser()
    lvt.add_shared_options(parser)
    default = parser.parse_args([])
    experiment = tasks.TASKS[task].experiment
    assert experiment(_args(work=str(tmp_path), **vars(default)), tmp_path).lora_target_modules == default.lora_targets
    mlp = parser.parse_args(["--lora-targets", "q_proj,v_proj,gate_proj,up_proj,down_proj"])
    args = _args(work=str(tmp_path), **vars(mlp))
    lightspan = experiment(args, tmp_path)
    _, lora = lvt.trl_config(args, tmp_path)
    assert lightspan.lora_target_modules == "q_proj,v_proj,gate_proj,up_proj,down_proj"
    assert set(lora.target_modules) == {"q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"}
    assert lvt.lightspan_trainer_config(args, str(tmp_path), tmp_path).lora_target_modules == lightspan.lora_target_modules


@pytest.mark.parametrize("task", ["addition", "gsm8k"])
def test_beta_reaches_both_sides(task, tmp_path):
    parser = argparse.ArgumentParser()
    lvt.add_shared_options(parser)
    experiment = tasks.TASKS[task].experiment
    for argv, beta in (([], 0.0), (["--beta", "0.04"], 0.04)):
        args = _args(work=str(tmp_path), **vars(parser.parse_args(argv)))
        config, _ = lvt.trl_config(args, tmp_path)
        assert config.beta == beta
        assert experiment(args, tmp_path).beta == beta
        assert lvt.lightspan_trainer_config(args, str(tmp_path), tmp_path).beta == beta


@pytest.mark.parametrize("task", ["addition", "gsm8k"])
def test_lightspan_samples_sets_lightspans_group_size_only(task, tmp_path):
    experiment = tasks.TASKS[task].experiment
    args = _args(work=str(tmp_path), lightspan_samples=16, lightspan_tasks_per_step=2, trl_lr=3e-4, trl_lora_r=16,
                 loss_type="grpo", max_tokens=24, beta=0.0, lora_targets="all-linear")
    exp = experiment(args, tmp_path)
    assert (exp.samples, exp.tasks_per_step) == (16, 2)
    config, _ = lvt.trl_config(args, tmp_path)
    assert config.num_generations == args.samples == 8          # TRL's group size stays --samples
    assert experiment(_args(work=str(tmp_path), lightspan_samples=None), tmp_path).samples == 8


def test_parts_a_step_are_medians_over_seeds_of_each_parts_cpu_over_its_steps(tmp_path):
    parts = {"lightspan": {"0": {"cpu_s": {"trainer": 80.0, "vllm": 70.0, "rest": 100.0}, "steps": 10},
                           "1": {"cpu_s": {"trainer": 90.0, "vllm": 50.0, "rest": 60.0}, "steps": 5},
                           "2": {"cpu_s": {"trainer": 40.0, "vllm": 60.0}, "steps": 4},        # no "rest": 0
                           "3": {"cpu_s": {"trainer": 1.0, "vllm": 1.0, "rest": 1.0}, "steps": 0}},  # no step
             "trl": {"0": {"cpu_s": {"generate": 200.0, "score": 10.0, "train": 90.0}, "steps": 10}}}
    per = lvt.parts_per_step(parts)
    assert per["lightspan"] == {"seeds": 3, "cpu_s": {"trainer": pytest.approx(10.0), "vllm": pytest.approx(10.0),
                                                      "rest": pytest.approx(10.0)}}
    assert per["trl"]["cpu_s"] == {"generate": 20.0, "score": 1.0, "train": 9.0}
    lines = lvt.report(lvt.summarise(RUNS), parts=per)
    assert "lightspan: CPU-s a step by part, median over 3 seeds: trainer 10.0, vllm 10.0, rest 10.0 (rest: " in \
        "\n".join(lines)
    assert any(line.startswith("      trl: CPU-s a step by part, median over 1 seed: generate 20.0, score 1.0, "
                               "train 9.0 (generate: ") for line in lines)
    assert lvt.report(lvt.summarise(RUNS)) == [line for line in lines if "by part" not in line]
    # saved files: each file's parts, their seeds together; a file from before parts were kept adds none
    one = {side: {"0": RUNS[side][0]} for side in RUNS}
    two = {side: {"1": RUNS[side][1]} for side in RUNS}
    (tmp_path / "a.json").write_text(json.dumps({"task": "addition", "runs": one,
                                                 "parts": {"trl": {"0": parts["trl"]["0"]}}}))
    (tmp_path / "b.json").write_text(json.dumps({"task": "addition", "runs": two, "parts": {"trl": {"1": {
        "cpu_s": {"generate": 100.0, "score": 30.0, "train": 70.0}, "steps": 10}}}}))
    (tmp_path / "c.json").write_text(json.dumps({"task": "addition", "runs": two}))
    both = lvt.summarise_file(str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert any("median over 2 seeds: generate 15.0, score 2.0, train 8.0" in line for line in both)
    old = lvt.summarise_file(str(tmp_path / "a.json"), str(tmp_path / "c.json"))
    assert any("median over 1 seed: generate 20.0" in line for line in old)
