"""In-flight prompt recovery after a crash (SPEC 8).

A checkpoint holds a snapshot of the data plane in which some prompts were still pending or
running. After a restore they are reissued: their partial trajectories are deleted first (so
nothing from before the crash mixes with the new samples), then the prompts are put again
with status ``pending``, the current ``global_steps`` and the next attempt number.
"""

from __future__ import annotations

from nemo_dapo.trainer.data_plane import DataPlane

PROMPT_FIELDS = ("prompt_ids", "ground_truth", "data_source", "prompt_index")


def reissue_inflight_prompts(plane: DataPlane | None, global_steps: int, mode: str, partition: str = "train") -> int:
    """Reissue prompts tagged pending|running; returns how many. A no-op (0) in sync mode."""
    if mode == "sync" or plane is None:
        return 0
    inflight = plane.kv_list(partition, {"is_prompt": True, "status": ["pending", "running"]})
    if not inflight.keys:
        return 0
    for key in inflight.keys:
        partial = plane.kv_list(partition, {"is_prompt": False, "prompt_id": key}).keys
        if partial:
            plane.kv_clear(partial, partition)
    fields = plane.kv_batch_get(inflight.keys, list(PROMPT_FIELDS), partition)
    plane.kv_clear(inflight.keys, partition)
    tags = [{**tag, "status": "pending", "global_steps": global_steps, "attempt": tag.get("attempt", 1) + 1}
            for tag in inflight.tags]
    plane.kv_batch_put(inflight.keys, fields, tags, partition)
    return len(inflight.keys)
