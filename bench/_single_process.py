"""The baseline of ``step_breakdown.py``: the same trainer loop in one process, no Ray, no vLLM.

What a user of a single-process library (TRL-style) would run: one Hugging Face model that
generates with ``model.generate`` and trains in place. It drives :class:`DAPOTrainer` itself, so
the data order, rewards, dynamic sampling, advantages, loss, micro-batching and optimizer are
ours line for line; only generation (HF instead of vLLM), orchestration (direct calls instead
of Ray actors) and the weight sync (none: one model) differ. The ratio of the two step times is
then the cost or gain of the engine and the orchestration, measured rather than guessed.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch

from nemo_dapo.algo.metric_names import combine_steps
from nemo_dapo.digest import digest_files
from nemo_dapo.policy.base import UpdateResult
from nemo_dapo.policy.inputs import mini_batches_per_rank, worker_inputs
from nemo_dapo.rollout.base import Generation, SamplingSettings


class InProcessPolicy:
    """The PolicyGroup calls the trainer makes, on one TorchPolicyWorker in this process."""

    world_size = 1
    digest_files = staticmethod(digest_files)  # a checkpoint's file digests: one process hashes them all

    def __init__(self, worker) -> None:
        self.worker = worker

    def compute_log_prob(self, batch, temperature: float) -> dict[str, torch.Tensor]:
        width = batch["responses"].shape[1]
        out = self.worker.compute_log_prob(worker_inputs(batch), temperature)
        return {key: value[:, :width] for key, value in out.items()}

    def update(
        self,
        batch,
        settings,
        prompts_per_mini_batch: int,
        ppo_epochs: int,
        correction=None,
        first_old_from_forward: bool = False,
    ) -> UpdateResult:
        minis = mini_batches_per_rank(batch, prompts_per_mini_batch, 1, ppo_epochs, first_old_from_forward)[0]
        result = self.worker.update(minis, settings, correction)
        return UpdateResult(combine_steps(result.metrics), result.first_forward)

    def export_weights(self, bucket_bytes: int) -> Iterator:
        return iter(())  # generation uses the trained model itself

    def save(self, path: str, asynchronous: bool = False) -> None:
        self.worker.save(path)

    def finish_save(self, blocking: bool = True) -> bool:
        return True

    def load(self, path: str) -> None:
        self.worker.load(path)


class HFGenerate:
    """The RolloutGroup calls the trainer makes, answered by ``model.generate`` on the policy's model."""

    restarts = 0  # one model in this process: no engine to replace

    def in_service(self) -> list[int]:
        return [0]

    def restore_lost(self) -> list[int]:
        return []  # no node to lose

    def __init__(self, model, pad_id: int, eos_id: int, dtype: torch.dtype) -> None:
        """``dtype``: the run's compute dtype. Below fp32, generation runs on a copy of the policy in
        that dtype, refreshed at every weight sync, as a single-process user would generate (autocast
        over fp32 weights would cast every weight at every decoding step)."""
        self.model, self.pad_id, self.eos_id = model, pad_id, eos_id
        self.generator = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingSettings, stop=None) -> list[Generation]:
        """``stop`` is not asked: the reference generates in the trainer's own process, to the end."""
        self.generator.eval()
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = self.generator.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=sampling.temperature > 0,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=0,
            max_new_tokens=sampling.max_tokens,
            num_return_sequences=sampling.n,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
            use_cache=True,
            return_dict_in_generate=True,
            output_scores=True,
        )
        tokens = out.sequences[:, width:]
        scores = torch.stack(out.scores, dim=1).float().log_softmax(-1)  # the processed distribution
        picked = scores.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        generations = [Generation() for _ in prompts]
        for row in range(tokens.shape[0]):
            ended = (tokens[row] == self.eos_id).nonzero()
            length = int(ended[0]) + 1 if len(ended) else tokens.shape[1]
            generation = generations[row // sampling.n]
            generation.token_ids.append(tokens[row, :length].tolist())
            generation.log_probs.append(picked[row, :length].tolist())
            generation.finish_reasons.append("stop" if len(ended) else "length")
        return generations

    def set_weight_source(self, current_weights) -> None:
        pass

    def sleep(self) -> None:
        pass

    def wake_up(self, tags=None) -> None:
        pass

    @property
    def store(self) -> HFGenerate:
        """The object-store path of the rollout group: here, the model copied in place (:meth:`send`)."""
        return self

    def send(self, bucket_refs, version: int, ranks=None) -> None:
        for _ in bucket_refs:
            pass
        if self.generator is not self.model:
            self.generator.load_state_dict(self.model.state_dict())


def run_single_process(cfg, save_to=None) -> dict:
    """``nemo-dapo train`` with the single-process policy and HF generation; returns the summary.
    ``save_to``: a folder for the final weights (Hugging Face format)."""
    from nemo_dapo.config.topology import total_optimizer_steps
    from nemo_dapo.policy.torch_worker import TorchPolicyWorker
    from nemo_dapo.trainer.assembly import load_data, resolve_paths, reward_manager
    from nemo_dapo.trainer.fit import DAPOTrainer
    from nemo_dapo.trainer.settings import policy_settings

    cfg = resolve_paths(cfg)
    cfg.rollout.weight_transfer = "object_store"  # one process: the trainer hands HFGenerate its buckets
    data = load_data(cfg)
    worker = TorchPolicyWorker(
        0,
        1,
        "",
        policy_settings(cfg, total_optimizer_steps(cfg, len(data.train))),
        attn_implementation=cfg.actor.attn_implementation,
        shared_prompt_forward=cfg.actor.shared_prompt_forward,
    )
    with reward_manager(cfg) as reward:
        tokenizer = data.tokenizer
        rollout = HFGenerate(worker.model, tokenizer.pad_token_id, tokenizer.eos_token_id, worker.compute_dtype)
        # no held-out set: the trainer validates after its last step, and HF `generate` keeping the
        # scores of all 800 held-out samples at once took the process to 19 GiB
        trainer = DAPOTrainer(cfg, InProcessPolicy(worker), rollout, tokenizer, data.train, None, reward)
        summary = trainer.fit()
    if save_to is not None:
        worker.model.save_pretrained(save_to)
        tokenizer.save_pretrained(save_to)
    return summary
