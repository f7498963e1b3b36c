"""Is our loss path TRL's? One batch, one mini-batch, the gradient each computes from it.

    .venv-trl/bin/python bench/loss_vs_trl.py [--config smollm2_cpu] [--seed 1] [--prompts 8] [key=value ...]

Generates one step's batch from the preset's model (``--prompts`` prompts x ``rollout.n`` samples,
HF ``generate`` at the preset's temperature), scores it with our reward, and computes the
gradient of the first mini-batch's loss (its first optimizer step, ratio 1) twice:

- ours: the torch policy worker's backward (shared-prompt forward, chunked log-probs, the actor
  loss with mini-batch-wide token counts, ``model.dtype``'s autocast);
- TRL's: ``GRPOTrainer._compute_loss`` on the same rows, with TRL's own group-normalised
  advantages, built from the same settings as ``bench/_trl_reference.py``.

Prints the advantages' largest difference, the per-token log-prob gap of the two forwards, the
cosine between the two gradients (over all parameters, and the lowest per tensor) and the ratio
of their norms against the one the two normalisers predict (TRL divides the mini-batch's summed
token losses by half the generation batch's tokens, we by the mini-batch's). Writes
``outputs/bench_loss_vs_trl/result.json``. Needs ``.venv-trl`` (``bench/trl_env.sh``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from _single_process import HFGenerate
from _trl_reference import reward_functions, trl_config

OUT = Path("outputs/bench_loss_vs_trl")


def our_batch(cfg, worker, data, reward, prompts: int, seed: int):
    """One generation round as the trainer builds it: items, HF generations, rewards, advantages."""
    from nemo_dapo.algo.kl import build_kl_controller
    from nemo_dapo.rollout.base import SamplingSettings
    from nemo_dapo.trainer.batching import batch_from_items
    from nemo_dapo.trainer.stages import add_advantages, add_rewards, score_batch

    torch.manual_seed(seed)
    items = [data.train[i] for i in torch.randperm(len(data.train))[:prompts].tolist()]
    tokenizer = data.tokenizer
    rollout = HFGenerate(worker.model, tokenizer.pad_token_id, tokenizer.eos_token_id, worker.compute_dtype)
    sampling = SamplingSettings(
        n=cfg.rollout.n,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_tokens=cfg.data.max_response_length,
    )
    batch = batch_from_items(
        items, rollout.generate([it["prompt_ids"] for it in items], sampling), "s0", tokenizer.pad_token_id, 0
    )
    score_batch(batch, reward, tokenizer)
    add_rewards(batch, cfg, build_kl_controller("fixed", 0.0))
    add_advantages(batch, cfg)
    return batch


def gradient(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def our_gradient(cfg, worker, batch) -> tuple[dict, list[int]]:
    from nemo_dapo.algo.correction import correction_settings
    from nemo_dapo.policy.inputs import mini_batch_rows, mini_batches_per_rank, worker_inputs
    from nemo_dapo.trainer.settings import loss_settings

    batch.add("old_log_probs", worker.compute_log_prob(worker_inputs(batch))["log_probs"])
    first = mini_batches_per_rank(batch, cfg.actor.ppo_mini_batch_size, 1, 1)[0][0]
    worker.model.train()
    settings = loss_settings(cfg, correction_settings(cfg.algorithm.rollout_correction))
    worker._accumulate_gradients(first, settings, None, None)
    return gradient(worker.model), mini_batch_rows(batch, cfg.actor.ppo_mini_batch_size)[0].tolist()


def trl_advantages(scores: torch.Tensor, n: int) -> torch.Tensor:
    """TRL's ``scale_rewards="group"``: (r - group mean) / (group std + 1e-4), torch's unbiased std."""
    groups = scores.view(-1, n)
    mean, std = groups.mean(dim=1, keepdim=True), groups.std(dim=1, keepdim=True)
    return ((groups - mean) / (std + 1e-4)).view(-1)


def trl_gradient(cfg, batch, rows: list[int], data) -> tuple[dict, torch.Tensor, torch.Tensor]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    from nemo_dapo.data.records import read_records

    records = read_records(cfg.data.train_files)[:16]  # TRL's trainer wants a dataset; none is drawn from
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_functions(cfg),
        args=trl_config(cfg, OUT),
        train_dataset=Dataset.from_list([{"prompt": r.messages, "ground_truth": r.ground_truth} for r in records]),
        processing_class=data.tokenizer,
    )
    advantages = trl_advantages(batch["token_level_rewards"].sum(dim=1).float(), cfg.rollout.n)
    inputs = {
        "prompt_ids": batch["prompts"][rows],
        "prompt_mask": batch["prompt_mask"][rows],
        "completion_ids": batch["responses"][rows],
        "completion_mask": batch["response_mask"][rows],
        "advantages": advantages[rows],
        "num_items_in_batch": batch["response_mask"].sum(),
    }
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer.train sets before a step
    low_precision = cfg.model.dtype == "bfloat16"
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low_precision):
        trainer._compute_loss(trainer.model, inputs).backward()
        with torch.no_grad():
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            log_probs = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, mask, inputs["completion_ids"].shape[1]
            )[0]
    return gradient(trainer.model), advantages, log_probs


def compare(ours: dict, theirs: dict) -> dict:
    names = sorted(ours.keys() & theirs.keys())
    flat_ours = torch.cat([ours[n].flatten().double() for n in names])
    flat_theirs = torch.cat([theirs[n].flatten().double() for n in names])
    per_tensor = {
        n: float(torch.nn.functional.cosine_similarity(ours[n].flatten().double(), theirs[n].flatten().double(), 0))
        for n in names
        if ours[n].abs().sum() > 0
    }
    worst = min(per_tensor, key=per_tensor.get)
    return {
        "tensors": len(names),
        "only_ours": sorted(ours.keys() - theirs.keys()),
        "only_trl": sorted(theirs.keys() - ours.keys()),
        "cosine": float(torch.nn.functional.cosine_similarity(flat_ours, flat_theirs, 0)),
        "lowest_tensor_cosine": [worst, per_tensor[worst]],
        "norm_ours": float(flat_ours.norm()),
        "norm_trl": float(flat_theirs.norm()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2_cpu")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from nemo_dapo.config import load_config
    from nemo_dapo.config.topology import total_optimizer_steps
    from nemo_dapo.policy.torch_worker import TorchPolicyWorker
    from nemo_dapo.trainer.assembly import load_data, resolve_paths, reward_manager
    from nemo_dapo.trainer.settings import policy_settings

    cfg = resolve_paths(load_config(args.config, args.overrides))
    data = load_data(cfg)
    settings = policy_settings(cfg, total_optimizer_steps(cfg, len(data.train)))
    worker = TorchPolicyWorker(0, 1, "", settings, shared_prompt_forward=cfg.actor.shared_prompt_forward)
    saved = OUT / f"batch_{args.config}_seed{args.seed}_prompts{args.prompts}.pt"  # generation is the slow part
    if saved.exists():
        batch = torch.load(saved, weights_only=False)  # written by this script
    else:
        with reward_manager(cfg) as reward:
            batch = our_batch(cfg, worker, data, reward, args.prompts, args.seed)
        OUT.mkdir(parents=True, exist_ok=True)
        torch.save(batch, saved)
    ours, rows = our_gradient(cfg, worker, batch)
    theirs, advantages, trl_log_probs = trl_gradient(cfg, batch, rows, data)
    mask = batch["response_mask"][rows].bool()
    mini_tokens, all_tokens = float(mask.sum()), float(batch["response_mask"].sum())
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "seed": args.seed,
        "dtype": cfg.model.dtype,
        "samples": len(batch),
        "correct": int(sum(batch["acc"])),
        "mini_batch_rows": len(rows),
        "advantage_max_diff": float((batch["advantages"][:, 0] - advantages).abs().max()),
        "log_prob_gap_max": float((batch["old_log_probs"][rows] - trl_log_probs)[mask].abs().max()),
        "log_prob_gap_mean": float((batch["old_log_probs"][rows] - trl_log_probs)[mask].abs().mean()),
        "expected_norm_ratio_trl_to_ours": mini_tokens / (all_tokens / 2),
        **compare(ours, theirs),
    }
    result["norm_ratio_trl_to_ours"] = result["norm_trl"] / result["norm_ours"]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
