"""One run per output folder: a second live run on it is refused, and so is a new run over an
older run's checkpoints; both at start-up (exit 2), with nothing of the first run touched."""

import subprocess
import sys
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


def test_a_second_live_run_on_the_folder_is_refused(tmp_path, capsys):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from nemo_dapo.trainer.run_folder import RunFolder; held = RunFolder({str(tmp_path)!r}); "
            "import time; print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        code = main(["train", f"trainer.output_dir={tmp_path}"])
        err = capsys.readouterr().err
        assert code == 2 and f"trainer.output_dir={tmp_path} is in use by another run (pid {holder.pid} on" in err, err
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    RunFolder(tmp_path).release()  # the dead holder's lock went with it


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
