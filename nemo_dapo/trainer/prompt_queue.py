"""The asynchronous trainer's protocol with the data plane: prompts in, finished groups out.

A prompt lives in the store under key ``q<n>`` with tags ``is_prompt``, ``status``
(:class:`PromptStatus`), ``global_steps`` and ``attempt``; its samples under
``q<n>_<k>`` with ``prompt_id``, ``policy_version`` and ``attempt``. One round: :meth:`launch`
sends up to a round of pending prompts to the engines (marking them running) without waiting,
:meth:`harvest` waits for them and stores their samples (marking them done; the prompts of an
engine that failed and was replaced go back as pending, next attempt), and
:meth:`take_finished` reads and removes every done prompt with its samples. After a restore,
:meth:`reissue_inflight` puts the prompts that were pending or running back as pending, their
partial samples deleted first, so nothing is lost and nothing counted twice (by prompt id).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from nemo_dapo.rollout.base import Generation, SamplingSettings
from nemo_dapo.trainer.batching import ITEM_FIELDS
from nemo_dapo.trainer.data_plane import DataPlane

if TYPE_CHECKING:
    from nemo_dapo.cluster.groups import GenerationRequest, RolloutGroup

PROMPT_FIELDS = ("prompt_ids", *ITEM_FIELDS)
SAMPLE_FIELDS = ("token_ids", "log_probs", "finish_reason", "routed_experts")
NO_ROUTING = torch.zeros(0, dtype=torch.int16)  # a sample without MoE routing (replay r3 off)


def sample_routing(generation: Generation) -> list[torch.Tensor]:
    """The samples' routing as the store keeps it (one dtype per field): int16 tensors."""
    if not generation.routed_experts:
        return [NO_ROUTING] * len(generation.token_ids)
    return [torch.as_tensor(r).to(torch.int16) for r in generation.routed_experts]


class PromptStatus(str, Enum):
    """Where a prompt is: waiting for an engine, being generated, or generated."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"


@dataclass
class InFlightRound:
    """Prompts the engines are generating now, and the weights they generate with."""

    keys: list[str]
    attempts: list[int]
    request: GenerationRequest  # the engines' pending generate calls
    policy_version: int


@dataclass
class FinishedPrompt:
    """A done prompt read out of the store: its fields, its samples and who generated them."""

    key: str
    attempt: int
    fields: dict[str, Any]  # PROMPT_FIELDS
    generation: Generation
    policy_version: int

    @property
    def item(self) -> dict[str, Any]:
        """The dataset item this prompt was issued from, as :func:`batch_from_items` reads it."""
        return {
            "prompt_ids": self.fields["prompt_ids"],
            **{key: self.fields[name] for name, key in ITEM_FIELDS.items()},
        }


def pending_tags(global_step: int, attempt: int) -> dict:
    """A prompt's tags while it waits for an engine (first issue or reissue)."""
    return {"is_prompt": True, "status": PromptStatus.PENDING.value, "global_steps": global_step, "attempt": attempt}


