"""``lightspan demo`` is a preset of the experiment, and finds its agent in an installed wheel."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tomllib
import typing
import zipfile
from pathlib import Path

import pytest

from lightspan import demo
from lightspan.core.config import ConfigError
from lightspan.experiment import ExperimentConfig, agent_command

ROOT = Path(__file__).resolve().parent.parent


def test_the_preset_is_an_experiment_of_the_demo_tasks_agent_and_settings(tmp_path):
    cfg = demo.DemoConfig(steps=3, tasks_per_step=2, samples=4, val_tasks=5, learning_rate=3e-5, seed=7, lora_r=8,
                          entropy_floor=0.25, lora_serving="adapter")
    exp = demo.preset(cfg, tmp_path)
    assert exp.lora_serving == "adapter" and demo.DemoConfig().lora_serving == "merged"
    assert exp.entropy_floor == 0.25 and demo.DemoConfig().entropy_floor > 0   # the demo warns of a collapse
    train, val = demo.make_tasks(7, 6, 5)
    assert Path(exp.train_tasks).read_text().count("\n") == len(train) == 6
    assert Path(exp.val_tasks).read_text().count("\n") == len(val) == 5
    assert (exp.steps, exp.tasks_per_step, exp.samples, exp.learning_rate, exp.seed, exp.lora_r) == (3, 2, 4, 3e-5, 7, 8)
    assert (exp.grpc_port, exp.http_port, exp.api_port, exp.vllm_port) == (4317, 4318, 8321, 8000)
    # the agent runs with this interpreter, from where the package keeps it
    assert agent_command(exp.agent) == [sys.executable, str(demo.agent_path())]
    assert {t["question"] for t in train}.isdisjoint(t["question"] for t in val)


def test_examples_math_agent_runs_the_packaged_agent():
    wrapper = (ROOT / "examples" / "math_agent.py").read_text()
    assert 'run_module("lightspan.agents.math_agent", run_name="__main__"' in wrapper
    assert demo.agent_path() == ROOT / "lightspan" / "agents" / "math_agent.py"


def test_a_wheel_installed_lightspan_finds_the_demo_agent(tmp_path):
    """Build the wheel from the package's folders alone (as the Dockerfile copies them), install it
    into a fresh directory, and resolve the agent there from another directory: it is the wheel's
    own copy of the agent, not the source tree's."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    folders = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    for folder in folders:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(src)], check=True)
    wheel, = (tmp_path / "dist").glob("lightspan-*.whl")
    assert "lightspan/agents/math_agent.py" in zipfile.ZipFile(wheel).namelist()

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", "import lightspan, lightspan.demo; print(lightspan.__file__); "
                               "print(lightspan.demo.agent_path())"],
        cwd=elsewhere, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, check=True,
        capture_output=True, text=True).stdout.split()
    package, agent = Path(out[0]), Path(out[1])
    assert package.is_relative_to(site), package                  # the wheel's lightspan, not the checkout's
    assert agent == site / "lightspan" / "agents" / "math_agent.py"
    assert agent.read_bytes() == (ROOT / "lightspan" / "agents" / "math_agent.py").read_bytes()


def test_the_demo_takes_the_experiments_options_with_its_own_defaults():
    """DemoConfig is derived from ExperimentConfig: each option but val_tasks (a count here) is the
    experiment's, with its type, help and choices; the demo's defaults are its own."""
    experiment = {f.name: f for f in dataclasses.fields(ExperimentConfig)}
    types, demo_types = typing.get_type_hints(ExperimentConfig), typing.get_type_hints(demo.DemoConfig)
    for f in dataclasses.fields(demo.DemoConfig):
        if f.name == "val_tasks":
            assert demo_types[f.name] is int and f.metadata["help"]
            continue
        assert demo_types[f.name] is types[f.name]
        assert f.metadata["help"].startswith(experiment[f.name].metadata["help"])
        assert f.metadata["choices"] == experiment[f.name].metadata["choices"]
    assert dataclasses.asdict(demo.DemoConfig()) == {
        "data_dir": "./lightspan-data/demo", "model": "", "steps": 15, "tasks_per_step": 4, "samples": 8,
        "val_tasks": 48, "concurrency": 32, "lora_r": 16, "lora_serving": "merged", "learning_rate": 3e-4,
        "beta": 0.0, "max_staleness": 1, "entropy_floor": 0.2, "trainer_threads": 0, "temperature": 0.7, "seed": 0,
        "grpc_port": 4317, "http_port": 4318, "api_port": 8321, "vllm_port": 8000, "metrics_port": 0}
    # every option is on the command line with its help and its demo default
    out = subprocess.run([sys.executable, "-m", "lightspan.cli", "demo", "--help"], check=True, text=True,
                         capture_output=True, env={**os.environ, "COLUMNS": "1000"}).stdout
    text = " ".join(out.split())
    for f in dataclasses.fields(demo.DemoConfig):
        flag = f"--{f.name.replace('_', '-')} {f.name.upper()}"
        assert f"{flag} {f.metadata['help']} (default: {f.default!r};" in text, flag
    with pytest.raises(ConfigError, match="demo.val_tasks"):
        demo.DemoConfig(val_tasks=0)


def test_the_trainer_is_started_with_the_experiments_trainer_settings(tmp_path):
    """trainer_args, parsed as ``lightspan train`` parses its command line, gives a trainer config that
    holds every trainer setting of the experiment."""
    from lightspan.core.config import add_arguments, cli_values, resolve
    from lightspan.experiment import trainer_args
    from lightspan.trainer.config import TrainerConfig

    exp = dataclasses.replace(
        demo.preset(demo.DemoConfig(steps=7, lora_r=8, seed=3), tmp_path), lora_target_modules="all-linear",
        lr_schedule="cosine", beta=0.02, zero_advantage="count", max_staleness=0, learning_rate=1e-4,
        loss_normalisation="rollout", entropy_floor=0.3, trainer_threads=1, mini_batches=2)
    parser = argparse.ArgumentParser()
    add_arguments(parser, TrainerConfig, "trainer")
    argv = trainer_args(exp, tmp_path / "data", tmp_path / "model", "http://127.0.0.1:9", 0)
    t = resolve(TrainerConfig, section="trainer", environ={}, cli=cli_values(parser.parse_args(argv), TrainerConfig))
    assert (t.lora_r, t.lora_alpha, t.lora_target_modules, t.sync) == (8, exp.lora_alpha, "all-linear", "reload")
    assert (t.lr_schedule, t.lr_decay_steps, t.learning_rate, t.beta, t.seed) == ("cosine", 7, 1e-4, 0.02, 3)
    assert (t.zero_advantage, t.max_staleness, t.loss_normalisation, t.loss_type) == ("count", 0, "rollout", exp.loss_type)
    assert (t.entropy_floor, t.torch_threads, t.mode, t.batch_size, t.mini_batches) == (0.3, 1, "continuous", 0, 2)
    adapter = trainer_args(dataclasses.replace(exp, lora_serving="adapter", max_staleness=1), tmp_path, tmp_path, "", 0)
    assert adapter[adapter.index("--sync") + 1] == "lora" and adapter[adapter.index("--verify-sync") + 1] == "false"
