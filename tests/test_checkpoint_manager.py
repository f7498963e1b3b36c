"""Atomic checkpoints: manifest verification, retention, fallback to the previous good one."""

import errno
import os
import subprocess

import pytest

from nemo_dapo.policy.base import WorkerSettings
from nemo_dapo.trainer.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointWriteError,
    verify,
    write_manifest,
)


def writer(payload: bytes):
    def write(folder):
        (folder / "policy").mkdir()
        (folder / "policy" / "weights.bin").write_bytes(payload)
        (folder / "trainer_state.pt").write_bytes(b"state" + payload)

    return write


def test_save_is_sealed_and_pointer_updated(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    path = manager.save(3, writer(b"abc"))
    assert path.name == "global_step_3" and verify(path) == path
    assert (tmp_path / "latest").read_text() == "global_step_3"
    assert not list(tmp_path.glob(".tmp_*"))


def test_staged_checkpoint_is_invisible_until_committed(tmp_path):
    """An asynchronous save stages its folder while files still arrive: resume and ``latest``
    keep the previous checkpoint until the commit, and a late file is sealed in the manifest."""
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(1, writer(b"one"))
    staging = manager.stage(2, writer(b"two"))
    (staging / "policy" / "shard.distcp").write_bytes(b"written in the background")
    assert [s for s, _ in manager.step_folders()] == [1]
    assert manager.resolve_resume("auto").name == "global_step_1"
    assert (tmp_path / "latest").read_text() == "global_step_1"
    final = manager.commit(staging)
    assert final.name == "global_step_2" and verify(final) == final and not staging.exists()
    assert (final / "policy" / "shard.distcp").read_bytes() == b"written in the background"
    assert manager.resolve_resume("auto") == final and (tmp_path / "latest").read_text() == "global_step_2"


def test_retention_keeps_last_k(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        manager.save(step, writer(bytes([step])))
    assert [s for s, _ in manager.step_folders()] == [4, 3]


def test_damaged_latest_falls_back_under_auto(tmp_path, caplog):
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.save(1, writer(b"one"))
    newest = manager.save(2, writer(b"two"))
    (newest / "policy" / "weights.bin").write_bytes(b"twX")  # same size, different bytes
    with pytest.raises(CheckpointError, match="weights.bin is damaged"):
        verify(newest)
    assert manager.resolve_resume("auto").name == "global_step_1"
    assert "skipping checkpoint of step 2" in caplog.text
    with pytest.raises(CheckpointError):
        manager.resolve_resume(str(newest))  # an explicit path must be intact


def test_missing_file_and_unfinished_save(tmp_path):
    manager = CheckpointManager(tmp_path)
    good = manager.save(1, writer(b"x"))
    os.remove(good / "trainer_state.pt")
    with pytest.raises(CheckpointError, match="trainer_state.pt listed in the manifest is missing"):
        verify(good)
    crashed = tmp_path / "global_step_7"  # renamed by hand, never sealed
    crashed.mkdir()
    with pytest.raises(CheckpointError, match="never completed"):
        verify(crashed)
    assert manager.resolve_resume("auto") is None
    assert manager.resolve_resume("disable") is None


def test_a_checkpoint_holds_its_manifest_files_only_and_export_follows_no_link(tmp_path, tiny_model_dir):
    """A file the manifest does not list, a manifest name leaving the folder, a link (to a file
    or a folder): each refused by name, at verify, and so at resume and export."""
    import json

    from nemo_dapo.cli import main

    def fresh(step):
        return CheckpointManager(tmp_path / "checkpoints").save(step, writer(b"x"))

    planted = fresh(1)
    (planted / "policy" / "extra.pt").write_bytes(b"not sealed")
    with pytest.raises(CheckpointError, match=r"file policy/extra\.pt is not in the manifest"):
        verify(planted)
    outside = fresh(2)
    record = json.loads((outside / "manifest.json").read_text())
    record["files"]["../../secret"] = record["files"].pop("trainer_state.pt")
    (outside / "manifest.json").write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match=r"the manifest names \.\./\.\./secret, outside the checkpoint"):
        verify(outside)
    secret = tmp_path / "secret.txt"
    secret.write_text("a file outside the checkpoint")
    for step, link in ((3, "policy/weights.bin"), (4, "policy")):
        linked = fresh(step)
        target = linked / link
        if target.is_dir():
            os.rename(target, tmp_path / f"moved_{step}")
            target.symlink_to(tmp_path / f"moved_{step}", target_is_directory=True)
        else:
            target.unlink()
            target.symlink_to(secret)
        with pytest.raises(CheckpointError, match=rf"{link} is a link; a checkpoint holds plain files only"):
            verify(linked)
    out = tmp_path / "export"
    assert main(["export", str(linked), str(out), "--tokenizer", str(tiny_model_dir)]) == 2
    assert not out.exists()


def test_crash_inside_write_leaves_previous_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, writer(b"ok"))

    def crash(folder):
        (folder / "half").write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        manager.save(2, crash)
    assert manager.resolve_resume("auto").name == "global_step_1"
    assert (tmp_path / "latest").read_text() == "global_step_1"


