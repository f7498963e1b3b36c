"""The single-process reference of the benches (bench/_single_process.py: our trainer, loss and
optimizer in one process, HF ``generate``) trains two steps of the tiny preset and checkpoints, so
the reference a learning or speed comparison rests on cannot break unnoticed when the trainer's
interfaces change."""

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_the_single_process_reference_trains_and_checkpoints(workdir):
    sys.path.insert(0, str(BENCH))
    try:
        from _single_process import run_single_process
    finally:
        sys.path.remove(str(BENCH))
    from nemo_dapo.config import load_config

    overrides = [
        "trainer.total_training_steps=2",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.save_freq=1",
        "algorithm.filter_groups.enable=false",
        "data.gen_batch_size=4",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2",
        f"trainer.output_dir={workdir / 'run'}",
    ]
    summary = run_single_process(load_config("tiny_cpu", overrides), save_to=workdir / "final")
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "actor/pg_loss" in row] == [1, 2]
    assert (workdir / "run" / "checkpoints" / "global_step_2").is_dir()
    assert (workdir / "final" / "config.json").is_file()
