"""The trainer's learning-rate schedule (lr_schedule): constant, or linear / cosine over lr_decay_steps
policy versions to learning_rate x lr_final_ratio, then held (the trainer sets it before every step:
tests/trainer/test_loop.py)."""

import math

import pytest

from lightspan.core.config import ConfigError
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.step import learning_rate_at


def cfg(**kwargs):
    return TrainerConfig(**{"model": "m", "learning_rate": 1e-3, **kwargs})


def test_constant_is_the_learning_rate_at_every_version():
    c = cfg()
    assert [learning_rate_at(c, v) for v in (0, 1, 50, 10**6)] == [1e-3] * 4


def test_linear_and_cosine_decay_to_the_final_ratio_then_hold():
    linear = cfg(lr_schedule="linear", lr_decay_steps=10, lr_final_ratio=0.1)
    assert learning_rate_at(linear, 0) == pytest.approx(1e-3)
    assert learning_rate_at(linear, 5) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert learning_rate_at(linear, 10) == pytest.approx(1e-4)
    assert learning_rate_at(linear, 25) == pytest.approx(1e-4)
    cosine = cfg(lr_schedule="cosine", lr_decay_steps=10, lr_final_ratio=0.0)
    assert learning_rate_at(cosine, 0) == pytest.approx(1e-3)
    assert learning_rate_at(cosine, 5) == pytest.approx(0.5e-3)
    assert learning_rate_at(cosine, 2) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 0.2)))
    assert learning_rate_at(cosine, 10) == 0.0
    # cosine stays above linear in the first half of the decay, below in the second
    lin0 = cfg(lr_schedule="linear", lr_decay_steps=10, lr_final_ratio=0.0)
    assert learning_rate_at(cosine, 3) > learning_rate_at(lin0, 3)
    assert learning_rate_at(cosine, 7) < learning_rate_at(lin0, 7)


@pytest.mark.parametrize("kwargs, field", [
    (dict(lr_schedule="cosine"), "trainer.lr_decay_steps"),
    (dict(lr_schedule="linear", lr_decay_steps=0), "trainer.lr_decay_steps"),
    (dict(lr_final_ratio=1.5), "trainer.lr_final_ratio"),
    (dict(lr_schedule="exponential", lr_decay_steps=5), "trainer.lr_schedule"),
])
def test_a_schedule_without_its_settings_fails_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        cfg(**kwargs)
    assert err.value.field == field