def test_a_full_disk_mid_save_keeps_the_previous_checkpoint_and_removes_the_partial_one(tmp_path, tiny_model_dir):
    """The real writer (the torch worker's state) on a tmpfs just larger than one checkpoint; where
    the sandbox cannot mount one, the same writer fails with an injected ENOSPC half-way."""
    from nemo_dapo.policy.torch_worker import TorchPolicyWorker
    from tests.batches import optim_settings

    worker = TorchPolicyWorker(0, 1, "", WorkerSettings(str(tiny_model_dir), optim_settings(), max_token_len=40))
    probe = CheckpointManager(tmp_path / "probe").save(1, lambda folder: worker.save(str(folder / "policy")))
    size = sum(p.stat().st_size for p in probe.rglob("*") if p.is_file())
    small = tmp_path / "small"
    small.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.5)}", "tmpfs", str(small)], capture_output=True
        ).returncode
        == 0
    )
    try:
        manager = CheckpointManager(small / "checkpoints")
        manager.save(1, lambda folder: worker.save(str(folder / "policy")))

        def second(folder):
            worker.save(str(folder / "policy"))
            if not mounted:  # no small file system here: fail as a full disk would, after a partial write
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        with pytest.raises(CheckpointWriteError) as failure:
            manager.save(2, second)
        message = str(failure.value)
        assert f"could not be written to {small / 'checkpoints' / '.tmp_global_step_2'}" in message
        assert "No space left on device" in message or "file write failed" in message, message
        assert f"the previous checkpoint {small / 'checkpoints' / 'global_step_1'} is intact" in message
        assert not list((small / "checkpoints").glob(".tmp_*"))  # the partial folder is gone
        assert (small / "checkpoints" / "latest").read_text() == "global_step_1"
        assert manager.resolve_resume("auto") == verify(small / "checkpoints" / "global_step_1")
    finally:
        if mounted:
            subprocess.run(["umount", str(small)], check=True)


def test_manifest_digests_come_from_the_hasher_and_old_sha256_manifests_still_verify(tmp_path):
    """The manager hashes through the hasher it is given (the trainer's spreads the files over the
    training ranks); a manifest of the sha256 era verifies, and catches damage, as before."""
    import hashlib
    import json

    from nemo_dapo.digest import digest_files, file_digest

    calls = []

    def hasher(folder, names):
        calls.append(sorted(names))
        return digest_files(folder, names)

    manager = CheckpointManager(tmp_path / "ckpt", keep_last=2, hasher=hasher)
    path = manager.save(1, writer(b"abc"))
    record = json.loads((path / "manifest.json").read_text())
    assert record["algorithm"] == "blake3" and calls == [["policy/weights.bin", "trainer_state.pt"]]
    assert record["files"]["trainer_state.pt"]["digest"] == file_digest(path / "trainer_state.pt")
    assert manager.resolve_resume("auto") == path and len(calls) == 2  # resume verifies through it too
    (path / "trainer_state.pt").write_bytes(b"stateabX")
    with pytest.raises(CheckpointError, match="trainer_state.pt is damaged"):
        verify(path, hasher)

    old = tmp_path / "old"
    (old / "policy").mkdir(parents=True)
    (old / "policy" / "weights.bin").write_bytes(b"xyz")
    files = {"policy/weights.bin": {"bytes": 3, "sha256": hashlib.sha256(b"xyz").hexdigest()}}
    (old / "manifest.json").write_text(json.dumps({"files": files}))
    assert verify(old) == old
    (old / "policy" / "weights.bin").write_bytes(b"xyZ")
    with pytest.raises(CheckpointError, match="weights.bin is damaged"):
        verify(old)


