"""One policy worker's training pass, timed: the shared part of ``policy_passes.py`` and
``microbatch_padding.py``.

A forward + backward over given micro-batches with the log-probs summed as the loss: the cost of
the update's model work without the loss terms or the optimizer step, which both benches hold fixed.
"""

from __future__ import annotations

import time

import torch

from nemo_dapo.config.schema_actor import OptimConfig
from nemo_dapo.model.builtin import resolve_builtin
from nemo_dapo.policy.base import WorkerSettings
from nemo_dapo.policy.torch_worker import TorchPolicyWorker


def policy_worker(model_name: str, dtype: str, max_token_len: int = 1024) -> TorchPolicyWorker:
    """A single-rank worker on a built-in model, with eager attention as the CPU preset runs it."""
    path = resolve_builtin(model_name, [], [])[0]
    return TorchPolicyWorker(
        0,
        1,
        "",
        WorkerSettings(path, OptimConfig(), dtype=dtype, max_token_len=max_token_len),
        attn_implementation="eager",
    )


def forward_backward_s(worker: TorchPolicyWorker, micros: list[dict[str, torch.Tensor]]) -> float:
    """Seconds of one forward + backward over ``micros`` in one precision context; gradients dropped."""
    worker.model.train()
    start = time.perf_counter()
    with worker._compute_precision():
        for micro in micros:
            worker._forward(micro, 1.0)[0].sum().backward()
    worker.model.zero_grad(set_to_none=True)
    return time.perf_counter() - start
