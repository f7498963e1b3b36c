"""The collapse warnings: once each, when the reward or the response length collapses, never on a
run that learns."""

from nemo_dapo.trainer.health import LearningHealth


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