class PromptQueue:
    def __init__(self, plane: DataPlane, rollout: RolloutGroup, partition: str = "train") -> None:
        self.plane, self.rollout, self.partition = plane, rollout, partition
        self.issued = 0  # prompts put so far: the next key is q<issued>
        self.inflight: InFlightRound | None = None

    def _with_status(self, status: PromptStatus):
        return self.plane.kv_list(self.partition, {"is_prompt": True, "status": status.value})

    def issue(self, items: list[dict], global_step: int) -> None:
        """Put dataset rows as pending prompts (first attempt)."""
        keys = [f"q{self.issued + j}" for j in range(len(items))]
        self.issued += len(items)
        fields = {"prompt_ids": [item["prompt_ids"] for item in items]}
        fields |= {name: [item[key] for item in items] for name, key in ITEM_FIELDS.items()}
        self.plane.kv_batch_put(keys, fields, [pending_tags(global_step, 1) for _ in keys], self.partition)

    def has_pending(self) -> bool:
        return bool(self._with_status(PromptStatus.PENDING).keys)

    def launch(self, round_size: int, sampling: SamplingSettings, policy_version: int) -> None:
        """Send up to ``round_size`` pending prompts to the engines without waiting (no-op while a
        round is in flight)."""
        if self.inflight is not None:
            return
        pending = self._with_status(PromptStatus.PENDING)
        keys = pending.keys[:round_size]
        prompts = self.plane.kv_batch_get(keys, ["prompt_ids"], self.partition)["prompt_ids"]
        self.plane.kv_update_tags(keys, {"status": PromptStatus.RUNNING.value}, self.partition)
        self.inflight = InFlightRound(
            keys,
            [tag["attempt"] for tag in pending.tags[: len(keys)]],
            self.rollout.submit(prompts, sampling),
            policy_version,
        )

    def harvest(self, global_step: int) -> int:
        """Wait for the in-flight round and store its samples ``<prompt key>_<k>``. The prompts of
        an engine that failed (and was replaced) are reissued; returns how many."""
        if self.inflight is None:
            return 0
        round_, self.inflight = self.inflight, None
        keys, tags, lost = [], [], []
        fields: dict[str, list] = {name: [] for name in SAMPLE_FIELDS}
        generations = self.rollout.collect(round_.request, regenerate=False)
        for key, attempt, generation in zip(round_.keys, round_.attempts, generations):
            if generation is None:
                lost.append((key, attempt))
                continue
            samples = zip(
                generation.token_ids, generation.log_probs, generation.finish_reasons, sample_routing(generation)
            )
            for k, sample in enumerate(samples):
                keys.append(f"{key}_{k}")
                tags.append(
                    {
                        "is_prompt": False,
                        "prompt_id": key,
                        "status": PromptStatus.DONE.value,
                        "policy_version": round_.policy_version,
                        "attempt": attempt,
                    }
                )
                for name, value in zip(SAMPLE_FIELDS, sample):
                    fields[name].append(value)
        self.plane.kv_batch_put(keys, fields, tags, self.partition)
        lost_keys = {key for key, _ in lost}
        self.plane.kv_update_tags(
            [key for key in round_.keys if key not in lost_keys], {"status": PromptStatus.DONE.value}, self.partition
        )
        return self._reissue([key for key, _ in lost], [attempt for _, attempt in lost], global_step)

    def take_finished(self) -> list[FinishedPrompt]:
        """Read and remove every done prompt with its samples (a few store calls, not one per prompt)."""
        done = self._with_status(PromptStatus.DONE)
        samples = self.plane.kv_list(self.partition, {"is_prompt": False, "prompt_id": done.keys})
        prompt_fields = self.plane.kv_batch_get(done.keys, list(PROMPT_FIELDS), self.partition)
        values = self.plane.kv_batch_get(samples.keys, list(SAMPLE_FIELDS), self.partition)
        self.plane.kv_clear([*done.keys, *samples.keys], self.partition)
        rows: dict[str, list[int]] = {key: [] for key in done.keys}
        for row, tags in enumerate(samples.tags):
            rows[tags["prompt_id"]].append(row)
        finished = []
        for i, key in enumerate(done.keys):
            mine = rows[key]
            generation = Generation(*([values[name][r] for r in mine] for name in SAMPLE_FIELDS))
            if not any(r.numel() for r in generation.routed_experts):
                generation.routed_experts = []
            finished.append(
                FinishedPrompt(
                    key,
                    done.tags[i]["attempt"],
                    {name: prompt_fields[name][i] for name in PROMPT_FIELDS},
                    generation,
                    samples.tags[mine[0]]["policy_version"],
                )
            )
        return finished

    def reissue_inflight(self, global_step: int) -> int:
        """After a restore: prompts tagged pending or running become pending again with the next
        attempt number, their partial samples deleted first; returns how many."""
        self.inflight = None
        inflight = self.plane.kv_list(
            self.partition, {"is_prompt": True, "status": [PromptStatus.PENDING.value, PromptStatus.RUNNING.value]}
        )
        attempts = [tag.get("attempt", 1) for tag in inflight.tags]  # checkpoints from before attempts: 1
        return self._reissue(inflight.keys, attempts, global_step)

    def _reissue(self, keys: list[str], attempts: list[int], global_step: int) -> int:
        """``keys`` (now at ``attempts``) become pending again with the next attempt number, their
        partial samples deleted first; returns how many."""
        if not keys:
            return 0
        partial = self.plane.kv_list(self.partition, {"is_prompt": False, "prompt_id": keys}).keys
        if partial:
            self.plane.kv_clear(partial, self.partition)
        fields = self.plane.kv_batch_get(keys, list(PROMPT_FIELDS), self.partition)
        self.plane.kv_clear(keys, self.partition)
        tags = [pending_tags(global_step, attempt + 1) for attempt in attempts]
        self.plane.kv_batch_put(keys, fields, tags, self.partition)
        return len(keys)

    def snapshot(self) -> dict:
        """Between two driver calls no writer is active: the store's state and the key counter."""
        return {"data_plane": self.plane.snapshot(), "issued": self.issued}

    def restore(self, state: dict, global_step: int) -> int:
        """Load a :meth:`snapshot` and reissue what was in flight; returns how many were reissued."""
        self.plane.restore(state["data_plane"])
        self.issued = state["issued"]
        return self.reissue_inflight(global_step)
