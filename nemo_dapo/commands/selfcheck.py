"""A readable, one-screen check that the DAPO math of docs/algorithm.md §1-6 and 10 behaves as specified.

Each row recomputes a value by hand and by the library and says whether they agree.
"""

from __future__ import annotations

import math

import torch
from rich.console import Console
from rich.table import Table

from nemo_dapo.algo.advantage import get_advantage_estimator
from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.algo.kl import kl_penalty
from nemo_dapo.algo.loss import aggregate_loss
from nemo_dapo.algo.policy_losses import PolicyLossSettings, dapo_loss
from nemo_dapo.algo.sampling import GroupAccumulator
from nemo_dapo.algo.shaping import overlong_penalty
from nemo_dapo.reward.math_dapo import compute_score


def _one_token_loss(log_ratio: float, advantage: float) -> float:
    def t(v):
        return torch.tensor([[float(v)]])

    return dapo_loss(t(0.0), t(log_ratio), t(advantage), torch.ones(1, 1), PolicyLossSettings())[0].item()


def _checks() -> list[tuple[str, float, float]]:
    """(what, expected by hand, computed by nemo_dapo)."""
    group = torch.zeros(4, 2)
    group[:, -1] = torch.tensor([1.0, 1.0, -1.0, -1.0])
    adv, _ = get_advantage_estimator("grpo")(
        token_level_rewards=group, response_mask=torch.ones(4, 2), group_ids=["q"] * 4
    )
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    acc = GroupAccumulator(target_groups=2)
    acc.add_round(RolloutBatch(fields={"uid": list("aabbcc"), "acc": [1, 0, 1, 1, 0, 1]}))
    return [
        ("clip-higher: r=1.5, A=+1 -> -(1+0.28)", -1.28, _one_token_loss(math.log(1.5), 1.0)),
        ("clip-low: r=0.5, A=-1 -> +(1-0.2)", 0.8, _one_token_loss(math.log(0.5), -1.0)),
        ("dual clip: r=50, A=-1 -> c=10", 10.0, _one_token_loss(math.log(50.0), -1.0)),
        ("GRPO: scores [1,1,-1,-1] -> A_0 = 1/std", 1 / (2 / math.sqrt(3) + 1e-6), adv[0, 0].item()),
        ("token-mean over 4 tokens", 10 / 4, aggregate_loss(loss, mask, "token-mean").item()),
        ("seq-mean-token-mean", (2 + 4) / 2, aggregate_loss(loss, mask, "seq-mean-token-mean").item()),
        (
            "k3 KL at lp=-1, ref=-2",
            math.exp(-1) + 1 - 1,
            kl_penalty(torch.tensor(-1.0), torch.tensor(-2.0), "k3").item(),
        ),
        ("overlong: L=18, max 20, buffer 4", -0.5, overlong_penalty(torch.tensor([18]), 20, 4, 1.0).item()),
        ("dynamic sampling keeps 2 of 3 groups", 2.0, float(acc.held_groups)),
        (
            "math_dapo: 'Answer: \\boxed{\\frac12}' vs 1/2",
            1.0,
            compute_score("so ... Answer: $\\boxed{\\frac12}$", "\\frac{1}{2}")["score"],
        ),
        ("math_dapo: wrong answer", -1.0, compute_score("Answer: 7", "8")["score"]),
    ]


def run_selfcheck() -> bool:
    table = Table(title="nemo-dapo algorithm self-check (docs/algorithm.md §1-6, 10)")
    for column in ("check", "expected", "computed", "ok"):
        table.add_column(column)
    all_ok = True
    for what, expected, computed in _checks():
        ok = math.isclose(expected, computed, rel_tol=1e-5, abs_tol=1e-6)
        all_ok &= ok
        table.add_row(what, f"{expected:.6g}", f"{computed:.6g}", "[green]yes[/green]" if ok else "[red]NO[/red]")
    Console().print(table)
    return all_ok
