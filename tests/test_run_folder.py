"""One run per output folder: a second live run on it is refused, and so is a new run over an
older run's checkpoints; both at start-up (exit 2), with nothing of the first run touched. A
requeued run of the same Slurm job waits for its predecessor instead; a file system without
locks is named as such."""

import errno
import os
import subprocess
import sys
import threading
import time

import pytest

from nemo_dapo.cli import main
from nemo_dapo.errors import InputError
from nemo_dapo.trainer.checkpoint import CheckpointManager
from nemo_dapo.trainer.run_folder import RunFolder, refuse_mixing


def an_old_run(folder):
    def write(step_folder):
        (step_folder / "trainer_state.pt").write_bytes(b"state")

    manager = CheckpointManager(folder / "checkpoints")
    for step in (2, 4):
        manager.save(step, write)
    return manager


def holding(folder, **env: str) -> subprocess.Popen:
    """Another process that holds ``folder``'s run lock until its standard input says go."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from nemo_dapo.trainer.run_folder import RunFolder; held = RunFolder({str(folder)!r}); "
            "print('held', flush=True); input()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, **env},
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_live_run_on_the_folder_is_refused(tmp_path, capsys):
    holder = holding(tmp_path)
    try:
        code = main(["train", f"trainer.output_dir={tmp_path}"])
        err = capsys.readouterr().err
        assert code == 2 and f"trainer.output_dir={tmp_path} is in use by another run (pid {holder.pid} on" in err, err
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    RunFolder(tmp_path).release()  # the dead holder's lock went with it


def test_a_requeued_run_of_the_same_slurm_job_waits_for_its_predecessor_others_are_refused(tmp_path, monkeypatch):
    holder = holding(tmp_path, SLURM_JOB_ID="4242")
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "424")  # another job: refused at once (exit 2)
        start = time.monotonic()
        with pytest.raises(InputError, match=r"is in use by another run \(pid \d+ on .* \(Slurm job 4242\)\)"):
            RunFolder(tmp_path, same_job_wait_s=30)
        assert time.monotonic() - start < 5
        monkeypatch.setenv("SLURM_JOB_ID", "4242")  # the same job, its predecessor still running
        with pytest.raises(RuntimeError, match="still held by an earlier run of this Slurm job") as held:
            RunFolder(tmp_path, same_job_wait_s=1.5)
        assert not isinstance(held.value, InputError)  # a crash, which the batch script requeues
        threading.Timer(2.0, lambda: holder.communicate("\n")).start()  # it lets go while we wait
        start = time.monotonic()
        RunFolder(tmp_path, same_job_wait_s=30).release()
        assert time.monotonic() - start > 1.5
        assert (tmp_path / ".nemo_dapo.lock").read_text().endswith("(Slurm job 4242)")
    finally:
        holder.kill()
        holder.wait()


def test_a_file_system_without_locks_is_named_with_the_fix(tmp_path, monkeypatch):
    """No file system here refuses POSIX locks (Lustre with noflock, NFS with nolock do, ENOLCK):
    lockf is made to answer as theirs does."""
    from nemo_dapo.trainer import run_folder

    def no_locks(*_):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_folder.fcntl, "lockf", no_locks)
    mount, fstype = run_folder.mount_of(tmp_path)
    with pytest.raises(InputError, match="without working POSIX locks") as refused:
        RunFolder(tmp_path)
    assert f"({mount}, {fstype}: No locks available)" in str(refused.value) and "-o flock" in str(refused.value)
    assert "in use by another run" not in str(refused.value)


def test_a_new_run_over_an_older_runs_checkpoints_is_refused(tmp_path, capsys):
    manager = an_old_run(tmp_path)
    code = main(["train", f"trainer.output_dir={tmp_path}", "checkpoint.resume=disable"])
    err = capsys.readouterr().err
    assert code == 2 and "holds the checkpoints of an earlier run (newest: global_step_4)" in err, err
    assert "checkpoint.resume=auto" in err
    assert [s for s, _ in manager.step_folders()] == [4, 2]  # untouched
    folders = manager.step_folders()
    refuse_mixing(folders, "auto", tmp_path)  # continuing it is the same run
    refuse_mixing(folders, str(folders[1][1]), tmp_path)  # so is resuming from one of its own checkpoints
    with pytest.raises(InputError, match="would start a run from /elsewhere/global_step_9 there"):
        refuse_mixing(folders, "/elsewhere/global_step_9", tmp_path)
