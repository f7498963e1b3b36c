"""Each distinct prompt through the decoder once (actor.shared_prompt_forward): the same log-probs,
entropy, loss, gradients and weights as every row whole, on a dense, a MoE and the real model."""

import pytest
import torch

from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.config import load_config
from nemo_dapo.errors import ConfigError
from nemo_dapo.policy.base import LossSettings, WorkerSettings
from nemo_dapo.policy.inputs import mini_batches_per_rank, worker_inputs
from nemo_dapo.policy.microbatch import MicroBatch, shares_prompts, trim_padding
from nemo_dapo.policy.shared_prompt import distinct_prompts

PROMPT_LENGTHS = (5, 3, 5)  # left-padded to 5; three groups of 3 samples
RESPONSE_LENGTHS = (6, 2, 4, 1, 6, 3, 5, 5, 2)


def grouped_batch(vocab: int = 494) -> RolloutBatch:
    """3 prompts x 3 samples with responses of different lengths."""
    gen = torch.Generator().manual_seed(0)
    width, rows = max(PROMPT_LENGTHS), len(RESPONSE_LENGTHS)
    prompts = torch.zeros(rows, width, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompts)
    for group, length in enumerate(PROMPT_LENGTHS):
        tokens = torch.randint(3, vocab, (length,), generator=gen)
        prompts[3 * group : 3 * group + 3, width - length :] = tokens
        prompt_mask[3 * group : 3 * group + 3, width - length :] = 1
    response_mask = (torch.arange(6)[None, :] < torch.tensor(RESPONSE_LENGTHS)[:, None]).long()
    responses = torch.randint(3, vocab, (rows, 6), generator=gen) * response_mask
    advantages = torch.linspace(-1.5, 1.5, rows)[:, None] * response_mask
    fields = {"prompts": prompts, "prompt_mask": prompt_mask, "responses": responses, "response_mask": response_mask}
    fields["loss_mask"] = response_mask.clone()
    uids = [str(row // 3) for row in range(rows)]
    return RolloutBatch({**fields, "advantages": advantages}, {"uid": uids, "finish_reason": ["stop"] * rows})


def trained(model_dir, shared: bool, max_token_len: int = 1000) -> dict:
    """A fresh worker's log-probs, then one update on them as the old ones."""
    from nemo_dapo.policy.torch_worker import TorchPolicyWorker
    from tests.batches import exported, optim_settings

    worker = TorchPolicyWorker(
        0,
        1,
        "",
        WorkerSettings(str(model_dir), optim_settings(), max_token_len=max_token_len),
        shared_prompt_forward=shared,
    )
    batch = grouped_batch(worker.model.config.vocab_size)
    scored = worker.compute_log_prob(worker_inputs(batch))
    batch.add("old_log_probs", scored["log_probs"])
    result = worker.update(mini_batches_per_rank(batch, 3, 1, 1)[0], LossSettings(entropy_coeff=0.01))
    return {"scored": scored, "metrics": result.metrics, "weights": exported(worker)}


def assert_same_training(whole: dict, shared: dict, tolerance: float, compare_weights: bool = True) -> None:
    mask = grouped_batch()["response_mask"].bool()
    for key in ("log_probs", "entropy"):
        assert shared["scored"][key][mask].abs().min() > 0  # every response token scored
        gap = (shared["scored"][key] - whole["scored"][key]).abs().max().item()
        assert gap < tolerance, (key, gap)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert shared["metrics"][key] == pytest.approx(whole["metrics"][key], rel=tolerance, abs=tolerance), key
    if compare_weights:
        moved = max((shared["weights"][k] - whole["weights"][k]).abs().max().item() for k in whole["weights"])
        assert moved < 1e-4  # Adam's first step is ~lr * g / |g|: rounding moves it a little


@pytest.mark.parametrize("max_token_len", [1000, 40], ids=["one-micro-batch", "groups-split-across-micro-batches"])
def test_sharing_prompts_trains_as_every_row_whole(tiny_model_dir, max_token_len):
    assert_same_training(
        trained(tiny_model_dir, False, max_token_len), trained(tiny_model_dir, True, max_token_len), 1e-5
    )


def test_a_moe_model_shares_prompts_alike(moe_dir):
    assert_same_training(trained(moe_dir, False), trained(moe_dir, True), 1e-5)


def gradients(model_dir, shared: bool) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the summed response log-probs of the grouped batch."""
    from nemo_dapo.config.schema_actor import OptimConfig
    from nemo_dapo.policy.torch_worker import TorchPolicyWorker

    worker = TorchPolicyWorker(0, 1, "", WorkerSettings(str(model_dir), OptimConfig()), shared_prompt_forward=shared)
    data = worker_inputs(grouped_batch(worker.model.config.vocab_size))
    micro = trim_padding(data, list(range(data["input_ids"].shape[0])))
    (worker._forward(micro, 1.0)[0] * micro["loss_mask"]).sum().backward()
    return {name: param.grad for name, param in worker.model.named_parameters() if param.grad is not None}


@pytest.mark.slow
def test_the_real_model_shares_prompts_alike(smollm2_dir):
    """SmolLM2: grouped-query attention (9 / 3 heads), tied embeddings, Llama's rotary positions.
    Its gradients are compared directly: Adam's first step moves a weight by about lr x sign(g),
    and among 135M gradients some are near zero, where float rounding alone flips the sign."""
    assert_same_training(trained(smollm2_dir, False), trained(smollm2_dir, True), 1e-4, compare_weights=False)
    whole, shared = gradients(smollm2_dir, False), gradients(smollm2_dir, True)
    assert whole.keys() == shared.keys() and len(whole) == 272
    for name, grad in whole.items():
        assert (shared[name] - grad).abs().max() <= 1e-4 * grad.abs().max() + 1e-9, name


def test_only_identical_prompts_and_padding_are_shared():
    micro = trim_padding(worker_inputs(grouped_batch()), list(range(9)))
    first, inverse = distinct_prompts(micro)
    assert inverse.tolist() == [inverse[0]] * 3 + [inverse[3]] * 3 + [inverse[6]] * 3
    assert sorted(first.tolist()) == [0, 3, 6]  # each distinct prompt's first row
    assert all(inverse[row] == inverse[first[inverse[row]]] for row in range(9))
    moved = MicroBatch({**micro.tensors, "attention_mask": micro["attention_mask"].clone()}, micro.rows)
    moved["attention_mask"][1, 0] = 0  # the same tokens with different padding: another prompt
    assert distinct_prompts(moved)[0].shape[0] == 4
    rows = [0, 3, 6]  # one row per prompt: nothing to share
    assert distinct_prompts(trim_padding(worker_inputs(grouped_batch()), rows)) is None
    assert shares_prompts(True, routed=False) and not shares_prompts(False, routed=False)
    assert not shares_prompts(True, routed=True)  # routes per row


def test_null_means_on_for_torch_and_off_for_megatron():
    assert load_config("tiny_cpu").actor.shared_prompt_forward is True
    assert load_config("tiny_cpu", ["actor.backend=megatron"]).actor.shared_prompt_forward is False
    assert load_config("tiny_cpu", ["actor.shared_prompt_forward=false"]).actor.shared_prompt_forward is False
    with pytest.raises(ConfigError, match="actor.shared_prompt_forward.*torch backend only"):
        load_config("tiny_cpu", ["actor.backend=megatron", "actor.shared_prompt_forward=true"])
