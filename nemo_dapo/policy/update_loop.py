"""The update loop both policy workers run: one optimizer step per mini-batch, each step's
metrics combined over its micro-batches (:func:`~nemo_dapo.algo.metric_names.combine_parts`),
and, for a mini-batch whose old policy is its own first forward (``MiniBatch.old_from_forward``),
that forward's scores returned to the trainer. A worker supplies the step and where its scores
are read (the torch worker holds them; a Megatron pipeline's last stage sends them to the rest)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.policy.base import MiniBatch, UpdateResult
from nemo_dapo.policy.microbatch import RowStats, within_responses

# (mini-batch, where its forward's scores go or None) -> metric name -> one value per part
StepFn = Callable[[MiniBatch, RowStats | None], dict[str, list[float]]]
# (the scores of a mini-batch's rows, its data) -> the scores in the data's [rows, response] form
PlaceFn = Callable[[RowStats, dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def run_update(mini_batches: list[MiniBatch], step: StepFn, place: PlaceFn) -> UpdateResult:
    metrics: dict[str, list[float]] = {}
    first_forward = None
    for mini in mini_batches:
        forward = RowStats() if mini.old_from_forward else None
        for key, values in step(mini, forward).items():
            metrics.setdefault(key, []).append(mn.combine_parts(key, values))
        if forward is not None:
            first_forward = within_responses(place(forward, mini.data), mini.data)
    return UpdateResult(metrics, first_forward)
