"""The MoE router's load-balancing loss, normalised per routed token of the whole mini-batch.

With ``calculate_per_token_loss`` Megatron adds ``coeff x aux x tokens`` to the gradients per
micro-batch and expects every gradient to be divided by the mini-batch's token count at the end.
The RL loss here is already divided by its own global count, so no division follows; instead the
coefficient is divided, for one optimizer step, by the tokens the router sees in every
micro-batch of every data-parallel rank: the same update whatever the DP / EP layout.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from nemo_dapo.algo import metric_names as mn

TRACKED = "load_balancing_loss"  # megatron-core's tracker name for the switch aux loss


@contextlib.contextmanager
def per_routed_token(config, routed_here: int, device: torch.device):
    """Within the block, ``config.moe_aux_loss_coeff`` is divided by the mini-batch's routed tokens
    (collective over the data-parallel group; nothing happens with the loss off)."""
    from megatron.core import parallel_state

    coeff = config.moe_aux_loss_coeff
    if not coeff:
        yield
        return
    routed = torch.tensor(float(routed_here), device=device)
    dist.all_reduce(routed, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    config.moe_aux_loss_coeff = coeff / routed.item()
    try:
        yield
    finally:
        config.moe_aux_loss_coeff = coeff


def load_balancing_metric(config, micro_batches: int) -> dict[str, list[float]]:
    """The step's load-balancing loss (without its coefficient), mean over MoE layers and
    micro-batches, then over data-parallel ranks; collective over PP and DP. Clears the tracker."""
    from megatron.core.transformer.moe import moe_utils

    if not config.moe_aux_loss_coeff:
        return {}
    moe_utils.reduce_aux_losses_tracker_across_ranks([TRACKED])
    total = moe_utils.get_moe_layer_wise_logging_tracker()[TRACKED]["values"].sum().item()
    moe_utils.clear_aux_losses_tracker()  # zeroes the values in place
    return {mn.MOE_LOAD_BALANCING_LOSS.name: [total / (micro_batches * config.num_layers)]}
