"""One run of TRL's GRPOTrainer set to a nemo-dapo config's algorithm (a reference for
``bench/learning_reference.py``); run with ``.venv-trl/bin/python`` (``bench/trl_env.sh``).

    .venv-trl/bin/python bench/_trl_reference.py --config smollm2_cpu [key=value ...]

From the config: the model folder and prompts (the same chat messages, TRL applies the model's
chat template), the scorer (nemo-dapo's math_dapo: +1 / -1) and, when on, the soft overlong
punishment (nemo-dapo's formula) as TRL reward functions; group-normalised advantages, the
token-level loss (``loss_type="dapo"``), clip 0.2 / 0.28, no KL, ``rollout.n`` samples per prompt,
``data.train_batch_size`` prompts per generation, one optimizer step per ``actor.ppo_mini_batch_size``
prompts, AdamW with the config's learning rate, betas, weight decay, warm-up and gradient clip,
bf16 autocast when ``model.dtype`` resolves to bf16. Writes ``trainer.output_dir/metrics.jsonl``
(one row per optimizer step, under nemo-dapo's metric names) and the final weights in
``trainer.output_dir/final``. Differences that remain: TRL's own prompt order and sampler, HF
``generate``, HF's warm-up shape (0 at the first step, ours starts at lr / warmup), no dual clip.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

TRL_TO_OURS = {
    "reward": "critic/score/mean",
    "completions/mean_length": "response_length/mean",
    "grad_norm": "actor/grad_norm",
    "entropy": "actor/entropy",
    "clip_ratio/region_mean": "actor/pg_clipfrac",
    "learning_rate": "actor/lr",
}


def reward_functions(cfg):
    from nemo_dapo.algo.shaping import overlong_penalty
    from nemo_dapo.reward.math_dapo import compute_score

    def score(completions, ground_truth, **_):
        # conversational prompts: each completion is the assistant's message list
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(compute_score(text, truth)["score"]) for text, truth in zip(texts, ground_truth)]

    functions = [score]
    buffer = cfg.reward.overlong_buffer
    if buffer.enable:

        def overlong(completion_ids, **_):
            lengths = torch.tensor([len(ids) for ids in completion_ids])
            penalty = overlong_penalty(lengths, cfg.data.max_response_length, buffer.len, buffer.penalty_factor)
            return penalty.tolist()

        functions.append(overlong)
    return functions


def trl_config(cfg, output: Path):
    """TRL's GRPOConfig set to the algorithm of ``cfg`` (see the module docstring)."""
    from trl import GRPOConfig

    n, prompts = cfg.rollout.n, cfg.data.train_batch_size
    bf16 = cfg.model.dtype == "bfloat16"
    optim = cfg.actor.optim
    return GRPOConfig(
        output_dir=str(output / "trl"),
        seed=cfg.trainer.seed,
        data_seed=cfg.data.seed,
        learning_rate=optim.lr,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_epsilon=optim.eps,
        weight_decay=optim.weight_decay,
        warmup_steps=optim.warmup_steps,
        lr_scheduler_type="constant_with_warmup",
        max_grad_norm=optim.clip_grad,
        per_device_train_batch_size=cfg.actor.ppo_mini_batch_size * n,
        gradient_accumulation_steps=1,
        generation_batch_size=prompts * n,
        num_generations=n,
        num_iterations=cfg.actor.ppo_epochs,
        max_steps=cfg.trainer.total_training_steps * (prompts // cfg.actor.ppo_mini_batch_size),
        max_completion_length=cfg.data.max_response_length,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        loss_type="dapo",
        epsilon=cfg.actor.clip_ratio_low,
        epsilon_high=cfg.actor.clip_ratio_high,
        beta=0.0,
        scale_rewards="group",
        mask_truncated_completions=cfg.algorithm.overlong_filtering,
        bf16=bf16,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        remove_unused_columns=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2_cpu")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from nemo_dapo.config import load_config
    from nemo_dapo.data.records import read_records
    from nemo_dapo.trainer.assembly import resolve_paths

    cfg = resolve_paths(load_config(args.config, args.overrides))
    output = Path(cfg.trainer.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    records = read_records(cfg.data.train_files)
    data = Dataset.from_list([{"prompt": r.messages, "ground_truth": r.ground_truth} for r in records])
    config = trl_config(cfg, output)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)

    class Record(TrainerCallback):
        def on_log(self, _args, state, _control, logs=None, **_):
            if logs and "reward" in logs:
                row = {
                    "step": state.global_step,
                    **{ours: logs[key] for key, ours in TRL_TO_OURS.items() if key in logs},
                }
                with open(output / "metrics.jsonl", "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(row) + "\n")

    (output / "metrics.jsonl").unlink(missing_ok=True)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_functions(cfg),
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[Record()],
    )
    trainer.train()
    trainer.model.save_pretrained(output / "final")
    tokenizer.save_pretrained(output / "final")


if __name__ == "__main__":
    main()
