"""What someone who can write into a shared checkpoint or output folder may plant there: a config
naming a module beside that module, a link where a run writes a file, a link placed in a
checkpoint after it was verified. Nothing planted runs, and no file it points to changes."""

import errno
import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_dapo.cli import main
from nemo_dapo.config import load_config, to_yaml
from nemo_dapo.errors import InputError
from nemo_dapo.trainer.checkpoint import CheckpointError, CheckpointManager, verify, write_manifest
from nemo_dapo.trainer.export import copy_weights, export_hf
from nemo_dapo.trainer.preemption import Preempted, record_preemption
from nemo_dapo.trainer.run_folder import RunFolder
from nemo_dapo.trainer.sinks import SinkContext
from nemo_dapo.trainer.summary import write_summary
from nemo_dapo.trainer.tracking import Tracker

ENTRY_POINTS = {
    "nemo-dapo": [str(Path(sys.executable).parent / "nemo-dapo")],
    "python -m": [sys.executable, "-m", "nemo_dapo.cli"],
}


def a_checkpoint(root: Path, model_dir: Path, policy_loss: str = "dapo", config: bool = True) -> Path:
    """A sealed checkpoint of step 3 holding the tiny model's weights and, with ``config``, the
    run's config.yaml naming ``policy_loss``."""
    config_yaml = to_yaml(load_config("tiny_cpu", [f"model.path={model_dir}"]))
    config_yaml = config_yaml.replace("policy_loss: dapo", f"policy_loss: {policy_loss}")

    def write(folder):
        model = folder / "policy" / "model"
        model.mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            (model / name).write_bytes((model_dir / name).read_bytes())
        if config:
            (folder / "config.yaml").write_text(config_yaml)

    return CheckpointManager(root).save(3, write)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("planted_in", ["run folder", "checkpoint folder"])
