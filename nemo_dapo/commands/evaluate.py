"""``nemo-dapo eval``: sample n answers per problem with vLLM and report acc/mean@n and pass@k.

Runs the rollout worker in-process (no Ray needed) with the same scoring and metric code as
validation during training, so an offline evaluation and a training curve agree.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.cluster.ray_env import apply_loopback_env

log = logging.getLogger(__name__)


def _model_context_length(model_dir: str) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("max_position_embeddings", 32768))


def evaluate(
    model: str,
    data: list[str],
    n: int = 32,
    temperature: float = 1.0,
    top_p: float = 0.7,
    max_tokens: int = 20480,
    max_prompt_length: int = 2048,
) -> dict[str, float]:
    """Each distinct problem of ``data`` sampled ``n`` times, as validation during training does
    (:func:`~nemo_dapo.trainer.assembly.load_data`): verl's AIME files repeat every problem 32
    times for avg@32 at one sample per row, and ``n=32`` on the 30 problems is that estimate."""
    apply_loopback_env()
    from nemo_dapo.data import RLDataset
    from nemo_dapo.data.duplicates import warn_if_copies_outnumber_samples
    from nemo_dapo.model.tokenizer import load_tokenizer
    from nemo_dapo.reward.manager import RewardManager
    from nemo_dapo.rollout.base import EngineSettings, SamplingSettings
    from nemo_dapo.rollout.vllm_worker import VLLMRolloutWorker
    from nemo_dapo.trainer.batching import batch_from_items
    from nemo_dapo.trainer.stages import score_batch
    from nemo_dapo.trainer.validation import accuracy_metrics

    context = _model_context_length(model)
    prompt_budget = min(max_prompt_length, context // 2)
    response_budget = min(max_tokens, context - prompt_budget)
    if response_budget < max_tokens or prompt_budget < max_prompt_length:
        log.warning(
            "model context is %d tokens: prompts truncated (left) to %d, responses capped at %d",
            context,
            prompt_budget,
            response_budget,
        )
    tokenizer = load_tokenizer(model)
    dataset = RLDataset(data, tokenizer, max_prompt_length=prompt_budget, truncation="left", drop_duplicates=True)
    warn_if_copies_outnumber_samples(dataset.duplicates, n, "--n")
    items = [dataset[i] for i in range(len(dataset))]
    engine = VLLMRolloutWorker(0, 1, "", EngineSettings(model, max_model_len=prompt_budget + response_budget))
    generations = engine.generate(
        [it["prompt_ids"] for it in items],
        SamplingSettings(n=n, temperature=temperature, top_p=top_p, max_tokens=response_budget),
    )
    batch = batch_from_items(items, generations, "eval", tokenizer.pad_token_id, 0)
    with RewardManager("math_dapo", max_response_length=response_budget) as reward:
        score_batch(batch, reward, tokenizer)
    return accuracy_metrics(batch["acc"], batch["data_source"], batch["uid"], n, mn.EVAL_ACC)
