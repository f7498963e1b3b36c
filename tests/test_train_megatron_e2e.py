"""End to end, on the lane beside the multi-node one (tests/lanes.py): `nemo-dapo eval` on AIME 2024,
and `nemo-dapo train` on Megatron at TP=2 with a KL term, packing and background saves, whose
checkpoint then planted with code is refused on resume. Each is a real subprocess, as a user runs it.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.train_runs import CLI, ENV, SMALL, records, train

pytestmark = pytest.mark.slow


def test_eval_on_aime_prints_acc(tiny_model_dir):
    from shared_paths import AIME_2024

    done = subprocess.run(
        [*CLI, "eval", "--model", str(tiny_model_dir), "--data", str(AIME_2024), "--n", "2", "--max-tokens", "24"],
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(": ") for line in done.stdout.splitlines() if line.startswith(("eval/", "val-aux/")))
    accuracy = float(lines["eval/math_dapo/acc/mean@2"]) if "eval/math_dapo/acc/mean@2" in lines else None
    assert accuracy is not None, done.stdout
    assert 0.0 <= accuracy <= 1.0 and "val-aux/math_dapo/pass@2" in lines


def test_megatron_tp2_run_with_a_kl_loss_packing_and_background_saves(workdir):
    """Megatron at TP=2 with a KL term: a reference group is built (frozen: weights only); the KL
    loss is zero while the actor equals it and grows once the actor has moved. Both pack their
    micro-batches (``sequence_packing`` reaches the actor and the reference from the config), and
    the checkpoints are written in the background, each committed in step order. (Learning on
    Megatron: the two-node run of tests/test_multinode.py; TP=2 updates equal the torch
    worker's: tests/test_megatron_worker.py.)"""
    pytest.importorskip("megatron.core", reason="the megatron extra is not installed")
    out = workdir / "megatron"
    done = train(
        out,
        "actor.backend=megatron",
        "actor.num_workers=2",
        "actor.megatron.tensor_model_parallel_size=2",
        "actor.use_kl_loss=true",
        "actor.kl_loss_type=low_var_kl",
        "actor.megatron.sequence_packing=true",
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
        "checkpoint.async_save=true",
        *SMALL,
        "actor.ppo_mini_batch_size=8",  # one optimizer step per trainer step
    )
    assert done.returncode == 0, done.stderr[-3000:]
    kl = [r["actor/kl_loss"] for r in records(out / "metrics.jsonl") if "actor/kl_loss" in r]
    assert len(kl) == 4 and kl[0] == pytest.approx(0.0, abs=1e-6) and kl[-1] > 1e-6, kl
    assert (out / "hf_export" / "model.safetensors").is_file()
    from nemo_dapo.trainer.checkpoint import verify

    # both background saves were committed (sealed, renamed), the last one at the end of the run
    for step in (2, 4):
        folder = verify(out / "checkpoints" / f"global_step_{step}")
        assert (folder / "policy" / "megatron" / ".metadata").is_file()  # sharded, reshardable state
    assert (out / "checkpoints" / "latest").read_text() == "global_step_4"
    _a_planted_megatron_checkpoint_runs_nothing_on_resume(out)


def _a_planted_megatron_checkpoint_runs_nothing_on_resume(out: Path) -> None:
    """Someone with write access to the checkpoint folder plants global_step_6: the last
    checkpoint with a .metadata that runs a command when unpickled (a dotted name, os.system
    looked up in a checkpoint module), its manifest resealed. The resume refuses it, exit 2, before
    Ray starts (each rank's load reads only a checked copy too: tests/test_safe_load.py)."""
    from nemo_dapo.trainer.checkpoint import write_manifest
    from tests.planted import dotted_name_payload

    planted, marker = out / "checkpoints" / "global_step_6", out / "planted_ran"
    shutil.copytree(out / "checkpoints" / "global_step_4", planted)
    (planted / "policy" / "megatron" / ".metadata").write_bytes(dotted_name_payload(marker))
    (planted / "manifest.json").unlink()
    write_manifest(planted)
    again = train(out, "actor.backend=megatron", "trainer.total_training_steps=8", "trainer.save_freq=0", *SMALL)
    assert again.returncode == 2 and "worker(s) on" not in again.stderr, again.stderr[-3000:]  # before Ray
    assert "global torch.distributed.checkpoint.filesystem.os.system is not allowed" in again.stderr
    assert not marker.exists()
