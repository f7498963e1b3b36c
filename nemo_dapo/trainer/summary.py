"""A run's summary.json: the held-out accuracy before and after, the steps and samples it took,
its wall time. Written when a run ends; a finished run found again on resume is left as it is."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from nemo_dapo.config import Config
from nemo_dapo.config.topology import total_training_steps
from nemo_dapo.folders import replace_file
from nemo_dapo.safe_load import load_state, refuse_unsafe_distributed_checkpoint
from nemo_dapo.trainer.checkpoint import (
    TRAINER_STATE,
    CheckpointError,
    CheckpointManager,
    refuse_mode_change,
    verify,
)
from nemo_dapo.trainer.validation import mean_val_accuracy

log = logging.getLogger(__name__)
SUMMARY = "summary.json"


def write_summary(
    output_dir: Path,
    initial_val: dict[str, float],
    last_val: dict[str, float],
    steps: int,
    generated_samples: int,
    wall_s: float,
) -> dict:
    """``last_val``: the validation of the last step's weights; the trainer writes the summary only
    once it has one (a run resumed at its last step takes it from the checkpoint, or validates first)."""
    summary = {
        "initial_val_acc": mean_val_accuracy(initial_val),
        "final_val_acc": mean_val_accuracy(last_val),
        "steps": steps,
        "generated_samples": generated_samples,
        "wall_s": wall_s,
        "initial_val": initial_val,
        "final_val": last_val,
    }
    replace_file(output_dir / SUMMARY, json.dumps(summary, indent=1))
    return summary


def completed_run(cfg: Config, dataset_size: Callable[[], int]) -> dict | None:
    """The summary of a run found complete in ``trainer.output_dir``, marked ``already_complete``
    and left as it is, with the ``checkpoint`` that holds its last step; None when the run has
    steps left (or has not begun).

    Complete: its summary is written and the checkpoint it would resume from holds the last step
    (or the spent ``trainer.total_generated_samples``). Known before Ray or a worker starts, from
    the driver alone: of that checkpoint only ``trainer_state.pt`` is read, checked against the
    manifest (the weights are not; the resumed trainer checks everything). A damaged state is
    not complete here: the trainer then falls back to an older checkpoint and says so.
    ``dataset_size`` is called only for a run counted in epochs. A checkpoint of another
    ``trainer.mode``, or a Megatron one whose loading would run code, is refused here, before
    Ray starts."""
    summary_file = Path(cfg.trainer.output_dir) / SUMMARY
    manager = CheckpointManager(Path(cfg.trainer.output_dir) / "checkpoints")
    resume = cfg.checkpoint.resume
    candidates = [path for _, path in manager.step_folders()[:1]] if resume == "auto" else [Path(resume)]
    if resume == "disable" or not candidates:
        return None
    try:
        state = load_state(verify(candidates[0], only=[TRAINER_STATE]) / TRAINER_STATE)
    except CheckpointError:
        return None
    refuse_mode_change(state, cfg.trainer.mode, candidates[0])  # said before Ray too
    if (candidates[0] / "policy" / "megatron").is_dir():  # a planted checkpoint: refused before Ray too
        refuse_unsafe_distributed_checkpoint(candidates[0] / "policy" / "megatron")
    if not summary_file.is_file():
        return None
    total_steps = total_training_steps(cfg, 0 if cfg.trainer.total_training_steps else dataset_size())
    budget = cfg.trainer.total_generated_samples
    step, generated = state["global_step"], state.get("generated_samples", 0)
    if step < total_steps and (budget is None or generated < budget):
        return None
    log.info("the run is already complete (step %d of %d): summary.json is left as it is", step, total_steps)
    return {**json.loads(summary_file.read_text()), "already_complete": True, "checkpoint": str(candidates[0])}
