"""The collapse warnings: once each, when the reward or the response length collapses, never on a
run that learns; and the stop after ``trainer.max_nonfinite_steps`` skipped steps in a row."""

import pytest

from nemo_dapo.errors import TrainingDiverged
from nemo_dapo.trainer.health import LearningHealth, NonFiniteSteps


def feed(rows):
    health = LearningHealth()
    return [(step, w) for step, row in enumerate(rows, 1) for w in health.observe(step, row)]


def test_a_reward_collapse_warns_once_with_the_settings_to_look_at():
    rows = [{"critic/acc/mean": a, "response_length/mean": 12.0} for a in (0.06, 0.03, 0.0, 0.0, 0.0, 0.0, 0.0)]
    warnings = feed(rows)
    assert [step for step, _ in warnings] == [5]
    assert "critic/acc/mean 0" in warnings[0][1] and "algorithm.filter_groups.enable" in warnings[0][1]


def test_a_length_collapse_warns_once():
    lengths = (12, 13, 11, 9, 5, 5.8, 5.5, 6, 6)
    warnings = feed([{"critic/acc/mean": 0.1, "response_length/mean": n} for n in lengths])
    assert [step for step, _ in warnings] == [7] and "12.0 -> 5.5 tokens" in warnings[0][1]


def test_a_run_that_learns_or_never_scored_is_left_alone():
    learning = [{"critic/acc/mean": 0.05 * i, "response_length/mean": 12 + i} for i in range(10)]
    never = [{"critic/acc/mean": 0.0, "response_length/mean": 12.0}] * 10  # nothing to have collapsed from
    assert feed(learning) == [] and feed(never) == []


def test_skipped_steps_warn_and_stop_the_run_at_the_limit_in_a_row():
    guard = NonFiniteSteps(limit=3)
    assert guard.observe(1, 0.0) is None
    assert "50% of its optimizer steps skipped" in guard.observe(2, 0.5)
    assert "2 such step(s) in a row" in guard.observe(3, 1.0)
    assert guard.observe(4, 0.0) is None  # a finite step starts the count again
    guard.observe(5, 1.0), guard.observe(6, 1.0)
    with pytest.raises(TrainingDiverged, match=r"steps 5-7: .*max_nonfinite_steps=3"):
        guard.observe(7, 1.0)
    never = NonFiniteSteps(limit=0)
    assert all("the run stops at none" in never.observe(step, 1.0) for step in range(1, 20))
