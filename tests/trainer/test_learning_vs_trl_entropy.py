"""bench/learning_vs_trl.py's entropy flag: a run whose final policy entropy falls below 0.2 nats per
token is flagged with the warning the demo's trainer logs, and a run without an entropy is flagged too."""

import importlib.util
from pathlib import Path

from lightspan.trainer.metrics import entropy_warning

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_learning_vs_trl", REPO / "bench" / "learning_vs_trl.py")
lvt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lvt)


def test_the_floor_is_the_issues_and_the_demos():
    from lightspan.demo import DemoConfig

    assert lvt.ENTROPY_FLOOR == 0.2 == DemoConfig.__dataclass_fields__["entropy_floor"].default


def test_a_run_below_the_floor_is_flagged_with_the_demos_warning():
    flag = lvt.entropy_flag(0.13)
    assert flag is not None and flag.startswith("ENTROPY COLLAPSE")
    assert entropy_warning(0.13, 0.2) in flag          # the trainer's own words, as the demo logs them
    assert "0.130 nats/token" in flag


def test_a_run_at_or_above_the_floor_is_not_flagged():
    assert lvt.entropy_flag(0.2) is None
    assert lvt.entropy_flag(0.85) is None


def test_another_floor():
    assert lvt.entropy_flag(0.25, floor=0.3) is not None
    assert lvt.entropy_flag(0.25, floor=0.1) is None


def test_a_run_without_an_entropy_is_flagged_not_passed():
    flag = lvt.entropy_flag(None)
    assert flag is not None and "no policy entropy" in flag
