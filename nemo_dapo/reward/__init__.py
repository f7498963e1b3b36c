"""Rewards for math RL (docs/algorithm.md §5, §10).

- :mod:`~nemo_dapo.reward.math_dapo`: exact-match scorer DAPO trained with.
- :mod:`~nemo_dapo.reward.math_verify_scorer`: symbolic-equivalence scorer in worker
  processes with a hard time limit.
- :mod:`~nemo_dapo.reward.scorers`: the scorers by name.
- :mod:`~nemo_dapo.reward.manager`: batch scoring, overlong shaping, token-level rewards.

Nothing is imported here, so a math_verify worker process only loads what it needs.
"""
