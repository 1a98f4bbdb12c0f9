"""bench/examples.py's pure parts: arguments, the command it runs, and the table from results files."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_examples", REPO / "bench" / "examples.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_examples"] = bench
_spec.loader.exec_module(bench)


def _error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_arguments_subset_and_defaults():
    args = bench.parse_args(["--examples", "gsm8k", "--seeds", "1", "2"])
    assert (args.examples, args.seeds, args.table_only) == (["gsm8k"], [1, 2], False)
    args = bench.parse_args([])
    assert args.examples == list(bench.EXAMPLES) and args.seeds == [0, 1, 2]
    assert bench.parse_args(["--table-only"]).table_only


def test_arguments_refused_with_the_reason(capsys):
    err = _error(capsys, ["--examples", "gsm8k", "gsm9k"])
    assert "unknown example gsm9k" in err and "search_r1" in err
    assert "twice" in _error(capsys, ["--examples", "gsm8k", "gsm8k"])
    assert "drop --seeds" in _error(capsys, ["--table-only", "--seeds", "1"])
    assert "distinct non-negative" in _error(capsys, ["--seeds", "1", "1"])
    assert "distinct non-negative" in _error(capsys, ["--seeds", "-1"])


def test_command_is_the_readme_command_with_seed_and_its_own_results_folder(tmp_path):
    cmd = bench.command("gsm8k", 2, tmp_path / "d")
    assert cmd[cmd.index("--seed") + 1] == "2"
    assert cmd[cmd.index("--out-dir") + 1] == str(REPO / "examples" / "gsm8k" / "results" / "seed2")
    assert cmd[cmd.index("--env-map") + 1] == "QUESTION=input.question,ANSWER=input.answer"
    assert cmd[cmd.index("--cpu-budget-s") + 1] == "2700" and "--vllm-url" not in cmd
    sandbox = bench.command("sandbox", 0, tmp_path / "d", "http://127.0.0.1:9")
    assert sandbox[sandbox.index("--vllm-url") + 1] == "http://127.0.0.1:9"
    multi = bench.command("multi_agent", 0, tmp_path / "d")
    assert multi[multi.index("--train-tasks") + 1] == "examples/sql_agent/data/train.jsonl"
    assert "--env-map" not in multi
    for name, example in bench.EXAMPLES.items():  # every path it names is in the repository
        assert (REPO / example.agent.split()[-1]).is_file(), name
        for split in (example.train, example.val):
            assert (REPO / example.tasks / "data" / f"{split}.jsonl").is_file(), name
    coding = bench.command("coding", 1, tmp_path / "d")
    assert coding[coding.index("--agent") + 1].endswith("python examples/coding/agent.py")
    assert coding[coding.index("--train-tasks") + 1] == "examples/coding/data/train-command.jsonl"
    assert coding[coding.index("--val-tasks") + 1] == "examples/coding/data/val-run.jsonl"


def _results(seed: int, before: float, after: float | None, cpu: float = 600.0, of: int = 48) -> dict:
    val = [{"step": 0, "solved": before, "rollouts": of}]
    if after is not None:
        val.append({"step": 3, "solved": after, "rollouts": of, "cpu_seconds": cpu})
    step = {"rollouts": 32, "outcomes": {"capture": {"calls": 64}}}
    return {"config": {"seed": seed}, "val": val, "train": [step, step, step], "trainer": {"steps": 2}}


def _write(root: Path, name: str, seed: int, results: dict, run: dict | None = None) -> None:
    folder = root / "examples" / name / "results" / f"seed{seed}"
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(results))
    if run is not None:
        (folder / "run.json").write_text(json.dumps(run))


def test_table_from_results_files(tmp_path):
    run = {"commit": "abc1234", "service_cpu_seconds": 60.0, "load_1min": {"min": 2.0, "median": 5.0, "max": 9.0},
           "store": {"train": {"rollouts": 96, "calls": 192, "prompt_tokens": 9000, "completion_tokens": 600}}}
    _write(tmp_path, "gsm8k", 1, _results(1, 0.0625, 0.25, cpu=540.0), run)
    _write(tmp_path, "gsm8k", 2, _results(2, 0.0625, 0.125, cpu=1140.0), run)
    _write(tmp_path, "gsm8k", 3, _results(3, 0.0625, None))  # ended without its final validation
    (tmp_path / "examples" / "gsm8k" / "results" / "seed0-killed.json").write_text("{}")  # not a seed folder
    rows = bench.load_rows("gsm8k", tmp_path)
    assert [r["seed"] for r in rows] == [1, 2, 3] and [r["finished"] for r in rows] == [True, True, False]
    assert rows[0]["turns"] == 2.0 and rows[0]["tokens"] == 100.0 and rows[0]["cpu_s"] == 600.0

    cells = bench.summarise("gsm8k", rows)
    assert cells["seeds"] == "1, 2 (no final validation: 3)"
    assert cells["heldout"] == "6.2 [6.2, 6.2] → 18.8 [12.5, 25.0] (of 48)"
    assert cells["gain"] == "+12.5 [+6.2, +18.8]"
    assert cells["cpu"] == "15.0 [10.0, 20.0]"
    assert cells["goal"] == "yes (2 of 3 seeds)"
    assert cells["reward"] == "-"                 # these results.json predate reward_mean
    text = bench.table(tmp_path)
    assert "| [gsm8k](gsm8k/) |" in text and "abc1234" in text and "2.0–9.0" in text
    assert "| [sandbox](sandbox/) | openai client, Python in bubblewrap | none finished |" in text


def test_mean_reward_column_and_no_goal_for_the_long_horizon_examples(tmp_path):
    for seed, (r0, r1) in enumerate([(0.08, 0.20), (0.08, 0.12)]):
        results = _results(seed, 0.0, 0.0)
        results["val"][0]["reward_mean"], results["val"][1]["reward_mean"] = r0, r1
        _write(tmp_path, "scienceworld", seed, results)
    cells = bench.summarise("scienceworld", bench.load_rows("scienceworld", tmp_path))
    assert cells["reward"] == "0.080 [0.080, 0.080] → 0.160 [0.120, 0.200]"
    assert cells["goal"] == "- (long-horizon: reported, no goal)" and cells["gain"] == "+0.0 [+0.0, +0.0]"
    assert "held-out mean reward before → after" in bench.table(tmp_path)


def test_goal_needs_every_seed_up_the_mean_gain_and_the_cpu_bound():
    assert bench.goal([12.0, 11.0, 14.0], [20.0, 30.0, 44.0]) == "yes"
    assert bench.goal([30.0, 2.0, -2.0], [20.0] * 3) == "no: a seed not above its start"
    assert bench.goal([5.0, 6.0, 9.0], [50.0] * 3) == "no: mean gain < +10, > 45 CPU-min"
    assert bench.goal([20.0], None) == "no: CPU not measured (1 of 3 seeds)"


def test_write_table_replaces_only_its_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# Examples\nintro\n{bench.BEGIN}\nold table\n{bench.END}\nafter\n")
    bench.write_table(readme, tmp_path)
    text = readme.read_text()
    assert text.startswith("# Examples\nintro\n") and text.endswith(f"{bench.END}\nafter\n")
    assert "old table" not in text and "| example | agent |" in text
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="no <!-- bench/examples.py: table -->"):
        bench.write_table(readme, tmp_path)