def test_shares_by_size_balance_the_bytes(tmp_path):
    from nemo_dapo.digest import shares_by_size

    sizes = {"a": 900, "b": 500, "c": 400, "d": 100, "e": 0}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(b"x" * size)
    shares = shares_by_size(tmp_path, list(sizes), 2)
    assert sorted(n for share in shares for n in share) == sorted(sizes)  # every file once
    assert sorted(sum(sizes[n] for n in share) for share in shares) == [900, 1000]


def test_a_complete_run_is_known_from_its_summary_and_trainer_state_alone(tmp_path):
    """What `nemo-dapo train` reads before Ray starts: a summary, and the newest checkpoint's
    trainer state (checked against its manifest) at the last step. Weights are not read; a
    damaged state means not complete (the trainer then falls back and says so)."""
    import json

    import torch

    from nemo_dapo.config import load_config
    from nemo_dapo.config.topology import prompts_per_round
    from nemo_dapo.trainer.summary import completed_run

    def config(*overrides):
        return load_config("tiny_cpu", [f"trainer.output_dir={tmp_path}", *overrides])

    def state(folder):
        torch.save({"global_step": 4, "generated_samples": 96}, folder / "trainer_state.pt")
        (folder / "weights.bin").write_bytes(b"weights")

    never = lambda: pytest.fail("the dataset is read only for a run counted in epochs")  # noqa: E731
    folder = CheckpointManager(tmp_path / "checkpoints").save(4, state)
    assert completed_run(config("trainer.total_training_steps=4"), never) is None  # no summary yet
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 4}))
    complete = {"steps": 4, "already_complete": True, "checkpoint": str(folder)}
    assert completed_run(config("trainer.total_training_steps=4"), never) == complete
    assert completed_run(config("trainer.total_training_steps=5"), never) is None
    assert completed_run(config("trainer.total_training_steps=5", "trainer.total_generated_samples=96"), never)
    epochs = config("trainer.total_training_steps=null", "trainer.total_epochs=1")
    per_step = prompts_per_round(epochs)
    assert completed_run(epochs, lambda: 4 * per_step) and not completed_run(epochs, lambda: 5 * per_step)
    (folder / "weights.bin").write_bytes(b"damaged")  # not read here
    assert completed_run(config("trainer.total_training_steps=4"), never)
    # a checkpoint of another trainer.mode is refused, finished or not (told by its contents when
    # it predates the mode entry: the stream's untrained rows, the retired async trainer's data plane)
    for mode, saved, refusal in (
        ("stream", {"mode": "sync"}, r"written by a trainer\.mode=sync run, which this trainer\.mode=stream"),
        ("sync", {"stream_untrained": []}, r"written by a trainer\.mode=stream run, which this trainer\.mode=sync"),
        ("sync", {"data_plane": {}}, r"trainer\.mode=async run; that trainer was replaced by trainer\.mode=stream"),
    ):
        torch.save({"global_step": 4, **saved}, folder / "trainer_state.pt")
        (folder / "manifest.json").unlink()
        write_manifest(folder)
        with pytest.raises(CheckpointError, match=refusal):
            completed_run(config("trainer.total_training_steps=9", f"trainer.mode={mode}"), never)
    (folder / "trainer_state.pt").write_bytes((folder / "trainer_state.pt").read_bytes()[:-1] + b"!")
    assert completed_run(config("trainer.total_training_steps=4"), never) is None


