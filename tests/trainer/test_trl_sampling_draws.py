"""bench/learning_vs_trl.py --trl-sampling-seed draws TRL's sampling again for one seed, and
bench/trl_vllm_sampling.py's per-block training reward (issue 33)."""

import importlib.util
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lvt = _load("learning_vs_trl")
tvs = _load("trl_vllm_sampling")


def _draw_after_train_begin(seed: int, before: int = 12345) -> torch.Tensor:
    torch.manual_seed(before)              # whatever state the seed's set-up left behind
    torch.rand(7)
    lvt.sampling_seed_callback(seed).on_train_begin(None, None, None)
    return torch.multinomial(torch.full((50,), 0.02), 16, replacement=True)


def test_training_begins_from_the_sampling_seed_whatever_came_before():
    first = _draw_after_train_begin(1000)
    again = _draw_after_train_begin(1000, before=777)
    torch.manual_seed(1000)
    fresh = torch.multinomial(torch.full((50,), 0.02), 16, replacement=True)
    assert torch.equal(first, again) and torch.equal(first, fresh)


def test_another_sampling_seed_is_another_draw():
    assert not torch.equal(_draw_after_train_begin(1000), _draw_after_train_begin(1001))


def test_blocks_are_means_of_five_steps_in_step_order():
    train = [{"step": s, "reward": r} for s, r in [(3, 0.3), (1, 0.1), (2, 0.2), (4, 0.4), (5, 0.5), (6, 1.0), (7, 0.0)]]
    assert tvs.blocks(train) == [0.3, 0.5]
    assert tvs.blocks([]) == []
