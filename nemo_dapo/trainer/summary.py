"""A run's summary.json: the held-out accuracy before and after, the steps and samples it took,
its wall time. Written when a run ends; a finished run found again on resume is left as it is."""

from __future__ import annotations

import json
import logging
from pathlib import Path

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
    summary = {
        "initial_val_acc": mean_val_accuracy(initial_val),
        "final_val_acc": mean_val_accuracy(last_val),
        "steps": steps,
        "generated_samples": generated_samples,
        "wall_s": wall_s,
        "initial_val": initial_val,
        "final_val": last_val,
    }
    (output_dir / SUMMARY).write_text(json.dumps(summary, indent=1))
    return summary


def finished_summary(output_dir: Path, step: int, total_steps: int, done: bool) -> dict | None:
    """The summary of a run that was complete (``done``) with its summary written, marked
    ``already_complete`` and left as it is, like the run's export; None otherwise."""
    summary_file = output_dir / SUMMARY
    if not (done and summary_file.is_file()):
        return None
    log.info(
        "the run is already complete (step %d of %d): summary.json and hf_export are left as they are",
        step,
        total_steps,
    )
    return {**json.loads(summary_file.read_text()), "already_complete": True}