def test_a_rollback_starts_a_branch_that_retention_and_auto_resume_follow(tmp_path, caplog):
    """Resumed from step 1 of a run at step 3: steps 2 and 3 are set aside (kept, out of resume
    and retention). The new branch saves step 2 and crashes; auto resumes the new step 2, and
    retention at keep_last=1 keeps it. Without the rollback, auto would pick the old step 3."""
    manager = CheckpointManager(tmp_path, keep_last=3)
    for step in (1, 2, 3):
        manager.save(step, writer(b"old branch %d" % step))
    assert manager.resolve_resume(str(tmp_path / "global_step_1")).name == "global_step_1"
    assert (tmp_path / "latest").read_text() == "global_step_1"
    (aside,) = (tmp_path / "abandoned").iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["global_step_2", "global_step_3"]
    assert (aside / "global_step_3" / "policy" / "weights.bin").read_bytes() == b"old branch 3"  # kept
    assert "rolled back to global_step_1: the later checkpoints (global_step_2, global_step_3)" in caplog.text
    manager = CheckpointManager(tmp_path, keep_last=1)  # the new branch's run
    manager.save(2, writer(b"new branch 2"))
    resumed = manager.resolve_resume("auto")  # after a crash
    assert resumed.name == "global_step_2" and (resumed / "policy" / "weights.bin").read_bytes() == b"new branch 2"
    assert [s for s, _ in manager.step_folders()] == [2] and (aside / "global_step_3").is_dir()
    assert manager.resolve_resume(str(resumed)) == resumed  # resuming the newest sets nothing aside
    assert len(list((tmp_path / "abandoned").iterdir())) == 1


def test_a_rollback_given_to_a_job_applies_to_its_first_run_only(tmp_path, monkeypatch):
    """A requeued job gets its submission's arguments again, checkpoint.resume=<path> included: its
    later runs continue the branch the rollback started instead of setting it aside again. A new
    job (another id) asking for the same rollback gets it."""
    manager = CheckpointManager(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        manager.save(step, writer(b"old branch %d" % step))
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert manager.resolve_resume(str(tmp_path / "global_step_1")).name == "global_step_1"  # the first run
    manager.save(2, writer(b"new branch 2"))
    manager.save(3, writer(b"new branch 3"))
    resumed = manager.resolve_resume(str(tmp_path / "global_step_1"))  # the requeued run, same arguments
    assert resumed.name == "global_step_3" and (resumed / "policy" / "weights.bin").read_bytes() == b"new branch 3"
    assert len(list((tmp_path / "abandoned").iterdir())) == 1  # nothing set aside a second time
    # the new branch goes on past retention, which prunes the rollback's target: a requeue still
    # starts (the path is the job's own, applied) and resumes from the newest checkpoint
    pruning = CheckpointManager(tmp_path, keep_last=2)
    pruning.save(4, writer(b"new branch 4"))
    assert not (tmp_path / "global_step_1").exists() and pruning.applied_in_this_job(str(tmp_path / "global_step_1"))
    pruning.refuse_missing_resume(str(tmp_path / "global_step_1"))
    assert pruning.resolve_resume(str(tmp_path / "global_step_1")).name == "global_step_4"
    monkeypatch.setenv("SLURM_JOB_ID", "8")  # a new submission rolls back again
    with pytest.raises(CheckpointError, match="checkpoint.resume"):  # pruned: nothing to roll back to
        manager.refuse_missing_resume(str(tmp_path / "global_step_1"))
    assert manager.resolve_resume(str(tmp_path / "global_step_3")).name == "global_step_3"
    assert len(list((tmp_path / "abandoned").iterdir())) == 2 and [s for s, _ in manager.step_folders()] == [3]