def test_export_runs_no_module_a_checkpoints_config_names(tmp_path, tiny_model_dir, entry, planted_in):
    """The checkpoint's config names ``planted_loss:x`` and planted_loss.py lies in the folder the
    command runs from (``python -m`` puts it first on the import path): in the run's folder, or in
    the checkpoint itself, sealed into its manifest (a manifest is no signature). Export refuses
    the config, naming the key (exit 2), and the module never runs."""
    marker = tmp_path / "ran"
    checkpoint = a_checkpoint(tmp_path / "run" / "checkpoints", tiny_model_dir, policy_loss="planted_loss:x")
    cwd = tmp_path / "run" if planted_in == "run folder" else checkpoint
    (cwd / "planted_loss.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    write_manifest(checkpoint)
    command = [*ENTRY_POINTS[entry], "export", str(checkpoint), str(tmp_path / "out")]
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert not marker.exists(), "the planted module ran"
    assert done.returncode == 2 and not (tmp_path / "out").exists(), done.stderr
    assert "actor.policy_loss='planted_loss:x' names a module to import" in done.stderr, done.stderr
    assert f"{checkpoint / 'config.yaml'}" in done.stderr and "--tokenizer" in done.stderr


def test_export_reads_a_checkpoints_config_for_the_tokenizer_and_names_what_is_missing(
    tmp_path, tiny_model_dir, capsys
):
    """A sealed config naming registered names only gives the tokenizer's folder; a checkpoint
    without config.yaml, a folder that is no checkpoint and a missing path each exit 2 naming it."""
    good = a_checkpoint(tmp_path / "a", tiny_model_dir)
    assert main(["export", str(good), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    no_config = a_checkpoint(tmp_path / "b", tiny_model_dir, config=False)
    (tmp_path / "not_a_checkpoint").mkdir()
    for folder, said in (
        (no_config, f"{no_config / 'config.yaml'}: missing; it names the base model"),
        (tmp_path / "not_a_checkpoint", "no manifest.json: not a checkpoint"),
        (tmp_path / "nowhere", f"{tmp_path / 'nowhere'}: no such folder"),
    ):
        assert main(["export", str(folder), str(tmp_path / "out2")]) == 2
        assert said in capsys.readouterr().err
    assert not (tmp_path / "out2").exists()


def test_resume_from_a_path_that_is_no_checkpoint_is_refused_before_anything_starts(tmp_path, capsys):
    """Refused at start-up (the run lock taken, before Ray), naming the path and the setting."""
    missing = tmp_path / "nowhere" / "global_step_3"
    assert main(["train", f"trainer.output_dir={tmp_path / 'run'}", f"checkpoint.resume={missing}"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint.resume: {missing}: no such folder" in err and "crash during save" not in err, err


def write_state(folder: Path) -> None:
    (folder / "trainer_state.pt").write_bytes(b"state")


# where a run writes in its output folder -> (the name a link is planted at, the writer, refused?)
RUN_FILES = {
    "run lock": (".nemo_dapo.lock", lambda run: RunFolder(run).release(), True),
    "latest": ("latest", lambda run: CheckpointManager(run).save(2, write_state), False),
    "latest's former temp name": (".latest.tmp", lambda run: CheckpointManager(run).save(2, write_state), False),
    "logger_runs.json's former temp name": (
        ".logger_runs.json.tmp",
        lambda run: SinkContext(run, "p", "e").remember("wandb", "run-1"),
        False,
    ),
    "summary.json": ("summary.json", lambda run: write_summary(run, {}, {}, 3, 12, 1.0), False),
    "metrics.jsonl": ("metrics.jsonl", lambda run: Tracker([], SinkContext(run, "p", "e")).close(), True),
    "preemptions.jsonl": ("preemptions.jsonl", lambda run: record_preemption(run, Preempted(3, "SIGUSR1")), True),
    "resumes.jsonl": (
        "resumes.jsonl",
        lambda run: CheckpointManager(run).resolve_resume(str(run / "global_step_1")),
        True,
    ),
}


@pytest.mark.parametrize("place", [*RUN_FILES, "run lock (hard link)"])
def test_a_link_planted_where_a_run_writes_leaves_its_target_unchanged(tmp_path, place):
    """A link to another file, planted at the name of a file a run writes (or at the fixed temp
    name it wrote through before) in a folder holding a checkpoint: the run replaces the link, or
    refuses it naming it (exit 2); the other file is never written."""
    victim = tmp_path / "victim.txt"
    victim.write_text("another file's content")
    run = tmp_path / "run"
    CheckpointManager(run).save(1, write_state)
    name, writer, refused = RUN_FILES[place.removesuffix(" (hard link)")]
    (run / name).unlink(missing_ok=True)
    if place.endswith("(hard link)"):
        os.link(victim, run / name)
    else:
        (run / name).symlink_to(victim)
    if refused:
        with pytest.raises(InputError, match=rf"{run / name}: .*move it away"):
            writer(run)
    else:
        writer(run)
        assert not (run / name.removeprefix(".").removesuffix(".tmp")).is_symlink()
    assert victim.read_text() == "another file's content"


def test_export_writes_through_no_link_in_its_folder_and_follows_none_placed_after_verify(tmp_path, tiny_model_dir):
    """The export's record (its former fixed temp name a link) and the export folder itself (a
    link to another model's folder) write nothing through; a link placed in the checkpoint after
    ``verify`` (at a weight file, or at the weights' folder) is refused by the copy, not followed."""
    victim = tmp_path / "victim.txt"
    victim.write_text("another file's content")
    checkpoint = a_checkpoint(tmp_path / "checkpoints", tiny_model_dir)
    out = tmp_path / "out"
    out.mkdir()
    (out / ".nemo_dapo_export.json.tmp").symlink_to(victim)
    export_hf(checkpoint, tiny_model_dir, out, overwrite=True)
    assert (out / "nemo_dapo_export.json").is_file() and not (out / "nemo_dapo_export.json").is_symlink()
    other_model = tmp_path / "other_model"
    other_model.mkdir()
    (other_model / "model.safetensors").write_text("another model's weights")
    (tmp_path / "linked_out").symlink_to(other_model)
    with pytest.raises(InputError, match=r"linked_out: is a link; give the folder it points to"):
        export_hf(checkpoint, tiny_model_dir, tmp_path / "linked_out", overwrite=True)
    assert (other_model / "model.safetensors").read_text() == "another model's weights"
    model = verify(checkpoint) / "policy" / "model"
    (model / "model.safetensors").unlink()
    (model / "model.safetensors").symlink_to(victim)
    staged = tmp_path / "staged"
    staged.mkdir()
    with pytest.raises(CheckpointError, match=r"policy/model/model\.safetensors: a link, or not a plain file"):
        copy_weights(checkpoint, staged)
    assert not (staged / "model.safetensors").exists()
    os.rename(model, tmp_path / "moved_model")
    model.symlink_to(other_model, target_is_directory=True)
    for copied in staged.iterdir():
        copied.unlink()
    with pytest.raises(CheckpointError, match=r"policy/model: a link, or not a folder"):
        copy_weights(checkpoint, staged)
    assert not list(staged.iterdir())
    assert victim.read_text() == "another file's content"


def test_a_passing_enolck_is_tried_again_and_the_lock_taken(tmp_path, monkeypatch):
    """NFS's lock manager can answer ENOLCK for a moment (out of locks, restarting): two such
    answers, then the lock; a file system without locks keeps its message (test_run_folder.py).
    No file system here answers so: lockf is made to answer as NFS's does, then locks for real."""
    from nemo_dapo.trainer import run_folder

    answers = [OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))] * 2
    real_lockf = fcntl.lockf

    def passing_enolck(*args):
        if answers:
            raise answers.pop()
        return real_lockf(*args)

    monkeypatch.setattr(run_folder.fcntl, "lockf", passing_enolck)
    RunFolder(tmp_path).release()
    assert not answers and (tmp_path / ".nemo_dapo.lock").read_text().startswith(f"pid {os.getpid()} on ")
