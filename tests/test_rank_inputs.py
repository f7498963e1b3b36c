"""What crosses between processes, and no more: one training rank is sent its share of the batch,
compact and exactly as cut for it; a weight bucket carries each tensor's own bytes once."""

import pickle

import pytest
import torch

from nemo_dapo.policy.inputs import mini_batches_per_rank, shard, worker_inputs
from nemo_dapo.rollout.base import Generation
from nemo_dapo.trainer.batching import build_rollout_batch

# bytes per element on the way: token ids and positions as int32, masks as bool, floats as they are
WIRE_BYTES = {"input_ids": 4, "position_ids": 4, "responses": 4, "attention_mask": 1, "loss_mask": 1}
OVERHEAD = 4096  # pickle framing per rank's rows: ~300 bytes per tensor (names, dtypes, shapes)


def rollout_batch(prompts: int = 16, n: int = 4, seed: int = 0):
    """A scored batch as the trainer builds it: prompts and responses of random lengths (padding
    included), a vocabulary of 150k ids, old log-probs and advantages."""
    gen = torch.Generator().manual_seed(seed)
    ids, generations = [], []
    for _ in range(prompts):
        ids.append(torch.randint(0, 150_000, (int(torch.randint(5, 40, (1,), generator=gen)),), generator=gen).tolist())
        generation = Generation()
        for _ in range(n):
            length = int(torch.randint(1, 200, (1,), generator=gen))
            generation.token_ids.append(torch.randint(0, 150_000, (length,), generator=gen).tolist())
            generation.log_probs.append((-torch.rand(length, generator=gen)).tolist())
            generation.finish_reasons.append("stop")
        generations.append(generation)
    batch = build_rollout_batch(ids, generations, {}, "s0", pad_token_id=151_643, policy_version=0)
    batch.add("old_log_probs", batch["rollout_log_probs"].clone())
    batch.add("advantages", torch.randn(len(batch), generator=gen)[:, None] * batch["response_mask"])
    return batch


def wire_bytes(rows: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * WIRE_BYTES.get(name, t.element_size()) for name, t in rows.items())


@pytest.mark.parametrize("dp", [2, 4])
def test_each_rank_is_sent_its_share_only_and_gets_the_tensors_cut_for_it(dp):
    data = worker_inputs(rollout_batch())
    whole = sum(t.numel() * t.element_size() for t in data.values())
    for part in shard(data, dp):
        sent = pickle.dumps(part)
        # its own rows, compact: about 1/dp of the batch and under half of its int64 size
        assert len(sent) <= wire_bytes(part) + OVERHEAD < whole / dp / 2 + OVERHEAD
        arrived = pickle.loads(sent)
        assert arrived.keys() == part.keys()
        for name, tensor in part.items():
            assert arrived[name].dtype == tensor.dtype and torch.equal(arrived[name], tensor), name


@pytest.mark.parametrize("dp", [2, 4])
def test_no_padding_crosses_the_wire(dp):
    """One long response among short ones pads every row of the batch to its width; a rank is sent
    its rows' real elements only (two lengths per row stand for the attention mask), and they
    arrive padded again, exactly as cut. A field whose padding is not zeros travels whole."""
    batch = rollout_batch(prompts=8)
    batch.add("is_weights", torch.ones_like(batch["old_log_probs"]))  # ones in the padding too
    data = worker_inputs(batch)
    prompt = data["input_ids"].shape[1] - data["responses"].shape[1]
    for part in shard(data, dp):
        real = part["attention_mask"].bool()
        tokens, generated = int(real.sum()), int(real[:, prompt:].sum())
        rows = real.shape[0]
        real_bytes = tokens * (4 + 4) + generated * (4 + 1 + 4 + 4 + 4)  # ids, positions; responses, masks, floats
        whole = part["is_weights"].numel() * 4
        sent = pickle.dumps(part)
        assert len(sent) <= real_bytes + rows * 2 * 4 + whole + OVERHEAD, (len(sent), real_bytes)
        assert len(sent) < wire_bytes(part) - whole  # the padded tensors alone would be more
        arrived = pickle.loads(sent)
        assert list(arrived) == list(part)
        for name, tensor in part.items():
            assert arrived[name].dtype == tensor.dtype and torch.equal(arrived[name], tensor), name


def test_an_update_sends_each_rank_its_mini_batch_rows_only():
    batch = rollout_batch()
    mini_batches = mini_batches_per_rank(batch, prompts_per_mini_batch=4, world_size=4, ppo_epochs=1)
    for rank_part in mini_batches:
        sent = pickle.dumps(rank_part)
        assert len(sent) <= sum(wire_bytes(mb.data) for mb in rank_part) + OVERHEAD * len(rank_part)
        for before, after in zip(rank_part, pickle.loads(sent)):
            assert after.global_token_count == before.global_token_count
            assert all(torch.equal(after.data[k], v) and after.data[k].dtype == v.dtype for k, v in before.data.items())


def test_values_that_do_not_fit_travel_as_they_are():
    wide = torch.tensor([[0, 2**40], [-(2**33), 7]])
    signed = torch.tensor([[-1, 0], [1, 0]])
    arrived = pickle.loads(pickle.dumps(shard({"wide": wide, "signed": signed}, 2)[1]))
    assert torch.equal(arrived["wide"], wide[1:]) and torch.equal(arrived["signed"], signed[1:])
    assert arrived["signed"].dtype == torch.int64


def test_a_weight_bucket_carries_each_tensor_once(tiny_model_dir):
    """Megatron's fused fc1 and QKV become HF's gate/up and q/k/v as views of the fused tensor:
    each would pickle the whole fused storage (fc1 twice, QKV three times per layer)."""
    import os

    from safetensors.torch import load_file
    from transformers import AutoConfig

    from nemo_dapo.policy.megatron import convert
    from nemo_dapo.policy.weights import bucketize

    hf = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    shape = convert.model_shape(AutoConfig.from_pretrained(tiny_model_dir))
    exported = convert.megatron_to_hf(convert.hf_to_megatron(hf, shape), shape)
    own_bytes = sum(t.numel() * t.element_size() for t in exported.values())
    buckets = list(bucketize(exported.items(), 1 << 20))
    sent = sum(len(pickle.dumps(bucket)) for bucket in buckets)
    assert own_bytes <= sent <= own_bytes + OVERHEAD * len(buckets) + 600 * len(exported)
    assert all(torch.equal(t, exported[name]) for bucket in buckets for name, t in bucket)
